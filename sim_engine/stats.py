"""Engine statistics (pure): the counters and histograms behind ``/metrics``.

Histogram buckets are vLLM V1's (``vllm/v1/metrics/loggers.py``), so dashboards and routers built
for vLLM read the same bucket edges. Times are simulated seconds.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class Histogram:
    """Fixed-bucket histogram; ``observe`` is one bisect (O(log buckets)).

    ``counts[i]`` counts values in ``(buckets[i-1], buckets[i]]``; ``counts[-1]`` the ones above the
    last edge (Prometheus ``+Inf``)."""

    __slots__ = ("buckets", "count", "counts", "sum")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        """Record one value (seconds)."""
        self.counts[bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """``[(le, cumulative count)]`` including ``"+Inf"``, as Prometheus exposes buckets."""
        out, acc = [], 0
        for edge, c in zip(self.buckets, self.counts):
            acc += c
            out.append((repr(float(edge)), acc))
        out.append(("+Inf", acc + self.counts[-1]))
        return out


@dataclass
class EngineStats:
    """Monotonic counters (vLLM counter names without ``vllm:``/``_total``) and latency histograms."""

    prompt_tokens: int = 0  # prompt tokens of requests that produced their first token
    generation_tokens: int = 0  # tokens generated
    prefix_cache_queries: int = 0  # prompt tokens looked up at first admission (not re-admissions)
    prefix_cache_hits: int = 0  # of which found cached
    num_preemptions: int = 0
    request_success: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    steps: int = 0
    busy_time: float = 0.0  # simulated seconds spent in steps
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
