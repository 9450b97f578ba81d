"""Fault scenarios of issues 8, 15 (13-19: :mod:`bench.faultsuite.scen_issue15`) and 27 (27.*:
:mod:`bench.faultsuite.scen_request_path`, :mod:`bench.faultsuite.scen_router_procs`, 27.7:
:mod:`bench.faultsuite.scen_remote_admin`) as plain functions that run real processes and return counted results.

Each ``run_*`` function builds its own :class:`bench.faultsuite.cluster.Stack`, injects one fault,
drives bounded traffic through the router, tears everything down and returns a :class:`Result`
(what was injected, requests sent / ok / failed honestly / lost, detection and recovery times,
plus scenario-specific figures in ``extra``). The pytest files in ``tests/faults`` assert on these
results; ``bench/faults.py`` runs the same functions and writes ``bench/results/faults.md``.
"""
from __future__ import annotations

from bench.faultsuite.common import DispatchWatch, Result, StatusWatch
from bench.faultsuite.scen_agent_restart import run_killed_agent_restarted
from bench.faultsuite.scen_clients import (
    BAD_ENDPOINTS,
    BAD_INPUTS,
    run_bad_input,
    run_client_disconnect,
    run_router_restart,
    run_security,
    run_stream_fidelity,
    run_ties_and_bursts,
)
from bench.faultsuite.scen_contained import (
    run_add_plain_engine,
    run_drain_cut,
    run_engine_abort,
    run_log_injection,
    run_queued_client_leaves,
    run_slot_frozen_mid_write,
)
from bench.faultsuite.scen_issue15 import (
    run_admin_exposure,
    run_crash_loop_gave_up_then_admin_restart,
    run_dead_and_departed_workers_in_plain_sight,
    run_first_byte_vs_idle_timeout,
    run_header_limits,
    run_round_robin_per_model,
    run_slow_request_one_504,
)
from bench.faultsuite.scen_remote_admin import (
    run_concurrent_add_remove,
    run_mirror_owner_killed,
)
from bench.faultsuite.scen_request_path import (
    run_all_down_before_noticed,
    run_engine_kill_retried,
    run_framing_errors,
    run_in_flight_retried_streamed_and_not,
    run_model_known_while_down,
    run_query_of_death,
    run_sync_openai_streams_counted,
)
from bench.faultsuite.scen_router_procs import run_router_process_killed
from bench.faultsuite.scen_stop import run_stop_under_traffic
from bench.faultsuite.scen_workers import (
    run_all_dead,
    run_breaker,
    run_drain_remove_cycles,
    run_engine_hang,
    run_hung_worker,
    run_kill_engine,
    run_long_prefill_default,
    run_remote_rejoin,
)

__all__ = ["BAD_ENDPOINTS", "BAD_INPUTS", "DispatchWatch", "Result", "StatusWatch", "run_admin_exposure", "run_all_dead",
           "run_bad_input", "run_breaker", "run_client_disconnect", "run_crash_loop_gave_up_then_admin_restart",
           "run_dead_and_departed_workers_in_plain_sight", "run_drain_remove_cycles", "run_engine_hang",
           "run_first_byte_vs_idle_timeout", "run_header_limits", "run_hung_worker", "run_kill_engine",
           "run_long_prefill_default", "run_remote_rejoin", "run_round_robin_per_model", "run_router_restart",
           "run_security", "run_slow_request_one_504", "run_stream_fidelity", "run_ties_and_bursts"]
# issue 27, the router's request path (rows 27.1a-27.9) and its parts (27.4)
__all__ += [
    "run_all_down_before_noticed",
    "run_engine_kill_retried",
    "run_framing_errors",
    "run_in_flight_retried_streamed_and_not",
    "run_model_known_while_down",
    "run_query_of_death",
    "run_router_process_killed",
    "run_sync_openai_streams_counted",
]
# issue 27 item 5, dead agents come back (row 27.5)
__all__ += ["run_killed_agent_restarted"]
# issue 27 item 6, a stop under traffic (row 27.6)
__all__ += ["run_stop_under_traffic"]
# issue 27 item 7, admin races on a remote worker (rows 27.7, 27.7w, 27.7k)
__all__ += ["run_concurrent_add_remove", "run_mirror_owner_killed"]
# issue 46, what fails stays contained (rows 46.*)
__all__ += ["run_add_plain_engine", "run_drain_cut", "run_engine_abort", "run_log_injection", "run_queued_client_leaves",
            "run_slot_frozen_mid_write"]
