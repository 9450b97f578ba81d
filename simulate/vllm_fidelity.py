"""Fidelity of the engine model against a real (CPU) vLLM: ``make test-fidelity``.

The same small trace goes through a running vLLM (``--base-url``) and through the simulator's engine
(:class:`sim_engine.engine.EngineCore`, the model behind ``dplb-sim-engine``) configured with the same
KV block budget, block size and batch limits, and we compare what does not depend on speed:

* preemptions (``vllm:num_preemptions_total`` / ``EngineStats.num_preemptions``);
* prefix-cache hits (``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total``);
* KV-cache usage over the run: vLLM's ``vllm:kv_cache_usage_perc`` sampled every few ms, against the
  model's usage after each step, both placed on the same axis: the fraction of all output tokens
  generated so far (``vllm:generation_tokens_total``), so the CPU's speed does not enter.

Workload: ``--requests`` lines of the Mooncake conversation trace, shrunk to the tiny model's context
(every 512-token block becomes ``--tokens-per-block`` token ids drawn from a PRNG seeded with the
block id, so equal leading block ids still share exactly those tokens; outputs capped), sent as
token-id prompts of ``/v1/completions`` with ``ignore_eos`` (so both sides generate exactly
``max_tokens``), in two waves: the first wave all at once, the second after the first has finished
(it meets the first wave's prefixes in the cache, partly evicted).

Known differences by construction: vLLM keeps one block as its null block (usage never below
1/num_blocks; the model gets ``num_blocks - 1`` blocks, usage compared on vLLM's denominator);
vLLM's requests of one wave reach its scheduler over a few ms, the model's at one instant.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

from dplb_trace.mooncake import load_trace
from sim_engine.config import EngineConfig
from sim_engine.engine import EngineCore
from sim_engine.request import SimRequest
from sim_engine.tokenizer import ids_to_words
from simulate.settings import Figures


def workload(n: int, tokens_per_block: int, max_prompt: int, max_out: int, vocab: int) -> list[tuple[list[int], int]]:
    """``(prompt token ids, max_tokens)`` for the first ``n`` trace requests, shrunk (see module docstring)."""
    out = []
    cache: dict[int, list[int]] = {}
    for r in load_trace(limit=n):
        ids: list[int] = []
        for b in r.hash_ids:
            if b not in cache:
                rng = random.Random(b)
                cache[b] = [rng.randrange(3, vocab) for _ in range(tokens_per_block)]
            ids += cache[b]
        want = max(1, min(max_prompt, r.input_length * tokens_per_block // 512))
        out.append((ids[:want], max(1, min(max_out, r.output_length))))
    return out


def parse_metrics(text: str) -> dict[str, float]:
    vals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ("vllm:kv_cache_usage_perc", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                    "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                    "vllm:num_requests_running", "vllm:num_requests_waiting"):
            vals[name] = vals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return vals


async def run_vllm(base: str, model: str, waves: list[list[tuple[list[int], int]]]) -> Figures:
    import httpx

    async with httpx.AsyncClient(base_url=base, timeout=600) as c:
        async def metrics() -> dict[str, float]:
            return parse_metrics((await c.get("/metrics")).text)

        m0 = await metrics()
        samples: list[tuple[float, float]] = []
        stop = asyncio.Event()

        async def sampler() -> None:
            while not stop.is_set():
                m = await metrics()
                samples.append((m.get("vllm:generation_tokens_total", 0.0) - m0.get("vllm:generation_tokens_total", 0.0),
                                m.get("vllm:kv_cache_usage_perc", 0.0)))
                await asyncio.sleep(0.005)

        async def one(ids: list[int], mt: int) -> None:
            body = {"model": model, "prompt": ids, "max_tokens": mt, "ignore_eos": True, "temperature": 0,
                    "stream": False}
            r = await c.post("/v1/completions", json=body)
            r.raise_for_status()

        task = asyncio.create_task(sampler())
        t0 = time.monotonic()
        for wave in waves:
            await asyncio.gather(*(one(ids, mt) for ids, mt in wave))
            await asyncio.sleep(0.3)
        wall = time.monotonic() - t0
        stop.set()
        await task
        m1 = await metrics()
    d = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in m1}
    return {"preemptions": d.get("vllm:num_preemptions_total", 0.0),
            "prefix_hits": d.get("vllm:prefix_cache_hits_total", 0.0),
            "prefix_queries": d.get("vllm:prefix_cache_queries_total", 0.0),
            "generated": d.get("vllm:generation_tokens_total", 0.0), "samples": samples, "wall_s": wall}


def run_model(cfg: EngineConfig, waves: list[list[tuple[list[int], int]]], usage_blocks: int) -> Figures:
    core = EngineCore(cfg)
    samples: list[tuple[float, float]] = []
    gen = 0
    t = 0.0
    k = 0
    for wave in waves:
        for ids, mt in wave:
            core.add_request(SimRequest(f"r{k}", ids_to_words(ids), mt, cfg.block_size), t)
            k += 1
        while core.has_work():
            produced, dt = core.step(t)
            t += dt
            gen += len(produced)
            # vLLM's usage: (used + its null block) / all its blocks
            samples.append((float(gen), (core.kv.num_used + 1) / usage_blocks))
    s = core.stats
    return {"preemptions": float(s.num_preemptions), "prefix_hits": float(s.prefix_cache_hits),
            "prefix_queries": float(s.prefix_cache_queries), "generated": float(gen), "samples": samples}


def usage_curve_diff(a: list[tuple[float, float]], b: list[tuple[float, float]], total: float) -> dict[str, float]:
    """Mean and max |usage_a − usage_b| over the progress axis (fraction of output generated), b
    interpolated at a's points; and each side's mean usage."""
    if not a or not b or total <= 0:
        return {"mean_abs_diff": float("nan"), "max_abs_diff": float("nan")}
    import bisect

    bx = [x for x, _ in b]
    diffs = []
    for x, ya in a:
        i = bisect.bisect_left(bx, x)
        yb = b[min(i, len(b) - 1)][1]
        diffs.append(abs(ya - yb))
    return {"mean_abs_diff": sum(diffs) / len(diffs), "max_abs_diff": max(diffs),
            "mean_usage_vllm": sum(y for _, y in a) / len(a), "mean_usage_model": sum(y for _, y in b) / len(b)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simulate.vllm_fidelity", allow_abbrev=False)
    p.add_argument("--base-url", required=True, help="the running vLLM, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default="tiny")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--tokens-per-block", type=int, default=32, help="token ids per 512-token trace block")
    p.add_argument("--max-prompt", type=int, default=1400)
    p.add_argument("--max-out", type=int, default=96)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("--num-blocks", type=int, required=True, help="vLLM's --num-gpu-blocks-override")
    p.add_argument("--max-num-seqs", type=int, required=True)
    p.add_argument("--max-num-batched-tokens", type=int, required=True)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--json-out", default=None)
    p.add_argument("--tolerance", type=float, default=0.15, help="relative tolerance reported as pass/fail")
    ns = p.parse_args(argv)
    reqs = workload(ns.requests, ns.tokens_per_block, ns.max_prompt, ns.max_out, ns.vocab)
    half = len(reqs) // 2
    waves = [reqs[:half], reqs[half:]]
    cfg = EngineConfig(block_size=ns.block_size, num_gpu_blocks=ns.num_blocks - 1, max_num_seqs=ns.max_num_seqs,
                       max_num_batched_tokens=ns.max_num_batched_tokens, max_model_len=ns.max_model_len)
    live = asyncio.run(run_vllm(ns.base_url, ns.model, waves))
    model = run_model(cfg, waves, ns.num_blocks)
    total = live["generated"]
    va = [(x / total, y) for x, y in live["samples"]]
    mb = [(x / model["generated"], y) for x, y in model["samples"]]

    def rel(a: float, b: float) -> float:
        return 0.0 if a == b else abs(a - b) / max(abs(a), 1e-9)

    hit_v = live["prefix_hits"] / live["prefix_queries"] if live["prefix_queries"] else 0.0
    hit_m = model["prefix_hits"] / model["prefix_queries"] if model["prefix_queries"] else 0.0
    out = {
        "requests": len(reqs), "generated_vllm": live["generated"], "generated_model": model["generated"],
        "preemptions_vllm": live["preemptions"], "preemptions_model": model["preemptions"],
        "preemptions_rel_diff": rel(live["preemptions"], model["preemptions"]),
        "prefix_queries_vllm": live["prefix_queries"], "prefix_queries_model": model["prefix_queries"],
        "prefix_hit_rate_vllm": hit_v, "prefix_hit_rate_model": hit_m,
        "prefix_hit_rate_rel_diff": rel(hit_v, hit_m),
        "kv_usage": usage_curve_diff(va, mb, 1.0), "vllm_wall_s": live["wall_s"],
    }
    out["kv_mean_usage_rel_diff"] = rel(out["kv_usage"].get("mean_usage_vllm", 0.0),
                                        out["kv_usage"].get("mean_usage_model", 0.0))
    out["within_tolerance"] = {k: out[k] <= ns.tolerance for k in
                               ("preemptions_rel_diff", "prefix_hit_rate_rel_diff", "kv_mean_usage_rel_diff")}
    print(json.dumps(out, indent=2))
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            json.dump({**out, "samples_vllm": va, "samples_model": mb}, f)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
