"""Fault-injection report: run the scenarios of issues 8, 15 and 27 with counting and write a Markdown table.

Usage: ``python -m bench.faults [--only 1,5,10,13] [--out bench/results/faults.md]``

Each scenario (the same functions the ``tests/faults`` suite asserts on, in
:mod:`bench.faultsuite.scenarios`) starts real processes on loopback — router, worker agents with sim
engines or fake workers — injects one fault under bounded traffic, and counts every request as
``ok``, ``honest`` (failed with an OpenAI-shaped error status or SSE error event) or ``lost``
(hang, reset, truncated stream, non-OpenAI error). The table has one row per scenario:

    | # | scenario | injected | sent | ok | failed honestly | lost | detection | recovery | notes |

*detection*: fault → the router stops sending to the worker (scenarios 1-3), → ``/health`` 503
(4), disconnect → the engine drops the request (6), second crash → ``gave_up`` in ``/dplb/status``
(13), kill → ``dead`` in the metrics (14), kill of an agent → its slot DEAD (27.5); *recovery*: worker back → eligible or serving again
(1a: the agent restarted the engine; 2-4), kill → new router ready (9), disconnect → slot in-flight
back to 0 (6), admin restart → eligible (13), agent kill → the worker serves again (27.5). Rows ``2a+``/``2b+`` run 2a/2b with
``retries.retry_on_timeout`` (the operator's opt-in to re-running timed-out requests elsewhere). Times are
wall-clock seconds on the machine that ran it; the file says which machine (CPU count) and when.
Exit status 1 when a scenario lost a request it should not have: every scenario but 9, where the
requests a ``kill -9``-ed lone router held or missed while down are lost by construction (counted).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Scenario(NamedTuple):
    """One row of the report: its id, the function of :mod:`bench.faultsuite.scenarios` that runs
    it (by name: the suite is imported only when a scenario runs) with its keyword arguments, and
    the keys of the result's ``extra`` shown in the notes (after ``notes``' own text, if any)."""

    id: str
    run: str
    keys: tuple[str, ...]
    kwargs: tuple[tuple[str, Any], ...] = ()
    notes: Callable[[Any], str] | None = None

    def runner(self) -> Callable[[], Any]:
        """The scenario's function, its arguments bound."""
        from bench.faultsuite import scenarios as sc

        fn = getattr(sc, self.run)
        return lambda: fn(**dict(self.kwargs))

    def note(self, r: Any) -> str:
        """The notes cell of result ``r``."""
        kv = "; ".join(f"{k}={r.extra.get(k)}" for k in self.keys if k in r.extra)
        return kv if self.notes is None else self.notes(r) + ("; " + kv if self.keys else "")


def _answers_27_2(r: Any) -> str:
    return f"answers={ {k: v[0] for k, v in r.extra['checks'].items()} }"


def _answers_27_9(r: Any) -> str:
    return "answers=" + str({k: a["status"].split(" ", 1)[1] + (" json" if a["shaped"] else " text")
                             for k, a in r.extra["answers"].items()})


