"""Writing a benchmark run out: ``latest.json``, ``latest.md`` and PNG plots (matplotlib, Agg).

``latest.json``: the list of rows (one per run of a workload: every repeat), each with exactly the
keys of :data:`bench.stats.ROW_KEYS`; ``goodput.json``: the goodput searches.

``latest.md`` opens with one table (issue 17): per workload, DPLB's default policy against the best
peer (lowest median of the figure among sglang-router, vllm-router and smg), each figure as the
median over the repeats with its [min–max], the ratio DPLB/peer with an interval, "no difference"
where the ranges overlap, and the verdict against the open issues' goals. Then a table per
workload for every system, goodput, overhead, scaling, every raw row, settings, machine, versions
and notes. Output tokens/s is not a ranking figure: in an open-loop replay every system that keeps
up serves the offered load; goodput (highest rate within the SLO) is. Added latency on (f) = e2e
p50 of the system − median e2e p50 of the direct run. Scaling efficiency(N) = output tok/s(N) /
(N × output tok/s(1)).
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.peers import PEERS, peer_version
from bench.stats import ROW_KEYS, Spread, ratio_interval, spread, summarize

Row = dict[str, Any]
Key = tuple[str, str, str, int]
PEERS_KINDS = ("sglang", "vllm", "smg")
#: workloads whose TTFT p99 is compared in the summary, in order
TTFT_WORKLOADS = ("a_mooncake", "s_sessions", "b_shared_prefix", "c_mixed_lengths", "d_heterogeneous")
DEFAULT = ("dplb", "dplb")


def _label(r: Row | Key) -> str:
    system, policy = (r["system"], r["policy"]) if isinstance(r, dict) else (r[0], r[1])
    return str(system) if system == "direct" else f"{system}/{policy}"


def _fmt(x: Any, nd: int = 2) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        if x == float("inf"):
            return "inf"
        return f"{x:.{nd}f}"
    return str(x)


def _verdict(ok: bool | None) -> str:
    return "—" if ok is None else ("met" if ok else "**not met**")


def fmt_spread(sp: Spread | None, nd: int = 1) -> str:
    """``median [min–max]`` (or ``—``)."""
    if sp is None or sp.median is None:
        return "—"
    if sp.n == 1 or sp.lo == sp.hi:
        return _fmt(float(sp.median), nd)
    return f"{_fmt(float(sp.median), nd)} [{_fmt(float(sp.lo), nd)}–{_fmt(float(sp.hi), nd)}]"  # type: ignore[arg-type]


def difference(a: Spread, b: Spread, lower_is_better: bool = True) -> str:
    """``DPLB better`` / ``peer better`` when the min–max ranges of ``a`` (DPLB) and ``b`` (peer)
    do not overlap, else ``no difference``."""
    if a.median is None or b.median is None:
        return "no data"
    if a.overlaps(b):
        return "no difference"
    a_low = a.hi < b.lo  # type: ignore[operator]
    return "DPLB better" if a_low == lower_is_better else "peer better"


def best_peer(summary: dict[Key, dict[str, Spread]], workload: str, figure: str,
              kinds: tuple[str, ...] = PEERS_KINDS) -> Key | None:
    """The peer system with the lowest median ``figure`` on ``workload``; systems whose repeats
    had errors rank after error-free ones (a system that drops requests is not "best")."""
    cands = [k for k, v in summary.items() if k[2] == workload and k[0] in kinds and v[figure].median is not None]
    if not cands:
        return None
    return min(cands, key=lambda k: ((summary[k]["errors"].hi or 0) > 0, summary[k][figure].median))


def best(rows: Iterable[Row], workload: str, dplb: bool) -> Row | None:
    """Lowest-TTFT-p99 single row on ``workload`` among DPLB's rows (``dplb=True``) or the peers';
    rows with errors rank after rows without."""
    cands = [r for r in rows if r["workload"] == workload and _valid(r)
             and ((r["system"] == "dplb") == dplb) and r["system"] != "direct"]
    if not cands:
        return None
    return min(cands, key=lambda r: (r["errors"] > 0, r["ttft_p99_ms"]))


def _valid(r: Row) -> bool:
    return r["requests"] > 0 and r["errors"] < r["requests"] and r["ttft_p99_ms"] is not None


def _key(summary: dict[Key, dict[str, Spread]], system: str, policy: str, workload: str) -> Key | None:
    return next((k for k in summary if k[:3] == (system, policy, workload)), None)


def paired_ratios(rows: list[Row], d: Key, p: Key, figure: str) -> list[float]:
    """DPLB / peer for each repeat both ran (same repeat index: the same input, seed and trace
    window), in repeat order; repeats where either figure is missing or the peer's is 0 are left out."""
    def by_repeat(key: Key) -> dict[int, Any]:
        return {r["repeat"]: r.get(figure) for r in rows if (r["system"], r["policy"], r["workload"], r["workers"]) == key}
    dv, pv = by_repeat(d), by_repeat(p)
    return [dv[i] / pv[i] for i in sorted(dv) if i in pv and dv[i] is not None and pv[i]]


