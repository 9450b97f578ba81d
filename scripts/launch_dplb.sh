#!/usr/bin/env bash
# The one command: start a DPLB endpoint (router + N worker agents + engines) in the foreground.
#
#   scripts/launch_dplb.sh --num-workers N [--gpus LIST] [--engine sim|vllm|sglang|openai] [--model M]
#                          [--port 30000] [--config dplb.yaml] [--state-interval-ms 200] [--policy P]
#                          [--time-scale F] [--dry-run] [-- extra engine args]
#
# On a fresh clone the first run installs what it needs (`make install`: .venv with the package and
# its native extension). Then it execs the Python supervisor (python -m launcher), which plans GPUs,
# creates the segment, starts everything, prints a ready banner and stops it all on Ctrl-C/SIGTERM.
# `scripts/launch_dplb.sh --help` lists every flag. DPLB_PYTHON=/path/to/python skips the install
# step and uses that interpreter (its environment must hold DPLB's dependencies).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if [[ -n "${DPLB_PYTHON:-}" ]]; then
    PY="$DPLB_PYTHON"
else
    PY="$ROOT/.venv/bin/python"
    if [[ ! -x "$PY" ]] || ! "$PY" -c 'import launcher, router, worker_agent, dplb_shm' >/dev/null 2>&1; then
        if ! command -v make >/dev/null 2>&1; then
            echo "launch_dplb: 'make' is needed for the first-run install (apt-get install make)" >&2
            exit 1
        fi
        echo "launch_dplb: installing or rebuilding DPLB in $ROOT/.venv (make install build) ..." >&2
        if ! make -C "$ROOT" install build >&2; then
            echo "launch_dplb: 'make install' failed; see the output above" >&2
            exit 1
        fi
    fi
fi

exec "$PY" -m launcher "$@"