#: every scenario, in issue order
SCENARIOS: tuple[Scenario, ...] = (
    Scenario("1a", "run_kill_engine", ("dead_s", "states0", "ready_gauge0", "failed_in_flight",
                                       "served_by_0_after_back", "by_worker"), (("target", "engine"),)),
    Scenario("1b", "run_kill_engine", ("failed_in_flight", "by_worker"), (("target", "worker"),)),
    Scenario("2a", "run_hung_worker", ("status_504_on_0", "slowest_s", "eligible_while_hung")),
    Scenario("2a+", "run_hung_worker", ("slowest_s", "timed_out", "eligible_while_hung"),
             (("retry_on_timeout", True),)),
    Scenario("2b", "run_engine_hang", ("statuses", "tried_on_hung", "circuit0")),
    Scenario("2b+", "run_engine_hang", ("served", "tried_on_hung", "circuit0"), (("retry_on_timeout", True),)),
    Scenario("2c", "run_long_prefill_default", ("min_latency_s",)),
    Scenario("3", "run_breaker", ("requests_to_0_500", "circuit_after_500s", "circuit_after_recovery",
                                  "circuit_after_400", "circuit_after_429")),
    Scenario("4a", "run_all_dead", ("statuses_while_dead", "retry_after", "served_after")),
    Scenario("4b", "run_remote_rejoin", ("statuses_while_dead", "served_after")),
    Scenario("5", "run_drain_remove_cycles", ("active_at_calls", "router_inflight", "local_inflight")),
    Scenario("6", "run_client_disconnect", ("aborts", "router_inflight")),
    Scenario("7", "run_stream_fidelity", ("first_chunk_s", "total_s", "utf8_intact", "usage_before_done")),
    Scenario("8", "run_ties_and_bursts", ("sequential", "burst")),
    Scenario("9", "run_router_restart", ("cut_in_flight_at_kill", "cut_or_refused_during_restart",
                                         "not_ok_after_restart", "workers_seen_by_new_router",
                                         "router_inflight_after")),
    Scenario("10", "run_bad_input", ("mismatches", "worker")),
    Scenario("11", "run_security", ("segment_mode", "agent_socket_mode", "engine_socket_mode", "claimed_slots")),
    # issue 15: stays up and tells the truth
    Scenario("13", "run_crash_loop_gave_up_then_admin_restart", ("first_restart_s", "row_gave_up", "metrics_gave_up",
                                                                  "served_while_dead", "served_after")),
    Scenario("14", "run_dead_and_departed_workers_in_plain_sight", ("seen", "after_leave")),
    Scenario("15", "run_slow_request_one_504", ("status", "elapsed_s", "requests_per_worker", "stream_status",
                                                "lone_hung_worker")),
    Scenario("16", "run_first_byte_vs_idle_timeout", ("prefill_stream", "stalled_stream", "stalled_error", "errors")),
    Scenario("17", "run_round_robin_per_model", ("model_a", "model_b")),
    Scenario("18", "run_header_limits", ("codes", "forwarded", "before_body", "flood")),
    Scenario("19", "run_admin_exposure", ("no_token", "with_token", "open_host_no_token", "mismatches")),
    # issue 27: the router's request path (ids are the items)
    Scenario("27.1a", "run_engine_kill_retried", ("inflight_at_kill", "retried", "cut_mid_stream",
                                                  "failed_non_streamed", "failed_before_first_byte", "by_worker")),
    Scenario("27.1b", "run_in_flight_retried_streamed_and_not", ("in_flight_on_0_at_kill", "retried", "statuses")),
    Scenario("27.1c", "run_query_of_death", ("qod_status", "read_by_worker", "query_of_death", "ordinary_ok")),
    Scenario("27.1d", "run_all_down_before_noticed", ("statuses", "retry_after", "after_back")),
    Scenario("27.2", "run_model_known_while_down", ("models_listed", "status_models"), notes=_answers_27_2),
    Scenario("27.4", "run_router_process_killed", ("at_kill", "cut_by_the_kill", "after_streams", "burst_lost",
                                                   "burst_split", "processes_after", "death_logged")),
    Scenario("27.5", "run_killed_agent_restarted", ("slot_seen", "first_served_s", "by_worker",
                                                    "served_by_victim_after", "old_engine_answers",
                                                    "admin_restart_while_down", "admin_restart", "dump_state")),
    Scenario("27.6", "run_stop_under_traffic", ("in_flight_at_stop", "sent_after_stop", "statuses", "finish_reasons",
                                                "refused_without_retry_after", "reset_before_status",
                                                "drain_limit_hit", "launcher_rc", "stop_s")),
    Scenario("27.7", "run_concurrent_add_remove", ("calls", "post_2xx_without_id", "nonempty_slots", "dead_slots",
                                                   "delete_removed", "cycles_s")),
    Scenario("27.7w", "run_concurrent_add_remove", ("calls", "post_2xx_without_id", "nonempty_slots", "dead_slots",
                                                    "delete_removed", "cycles_s"), (("router_workers", 2),)),
    Scenario("27.7k", "run_mirror_owner_killed", ("post", "answered_while_owner_stopped", "delete", "delete_s",
                                                  "slot_state_after", "readded", "new_owner_differs")),
    Scenario("27.8", "run_sync_openai_streams_counted", ("statuses", "client_disconnect", "statuses_after_leaver")),
    Scenario("27.9", "run_framing_errors", ("forwarded",), notes=_answers_27_9),
    # issue 46: what fails stays contained (ids are the items)
    Scenario("46.2", "run_engine_abort", ("early", "cut", "non_streamed_everywhere", "requests_502",
                                          "engine_abort_errors")),
    Scenario("46.2d", "run_drain_cut", ("streams", "non_streamed", "access_statuses", "drain_cut_lines", "stop_s",
                                         "router_rc")),
    Scenario("46.4", "run_slot_frozen_mid_write", ("idle_cpu_before", "idle_cpu_frozen", "served", "routing_1",
                                                   "stale_read", "spins_per_read", "dump_state_1")),
    Scenario("46.5", "run_log_injection", ("statuses", "lines", "access_lines", "bad_access_lines", "forged_lines",
                                           "other_lines", "big_lines", "big_growth_bytes")),
    Scenario("46.5j", "run_log_injection", ("lines", "access_lines", "bad_access_lines", "forged_lines",
                                            "other_lines", "big_lines", "big_growth_bytes"), (("mode", "json"),)),
    Scenario("46.6", "run_queued_client_leaves", ("aborted_while_queued", "long_still_running",
                                                  "engine_steps_meanwhile")),
    Scenario("46.6n", "run_queued_client_leaves", ("aborted_while_queued", "long_still_running",
                                                   "engine_steps_meanwhile"), (("stream", False),)),
    Scenario("46.8", "run_add_plain_engine", ("engine_added", "engine_row", "served", "scraped_kv_cache_usage",
                                              "neither", "agent_added", "slots")),
)


