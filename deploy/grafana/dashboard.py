"""The DPLB Grafana dashboard, as code: ``python deploy/grafana/dashboard.py > deploy/grafana/dplb.json``.

Edit the panels here and regenerate; tests/deploy checks that dplb.json is this script's output
and evaluates every expression against a real Prometheus scraping a launched system. Expressions
use the dashboard's ``$model`` variable (all models: ``.*``) and Grafana's ``$__rate_interval``.
"""
import json

DS = {"type": "prometheus", "uid": "${datasource}"}
M = 'model=~"$model"'
RI = "$__rate_interval"
panels = []
pid = [0]
y = [0]

def nid():
    pid[0] += 1
    return pid[0]

def row(title):
    panels.append({"type": "row", "title": title, "id": nid(), "collapsed": False,
                   "gridPos": {"h": 1, "w": 24, "x": 0, "y": y[0]}, "panels": []})
    y[0] += 1

def target(expr, legend="", ref="A", **kw):
    t = {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, "range": True}
    t.update(kw)
    return t

def panel(kind, title, desc, targets, x, w, h=8, unit=None, extra=None, fieldcfg=None, options=None):
    p = {"type": kind, "title": title, "description": desc, "id": nid(), "datasource": DS,
         "gridPos": {"h": h, "w": w, "x": x, "y": y[0]},
         "targets": [target(*t) if isinstance(t, tuple) else t for t in targets],
         "fieldConfig": {"defaults": {}, "overrides": []}, "options": options or {}}
    if unit:
        p["fieldConfig"]["defaults"]["unit"] = unit
    if fieldcfg:
        p["fieldConfig"]["defaults"].update(fieldcfg)
    if extra:
        p.update(extra)
    panels.append(p)
    return p

def refs(ts):
    out = []
    for i, t in enumerate(ts):
        out.append((t[0], t[1], "ABCDEFGH"[i]))
    return out

# ---------------------------------------------------------------- overview
row("Overview")
panel("stat", "Requests / s", "Answers per second, every status (router).",
      [(f"sum(rate(dplb_router_requests_total{{{M}}}[{RI}]))", "req/s")], 0, 4, 4, "reqps")
