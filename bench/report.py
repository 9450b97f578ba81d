"""Writing a benchmark run out: ``latest.json``, ``latest.md`` and PNG plots (matplotlib, Agg).

``latest.json``: the list of rows, each with exactly the keys of :data:`bench.stats.ROW_KEYS`.

``latest.md``: the goals of issue 7 checked (DPLB's best policy against the best peer per
workload, "best" meaning lowest TTFT p99 on that workload), then every row, machine, versions,
settings, the command line and notes. Ratios are DPLB / peer, so TTFT p99 wants ≤ 0.8 and
output tokens/s wants ≥ 1.1. Added latency on (f) = e2e p50 of the system − e2e p50 of the
direct run. Scaling efficiency(N) = output tok/s(N) / (N × output tok/s(1)).
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

from bench.peers import peer_version
from bench.stats import ROW_KEYS

Row = dict[str, Any]
GOAL_WORKLOADS = ("a_mooncake", "b_shared_prefix", "c_mixed_lengths", "d_heterogeneous")


def _label(r: Row) -> str:
    return str(r["system"]) if r["system"] == "direct" else f"{r['system']}/{r['policy']}"


def _valid(r: Row) -> bool:
    return r["requests"] > 0 and r["errors"] < r["requests"] and r["ttft_p99_ms"] is not None


def best(rows: Iterable[Row], workload: str, dplb: bool) -> Row | None:
    """Lowest-TTFT-p99 row on ``workload`` among DPLB's rows (``dplb=True``) or the peers'.

    Rows with any error rank after rows without (a system that drops requests is not "best").
    """
    cands = [r for r in rows if r["workload"] == workload and _valid(r)
             and ((r["system"] == "dplb") == dplb) and r["system"] != "direct"]
    if not cands:
        return None
    return min(cands, key=lambda r: (r["errors"] > 0, r["ttft_p99_ms"]))


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _fmt(x: Any, nd: int = 2) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def _verdict(ok: bool | None) -> str:
    return "—" if ok is None else ("met" if ok else "**not met**")


def _compare(w: str, d: Row | None, p: Row | None) -> str:
    """One goals-table line: DPLB row ``d`` against peer row ``p`` on workload ``w``."""
    if not d or not p:
        return f"| {w} | {_label(d) if d else '—'} | {_label(p) if p else '—'} | — | — | — | no data |"
    tr = _ratio(d["ttft_p99_ms"], p["ttft_p99_ms"])
    sr = _ratio(d["output_tok_s"], p["output_tok_s"])
    dh, ph = d["prefix_hit_rate"], p["prefix_hit_rate"]
    ok = [tr is not None and tr <= 0.8, sr is not None and sr >= 1.1,
          dh is not None and ph is not None and dh >= ph - 1e-9]
    miss = [n for n, k in zip(("TTFT", "tok/s", "hit rate"), ok, strict=True) if not k]
    if d["errors"]:
        miss.append(f"{d['errors']} errors")
    return (f"| {w} | {_label(d)} | {_label(p)} | {_fmt(tr)} | {_fmt(sr)} | {_fmt(dh, 3)} / {_fmt(ph, 3)} "
            f"| {'met' if not miss else 'not met: ' + ', '.join(miss)} |")


def goals(rows: list[Row]) -> list[str]:
    """Markdown lines checking every goal of issue 7 against ``rows``."""
    head = [("| workload | DPLB | best peer | TTFT p99 ratio (≤ 0.8) | output tok/s ratio (≥ 1.1) "
            "| prefix hit DPLB / peer (≥) | verdict |"), "|---|---|---|---|---|---|---|"]
    out = ["DPLB's best policy per workload (lowest TTFT p99) against the best peer:", "", *head]
    out += [_compare(w, best(rows, w, True), best(rows, w, False)) for w in GOAL_WORKLOADS]
    out += ["", "DPLB's own policy (`dplb`) against the best peer:", "", *head]
    for w in GOAL_WORKLOADS:
        own = next((r for r in rows if r["workload"] == w and r["system"] == "dplb" and r["policy"] == "dplb"
                    and _valid(r)), None)
        out.append(_compare(w, own, best(rows, w, False)))
    out.append("")
    # (e) burst share
    e_rows = [r for r in rows if r["workload"] == "e_burst" and r["max_share"] is not None]
    if e_rows:
        out += ["(e) burst of 200 at t=0, max/min per-worker share (goal for DPLB ≤ 1.3):", "",
                "| system | max share | min share | max/min | verdict |", "|---|---|---|---|---|"]
        for r in e_rows:
            mm = r["max_share"] / r["min_share"] if r["min_share"] else float("inf")
            v = _verdict(mm <= 1.3) if r["system"] == "dplb" else ""
            out.append(f"| {_label(r)} | {_fmt(r['max_share'], 3)} | {_fmt(r['min_share'], 3)} | {_fmt(mm)} | {v} |")
        out.append("")
    # (f) overhead
    direct = next((r for r in rows if r["workload"] == "f_overhead" and r["system"] == "direct" and _valid(r)), None)
    f_rows = [r for r in rows if r["workload"] == "f_overhead" and r["system"] != "direct" and _valid(r)]
    if direct and f_rows:
        base = direct["e2e_p50_ms"]
        out += [(f"(f) router overhead, tiny non-streaming requests; direct e2e p50 = {_fmt(base, 3)} ms "
                "(goal: DPLB's added p50 no worse than sglang-router's):"), "",
                "| system | e2e p50 ms | added p50 ms | e2e p99 ms | req/s | routing CPU s / 1k req |",
                "|---|---|---|---|---|---|"]
        for r in f_rows:
            out.append(f"| {_label(r)} | {_fmt(r['e2e_p50_ms'], 3)} | {_fmt(r['e2e_p50_ms'] - base, 3)} | "
                       f"{_fmt(r['e2e_p99_ms'], 3)} | {_fmt(r['req_s'], 1)} | {_fmt(r['router_cpu_s_per_1k'], 3)} |")
        dp = [r["e2e_p50_ms"] for r in f_rows if r["system"] == "dplb"]
        sp = [r["e2e_p50_ms"] for r in f_rows if r["system"] == "sglang"]
        if dp and sp:
            out += ["", (f"Best DPLB added p50 {min(dp) - base:.3f} ms vs best sglang-router {min(sp) - base:.3f} ms: "
                    f"{_verdict(min(dp) <= min(sp))}.")]
        out.append("")
    # scaling, per DPLB policy that ran it (the goal is judged on the first one, DPLB's own by default)
    pols = scaling_policies(rows)
    for k, pol in enumerate(pols):
        eff = scaling_efficiency(rows, pol)
        goal = "; goal: efficiency at 8 ≥ 0.97" if k == 0 else "; for comparison"
        out += [f"Scaling of dplb/{pol} (closed loop, concurrency ∝ engines{goal}):", "",
                "| engines | output tok/s | efficiency | max share | min share |", "|---|---|---|---|---|"]
        shares_by_n = {int(r["workers"]): r for r in rows if r["workload"] == "scaling" and r["policy"] == pol}
        for n, (tps, e) in sorted(eff.items()):
            r = shares_by_n[n]
            out.append(f"| {n} | {_fmt(tps, 1)} | {_fmt(e, 3)} | {_fmt(r['max_share'], 3)} | {_fmt(r['min_share'], 3)} |")
        if k == 0 and 8 in eff and eff[8][1] is not None:
            out += ["", f"Efficiency of dplb/{pol} at 8 engines: {eff[8][1]:.3f}: {_verdict(eff[8][1] >= 0.97)}."]
        out.append("")
    return out


def scaling_policies(rows: list[Row]) -> list[str]:
    """DPLB policies with ``scaling`` rows, in the order they ran."""
    seen: list[str] = []
    for r in rows:
        if r["workload"] == "scaling" and r["policy"] not in seen:
            seen.append(str(r["policy"]))
    return seen


def scaling_efficiency(rows: list[Row], policy: str | None = None) -> dict[int, tuple[float | None, float | None]]:
    """``{engines: (output tok/s, efficiency)}`` from the ``scaling`` rows of ``policy`` (default:
    the first policy that ran the scaling workload); efficiency = tok/s(N) / (N × tok/s(1))."""
    if policy is None:
        pols = scaling_policies(rows)
        policy = pols[0] if pols else None
    sc = {int(r["workers"]): r["output_tok_s"] for r in rows if r["workload"] == "scaling" and r["policy"] == policy}
    one = sc.get(1)
    return {n: (t, (t / (n * one)) if (t is not None and one) else None) for n, t in sc.items()}


def _versions() -> list[str]:
    out = [f"python {platform.python_version()}"]
    for dist in ("aiohttp", "uvloop", "orjson", "fastapi", "uvicorn", "Cython", "matplotlib"):
        try:
            out.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    out.append(f"sglang-router {peer_version('sglang')}")
    out.append(f"vllm-router {peer_version('vllm')}")
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


def markdown(rows: list[Row], meta: dict[str, Any], notes: list[str], router_only: dict[tuple[str, str], float]) -> str:
    """The whole ``latest.md`` text."""
    lines = ["# DPLB benchmark: latest run", "",
             (f"Run {meta.get('run_id')} ({meta.get('profile')} profile), finished "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, took {meta.get('elapsed_s')} s."), "",
             f"Command line: `{meta.get('command')}` (from the repository root, in `.venv`).", "",
             "## Goals of issue 7", "", *goals(rows), "## All rows", "",
             "| " + " | ".join(ROW_KEYS) + " |", "|" + "---|" * len(ROW_KEYS)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r[k], 3 if isinstance(r[k], float) and abs(r[k]) < 10 else 1)
                                         for k in ROW_KEYS) + " |")
    lines += ["", ("`router_cpu_s_per_1k` for DPLB counts the router and its worker agents (the agents keep the "
              "engines off the request path and scrape their metrics every 200 ms); the router process alone:"), ""]
    dplb_only = {k: v for k, v in router_only.items() if k[0].startswith("dplb/")}
    if dplb_only:
        lines += ["| system | workload | router-only CPU s / 1k req |", "|---|---|---|"]
        lines += [f"| {s} | {w} | {v:.3f} |" for (s, w), v in sorted(dplb_only.items())]
    lines += ["", "## Settings", "",
              (f"- engines per system: {meta.get('num_engines')} fresh `python -m sim_engine` processes per system "
              f"(same flags for all: `{meta.get('engine_flags')}`); (d) runs on a separate set with one engine at "
              f"`--slowdown {meta.get('hetero_slowdown')}`; (f) on a set at `--time-scale "
              f"{meta.get('fast_time_scale')}` so that engine time is negligible"),
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
              "- `ttft_cdf_a.png`: TTFT CDF per system on (a)", "- `share_e.png`: per-worker share on (e)",
              "- `scaling.png`: DPLB output tokens/s and efficiency at 1, 2, 4, 8 engines", "", "## Notes", ""]
    lines += [f"- {n}" for n in notes] or ["- none"]
    return "\n".join(lines) + "\n"


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
              share_e: dict[str, list[float]], router_only: dict[tuple[str, str], float]) -> None:
    """Write ``latest.json``, the plots and ``latest.md`` into ``out`` (created if missing)."""
    out.mkdir(parents=True, exist_ok=True)
    for r in rows:
        if tuple(r) != ROW_KEYS:
            raise ValueError(f"row keys {tuple(r)} differ from {ROW_KEYS}")
    (out / "latest.json").write_text(json.dumps(rows, indent=1) + "\n")
    try:
        plots(out, rows, ttft_a, share_e)
    except ImportError:
        notes = notes + ["matplotlib is missing (`pip install -e '.[bench]'`): no plots written"]
    (out / "latest.md").write_text(markdown(rows, meta, notes, router_only))
