# DPLB in a container: router + worker agents + engines in one image.
#
#   podman build --network=host -t dplb .                                  # simulated engines (default base)
#   docker build --build-arg BASE=vllm/vllm-openai:<tag> -t dplb:vllm .    # on an engine's own image
#   docker run --network=host --shm-size=16g --gpus all -e DPLB_ENGINE_PYTHON=python3 dplb:vllm \
#       --num-workers 4 --model meta-llama/Llama-3.1-8B-Instruct
#
# BASE: any image with Python >= 3.11 (venv or pip) and apt (for gcc, the Python headers and tini when
# the image lacks them). The default is a plain Debian bookworm rootfs that `make test-container`
# builds locally with mmdebstrap (no registry needed); `python:3.11-slim-bookworm`, vLLM's and
# SGLang's images work the same way. DPLB lives in its own virtual environment, /opt/dplb, so its
# dependencies never replace the engine's; the engine runs with DPLB_ENGINE_PYTHON (set it to the
# base image's interpreter, e.g. python3, when building on an engine image; the default is DPLB's
# own, which runs the built-in simulated engine).
#
# /dev/shm: the segment is 128 B + 1,536 B per slot (64 slots: 96 KiB); the launcher refuses to start,
# naming --shm-size, when /dev/shm cannot hold it. Engines need far more (NCCL, PyTorch workers):
# give the container --shm-size=16g (compose: shm_size) or --ipc=host for a multi-GPU engine.
ARG BASE=localhost/dplb-debian-base:bookworm

# ---------------------------------------------------------------------------------------------------
# build: compile the native extension (Cython + gcc) and install DPLB with its dependencies
FROM ${BASE} AS build
ARG DEBIAN_FRONTEND=noninteractive
# pip inside the build trusts what the build host trusts: `make test-container` mounts the host's CA
# bundle over this path at build time (never copied into the image); elsewhere it is the base's own
ARG PIP_CERT=/etc/ssl/certs/ca-certificates.crt
ARG PIP_DISABLE_PIP_VERSION_CHECK=1
RUN set -eu; need=""; \
    command -v gcc >/dev/null 2>&1 || need="$need gcc libc6-dev"; \
    python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
        || need="$need python3-dev"; \
    python3 -c 'import ensurepip' >/dev/null 2>&1 || python3 -m pip --version >/dev/null 2>&1 || need="$need python3-venv"; \
    if [ -n "$need" ]; then \
        apt-get update -qq && apt-get install -y -qq --no-install-recommends $need && rm -rf /var/lib/apt/lists/*; \
    fi
# a venv with pip from ensurepip, else (engine images often ship pip but no ensurepip) the base's pip
RUN python3 -m venv /opt/dplb \
    || { python3 -m venv --without-pip /opt/dplb && python3 -m pip --python /opt/dplb/bin/python install -q pip; }
RUN /opt/dplb/bin/pip install -q --no-cache-dir 'Cython>=3.0' 'setuptools>=68' wheel
COPY . /src
RUN /opt/dplb/bin/pip install -q --no-cache-dir --no-build-isolation /src \
    && /opt/dplb/bin/python -c 'import dplb_shm, dplb_prefix, router._relay, launcher, worker_agent, sim_engine' \
    && /opt/dplb/bin/pip uninstall -q -y Cython wheel

# ---------------------------------------------------------------------------------------------------
# runtime: the base, tini, an unprivileged user and the venv; no compiler, no sources
FROM ${BASE} AS runtime
ARG DEBIAN_FRONTEND=noninteractive
# tini as PID 1: forwards the stop signal to the launcher and reaps orphans (the launcher is a
# subreaper for its own tree; tini covers `podman exec`'s and everything else). `docker run --init`
# is then not needed (it would only add a second init in front of this one).
RUN set -eu; \
    if ! command -v tini >/dev/null 2>&1; then \
        apt-get update -qq && apt-get install -y -qq --no-install-recommends tini \
            && apt-get clean && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log; \
    fi; \
    groupadd --gid 10001 dplb && useradd --uid 10001 --gid 10001 --home-dir /home/dplb --create-home \
        --shell /bin/sh dplb; \
    mkdir -p /run/dplb && chown 10001:10001 /run/dplb && chmod 0700 /run/dplb
COPY --from=build /opt/dplb /opt/dplb
# DPLB_RUN_DIR: sockets and logs; a volume there shares the engines' sockets with a router in
# another container (deploy/compose.yaml, profile split). DPLB_HEALTH_URL: what HEALTHCHECK asks.
ENV PATH=/opt/dplb/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    DPLB_RUN_DIR=/run/dplb \
    DPLB_HEALTH_URL=http://127.0.0.1:30000/health \
    HOME=/home/dplb
USER 10001:10001
WORKDIR /home/dplb
EXPOSE 30000
# SIGINT is the launcher's Ctrl-C: the workers drain (requests in flight, streams included, run to
# their end) while the router still relays, then everything stops and the segment is unlinked.
# Give `docker stop` a timeout (-t) above the longest request you want to finish (default 10 s).
STOPSIGNAL SIGINT
# the router's /health: 200 when at least one worker is ready (with --port N, run with
# -e DPLB_HEALTH_URL=http://127.0.0.1:N/health); the image's format must be docker's to keep it
# (podman build --format docker)
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["/opt/dplb/bin/python", "-c", "import os, urllib.request as u; u.build_opener(u.ProxyHandler({})).open(os.environ['DPLB_HEALTH_URL'], timeout=4)"]
ENTRYPOINT ["tini", "--", "/opt/dplb/bin/python", "-m", "launcher"]
# simulated engines by default; pass the launcher's flags to change it (see README.md, docs/containers.md)
CMD ["--num-workers", "2"]