def paired_difference(ratios: list[float]) -> str:
    """``DPLB better (paired n/n)`` when DPLB's figure is lower in every repeat (of at least two),
    ``peer better (paired n/n)`` when higher in every one, else ``no difference``. The repeats differ
    in their input (seed, trace window), so the min–max ranges of the two systems can overlap only
    because one window is harder than another; compared repeat by repeat on the same input, the
    window's difficulty cancels."""
    n = len(ratios)
    if n >= 2 and all(r < 1.0 for r in ratios):
        return f"DPLB better (paired {n}/{n})"
    if n >= 2 and all(r > 1.0 for r in ratios):
        return f"peer better (paired {n}/{n})"
    return "no difference"


def _cmp_line(summary: dict[Key, dict[str, Spread]], workload: str, figure: str, name: str, goal: str,
              peer_kinds: tuple[str, ...] = PEERS_KINDS, nd: int = 1, rows: list[Row] | None = None) -> str:
    d = _key(summary, *DEFAULT, workload)
    p = best_peer(summary, workload, figure, peer_kinds)
    if d is None or p is None:
        return (f"| {workload} | {name} | {fmt_spread(summary[d][figure], nd) if d else '—'} | "
                f"{_label(p) if p else '—'} | — | no data | {goal + ': no data' if goal else ''} |")
    ds, ps = summary[d][figure], summary[p][figure]
    r, lo, hi = ratio_interval(ds, ps)
    diff = difference(ds, ps)
    paired = ""
    if rows is not None:
        pr = paired_ratios(rows, d, p, figure)
        if len(pr) >= 2:
            paired = "; per repeat " + ", ".join(_fmt(x) for x in pr)
        if diff == "no difference":
            diff = paired_difference(pr)
    errs = summary[d]["errors"].hi or 0
    met = diff.startswith("DPLB better") and not errs
    g = f"{goal}: {_verdict(met)}" if goal else ""
    if errs:
        g += f" ({int(errs)} errors in a repeat)"
    return (f"| {workload} | {name} | {fmt_spread(ds, nd)} | {_label(p)} {fmt_spread(ps, nd)} | "
            f"{_fmt(r)} [{_fmt(lo)}–{_fmt(hi)}]{paired} | {diff} | {g} |")


