"""Reading an engine's Prometheus ``/metrics`` text into the few figures the slot needs.

Parsing uses ``prometheus_client.parser`` (the reference parser of the exposition format). A real
vLLM ``/metrics`` page is tens of kilobytes of histogram buckets; the agent scrapes it every state
interval (its main cost when idle: ``bench/results/router_profile.md`` section 6), so one regular
expression first picks the sample lines of the names we read, and, since the figures combine
samples across label sets whatever their labels, each line's label set is cut before the parser
sees it (the parser's label scanner took two thirds of its time). A line the expression cannot
take apart goes to the parser whole, which raises on malformed text as before.

Metric names (sources):

- vLLM (``vllm/v1/metrics/loggers.py``; docs.vllm.ai "Metrics"): ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting`` (gauges, requests), ``vllm:kv_cache_usage_perc`` (gauge, a fraction
  0..1 despite the name; before v0.10 it was ``vllm:gpu_cache_usage_perc``). V1 labels every sample
  with ``engine="<dp rank>"`` and ``model_name``.
- SGLang (docs.sglang.io "Production Metrics"): ``sglang:num_running_reqs``,
  ``sglang:num_queue_reqs`` (gauges, requests), ``sglang:token_usage`` (gauge, fraction 0..1 of
  the KV token pool), labelled by ``model_name`` (and ``tp_rank`` etc. in newer versions).

When several label sets are present (vLLM data-parallel engines behind one API server, SGLang TP
ranks), counts are summed per ``engine`` label and usage takes the maximum (the fullest engine is
the one that preempts first). SGLang reports the same scheduler state on every TP rank, so its
counts take the maximum across samples instead of the sum.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from dplb_shm.types import SlotFields


@dataclass(frozen=True)
class MetricNames:
    """Which gauge families of an engine give running, waiting and KV-cache usage.

    ``kv_usage`` lists names in order of preference (the first present wins). ``sum_counts``:
    whether samples of several label sets are summed (vLLM DP engines) or maxed (SGLang TP ranks).
    """

    running: str
    waiting: str
    kv_usage: tuple[str, ...]
    sum_counts: bool = True
    #: latency histograms (family names, seconds) whose ``_sum``/``_count`` feed the slot's windows
    ttft: str | None = None
    tpot: str | None = None
    e2e: str | None = None
    #: counter of finished requests (the slot's ``completed``)
    finished: str | None = None


VLLM = MetricNames("vllm:num_requests_running", "vllm:num_requests_waiting",
                   ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), sum_counts=True,
                   ttft="vllm:time_to_first_token_seconds", tpot="vllm:inter_token_latency_seconds",
                   e2e="vllm:e2e_request_latency_seconds", finished="vllm:request_success_total")
SGLANG = MetricNames("sglang:num_running_reqs", "sglang:num_queue_reqs", ("sglang:token_usage",),
                     sum_counts=False, ttft="sglang:time_to_first_token_seconds",
                     tpot="sglang:inter_token_latency_seconds", e2e="sglang:e2e_request_latency_seconds")


@dataclass(frozen=True)
class EngineMetrics:
    """Live engine state read from ``/metrics``; ``None`` where the page lacks that family.

    Attributes:
        num_running: requests in the engine's running batch (prefill or decode).
        num_waiting: requests queued in the engine's scheduler, not yet admitted.
        kv_cache_usage: fraction 0..1 of the KV-cache blocks (vLLM) or token pool (SGLang) in use.
    """

    num_running: int | None = None
    num_waiting: int | None = None
    kv_cache_usage: float | None = None
    #: cumulative ``(sum seconds, count)`` of the latency histograms (``ttft``, ``tpot``, ``e2e``)
    #: and ``(finished, 0)``, summed over label sets; absent families are absent
    totals: tuple[tuple[str, float, float], ...] = ()

    @property
    def empty(self) -> bool:
        """True when none of the three figures was found."""
        return self.num_running is None and self.num_waiting is None and self.kv_cache_usage is None


def _filter_lines(text: str, prefixes: tuple[str, ...]) -> str:
    """Keep only sample and ``# HELP``/``# TYPE`` lines of the families named by ``prefixes``."""
    keep = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[2].startswith(prefixes):
                keep.append(line)
        elif line.startswith(prefixes):
            keep.append(line)
    return "\n".join(keep) + "\n"


