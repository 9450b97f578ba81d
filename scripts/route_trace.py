"""Instrument one simulated run: per-engine share, per-document placement, and (for ``dplb``)
every decision's ``/dplb/route`` rows plus every learned prefill-rate sample.

How the docqa loss of issue 29 item 4 was found (docs/DESIGN.md "Why dplb lost docqa")::

    .venv/bin/python scripts/route_trace.py dplb 1 0 [config.yaml]

Arguments: policy, rate scale, seed, optional router config. Writes the rows as JSON lines to
``/tmp/route_trace_<policy>_<rate>_<seed>.jsonl`` (one line per request: prompt tokens, chosen
worker, reason, rows) and prints rate samples (``RATE w<k> ahead= u= ttft= sample=``) to stderr.
The workload is document QA (500 requests); the document of a request is its second block id.
"""
from __future__ import annotations

import collections
import json
import sys

from router import accounting
from router.config import Config, load_config
from router.policies import dplb
from simulate.cli import build_parser, engine_configs
from simulate.cluster import Simulation
from simulate.generators import generate
from simulate.settings import SimSettings
from simulate.workload import window_of


def main(argv: list[str]) -> None:
    """Run the instrumented simulation described in the module docstring."""
    policy, rate, seed = argv[0], float(argv[1]), int(argv[2])
    cfg = load_config(argv[3]) if len(argv) > 3 else Config()
    engines = engine_configs(build_parser().parse_args(["--workload", "docqa", "--engines", "4"]))
    reqs = window_of(generate("docqa", seed, 500), 0, 500, None)
    log: list[tuple[int, int, str, object]] = []
    choose = dplb.DplbPolicy.choose
    first_token = accounting.RequestAccount.first_token

    def traced_choose(self, workers, req, explain=False):
        d = choose(self, workers, req, True)
        log.append((req.prompt_len, d.worker_id, d.reason, d.scores))
        return d

    def traced_first_token(self, now, observed=True):
        ahead, u = self.queue_ahead, self.uncached_tokens
        ttft = first_token(self, now, observed)
        if ttft and ahead + u >= 1024:
            print(f"RATE w{self.worker_id} t={now:.1f} ahead={ahead} u={u} prompt={self.prompt_tokens} "
                  f"ttft={ttft:.3f} sample={(ahead + u) / ttft:.0f}", file=sys.stderr)
        return ttft

    dplb.DplbPolicy.choose = traced_choose                     # type: ignore[method-assign]
    accounting.RequestAccount.first_token = traced_first_token  # type: ignore[method-assign]
    res = Simulation(reqs, SimSettings(engines=engines, router=cfg, rate_scale=rate, seed=seed,
                                       policy=policy), {}).run(None)
    n = len(reqs)
    print("share", {k: round(v / n, 3) for k, v in sorted(collections.Counter(res.worker).items())})
    bydoc: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for r, w in zip(reqs, res.worker):
        bydoc[r.hash_ids[1]][w] += 1
    for doc, c in sorted(bydoc.items(), key=lambda x: -sum(x[1].values())):
        print("doc", doc, dict(c))
    print("hit", round(sum(res.cached_tokens) / sum(res.prompt_tokens), 3),
          "busy_s", [round(s["busy_time_s"], 1) for s in res.engine_stats])
    if log:
        with open(f"/tmp/route_trace_{policy}_{rate}_{seed}.jsonl", "w") as f:
            for plen, w, why, rows in log:
                f.write(json.dumps({"prompt_tokens": plen, "worker": w, "reason": why, "rows": rows}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
