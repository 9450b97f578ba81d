"""Output of ``dplb-simulate``: the table on stdout, the JSON file, the PNG plots, the progress bar."""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import orjson

from simulate.settings import AttainmentSLO, Figures

COLUMNS = (
    ("policy", 14), ("served", 7), ("rej", 5), ("ttft50", 8), ("ttft90", 8), ("ttft99", 8), ("tpot50", 7),
    ("tpot99", 7), ("e2e50", 8), ("e2e99", 8), ("queue50", 8), ("tok/s", 8), ("hit", 6), ("preempt", 7),
    ("share max/min", 13), ("ratio", 7),
)
#: what the table's columns hold (printed under it by ``dplb-simulate``)
LEGEND = ("times in s, TPOT in ms; share max/min: the largest and smallest engine's share of the requests; "
          "ratio: their quotient")


def _f(x: object, nd: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def row_cells(r: Figures) -> list[str]:
    """One table row (times in seconds, TPOT in ms)."""
    pe = r["per_engine"]
    tp = r["tpot_s"]
    share = "-" if pe["max_share"] is None else f"{pe['max_share']:.3f}/{pe['min_share']:.3f}"
    return [
        r["policy"], str(r["served"]), str(r["rejected"]),
        _f(r["ttft_s"]["p50"]), _f(r["ttft_s"]["p90"]), _f(r["ttft_s"]["p99"]),
        _f(None if tp["p50"] is None else tp["p50"] * 1000, 1), _f(None if tp["p99"] is None else tp["p99"] * 1000, 1),
        _f(r["e2e_s"]["p50"]), _f(r["e2e_s"]["p99"]), _f(r["queue_s"]["p50"]),
        _f(r["output_tokens_per_s"], 0), _f(r["prefix_hit_rate"], 3), str(r["preemptions"]), share,
        _f(pe["max_min_ratio"]),
    ]


def table(rows: Sequence[Figures]) -> str:
    """The comparison table: one line per policy (times in s, TPOT in ms, share = max/min fraction)."""
    head = " ".join(name.rjust(w) if i else name.ljust(w) for i, (name, w) in enumerate(COLUMNS))
    lines = [head]
    for r in rows:
        cells = row_cells(r)
        lines.append(" ".join(c.rjust(w) if i else c.ljust(w) for i, (c, (_, w)) in enumerate(zip(cells, COLUMNS))))
    return "\n".join(lines)


def capacity_table(rows: Sequence[Figures], qs: Sequence[str] | None = None) -> str:
    """Goodput per policy: the highest rate multiple within the SLO and the fewest engines; with
    ``qs`` (keys of ``capacity_attainment``, e.g. ``"0.99"``), one such triple per attainment Q."""
    if not qs:
        lines = [f"{'policy':<14} {'capacity x':>10} {'req/s':>8} {'min engines':>11}"]
        for r in rows:
            cap = r.get("capacity") or {}
            me = r.get("min_engines") or {}
            x = cap.get("capacity_rate_scale")
            rps = cap.get("capacity_requests_per_s")
            lines.append(f"{r['policy']:<14} {_f(x, 3):>10} {_f(rps, 3):>8} {_f(me.get('min_engines')):>11}")
        return "\n".join(lines)
    head = f"{'policy':<14}" + "".join(f" {'x@' + q:>9} {'req/s':>8} {'engines':>7}" for q in qs)
    lines = [head]
    for r in rows:
        caps = r.get("capacity_attainment") or {}
        mes = r.get("min_engines_attainment") or {}
        cells = ""
        for q in qs:
            cap = caps.get(q) or {}
            me = mes.get(q) or {}
            cells += (f" {_f(cap.get('capacity_rate_scale'), 3):>9} {_f(cap.get('capacity_requests_per_s'), 3):>8}"
                      f" {_f(me.get('min_engines')):>7}")
        lines.append(f"{r['policy']:<14}{cells}")
    return "\n".join(lines)


def grid_table(rows: Sequence[Figures], qs: Sequence[str]) -> str:
    """Misses per policy at each rate of the ``rate_grid`` (:func:`simulate.capacity.rate_sweep`),
    their sum, and the sustained capacity at each Q of ``qs``."""
    have = [r for r in rows if r.get("rate_grid")]
    if not have:
        return ""
    xs = [p["x"] for p in have[0]["rate_grid"]["points"]]
    head = (f"{'policy':<14}" + "".join(f" {'x' + format(x, '.3g'):>8}" for x in xs) + f" {'total':>6}"
            + "".join(f" {'sust@' + q:>10}" for q in qs))
    lines = [head]
    for r in have:
        g = r["rate_grid"]
        cells = "".join(f" {p['missed']:>8}" for p in g["points"]) + f" {g['missed_total']:>6}"
        cells += "".join(f" {_f(g['sustained'].get(q, {}).get('capacity_rate_scale'), 3):>10}" for q in qs)
        lines.append(f"{r['policy']:<14}{cells}")
    return "\n".join(lines)


def attainment_line(rows: Sequence[Figures], slo: AttainmentSLO) -> str:
    """One line: each policy's SLO attainment in the table's runs (share of requests meeting ``slo``,
    an :class:`simulate.settings.AttainmentSLO`)."""
    tpot = f", TPOT <= {slo.tpot_s:g} s" if slo.tpot_s is not None else ""
    parts = ", ".join(f"{r['policy']} {r['slo_attainment']['attainment']:.4f}" for r in rows)
    return (f"SLO attainment (per request TTFT <= {slo.ttft_base_s:g} s + {slo.ttft_per_1k_s:g} s/1k prompt "
            f"tokens{tpot}): {parts}")


def write_json(path: str | Path, rows: Sequence[Figures]) -> None:
    """``rows`` as a JSON array, keys sorted (the same inputs give the same bytes)."""
    data = orjson.dumps(list(rows), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
    Path(path).write_bytes(data + b"\n")


def queue_scale(rows: Sequence[Figures]) -> tuple[float, float]:
    """``(last time s, largest queue)`` over every policy's ``load_over_time``: the one x and y
    range of the per-policy queue plots, so the figures compare at a glance (each plot scaled to
    its own maximum hid the difference they exist to show, issue 32). At least ``(1, 1)``."""
    t_max, q_max = 0.0, 0.0
    for r in rows:
        lot = r["load_over_time"]
        for q in lot["queue"]:
            if q:
                q_max = max(q_max, float(max(q)))
                t_max = max(t_max, float(lot["t_s"][min(len(q), len(lot["t_s"])) - 1]))
    return max(t_max, 1.0), max(q_max, 1.0)


def plot(rows: Sequence[Figures], ttft_samples: dict[str, list[float]], out_dir: str | Path) -> list[str]:
    """Write ``ttft_cdf.png`` (TTFT CDF per policy) and ``queue_<policy>.png`` (each engine's
    queue, running + waiting, over time; one x and y range for every policy, :func:`queue_scale`).
    Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        xs = sorted(ttft_samples.get(r["policy"], []))
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.plot(xs, ys, label=f"{r['policy']} (p99 {r['ttft_s']['p99']:.2f} s)")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF per policy (dplb-simulate)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    p = out / "ttft_cdf.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    written.append(str(p))
    t_max, q_max = queue_scale(rows)
    for r in rows:
        lot = r["load_over_time"]
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for k, q in enumerate(lot["queue"]):
            ax.plot(lot["t_s"][:len(q)], q, linewidth=0.8, label=f"engine {k}")
        ax.set_xlabel("time (s, simulated)")
        ax.set_ylabel("queue (running + waiting)")
        ax.set_xlim(0.0, t_max)
        ax.set_ylim(0.0, q_max * 1.05)   # the same scale in every policy's figure
        ax.set_title(f"per-engine queue over time: {r['policy']}")
        ax.grid(True, alpha=0.3)
        if len(lot["queue"]) <= 16:
            ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        p = out / f"queue_{r['policy']}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(str(p))
    return written


class Progress:
    """A one-line progress bar on ``stream`` (stderr), redrawn at most 4 times a second; silent
    when disabled (not a terminal and not forced)."""

    def __init__(self, label: str, enabled: bool, stream: TextIO | None = None) -> None:
        self.label = label
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self._last = 0.0
        self._t0 = time.monotonic()

    def __call__(self, done: int, total: int, t_sim: float) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < 0.25 and done < total:
            return
        self._last = now
        width = 30
        fill = int(width * done / total) if total else width
        bar = "#" * fill + "." * (width - fill)
        self.stream.write(f"\r{self.label:<28} [{bar}] {done}/{total} req  t={t_sim:8.1f} s sim  "
                          f"{now - self._t0:6.1f} s wall")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def progress_enabled(flag: str) -> bool:
    """``--progress auto|on|off``: auto = only when stderr is a terminal."""
    if flag == "on":
        return True
    if flag == "off":
        return False
    return sys.stderr.isatty() and os.environ.get("TERM") != "dumb"
