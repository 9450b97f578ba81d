"""The KV-cache events of a real vLLM (CPU build) read by DPLB's consumer (router/kv_events.py).

Usage (from the repository root, DPLB's venv; make test-vllm runs it)::

    .venv/bin/python scripts/vllm_kv_events_check.py VLLM_PYTHON MODEL_DIR WORK_DIR

Starts one ``vllm.entrypoints.openai.api_server`` with ``--kv-events-config`` (ZMQ PUB and a replay
socket on loopback TCP), subscribes to it with :class:`router.kv_events.KVEventSubscriber`, sends
a chat request, asks the engine for the same prompt's token ids (``POST /tokenize``, its chat
template), and checks that: the subscriber caught up and decodes the engine's batches (no skipped
batch), the engine's ``BlockStored`` events carry the prompt's tokens block by block, the block set
holds the prompt's full blocks by the engine's own hashes, and by DPLB's token keys of the
prompt's ids (what the router matches: :func:`router.kv_events.token_keys`); a second request with
the same prefix is matched as far as its shared blocks. Exit status 0 when all hold.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx

from router.kv_events import KVEventSubscriber, token_keys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait(what: str, cond, timeout: float) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            sys.exit(f"FAIL: {what} not within {timeout:.0f} s")
        time.sleep(0.5)
    print(f"  {what} after {time.monotonic() - t0:.1f} s", flush=True)


def main() -> int:
    vpy, model, work = sys.argv[1:4]
    port = free_port()
    # ipc:// so the publisher binds (vLLM binds an endpoint with "*", "::" or ipc://, and connects
    # to any other) without listening beyond this machine
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{work}/kv-pub",
           "replay_endpoint": f"ipc://{work}/kv-replay", "buffer_steps": 10000, "topic": ""}
    env = dict(os.environ, VLLM_HOST_IP="127.0.0.1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", VLLM_CPU_KVCACHE_SPACE="1")
    log = open(os.path.join(work, "vllm-events.log"), "wb")   # noqa: SIM115 - closed in the finally
    engine = subprocess.Popen([vpy, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                               "--served-model-name", "tiny-llama", "--host", "127.0.0.1", "--port", str(port),
                               "--max-model-len", "1024", "--dtype", "bfloat16", "--max-num-seqs", "2",
                               "--enable-prefix-caching", "--kv-events-config", json.dumps(cfg)],
                              stdout=log, stderr=subprocess.STDOUT, env=env)
    sub = KVEventSubscriber(cfg["endpoint"], cfg["replay_endpoint"], name="vllm")
    base = f"http://127.0.0.1:{port}"
    sizes: set[int] = set()   # the block sizes the engine's BlockStored events give
    store = sub.blocks.store

    def recording_store(hashes, parent=None, token_ids=(), block_size=0):   # type: ignore[no-untyped-def]
        sizes.add(block_size)
        return store(hashes, parent, token_ids, block_size)

    sub.blocks.store = recording_store   # type: ignore[method-assign]
    try:
        def up() -> bool:
            if engine.poll() is not None:
                sys.exit(f"FAIL: vLLM exited with {engine.returncode} (see {log.name})")
            try:
                return httpx.get(base + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait("vLLM up", up, 900)
        sub.start()
        wait("the subscriber's catch-up", sub.caught_up, 60)
        words = "the model token cache block prefill decode engine worker router request prompt batch queue"
        msgs = [{"role": "system", "content": (words + " ") * 50}, {"role": "user", "content": "first question"}]
        r = httpx.post(base + "/v1/chat/completions", timeout=120,
                       json={"model": "tiny-llama", "messages": msgs, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        ids = httpx.post(base + "/tokenize", timeout=30, json={"model": "tiny-llama", "messages": msgs,
                                                               "add_generation_prompt": True}).json()["tokens"]
        bs = sub.blocks
        wait("BlockStored events of the prompt", lambda: len(bs) > 0 and bs.applied > 0, 60)
        time.sleep(1.0)   # the step's remaining batches
        with bs.lock:
            stored = dict(bs.blocks)
            lost, applied = bs.lost, bs.applied
        print(f"  prompt {len(ids)} tokens; {applied} batches applied, {lost} lost; {len(stored)} blocks held; "
              f"hash type {type(next(iter(stored))).__name__}")
        if len(sizes) != 1:
            sys.exit(f"FAIL: BlockStored block sizes {sizes}")
        size = sizes.pop()
        keys = token_keys(ids[:len(ids) - 1], size)
        full = len(keys)
        by_key = bs.match_keys(keys)
        print(f"  block size {size}: {full} full blocks in the prompt (but its last token), "
              f"{by_key} matched by DPLB's token keys")
        ok = lost == 0 and full > 0 and by_key == full and all(k is not None for k in stored.values())
        # a second turn sharing the first's prefix: matched as far as the shared blocks go
        msgs2 = msgs[:1] + [{"role": "user", "content": "a different question altogether"}]
        ids2 = httpx.post(base + "/tokenize", timeout=30, json={"model": "tiny-llama", "messages": msgs2,
                                                                "add_generation_prompt": True}).json()["tokens"]
        common = next((i for i, (a, b) in enumerate(zip(ids, ids2)) if a != b), min(len(ids), len(ids2)))
        m2 = bs.match_keys(token_keys(ids2[:len(ids2) - 1], size))
        print(f"  second prompt: {common} leading tokens shared -> {common // size} blocks; matched {m2}")
        ok = ok and m2 == min(common // size, full)
        print("PASS" if ok else "FAIL")
        return 0 if ok else 1
    finally:
        sub.close()
        engine.terminate()
        try:
            engine.wait(60)
        except subprocess.TimeoutExpired:
            engine.kill()
        log.close()


if __name__ == "__main__":
    raise SystemExit(main())