def summary_lines(rows: list[Row], goodput: list[dict[str, Any]]) -> list[str]:
    """The table ``latest.md`` opens with: per workload, ``dplb/dplb`` against the best peer
    (``sglang``, ``vllm``, ``smg``; lowest median), each figure as median [min–max] over the
    repeats, the ratio DPLB/peer with its interval (lo = DPLB min / peer max, hi = DPLB max / peer
    min) and per repeat (same input), the difference (ranges apart; else DPLB lower or higher in
    every paired repeat; else "no difference"), and the verdict against the open issues' goals.
    """
    sm = summarize(rows)
    out = ["| workload | figure | DPLB `dplb` | best peer | ratio [interval] | difference | goal |",
           "|---|---|---|---|---|---|---|"]
    goal_of = {"a_mooncake": "below the best peer (issue 13)"}
    for w in TTFT_WORKLOADS:
        if any(k[2] == w for k in sm):
            out.append(_cmp_line(sm, w, "ttft_p99_ms", "TTFT p99 ms", goal_of.get(w, ""), rows=rows))
    if any(k[2] == "a_mooncake" for k in sm):
        out.append(_cmp_line(sm, "a_mooncake", "tpot_p99_ms", "TPOT p99 ms", "", rows=rows))
    for w in ("a_mooncake", "b_shared_prefix"):
        gp = {(g["system"], g["policy"]): g for g in goodput if g["workload"] == w}
        d = gp.get(DEFAULT)
        peers = [g for k, g in gp.items() if k[0] in PEERS_KINDS]
        if d is None or not peers:
            continue
        p = max(peers, key=lambda g: g["goodput_mult"])
        r = (d["goodput_mult"] / p["goodput_mult"]) if p["goodput_mult"] else None
        diff = ("no difference" if d["goodput_mult"] == p["goodput_mult"]
                else "DPLB better" if d["goodput_mult"] > p["goodput_mult"] else "peer better")
        out.append(f"| {w} | goodput (× own rate, one ladder) | {_fmt(d['goodput_mult'])} | {_label(p)} "
                   f"{_fmt(p['goodput_mult'])} | {_fmt(r)} | {diff} (ladder step resolution) | ≥ best peer (issue 17) "
                   f"{_verdict(d['goodput_mult'] >= p['goodput_mult'])} |")
    e = _key(sm, *DEFAULT, "e_burst")
    if e is not None:
        mx, mn = sm[e]["max_share"], sm[e]["min_share"]
        ratios = [a / b if b else float("inf") for a, b in zip(_vals(rows, e, "max_share"), _vals(rows, e, "min_share"),
                                                               strict=True)]
        rs = spread(ratios)
        out.append(f"| e_burst | max/min share | {fmt_spread(rs, 2)} (max {fmt_spread(mx, 3)}, min {fmt_spread(mn, 3)}) "
                   f"| — | — | — | ≤ 1.3 in every repeat (issue 13): {_verdict(rs.hi is not None and rs.hi <= 1.3)} |")
    out += _overhead_summary(rows, sm)
    pols = scaling_policies(rows)
    if pols:
        eff = scaling_efficiency_spread(rows, pols[0])
        if 8 in eff:
            sp = eff[8]
            out.append(f"| scaling | efficiency at 8 engines, dplb/{pols[0]} | {fmt_spread(sp, 3)} | — | — | — | "
                       f"seeds' claim 0.97: {_verdict(sp.median is not None and sp.median >= 0.97)} |")
    return out


def _vals(rows: list[Row], key: Key, figure: str) -> list[Any]:
    return [r[figure] for r in rows if (r["system"], r["policy"], r["workload"], r["workers"]) == key]


def _overhead_summary(rows: list[Row], sm: dict[Key, dict[str, Spread]]) -> list[str]:
    """Summary lines of issue 14's goals: added latency and router CPU against sglang-router."""
    out = []
    direct = _key(sm, "direct", "none", "f_overhead")
    d = _key(sm, *DEFAULT, "f_overhead")
    sg = best_peer(sm, "f_overhead", "e2e_p50_ms", ("sglang",))
    if direct and d and sg:
        base = sm[direct]["e2e_p50_ms"].median
        added_d = spread([x - base for x in _vals(rows, d, "e2e_p50_ms") if x is not None])
        added_s = spread([x - base for x in _vals(rows, sg, "e2e_p50_ms") if x is not None])
        r, lo, hi = ratio_interval(added_d, added_s)
        out.append(f"| f_overhead | added p50 ms over direct | {fmt_spread(added_d, 3)} | {_label(sg)} "
                   f"{fmt_spread(added_s, 3)} | {_fmt(r)} [{_fmt(lo)}–{_fmt(hi)}] | {difference(added_d, added_s)} | "
                   f"≤ sglang-router's (issue 14): {_verdict(added_d.median is not None and added_s.median is not None and added_d.median <= added_s.median)} |")
    for w, name in (("f_overhead", "routing CPU s / 1k tiny req"), ("a_mooncake", "routing CPU s / 1k streamed req")):
        d = _key(sm, *DEFAULT, w)
        sg = best_peer(sm, w, "router_cpu_s_per_1k", ("sglang",))
        if d and sg:
            ds, ps = sm[d]["router_cpu_s_per_1k"], sm[sg]["router_cpu_s_per_1k"]
            r, lo, hi = ratio_interval(ds, ps)
            out.append(f"| {w} | {name} | {fmt_spread(ds, 2)} | {_label(sg)} {fmt_spread(ps, 2)} | "
                       f"{_fmt(r)} [{_fmt(lo)}–{_fmt(hi)}] | {difference(ds, ps)} | ≤ 1.5× sglang-router's (issue 14): "
                       f"{_verdict(r is not None and r <= 1.5)} |")
    return out


