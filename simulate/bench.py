"""``make bench-simulate``: the full conversation trace (12,031 requests) at 8 engines, one policy.

Prints ``simulate requests=<N> engines=<E> wall_s=<float>`` (wall seconds of the run, including
loading the trace; target: under 5 minutes on one core of the 2-core development machine), then
the run's table. ``--policy`` (default ``dplb``, the most expensive: it builds every prompt's
text for the prefix index), ``--engines``, ``--requests``, ``--profile FILE`` (cProfile output).
"""
from __future__ import annotations

import argparse
import sys
import time

from dplb_trace.mooncake import DEFAULT_TRACE
from sim_engine.config import EngineConfig
from simulate.cluster import Simulation
from simulate.report import table
from simulate.settings import SimSettings
from simulate.stats import summarize
from simulate.workload import load_workload


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simulate.bench", allow_abbrev=False)
    p.add_argument("--policy", default="dplb")
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--rate-scale", type=float, default=1.0)
    p.add_argument("--profile", default=None, help="write cProfile stats here")
    ns = p.parse_args(argv)
    t0 = time.perf_counter()
    c0 = time.process_time()
    reqs = load_workload(DEFAULT_TRACE, requests=ns.requests)
    sim = Simulation(reqs, SimSettings(engines=[EngineConfig() for _ in range(ns.engines)], policy=ns.policy,
                                       rate_scale=ns.rate_scale))
    if ns.profile:
        import cProfile

        prof = cProfile.Profile()
        res = prof.runcall(sim.run)
        prof.dump_stats(ns.profile)
    else:
        res = sim.run()
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    print(f"simulate requests={len(reqs)} engines={ns.engines} wall_s={wall:.1f}")
    fig = summarize(res, ns.engines)
    print(f"policy={ns.policy} cpu_s={cpu:.1f} events={res.events} simulated_s={res.end_time:.1f}")
    print(table([{"policy": ns.policy, **fig}]))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