panel("stat", "5xx ratio", "Share of answers with a 5xx status (the router's 502/503/504 and the engines'). Alert: DPLBHighErrorRatio.",
      [(f'(sum(rate(dplb_router_requests_total{{status=~"5..", {M}}}[{RI}])) or vector(0)) / sum(rate(dplb_router_requests_total{{{M}}}[{RI}]))', "5xx")],
      4, 4, 4, "percentunit", fieldcfg={"thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None}, {"color": "red", "value": 0.05}]}})
panel("stat", "Ready workers", "Workers the router routes to, out of the workers listed (dead ones included).",
      refs([(f"sum(dplb_worker_ready{{{M}}})", "ready"), (f"count(dplb_worker_info{{{M}}})", "listed")]), 8, 4, 4)
panel("stat", "TTFT p99 (router)", "99th percentile of the time from a request's arrival to the first chunk carrying content (streams).",
      [(f"histogram_quantile(0.99, sum by (le) (rate(dplb_router_time_to_first_token_seconds_bucket{{{M}}}[{RI}])))", "p99")], 12, 4, 4, "s")
panel("stat", "Output tokens / s", "Tokens generated per second over all workers of the selected models.",
      [(f"sum(rate(dplb_router_generation_tokens_total{{{M}}}[{RI}]))", "tokens/s")], 16, 4, 4, "short")
panel("stat", "Build", "DPLB version, segment layout version and routing policy of the router.",
      [("dplb_build_info", "{{version}} layout {{layout_version}} {{policy}}")], 20, 4, 4,
      options={"textMode": "name", "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}})
y[0] += 4

# ---------------------------------------------------------------- load
row("Load per worker")
pend = (f"sum by (worker, gpus) ((dplb_worker_requests_running{{{M}}} + dplb_worker_requests_waiting{{{M}}})"
        f" * on (job, instance, worker, model) group_left (gpus) dplb_worker_info{{{M}}})")
panel("heatmap", "Pending requests per GPU", "Requests the engine holds (running + waiting) per worker and its GPUs, over time: a hot row is a GPU that gets more than its share.",
      [target(pend, "worker {{worker}} GPU {{gpus}}", format="time_series")], 0, 12, 9,
      options={"calculate": False, "cellGap": 1, "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64, "exponent": 0.5},
               "yAxis": {"axisPlacement": "left"}, "rowsFrame": {"layout": "auto"}, "legend": {"show": True},
               "tooltip": {"show": True, "yHistogram": False}, "cellValues": {"unit": "short"}})
panel("timeseries", "Requests in flight (all routers)", "Requests dispatched to each worker by every router process and not yet answered (segment, read at scrape time).",
      [(f"dplb_worker_requests_in_flight{{{M}}}", "worker {{worker}}")], 12, 6, 9, "short")
panel("timeseries", "Outstanding prefill tokens", "Uncached prompt tokens dispatched to each worker whose first token has not come back: the queue the default policy prices.",
      [(f"dplb_worker_prefill_outstanding_tokens{{{M}}}", "worker {{worker}}")], 18, 6, 9, "short")
y[0] += 9
panel("timeseries", "Engine: running / waiting", "The engine's own running batch and waiting queue (its /metrics, through the agent).",
      refs([(f"dplb_worker_requests_running{{{M}}}", "running {{worker}}"), (f"dplb_worker_requests_waiting{{{M}}}", "waiting {{worker}}")]), 0, 8, 8, "short")
panel("timeseries", "Decoding requests", "Requests past their first token, per worker (router accounting).",
      [(f"dplb_worker_decode_requests{{{M}}}", "worker {{worker}}")], 8, 8, 8, "short")
panel("timeseries", "Tokens / s per worker", "Prompt and generated tokens per second relayed by the router, per worker.",
      refs([(f"sum by (worker) (rate(dplb_router_prompt_tokens_total{{{M}}}[{RI}]))", "prompt {{worker}}"),
            (f"sum by (worker) (rate(dplb_router_generation_tokens_total{{{M}}}[{RI}]))", "generated {{worker}}")]), 16, 8, 8, "short")
y[0] += 8

# ---------------------------------------------------------------- latency
row("Latency")
kv = panel("timeseries", "KV-cache usage against decode latency", "KV-cache usage of each engine (left axis) and the routers' recent time per output token on it (right axis): decode slows as the cache fills, and past routing_policy.kv_cache_threshold (0.8) the router stops sending there.",
           refs([(f"dplb_worker_kv_cache_usage_ratio{{{M}}}", "KV {{worker}}"), (f"dplb_worker_recent_tpot_seconds{{{M}}}", "TPOT {{worker}}")]), 0, 12, 9, "percentunit")
kv["fieldConfig"]["overrides"].append({"matcher": {"id": "byFrameRefID", "options": "B"},
                                       "properties": [{"id": "unit", "value": "s"}, {"id": "custom.axisPlacement", "value": "right"}]})
split = panel("timeseries", "Request time split: routing, queue + prefill, decode", "Mean seconds a streamed request spends in each phase: routing (arrival to dispatch, retries included), queue_prefill (dispatch to first content: the engine's queue and the prefill), decode (first content to last byte).",
              [(f"sum by (phase) (rate(dplb_router_request_phase_seconds_sum{{{M}}}[{RI}])) / sum by (phase) (rate(dplb_router_request_phase_seconds_count{{{M}}}[{RI}]))", "{{phase}}")],
              12, 12, 9, "s", fieldcfg={"custom": {"stacking": {"mode": "normal", "group": "A"}, "drawStyle": "bars", "fillOpacity": 80}})
y[0] += 9
panel("timeseries", "TTFT (router, to the first content)", "Quantiles of the router's time to first token: request arrival to the first streamed chunk that carries content.",
      refs([(f"histogram_quantile({q}, sum by (le) (rate(dplb_router_time_to_first_token_seconds_bucket{{{M}}}[{RI}])))", f"p{int(q*100)}") for q in (0.5, 0.9, 0.99)]), 0, 8, 8, "s")
panel("timeseries", "Recent TTFT per worker", "The routers' moving average of time to first token on each worker (dispatch to first content).",
      [(f"dplb_worker_recent_ttft_seconds{{{M}}}", "worker {{worker}}")], 8, 8, 8, "s")
panel("timeseries", "Engine TTFT p99 (engine's own histogram)", "vLLM's vllm:time_to_first_token_seconds per worker (job dplb-engines): the engine's view, without the router and the network.",
      [(f"histogram_quantile(0.99, sum by (worker, le) (rate(vllm:time_to_first_token_seconds_bucket{{{M}}}[{RI}])))", "worker {{worker}}")], 16, 8, 8, "s")
y[0] += 8
panel("timeseries", "End-to-end duration", "Quantiles of the time from a request's arrival to its last byte, by route.",
      refs([(f"histogram_quantile({q}, sum by (route, le) (rate(dplb_router_request_duration_seconds_bucket{{{M}}}[{RI}])))", f"p{int(q*100)} {{{{route}}}}") for q in (0.5, 0.99)]), 0, 12, 8, "s")
panel("timeseries", "Prefill rate: learned, else the default", "Prompt tokens per second each worker prefills, learned by the routers from observed TTFTs (from the first prompt of routing_policy.rate_min_tokens, 1024 by default); until then a worker is priced with the default (routing_policy.prefill_tokens_per_s).",
      refs([(f"dplb_worker_prefill_rate_tokens_per_second{{{M}}}", "worker {{worker}}"),
            ("dplb_router_default_prefill_rate_tokens_per_second", "default (until learned)")]), 12, 12, 8, "short")
y[0] += 8

# ---------------------------------------------------------------- routing and failures
row("Routing and failures")
panel("timeseries", "Routing decisions by reason (all models)", "Decisions per second of the routing policy, by reason (e.g. ttft, prefix, only_one); every model (decisions carry no model label).",
      [(f"sum by (policy, reason) (rate(dplb_router_routing_decisions_total[{RI}]))", "{{policy}} {{reason}}")], 0, 8, 8, "short")
panel("timeseries", "Retries by reason (all models)", "Requests sent again to another worker before their first byte: refused connections, 429/503 answers (and timeouts or disconnects only when configured); every model.",
      [(f"sum by (reason) (rate(dplb_router_retries_total[{RI}]))", "{{reason}}")], 8, 8, 8, "short")
panel("timeseries", "Errors by kind", "Forwarding errors per second: connect, timeout, status_5xx, engine_abort, stream_broken, client_disconnect, drain_cut (the router's stop cut the request at its drain limit: a 503).",
      [(f"sum by (kind) (rate(dplb_router_request_errors_total{{{M}}}[{RI}]))", "{{kind}}")], 16, 8, 8, "short")
y[0] += 8
panel("timeseries", "Answers by status", "Answers per second by HTTP status.",
      [(f"sum by (status) (rate(dplb_router_requests_total{{{M}}}[{RI}]))", "{{status}}")], 0, 8, 8, "reqps")
panel("state-timeline", "Circuit state", "Each worker's circuit breaker: closed, open (no requests until a half-open probe), half-open. Alert: DPLBCircuitOpen.",
      [(f"dplb_worker_circuit_state{{{M}}}", "worker {{worker}}")], 8, 8, 8,
      fieldcfg={"mappings": [{"type": "value", "options": {"0": {"text": "closed", "color": "green"}, "1": {"text": "open", "color": "red"}, "2": {"text": "half-open", "color": "orange"}}}]})
panel("state-timeline", "Worker state", "The state of each worker's slot (starting, ready, draining, dead), as dplb-shm-dump prints it. Alert: DPLBWorkerDead.",
      [(f"dplb_worker_state{{{M}}} == 1", "worker {{worker}} {{state}}")], 16, 8, 8,
      fieldcfg={"mappings": [{"type": "value", "options": {"1": {"text": "in state"}}}]})
y[0] += 8
panel("timeseries", "Admission queue", "Requests waiting in the routers' admission queues (summed over router processes): the engines are saturated and the router holds what they have no room for (docs/admission.md).",
      [("sum(dplb_router_admission_queue_depth)", "waiting")], 0, 8, 8, "short")
panel("timeseries", "Admission wait p99 by class", "99th percentile of the time a request waited in the admission queue before it went to a worker, per priority class (requests routed at once are not counted).",
      [(f"histogram_quantile(0.99, sum by (class, le) (rate(dplb_router_admission_wait_seconds_bucket[{RI}])))", "class {{class}}")], 8, 8, 8, "s")
panel("timeseries", "Shed (429) by reason and class", "Requests the admission queue answered 429 + Retry-After per second: budget (waited its queue budget), deadline (could no longer meet its TTFT deadline), full (queue full); by priority class.",
      [(f"sum by (reason, class) (rate(dplb_router_admission_shed_total[{RI}]))", "{{reason}} class {{class}}")], 16, 8, 8, "short")
y[0] += 8
panel("state-timeline", "Routed to", "1 when the router sends requests to the worker (eligible), 0 when not: /dplb/status says why. Alerts: DPLBWorkerNotReady, DPLBNoWorkerReady.",
      [(f"dplb_worker_ready{{{M}}}", "worker {{worker}}")], 0, 8, 8,
      fieldcfg={"mappings": [{"type": "value", "options": {"0": {"text": "not routed", "color": "red"}, "1": {"text": "ready", "color": "green"}}}]})
panel("timeseries", "Engine restarts", "Restarts of each worker's engine, and of its agent (the engine keeps serving through an agent restart). Alerts: DPLBEngineRestarting, DPLBAgentRestarting.",
      refs([(f"dplb_worker_engine_restarts_total{{{M}}}", "worker {{worker}} engine"),
            (f"dplb_worker_agent_restarts_total{{{M}}}", "worker {{worker}} agent")]), 8, 8, 8, "short")
panel("timeseries", "Agent heartbeat age", "Seconds since each agent last wrote its slot; past health_check.heartbeat_timeout_ms the router stops routing to it.",
      [(f"dplb_worker_heartbeat_age_seconds{{{M}}}", "worker {{worker}}")], 16, 8, 8, "s")
y[0] += 8

# ---------------------------------------------------------------- resources
row("GPUs and engines")
panel("timeseries", "GPU memory used", "Share of each worker's GPU memory in use (NVML, summed over its GPUs).",
      [(f"dplb_worker_gpu_memory_used_bytes{{{M}}} / dplb_worker_gpu_memory_total_bytes{{{M}}}", "worker {{worker}}")], 0, 8, 8, "percentunit")
panel("timeseries", "GPU memory (bytes)", "Used and total GPU memory per worker.",
      refs([(f"dplb_worker_gpu_memory_used_bytes{{{M}}}", "used {{worker}}"), (f"dplb_worker_gpu_memory_total_bytes{{{M}}}", "total {{worker}}")]), 8, 8, 8, "bytes")
panel("timeseries", "Engine prefix-cache hit ratio", "vLLM's prefix-cache hits over queries per worker (job dplb-engines): what prefix-aware routing earns.",
      [(f"sum by (worker) (rate(vllm:prefix_cache_hits_total{{{M}}}[{RI}])) / sum by (worker) (rate(vllm:prefix_cache_queries_total{{{M}}}[{RI}]))", "worker {{worker}}")], 16, 8, 8, "percentunit")
y[0] += 8

dash = {

    "title": "DPLB", "uid": "dplb-overview", "description": "DPLB: router, workers and engines. Series: docs/operating.md 'Monitoring'.",
    "tags": ["dplb", "llm", "serving"], "timezone": "browser", "editable": True, "graphTooltip": 1,
    "schemaVersion": 39, "version": 1, "refresh": "10s", "time": {"from": "now-1h", "to": "now"},
    "templating": {"list": [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus", "current": {}, "hide": 0, "refresh": 1},
        {"name": "model", "label": "Model", "type": "query", "datasource": DS, "query": {"query": "label_values(dplb_worker_info, model)", "refId": "model"},
         "definition": "label_values(dplb_worker_info, model)", "multi": True, "includeAll": True, "allValue": ".*", "current": {}, "refresh": 2, "sort": 1, "hide": 0},
    ]},
    "annotations": {"list": []},
    "panels": panels,
}


def render() -> str:
    """The dashboard JSON text (what dplb.json holds)."""
    return json.dumps(dash, indent=2) + "\n"


if __name__ == "__main__":
    import sys

    sys.stdout.write(render())