FIG_COLUMNS = (("ttft_p50_ms", "TTFT p50 ms", 1), ("ttft_p99_ms", "TTFT p99 ms", 1), ("tpot_p99_ms", "TPOT p99 ms", 2),
               ("e2e_p99_ms", "e2e p99 ms", 0), ("prefix_hit_rate", "prefix hit", 3), ("max_share", "max share", 3),
               ("min_share", "min share", 3), ("router_cpu_s_per_1k", "routing CPU s/1k", 2), ("errors", "errors", 0))


def workload_tables(rows: list[Row]) -> list[str]:
    """One table per workload: every system, each figure as median [min–max] over the repeats."""
    sm = summarize(rows)
    out: list[str] = []
    workloads: list[str] = []
    for r in rows:
        if r["workload"] not in workloads and r["workload"] != "scaling":
            workloads.append(r["workload"])
    for w in workloads:
        keys = [k for k in sm if k[2] == w]
        n = max(sm[k]["errors"].n for k in keys)
        out += [f"### {w} ({n} repeats)", "", "| system | " + " | ".join(c[1] for c in FIG_COLUMNS) + " |",
                "|---|" + "---|" * len(FIG_COLUMNS)]
        for k in keys:
            out.append(f"| {_label(k)} | " + " | ".join(fmt_spread(sm[k][f], nd) for f, _, nd in FIG_COLUMNS) + " |")
        out.append("")
    return out


