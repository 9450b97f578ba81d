#!/usr/bin/env bash
# make test-fidelity: the engine model (sim_engine's EngineCore) against a real CPU vLLM.
#
# 1. the CPU vLLM and the tiny random Llama of `make test-vllm` (installed on first use, ~3.5 GB);
# 2. one vLLM OpenAI server with a small KV cache: --block-size 32 (the CPU attention backend needs a
#    multiple of 32), --num-gpu-blocks-override 128, --max-num-seqs 8, --max-num-batched-tokens 512;
# 3. python -m simulate.vllm_fidelity: the same shrunk Mooncake trace (96 requests, two waves) through
#    vLLM and through EngineCore with the same block size, block budget and batch limits; prints
#    preemptions, prefix-cache hit rate and KV usage over the run side by side (and their relative
#    differences against the 15 % the issue asks for). Not part of `make test`.
# Environment: VLLM_VENV (default .venv-vllm), DPLB_FIDELITY_JSON=FILE keeps the samples.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
# shellcheck source=scripts/vllm_common.sh
source "$ROOT/scripts/vllm_common.sh"
PY="$ROOT/.venv/bin/python"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
VPY="$VENV/bin/python"
MODEL_DIR="$VENV/dplb-tiny-llama"
WORK=$(mktemp -d /tmp/dplb-fidelity-XXXXXX)
PORT=$("$PY" -c 'from launcher.stack import free_port; print(free_port())')
VLLM_PID=""
SHM_BEFORE=$(ls /dev/shm 2>/dev/null || true)
BLOCK=32 BLOCKS=128 SEQS=8 BATCH=512

log() { printf '[test-fidelity %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

cleanup() {
    local rc=$?
    if [[ -n "$VLLM_PID" ]]; then
        kill -TERM "$VLLM_PID" 2>/dev/null || true
        for _ in $(seq 1 60); do kill -0 "$VLLM_PID" 2>/dev/null || break; sleep 0.5; done
        kill -KILL "$VLLM_PID" 2>/dev/null || true
    fi
    remove_left_vllm_shm
    [[ $rc -ne 0 && -f "$WORK/vllm.log" ]] && { echo "---- vllm.log (tail)"; tail -n 30 "$WORK/vllm.log"; }
    rm -rf "$WORK"
    exit $rc
}
trap cleanup EXIT INT TERM

ensure_vllm
ensure_tiny_llama

log "starting vllm $("$VPY" -c 'import vllm; print(vllm.__version__)' 2>/dev/null) on port $PORT (about 90 s)"
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_CPU_KVCACHE_SPACE=1 \
    "$VPY" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" --served-model-name tiny \
    --max-model-len 2048 --dtype bfloat16 --block-size $BLOCK --num-gpu-blocks-override $BLOCKS \
    --max-num-seqs $SEQS --max-num-batched-tokens $BATCH --host 127.0.0.1 --port "$PORT" \
    >"$WORK/vllm.log" 2>&1 &
VLLM_PID=$!
for i in $(seq 1 600); do
    curl -fsS "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    kill -0 "$VLLM_PID" 2>/dev/null || { log "vllm exited"; exit 1; }
    sleep 1
done
curl -fsS "http://127.0.0.1:$PORT/health" >/dev/null || { log "vllm not ready after 600 s"; exit 1; }
log "vllm ready; running the same trace through vllm and the engine model"
"$PY" -m simulate.vllm_fidelity --base-url "http://127.0.0.1:$PORT" --block-size $BLOCK --num-blocks $BLOCKS \
    --max-num-seqs $SEQS --max-num-batched-tokens $BATCH --requests 96 --max-out 128 \
    ${DPLB_FIDELITY_JSON:+--json-out "$DPLB_FIDELITY_JSON"}