def parse_gauges(text: str, names: list[str] | tuple[str, ...]) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Parse the samples of the named families out of a Prometheus exposition ``text``.

    Args:
        text: the body of a ``/metrics`` response (text format 0.0.4).
        names: family names, e.g. ``["vllm:num_requests_running"]``.

    Returns:
        ``{name: [(labels, value), ...]}`` for each name found (names absent from the text are
        absent from the result).

    Raises:
        ValueError: when a kept line is not valid exposition text (from ``prometheus_client``).
    """
    wanted = tuple(names)
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(_filter_lines(text, wanted)):
        for sample in family.samples:
            # untyped families keep the sample name; typed ones too for gauges (no suffix)
            if sample.name in wanted:
                out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


#: a sample line's label set, quoted values may hold braces and escaped quotes
_LABELS = re.compile(r'\{(?:[^"{}]|"(?:[^"\\]|\\.)*")*\}')


@functools.lru_cache(maxsize=64)
def _picker(names: tuple[str, ...]) -> re.Pattern[str]:
    """The sample lines of exactly ``names`` (a name, then its label set or a blank)."""
    return re.compile("^(?:" + "|".join(re.escape(n) for n in names) + r")(?=[{\s])[^\n]*", re.MULTILINE)


def sample_values(text: str, names: list[str] | tuple[str, ...]) -> dict[str, list[float]]:
    """The values of the samples named ``names`` (exact sample names, e.g. ``..._sum``,
    ``..._total``) in exposition ``text``, labels left out: ``{name: [value, ...]}`` (names absent
    from the text are absent). A line reduced to ``name value [timestamp]`` has its value read by
    ``float`` (the format's values: Go float syntax, ``NaN``, ``+Inf``, ``-Inf``); any other line
    goes to ``prometheus_client``'s parser. Raises ValueError on a malformed line of those names."""
    out: dict[str, list[float]] = {}
    if not names:
        return out
    wanted = tuple(names)
    rest = []
    for line in _picker(wanted).findall(text):
        if "{" in line:
            m = _LABELS.search(line)
            if m is None or line[:m.start()] not in wanted:
                rest.append(line)
                continue
            line = line[:m.start()] + line[m.end():]
        parts = line.split()
        if len(parts) in (2, 3):
            try:
                out.setdefault(parts[0], []).append(float(parts[1]))
                continue
            except ValueError:
                pass
        rest.append(line)
    if rest:
        for family in text_string_to_metric_families("\n".join(rest) + "\n"):
            for sample in family.samples:
                if sample.name in wanted:
                    out.setdefault(sample.name, []).append(float(sample.value))
    return out


def _combine(values: list[float], how: str) -> float:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return float("nan")
    return sum(values) if how == "sum" else max(values)


def parse_engine_metrics(text: str, names: MetricNames) -> EngineMetrics:
    """Read running, waiting and KV-cache usage from ``text`` using the family ``names``.

    Args:
        text: a ``/metrics`` body.
        names: :data:`VLLM` or :data:`SGLANG` (or any :class:`MetricNames`).

    Returns:
        :class:`EngineMetrics`; a field is ``None`` when its family is missing or NaN. Usage is
        clamped to 0..1.

    Raises:
        ValueError: on malformed exposition text in the families read.
    """
    hists = {k: v for k, v in (("ttft", names.ttft), ("tpot", names.tpot), ("e2e", names.e2e),
                                 ("finished", names.finished)) if v}
    wanted = [names.running, names.waiting, *names.kv_usage]
    for k, fam in hists.items():
        wanted += [fam] if k == "finished" else [fam + "_sum", fam + "_count"]
    fams = sample_values(text, wanted)
    how = "sum" if names.sum_counts else "max"

    def count(name: str) -> int | None:
        if name not in fams:
            return None
        v = _combine(fams[name], how)
        return None if math.isnan(v) else round(v)

    kv: float | None = None
    for kv_name in names.kv_usage:
        if kv_name in fams:
            v = _combine(fams[kv_name], "max")
            if not math.isnan(v):
                kv = min(1.0, max(0.0, v))
                break
    totals = []
    for k, fam in hists.items():
        if k == "finished":
            if fam in fams:
                totals.append((k, _combine(fams[fam], "sum"), 0.0))
        elif fam + "_sum" in fams and fam + "_count" in fams:
            totals.append((k, _combine(fams[fam + "_sum"], "sum"), _combine(fams[fam + "_count"], "sum")))
    return EngineMetrics(num_running=count(names.running), num_waiting=count(names.waiting), kv_cache_usage=kv,
                         totals=tuple(totals))


def slot_fields(m: EngineMetrics, inflight: int, stand_in: bool = False) -> SlotFields:
    """The slot fields one scrape ``m`` of an engine sets, the one builder every scraper uses (the
    agent's probe loop, :meth:`worker_agent.agent.Agent.publish_engine`; the scrape of a plain
    engine by the router and the picker, :mod:`router.mirror`): its running and waiting requests
    with ``inflight``, the routers' in-flight count taken at the same scrape (so that ``running +
    waiting - inflight`` is what the engine holds that no router dispatched, csrc/dplb_kernel.h
    ``X_i``), and its KV-cache usage (0..1). An engine that reported neither count sets none of the
    three, or with ``stand_in`` the in-flight count stands for its running requests (0 waiting;
    nothing then looks dispatched from outside)."""
    f: SlotFields = {}
    if m.num_running is None and m.num_waiting is None:
        if stand_in:
            f.update({"num_running": inflight, "num_waiting": 0, "inflight": inflight})
    else:
        if m.num_running is not None:
            f["num_running"] = m.num_running
        if m.num_waiting is not None:
            f["num_waiting"] = m.num_waiting
        f["inflight"] = inflight
    if m.kv_cache_usage is not None:
        f["kv_cache_usage"] = m.kv_cache_usage
    return f