def goodput_lines(goodput: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    """The goodput table: the highest multiplier of each workload's own rate within the SLO."""
    if not goodput:
        return []
    slo = meta.get("goodput_slo", {})
    out = ["SLO per workload (simulated seconds; wall × the engines' time scale): "
           + "; ".join(f"{w}: TTFT p99 ≤ {v['ttft_p99_s']} s, TPOT p99 ≤ {v['tpot_p99_s']} s (scaling {v['scaled']}, "
                       f"ladder {v.get('ladder')}, down {v.get('down')})" for w, v in slo.items())
           + "; each step on fresh engines, once; `dplb/dplb` and the two peers with the lowest median TTFT p99 "
           "on the workload.", "",
           "| workload | system | goodput (× own rate) | req/s at that rate (wall) | steps: multiplier ok TTFT/TPOT p99 ms |",
           "|---|---|---|---|---|"]
    for g in goodput:
        steps = "; ".join(f"×{m} {'✓' if ok else '✗'} {_fmt(t, 0)}/{_fmt(p, 1)}" for m, ok, t, p in g["steps"])
        out.append(f"| {g['workload']} | {_label((g['system'], g['policy'], '', 0))} | {_fmt(g['goodput_mult'])} | "
                   f"{_fmt(g['goodput_req_s'])} | {steps} |")
    return out + [""]


def overhead_lines(rows: list[Row], router_only: dict[tuple[str, str], list[float]]) -> list[str]:
    """(f): added p50 over the direct run, per system, median [min–max] over repeats."""
    sm = summarize(rows)
    direct = _key(sm, "direct", "none", "f_overhead")
    keys = [k for k in sm if k[2] == "f_overhead" and k[0] != "direct"]
    if not direct or not keys:
        return []
    base = sm[direct]["e2e_p50_ms"].median
    out = [f"(f) tiny non-streaming requests, concurrency 1; direct e2e p50 = {_fmt(base, 3)} ms:", "",
           "| system | e2e p50 ms | added p50 ms | e2e p99 ms | req/s | routing CPU s / 1k req | router alone CPU s / 1k |",
           "|---|---|---|---|---|---|---|"]
    for k in keys:
        added = spread([x - base for x in _vals(rows, k, "e2e_p50_ms") if x is not None])
        ro = spread(router_only.get((_label(k), "f_overhead"), []))
        out.append(f"| {_label(k)} | {fmt_spread(sm[k]['e2e_p50_ms'], 3)} | {fmt_spread(added, 3)} | "
                   f"{fmt_spread(sm[k]['e2e_p99_ms'], 3)} | {fmt_spread(sm[k]['req_s'], 1)} | "
                   f"{fmt_spread(sm[k]['router_cpu_s_per_1k'], 3)} | {fmt_spread(ro, 3)} |")
    return out + [""]


def scaling_lines(rows: list[Row]) -> list[str]:
    """Scaling tables (output tok/s and efficiency as median [min–max]) per DPLB policy."""
    out: list[str] = []
    for k, pol in enumerate(scaling_policies(rows)):
        tps = {n: spread([r["output_tok_s"] for r in rows if r["workload"] == "scaling" and r["policy"] == pol
                          and int(r["workers"]) == n]) for n in SIZES if _has(rows, pol, n)}
        eff = scaling_efficiency_spread(rows, pol)
        out += [f"Scaling of dplb/{pol} (closed loop, concurrency ∝ engines{'' if k == 0 else '; for comparison'}):", "",
                "| engines | output tok/s | efficiency |", "|---|---|---|"]
        out += [f"| {n} | {fmt_spread(tps[n], 1)} | {fmt_spread(eff.get(n), 3)} |" for n in sorted(tps)]
        out.append("")
    return out


SIZES = (1, 2, 4, 8)


def _has(rows: list[Row], pol: str, n: int) -> bool:
    return any(r["workload"] == "scaling" and r["policy"] == pol and int(r["workers"]) == n for r in rows)


def scaling_policies(rows: list[Row]) -> list[str]:
    """DPLB policies with ``scaling`` rows, in the order they ran."""
    seen: list[str] = []
    for r in rows:
        if r["workload"] == "scaling" and r["policy"] not in seen:
            seen.append(str(r["policy"]))
    return seen


def scaling_efficiency(rows: list[Row], policy: str | None = None) -> dict[int, tuple[float | None, float | None]]:
    """``{engines: (median output tok/s, efficiency of the medians)}`` from the ``scaling`` rows of
    ``policy`` (default: the first policy that ran it); efficiency = tok/s(N) / (N × tok/s(1))."""
    if policy is None:
        pols = scaling_policies(rows)
        policy = pols[0] if pols else None
    sc = {n: spread([r["output_tok_s"] for r in rows if r["workload"] == "scaling" and r["policy"] == policy
                     and int(r["workers"]) == n]).median for n in SIZES if _has(rows, str(policy), n)}
    one = sc.get(1)
    return {n: (t, (t / (n * one)) if (t is not None and one) else None) for n, t in sc.items()}


def scaling_efficiency_spread(rows: list[Row], policy: str) -> dict[int, Spread]:
    """Efficiency(N) per repeat (tok/s of repeat k at N / (N × median tok/s at 1)), folded."""
    base = scaling_efficiency(rows, policy).get(1, (None, None))[0]
    if not base:
        return {}
    return {n: spread([r["output_tok_s"] / (n * base) for r in rows if r["workload"] == "scaling"
                       and r["policy"] == policy and int(r["workers"]) == n and r["output_tok_s"] is not None])
            for n in SIZES if _has(rows, policy, n)}


def goals(rows: list[Row], goodput: list[dict[str, Any]] | None = None) -> list[str]:
    """Markdown lines of the summary (see :func:`summary_lines`)."""
    return summary_lines(rows, goodput or [])


def _versions() -> list[str]:
    out = [f"python {platform.python_version()}"]
    for dist in ("aiohttp", "uvloop", "orjson", "fastapi", "uvicorn", "Cython", "matplotlib"):
        try:
            out.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    for name, spec in PEERS.items():
        out.append(f"{spec.package} {peer_version(name)}")
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], check=False, capture_output=True,
                               text=True, timeout=10, cwd=Path(__file__).resolve().parent).stdout.strip()
        out.append(f"dplb git {rev}{' (with uncommitted changes)' if dirty else ''}")
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def _machine() -> list[str]:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import psutil
    mem = psutil.virtual_memory().total / 2**30
    la = os.getloadavg()
    return [f"{platform.system()} {platform.release()} {platform.machine()}", f"CPU: {cpu}, {os.cpu_count()} cores",
            f"memory: {mem:.1f} GiB", f"load average at the end: {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}",
            "GPU: none (simulated engines)"]


