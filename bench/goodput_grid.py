"""Issue 29's judging harness: ``dplb-simulate --rate-grid`` over a fixed set of windows, per variant.

Bisection (``--find-capacity``) assumes SLO attainment falls as the rate rises; near capacity it
does not (bench/results/goodput.md, Round 5), so routing variants are judged here on a fixed grid
of rates around a reference fixed in advance per window: SLO misses summed over the grid (fewer
is better) and the sustained capacity per Q (the highest grid rate with every rate up to it
attaining Q). The windows are the 25 of Rounds 5 and 6 (the conversation trace and the three
generated workloads at seeds 0-5) and, when ``--held-out DIR`` names a folder holding any of
:data:`HELD_OUT` (Mooncake's synthetic trace, Azure's 2023 code and conversation traces; not in
this repository, never used to choose a setting), those traces too.

A variant is ``NAME=ARGS``: extra ``dplb-simulate`` arguments (a ``--config`` file, a
``--client-max-tokens`` bound, ``--policy``); ``plain=`` is the default dplb. Each (window,
variant) runs as its own ``dplb-simulate`` process, ``--jobs`` at a time.

Usage::

    python -m bench.goodput_grid --engines 4 --variant plain= \\
        --variant slo='--config slo.yaml' --out grid.json [--windows r5,r6] [--held-out DIR]

Prints one row per window (misses per variant, sustained x at Q 0.99 / 0.90) and the totals per
set of windows; ``--out`` keeps every run's grid as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

GRID = "0.7,0.8,0.9,1,1.1,1.2,1.3"
CONVERSATION = ("--arrival-spread-ms", "3000", "--start", "2000", "--requests", "500")


#: held-out traces (file name, label, reference x on 4 engines): Mooncake's synthetic trace
#: (kvcache-ai/Mooncake ``FAST25-release/traces``; x: least_load's Q 0.99 capacity, Round 3) and
#: Azure's 2023 LLM inference traces (Azure/AzurePublicDataset ``data/``, no prefixes; x:
#: least_load's Q 0.99 capacity by bisection, 1,000 requests, seed 0, fixed before any dplb run)
HELD_OUT = (("synthetic_trace.jsonl", "mooncake-synthetic", 0.771),
            ("AzureLLMInferenceTrace_code.csv", "azure-code", 1.682),
            ("AzureLLMInferenceTrace_conv.csv", "azure-conv", 14.672))


@dataclass(frozen=True)
class Window:
    """One judged window: ``name`` (workload and seed), its set (``r5``, ``r6``, ``held``), the
    reference rate multiple the grid is centred on, and its ``dplb-simulate`` arguments."""

    name: str
    group: str
    x: float
    args: tuple[str, ...]


def windows(held_out: str | None, engines: int) -> list[Window]:
    """The windows of Rounds 5 and 6 (4 engines' references; ×2 for 8 engines, where capacity
    about doubles) and, with ``held_out``, the held-out traces found there."""
    scale = engines / 4.0
    gen = {"agentic": (8.724, 11.314, 10.0), "docqa": (11.314, 14.672, 13.0), "mixed": (14.672, 11.314, 13.0)}
    out: list[Window] = []
    for seed in range(6):
        group = "r5" if seed < 2 else "r6"
        out.append(Window(f"conversation s{seed}", group, 0.841 * scale, ("--seed", str(seed), *CONVERSATION)))
        for w, (x0, x1, xr) in gen.items():
            x = (x0, x1)[seed] if seed < 2 else xr
            out.append(Window(f"{w} s{seed}", group, x * scale,
                              ("--seed", str(seed), "--workload", w, "--requests", "500")))
    if held_out:
        for fname, label, x in HELD_OUT:
            path = os.path.join(held_out, fname)
            if os.path.exists(path):
                for seed in (0, 1):
                    out.append(Window(f"{label} s{seed}", "held", x * scale,
                                      ("--seed", str(seed), "--trace", path, "--requests", "1000")))
    return out


def run_one(w: Window, variant: str, extra: Sequence[str], engines: int, grid: str) -> dict:
    """One ``dplb-simulate --rate-grid`` run: ``{"missed", "sustained": {q: x}, "points"}``."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        cmd = [sys.executable, "-m", "simulate.cli", "--engines", str(engines), "--slo-attainment", "0.99,0.90",
               "--rate-scale", f"{w.x:.4f}", "--rate-grid", grid, "--progress", "off", *w.args, *extra,
               "--json-out", out]
        if "--policy" not in extra:
            cmd += ["--policy", "dplb"]
        p = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if p.returncode != 0:
            raise RuntimeError(f"{w.name} / {variant}: {shlex.join(cmd)} failed:\n{p.stderr[-2000:]}")
        with open(out) as f:
            rows = json.load(f)
    g = rows[0]["rate_grid"]
    return {"window": w.name, "group": w.group, "variant": variant, "missed": g["missed_total"],
            "sustained": {q: (s["capacity_rate_scale"], s.get("bound")) for q, s in g["sustained"].items()},
            "points": [(p["x"], p["missed"], p["missed_by"]) for p in g["points"]]}


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, run every (window, variant), print the table; returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--variant", action="append", required=True, help="NAME=dplb-simulate arguments (repeatable)")
    ap.add_argument("--windows", default="r5,r6,held", help="sets of windows: r5 (seeds 0-1), r6 (seeds 2-5), held")
    ap.add_argument("--only", default=None, help="comma-separated window names (e.g. 'agentic s3,mixed s0')")
    ap.add_argument("--held-out", default=None,
                    help="folder with the held-out traces (synthetic_trace.jsonl, AzureLLMInferenceTrace_{code,conv}.csv)")
    ap.add_argument("--grid", default=GRID, help=f"rate factors around each window's reference ({GRID})")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=None, help="write every run as JSON")
    ns = ap.parse_args(argv)
    variants = []
    for v in ns.variant:
        name, sep, args = v.partition("=")
        if not sep or not name:
            ap.error(f"--variant {v!r}: NAME=ARGS")
        variants.append((name, shlex.split(args)))
    groups = set(ns.windows.split(","))
    ws = [w for w in windows(ns.held_out, ns.engines) if w.group in groups]
    if ns.only:
        only = {s.strip() for s in ns.only.split(",")}
        ws = [w for w in ws if w.name in only]
    jobs = [(w, name, extra) for w in ws for name, extra in variants]
    with ThreadPoolExecutor(max(1, ns.jobs)) as ex:
        results = list(ex.map(lambda j: run_one(j[0], j[1], j[2], ns.engines, ns.grid), jobs))
    by = {(r["window"], r["variant"]): r for r in results}
    names = [n for n, _ in variants]

    def cell(r: dict) -> str:
        s = r["sustained"]

        def fmt(q: str) -> str:
            x, b = s.get(q, (None, None))
            return "-" if b == "below" or x is None else f"{x:.2f}{'+' if b == 'above' else ''}"
        return f"{r['missed']} ({fmt('0.99')} / {fmt('0.9')})"

    print(f"# {ns.engines} engines, grid {ns.grid} x each window's reference; misses (sustained x at Q 0.99 / 0.90)")
    print("| window | x | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for w in ws:
        print(f"| {w.name} | {w.x:.3f} | " + " | ".join(cell(by[(w.name, n)]) for n in names) + " |")
    for g in ("r5", "r6", "held"):
        if any(w.group == g for w in ws):
            tot = [sum(by[(w.name, n)]["missed"] for w in ws if w.group == g) for n in names]
            print(f"| **total {g}** | | " + " | ".join(str(t) for t in tot) + " |")
    if len(names) > 1:
        base = names[0]
        for n in names[1:]:
            fewer = sum(by[(w.name, n)]["missed"] < by[(w.name, base)]["missed"] for w in ws)
            more = sum(by[(w.name, n)]["missed"] > by[(w.name, base)]["missed"] for w in ws)
            print(f"{n} against {base}: fewer misses on {fewer} windows, more on {more}, equal on {len(ws) - fewer - more}")
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