def _secs(v: float | None) -> str:
    return "—" if v is None else f"{v:.3f} s"


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def render(rows: list[dict[str, Any]]) -> str:
    """The Markdown report for ``rows`` (dicts with the table's columns)."""
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    out = [
        "# DPLB fault-injection report (issues 8, 15 and 27)",
        "",
        f"Generated {now} by `python -m bench.faults` on a {os.cpu_count()}-CPU machine (loopback only).",
        "Counts: *ok* = complete answer; *failed honestly* = OpenAI-shaped error status or SSE error event;",
        "*lost* = hang, reset, truncated stream or non-OpenAI error. Detection/recovery: see `bench/faults.py`.",
        "",
        "| # | scenario | injected | sent | ok | failed honestly | lost | detection | recovery | notes |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        out.append(f"| {r['id']} | {_cell(r['scenario'])} | {_cell(r['injected'])} | {r['sent']} | {r['ok']} | "
                   f"{r['honest']} | {r['lost']} | {r['detection']} | {r['recovery']} | {_cell(r['notes'])} |")
    out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Run the chosen scenarios, print one line each, write the report; 1 if anything was lost."""
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m bench.faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="comma-separated scenario ids (1a,1b,2a,...,11); default all")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "faults.md"))
    args = p.parse_args(argv)
    want = {x.strip() for x in args.only.split(",") if x.strip()}
    rows = []
    lost = 0
    for sc in SCENARIOS:
        sid = sc.id
        if want and sid not in want and sid.rstrip("abckw+") not in want:
            continue
        t0 = time.monotonic()
        try:
            r = sc.runner()()
        except Exception as e:  # noqa: BLE001 - a broken scenario is a row, not the end of the report
            traceback.print_exc()
            rows.append({"id": sid, "scenario": f"scenario {sid}", "injected": "—", "sent": 0, "ok": 0, "honest": 0,
                         "lost": 0, "detection": "—", "recovery": "—", "notes": f"scenario failed: {e!r}"[:300]})
            lost += 1
            continue
        row = {"id": sid, "scenario": r.scenario.split(" ", 1)[1], "injected": r.injected, "sent": r.sent,
               "ok": r.ok, "honest": r.honest, "lost": r.lost, "detection": _secs(r.detection_s),
               "recovery": _secs(r.recovery_s), "notes": sc.note(r)}
        rows.append(row)
        # a killed router (9) or router process (27.4) cuts its own clients' connections: what counts
        # is what fails after it
        after = {"9": "not_ok_after_restart", "27.4": "burst_lost"}.get(sid)
        lost += r.lost if after is None else r.extra.get(after, 0)
        print(f"faults {sid:>3} sent={r.sent} ok={r.ok} honest={r.honest} lost={r.lost} "
              f"detection={row['detection']} recovery={row['recovery']} ({time.monotonic() - t0:.0f}s wall)",
              flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(render(rows))
    print(f"wrote {args.out}")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