def markdown(rows: list[Row], meta: dict[str, Any], notes: list[str], router_only: dict[tuple[str, str], list[float]],
             goodput: list[dict[str, Any]] | None = None) -> str:
    """The whole ``latest.md`` text: the summary table first, then per-workload tables, goodput,
    overhead, scaling, every raw row, settings, machine, versions, plots and notes."""
    goodput = goodput or []
    lines = ["# DPLB benchmark: latest run", "",
             (f"Run {meta.get('run_id')} ({meta.get('profile')} profile, {meta.get('repeats', 1)} repeats), finished "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, took {meta.get('elapsed_s')} s."), "",
             f"Command line: `{meta.get('command')}` (from the repository root, in `.venv`).", "",
             "## Summary: DPLB's default policy against the best peer", "",
             ("Each figure is the median over the repeats with [min–max]; the ratio is DPLB / peer with the "
              "interval [DPLB min / peer max – DPLB max / peer min], then per repeat (repeat k of both systems ran "
              "the same input: seed, trace window). A difference is called when the two ranges are apart, or, "
              "when they overlap, when DPLB is lower (or higher) in every paired repeat (the windows differ in "
              "difficulty; paired, that cancels); else \"no difference\". "
              "Times are wall milliseconds (the engines run at the time scales under Settings)."), "",
             *summary_lines(rows, goodput), "", "## Per workload", "", *workload_tables(rows)]
    gl = goodput_lines(goodput, meta)
    if gl:
        lines += ["## Goodput at an SLO", "", *gl]
    ol = overhead_lines(rows, router_only)
    if ol:
        lines += ["## Router overhead", "", *ol]
    sl = scaling_lines(rows)
    if sl:
        lines += ["## Scaling", "", *sl]
    lines += ["## All rows (one per run)", "", "| " + " | ".join(ROW_KEYS) + " |", "|" + "---|" * len(ROW_KEYS)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r[k], 3 if isinstance(r[k], float) and abs(r[k]) < 10 else 1)
                                         for k in ROW_KEYS) + " |")
    chunks = meta.get("chunks_per_router_cpu_s") or {}
    if chunks:
        lines += ["", ("SSE chunks relayed per router CPU-second on the streamed trace workloads (output tokens / CPU "
                  "seconds of the router process alone; one chunk per token), median [min–max] over repeats:"), "",
                  "| system | workload | chunks per router CPU-second |", "|---|---|---|"]
        lines += [f"| {k.split('|')[0]} | {k.split('|')[1]} | {fmt_spread(spread(v), 0)} |" for k, v in sorted(chunks.items())]
    lines += ["", ("`router_cpu_s_per_1k` for DPLB counts the router and its worker agents (the agents keep the "
              "engines off the request path and scrape their metrics every 200 ms); the router process alone:"), ""]
    dplb_only = {k: v for k, v in router_only.items() if k[0].startswith("dplb/")}
    if dplb_only:
        lines += ["| system | workload | router-only CPU s / 1k req |", "|---|---|---|"]
        lines += [f"| {s} | {w} | {fmt_spread(spread(v), 3)} |" for (s, w), v in sorted(dplb_only.items())]
    lines += ["", "## Settings", "",
              (f"- engines per system: {meta.get('num_engines')} fresh `python -m sim_engine` processes per system "
              f"and engine set (same flags for all: `{meta.get('engine_flags')}`); (a) and (s) run on the `trace` set at "
              f"`--time-scale {meta.get('trace_time_scale')}`; (d) on a set with one engine at "
              f"`--slowdown {meta.get('hetero_slowdown')}`; (f) on a set at `--time-scale "
              f"{meta.get('fast_time_scale')}` so that engine time is negligible"),
              (f"- repeats: {meta.get('repeats')} per workload and system, in order on the same engines; repeat k has "
              "its own seed (for (a)/(s) its own trace window, `mooncake_stride` lines further)"),
              f"- cores: {meta.get('cores')}",
              f"- workload sizes: `{meta.get('profile_values')}`",
              ("- DPLB: one router + one worker agent per engine (`--engine openai --engine-url ...`), fresh segment; "
              "peers: pointed at the engines directly, `--host 127.0.0.1 --prometheus-host 127.0.0.1`, warn-level "
              "logs; direct: the client talks to engine 0"),
              ("- prefix hit rate and per-worker share come from the engines' own `/metrics` counters "
              "(`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`, `vllm:request_success_total`)"),
              f"- process logs: `{meta.get('log_dir')}`", "",
              "## Machine", "", *[f"- {m}" for m in _machine()],
              (f"- load average at the start: {meta.get('load_start', '?')} (other work on this machine shares "
              "the cores; compare figures within one run)"), "", "## Versions", "",
              *[f"- {v}" for v in _versions()], "", "## Plots", "",
              "- `ttft_cdf_a.png`: TTFT CDF per system on (a), all repeats pooled",
              "- `share_e.png`: per-worker share on (e), first repeat",
              "- `scaling.png`: DPLB output tokens/s and efficiency at 1, 2, 4, 8 engines (medians)", "", "## Notes", ""]
    lines += [f"- {n}" for n in notes] or ["- none"]
    return "\n".join(lines) + "\n"


