"""``GET /metrics``: Prometheus text with vLLM V1's metric names, types and meanings.

Values are read from the engine at scrape time, so the exposition always agrees with
:meth:`EngineCore.state`. Labels are vLLM's: ``model_name`` and ``engine`` (``"0"``);
``vllm:request_success_total`` adds ``finished_reason``. The text (exposition format 0.0.4, the
same lines ``prometheus_client`` writes for these families) is written by hand: worker agents scrape
every engine many times a second, and ``prometheus_client.generate_latest`` with custom collectors
costs milliseconds per scrape where this costs tens of microseconds.

=============================================  =========  ================================================
name                                           type       meaning
=============================================  =========  ================================================
vllm:num_requests_running                      gauge      requests in the running batch
vllm:num_requests_waiting                      gauge      requests queued (incl. preempted)
vllm:kv_cache_usage_perc                       gauge      used blocks / total blocks, 0..1
vllm:prefix_cache_queries_total                counter    prompt tokens looked up at first admission
vllm:prefix_cache_hits_total                   counter    of which found cached
vllm:num_preemptions_total                     counter    preemptions (by recompute)
vllm:prompt_tokens_total                       counter    prompt tokens of requests that started decoding
vllm:generation_tokens_total                   counter    generated tokens
vllm:request_success_total                     counter    finished requests by finished_reason
vllm:time_to_first_token_seconds               histogram  arrival → first token
vllm:inter_token_latency_seconds               histogram  gap between consecutive tokens
vllm:e2e_request_latency_seconds               histogram  arrival → last token
vllm:request_queue_time_seconds                histogram  arrival → first scheduled
vllm:cache_config_info                         gauge      1, labels block_size and num_gpu_blocks
=============================================  =========  ================================================

Latencies are wall-clock seconds, what a client of the engine measures: with ``--time-scale F``
the simulated seconds the core records are divided by F (bucket bounds and sums alike, so each
bucket still counts the same requests). One definition of a latency everywhere: the agent
publishes these into the slot, so the dump, ``/dplb/status``, the router's ``/metrics`` and the
client agree (issue 32: under ``--time-scale 10`` the dump showed TTFT 1.3-2.6 s beside the
client's 0.15 s).
"""

from __future__ import annotations

from sim_engine.engine import EngineCore
from sim_engine.stats import Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

GAUGES = (
    ("vllm:num_requests_running", "Number of requests in model execution batches."),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
)
COUNTERS = (
    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    ("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
    ("vllm:prompt_tokens", "Number of prefill tokens processed."),
    ("vllm:generation_tokens", "Number of generation tokens processed."),
)
HISTOGRAMS = (
    ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", "ttft"),
    ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", "itl"),
    ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", "e2e"),
    (
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        "queue_time",
    ),
)


def _label_value(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    return repr(float(v))


class MetricsRenderer:
    """Writes the ``/metrics`` text of one :class:`EngineCore`; static parts are built once."""

    def __init__(self, core: EngineCore, model_name: str, time_scale: float = 1.0) -> None:
        self.core = core
        self.time_scale = float(time_scale)
        self.labels = f'engine="0",model_name="{_label_value(model_name)}"'
        self._buckets: dict[str, list[str]] = {}
        for name, _, attr in HISTOGRAMS:
            h: Histogram = getattr(core.stats, attr)
            self._buckets[attr] = [f'{name}_bucket{{{self.labels},le="{_num(e / self.time_scale)}"}} '
                                   for e in h.buckets] + [
                f'{name}_bucket{{{self.labels},le="+Inf"}} '
            ]
        c = core.config
        self._info = (
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="{c.block_size}",enable_prefix_caching='
            f'"{c.enable_prefix_caching}",num_gpu_blocks="{c.num_gpu_blocks}"}} 1.0\n'
        )

    def render(self) -> bytes:
        """The full exposition text, UTF-8."""
        core, s, lab = self.core, self.core.stats, self.labels
        out: list[str] = []
        gauges = (len(core.running), len(core.waiting), core.kv.usage)
        for (name, doc), v in zip(GAUGES, gauges):
            out.append(f"# HELP {name} {doc}\n# TYPE {name} gauge\n{name}{{{lab}}} {_num(v)}\n")
        counters = (
            s.prefix_cache_queries,
            s.prefix_cache_hits,
            s.num_preemptions,
            s.prompt_tokens,
            s.generation_tokens,
        )
        for (name, doc), v in zip(COUNTERS, counters):
            out.append(
                f"# HELP {name}_total {doc}\n# TYPE {name}_total counter\n{name}_total{{{lab}}} {_num(v)}\n"
            )
        out.append(
            "# HELP vllm:request_success_total Count of successfully processed requests.\n"
            "# TYPE vllm:request_success_total counter\n"
        )
        for reason, v in sorted(s.request_success.items()):
            out.append(f'vllm:request_success_total{{{lab},finished_reason="{reason}"}} {_num(v)}\n')
        for name, doc, attr in HISTOGRAMS:
            h: Histogram = getattr(s, attr)
            out.append(f"# HELP {name} {doc}\n# TYPE {name} histogram\n")
            acc = 0
            for prefix, c in zip(self._buckets[attr], h.counts):
                acc += c
                out.append(f"{prefix}{_num(acc)}\n")
            out.append(f"{name}_count{{{lab}}} {_num(h.count)}\n{name}_sum{{{lab}}} {_num(h.sum / self.time_scale)}\n")
        out.append(self._info)
        return "".join(out).encode()