def _replace_block(md: str, start: str, end: str, new: str) -> str:
    """``md`` with the text from the line starting with ``start`` up to (not including) the next
    occurrence of ``end`` after it replaced by ``new``; ``ValueError`` when ``start`` is missing."""
    i = md.index(start)
    j = md.find(end, i + len(start))
    return md[:i] + new + (md[j:] if j >= 0 else "")


def update_goodput(out: Path, goodput: list[dict[str, Any]], slo: dict[str, Any], note: str) -> None:
    """Put a new goodput search into an existing run in ``out`` (``python -m bench.run --goodput-only``).

    Reads the rows of ``latest.json``, writes ``goodput.json``, and in ``latest.md`` replaces the
    summary table (its goodput lines change) and the "Goodput at an SLO" section, and adds ``note``
    to the notes. Raises ``FileNotFoundError`` when ``out`` holds no run.
    """
    rows = json.loads((out / "latest.json").read_text())
    (out / "goodput.json").write_text(json.dumps(goodput, indent=1) + "\n")
    md = (out / "latest.md").read_text()
    md = _replace_block(md, "| workload | figure |", "\n\n", "\n".join(summary_lines(rows, goodput)))
    section = "## Goodput at an SLO\n\n" + "\n".join(goodput_lines(goodput, {"goodput_slo": slo}))
    if "## Goodput at an SLO" in md:
        md = _replace_block(md, "## Goodput at an SLO", "\n## ", section)
    else:
        md = _replace_block(md, "## Router overhead", "\n## Router overhead", section + "\n")
    md = md.replace("## Notes\n\n- none\n", "## Notes\n\n")
    md = (md if md.endswith("\n\n") else md.rstrip("\n") + "\n") + f"- {note}\n"
    (out / "latest.md").write_text(md)


def ensure_matplotlib() -> None:
    """Import matplotlib, installing the ``bench`` extra's pin (``matplotlib>=3.7``) into the running
    interpreter's environment with pip when it is missing. Raises ``ImportError`` if that fails."""
    try:
        import matplotlib
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "matplotlib>=3.7"], check=False, timeout=900)
        import matplotlib  # noqa: F401


def plots(out: Path, rows: list[Row], ttft_a: dict[str, list[float]], share_e: dict[str, list[float]]) -> list[str]:
    """Write the PNG plots that have data; return their file names. Needs matplotlib (``.[bench]``,
    installed on first use by :func:`ensure_matplotlib`)."""
    ensure_matplotlib()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    if ttft_a:
        fig, ax = plt.subplots(figsize=(8, 5))
        for label, xs in sorted(ttft_a.items()):
            if not xs:
                continue
            xs = sorted(x * 1000 for x in xs)
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", label=label, linestyle="-" if label.startswith("dplb") else "--")
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_title("(a) Mooncake replay: TTFT CDF")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "ttft_cdf_a.png", dpi=110)
        plt.close(fig)
        written.append("ttft_cdf_a.png")
    if share_e:
        labels = sorted(share_e)
        n = max(len(v) for v in share_e.values())
        fig, ax = plt.subplots(figsize=(max(8, len(labels) * 1.1), 5))
        width = 0.8 / n
        for k in range(n):
            ax.bar([i + k * width for i in range(len(labels))],
                   [share_e[lab][k] if k < len(share_e[lab]) else 0 for lab in labels], width, label=f"engine {k}")
        ax.axhline(1.0 / n, color="black", linewidth=0.8, linestyle=":")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))])
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("share of the burst's requests")
        ax.set_title("(e) burst of 200 at t=0: per-worker share")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "share_e.png", dpi=110)
        plt.close(fig)
        written.append("share_e.png")
    pols = scaling_policies(rows)
    if pols:
        fig, ax = plt.subplots(figsize=(7, 5))
        ax2 = ax.twinx()
        for k, pol in enumerate(pols):
            eff = scaling_efficiency(rows, pol)
            ns = sorted(eff)
            ax.plot(ns, [eff[n][0] or 0 for n in ns], marker="o", color=f"C{k}", label=f"dplb/{pol} output tok/s")
            ax2.plot(ns, [eff[n][1] or 0 for n in ns], marker="s", linestyle="--", color=f"C{k}",
                     label=f"dplb/{pol} efficiency")
            one = eff.get(1, (None, None))[0]
            if k == 0 and one:
                ax.plot(ns, [one * n for n in ns], linestyle=":", color="gray", label="linear (N × 1 engine)")
            ax.set_xticks(ns)
        ax.set_xlabel("engines")
        ax.set_ylabel("output tokens/s")
        ax2.set_ylim(0, 1.2)
        ax2.set_ylabel("efficiency (dashed)")
        ax.set_title("DPLB scaling")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
        fig.tight_layout()
        fig.savefig(out / "scaling.png", dpi=110)
        plt.close(fig)
        written.append("scaling.png")
    return written


def write_all(out: Path, rows: list[Row], meta: dict[str, Any], notes: list[str], ttft_a: dict[str, list[float]],
              share_e: dict[str, list[float]], router_only: dict[tuple[str, str], list[float]],
              goodput: list[dict[str, Any]] | None = None) -> None:
    """Write ``latest.json`` (rows), ``goodput.json``, the plots and ``latest.md`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    for r in rows:
        if tuple(r) != ROW_KEYS:
            raise ValueError(f"row keys {tuple(r)} differ from {ROW_KEYS}")
    (out / "latest.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "goodput.json").write_text(json.dumps(goodput or [], indent=1) + "\n")
    try:
        plots(out, rows, ttft_a, share_e)
    except ImportError:
        notes = notes + ["matplotlib is missing (`pip install -e '.[bench]'`): no plots written"]
    (out / "latest.md").write_text(markdown(rows, meta, notes, router_only, goodput))
