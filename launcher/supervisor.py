"""The supervisor behind ``scripts/launch_dplb.sh``: segment, router, N worker agents, one lifetime.

Three rooms serve it: the plan of the launch (:class:`launcher.plan.LaunchPlan`: every child's
command line and environment), the host checks and probes (:mod:`launcher.host`) and what it
prints once ready (:mod:`launcher.banner`); this module runs the lifetime.

Start-up, in order (each step fails with a :class:`launcher.errors.LaunchError` naming what and
why, after undoing the steps before it):

0. own the run dir and the segment name: an exclusive ``flock`` on ``<run dir>/launch.lock`` and
   on ``$XDG_RUNTIME_DIR`` (else ``/tmp``) ``/dplb-locks/<segment>.lock``, held for the
   launcher's life (removed at its stop; the kernel drops the locks when it dies, kill -9 too). A second launch on
   the same port, run dir or segment (``--host ::1`` beside ``127.0.0.1`` too) is refused
   (exit status 2, naming the owner's pid) and touches nothing of the running stack: cleanup
   undoes only what this launch owns;
1. check the router port is free and the run dir's socket paths fit ``sun_path`` (108 bytes);
2. create the run dir (mode 0700) and drop sockets a previous run left behind;
3. check ``/dev/shm`` has room for the segment (:func:`launcher.host.check_shm_space`: a container's default
   64 MB, or a ``--shm-size`` too small, would otherwise end in SIGBUS on the first write past the
   limit) and create the segment ``dplb-<port>`` (64 slots, replacing a stale one — the port being
   free means no live launch owns it);
4. start the N agents (``python -m worker_agent``, ``CUDA_VISIBLE_DEVICES`` = the worker's GPU
   group) and the router (``python -m router``; not with ``--no-router``: the routers run
   elsewhere, e.g. another container sharing this IPC namespace and run dir), each in its own
   process group, logs in the run dir;
5. wait until every agent's slot is READY and the router answers ``GET /health`` with 200,
   printing progress from the slot states; a child that exits, or a slot that turns DEAD,
   stops the launch with that child's log's last lines;
6. print the ready banner and stay in the foreground.

Ctrl-C, SIGTERM or SIGHUP stop the workers first, while the router still relays: each agent
drains its engine (DRAINING: the router stops sending it requests and answers new ones 503 +
``Retry-After`` once every worker drains; the requests in flight, streams included, run to their
end, up to the drain limit ``--drain-timeout``) and stops it (:meth:`Supervisor.shutdown`); the
launcher waits the drain limit plus :data:`STOP_MARGIN_S` for that before it stops what is left.
Then every child and its descendants are stopped (engines included, see :mod:`launcher.children`),
the segment unlinked and the sockets removed; logs stay in the run dir. A second Ctrl-C kills
everything at once.
After start-up an agent that dies (a non-zero status: killed, crashed) is restarted
(:meth:`Supervisor.agent_died`, :meth:`Supervisor.restart_due_agents`) with the policy the agent
applies to its engine (:class:`worker_agent.restart.RestartPolicy`, ``--agent-restart-*``): its
death is printed on one line (status, when it comes back, then the log's last lines), its slot
marked DEAD at once (reason ``agent_exited``, the last heartbeat kept: routers stop sending to it
before the heartbeat would go stale), and after the backoff a new agent with the same command line
claims the same slot (generation bumped, new pid) and re-attaches to the engine, which kept
serving through its agent's death (:mod:`worker_agent.adapters.base`; a fresh engine only when
it is gone); one line says so, another when it is READY again. Past the budget
(``--agent-restart-max`` deaths within ``--agent-restart-window``) the slot stays DEAD (reason
``gave_up``), its engine is stopped, and the rest of the launch keeps serving. An agent that exits
0 (it was asked to stop, and released its slot) is not restarted. A dead router (Envoy, ``dplb-epp``)
is restarted with a bounded backoff, SIGUSR1/SIGUSR2/SIGALRM ignored (:mod:`launcher.respawn`).
Each engine failure and restart an agent records in its slot (``state_reason``,
``last_exit_code``, ``restarts``) is printed (:meth:`Supervisor.report_engines`): the exit code
and when the agent restarts it, each restart, the return to READY, and an agent that gave up
(with the admin call that restarts it).
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from dplb_protocol.limits import DRAIN_TIMEOUT_S
from dplb_shm.exits import exit_words
from launcher import respawn
from launcher.banner import banner, describe_slot
from launcher.children import (
    Child,
    become_subreaper,
    reap_orphans,
    start_child,
    stop_recorded_engine,
    stop_tree,
)
from launcher.errors import ChildStartError, LaunchError, StartTimeoutError, UsageError
from launcher.host import (
    check_port_free,
    check_shm_space,
    check_socket_paths,
    envoy_cluster_hosts,
    http_ok,
    lock_dir,
    now_ns,
    prepare_run_dir,
    release_lock,
    remove_sockets,
    segment_class,
    take_lock,
)
from launcher.plan import DEFAULT_SIM_MODEL, LaunchPlan, describe_workers
from launcher.stack import LOOPBACK
from worker_agent.config import ENGINE_STOP_GRACE_S
from worker_agent.logtail import log_tail
from worker_agent.restart import RestartPolicy

#: how long a stop waits for the agents beyond the drain limit (``--drain-timeout``) before it stops
#: the rest: an agent past its drain limit stops its engine (SIGTERM, SIGKILL after
#: ``ENGINE_STOP_GRACE_S``, 15 s), closes its control API (2 s) and exits; 3 s to spare
STOP_MARGIN_S = ENGINE_STOP_GRACE_S + 5.0


class _Stop(Exception):
    """Raised inside the supervisor's loops when a stop signal arrived."""


class Supervisor:
    """Runs one launch (:meth:`run`); the children's commands come from ``cfg``.

    ``out`` receives progress and the banner (default stdout). ``segment_api``: the class whose
    ``create(name, num_slots=, replace=)`` makes the segment (default ``dplb_shm.Segment``).
    """

    # Any: the segment class (dplb_shm.Segment, or a test's stand-in with the same create())
    def __init__(self, cfg: LaunchPlan, out: TextIO | None = None, segment_api: Any = None) -> None:  # type: ignore[explicit-any]
        self.cfg = cfg
        self.out = out or sys.stdout
        self._segment_api = segment_api
        # Any: the dplb_shm.Segment (or the stand-in) created at start(), None before and after
        self.segment: Any = None  # type: ignore[explicit-any]
        self.router: Child | None = None   # with --gateway envoy: Envoy, the front door
        self.epp: Child | None = None      # --gateway envoy: dplb-epp, Envoy's endpoint picker
        self.agents: list[Child] = []
        self._stop_sig: int | None = None
        self._reported_dead: set[int] = set()   # pids of children whose exit was reported
        self._engines: dict[int, tuple[str, int, str]] = {}  # worker -> (state, restarts, reason) last seen
        # dead agents (agent_died): worker -> its restart policy, when its restart is due
        # (monotonic s), its agent restarts so far; workers whose new agent is not READY yet; gave up
        self._agent_policy: dict[int, RestartPolicy] = {}
        self._agent_due: dict[int, float] = {}
        self._agent_restarts: dict[int, int] = {}
        self._agent_back: set[int] = set()
        self._agent_gave_up: set[int] = set()
        self._fronts = respawn.FrontRestarts()   # dead router / Envoy / dplb-epp waiting for their restart
        self._locks: list[TextIO] = []   # open lock files (step 0); empty: this launch owns nothing to clean
        self._tty = hasattr(self.out, "isatty") and self.out.isatty()

    # ----------------------------------------------------------------- public
    def run(self) -> int:
        """Start everything, wait for a stop signal, stop everything; returns the exit status.

        0 after a requested stop once ready, 130 when stopped before ready, 1 when the router
        died; raises :class:`LaunchError` for a failed start (after cleaning up).
        """
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        old.update(respawn.ignore_signals(self._say, "the launcher", "Ctrl-C, SIGTERM and SIGHUP"))
        try:
            try:
                self.start()
                self.wait_ready()
            except _Stop:
                self._say(f"\nstopping ({signal.Signals(self._stop_sig or 2).name}) before ready ...")
                return 130
            self.print_banner()
            try:
                return self.serve()
            except _Stop:
                self._say(f"\nstopping ({signal.Signals(self._stop_sig or 2).name}) ...")
                return 0
        finally:
            self.shutdown()
            for s, h in old.items():
                signal.signal(s, h)

    def start(self) -> None:
        """Steps 1–4 of the module docstring."""
        cfg = self.cfg
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        locks = [take_lock(cfg.run_dir / "launch.lock", f"run dir {cfg.run_dir}")]
        try:
            locks.append(take_lock(lock_dir() / f"{cfg.shm_name}.lock", f"segment {cfg.shm_name}"))
        except UsageError:
            release_lock(locks[0])
            raise
        self._locks = locks
        if cfg.with_router:
            check_port_free(cfg.host, cfg.port)
            if cfg.metrics_port:
                check_port_free(cfg.host, cfg.metrics_port)
        check_socket_paths(cfg.run_dir, cfg.num_workers)
        prepare_run_dir(cfg.run_dir)
        become_subreaper()
        check_shm_space(cfg.shm_dir, cfg.shm_name, cfg.num_slots)
        seg_cls = self._segment_api or segment_class()
        self.segment = seg_cls.create(cfg.shm_name, num_slots=cfg.num_slots, replace=True)
        self._say(f"dplb: {cfg.num_workers} worker(s), {describe_workers(cfg.workers)}; segment {cfg.shm_name}; "
                  f"logs in {cfg.run_dir}")
        for k in range(cfg.num_workers):
            self._check_stop()
            self.agents.append(self._start(f"worker {k}", cfg.agent_argv(k), cfg.run_dir / f"agent-{k}.log",
                                           cfg.child_env(k)))
        if cfg.envoy:
            cfg.envoy_config_path.write_text(cfg.envoy_config())
            from epp.envoy import write_eds

            write_eds(str(cfg.envoy_eds_path), [])   # Envoy starts on an empty pool; the picker fills it
            self.epp = self._start("dplb-epp", cfg.epp_argv(), cfg.run_dir / "epp.log", cfg.child_env(None))
            self.router = self._start("envoy", cfg.envoy_argv(), cfg.run_dir / "envoy.log", cfg.child_env(None))
        elif cfg.with_router:
            self.router = self._start("router", cfg.router_argv(), cfg.run_dir / "router.log", cfg.child_env(None))

    def wait_ready(self) -> None:
        """Step 5: poll slots and the router until all are ready; progress on ``out``."""
        cfg = self.cfg
        t0 = time.monotonic()
        last, last_print = "", 0.0
        while True:
            self._check_stop()
            self._check_children(starting=True)
            states = self.slot_states()
            router_ok = self.front_ready() if cfg.with_router else True
            ready = sum(1 for s in states if s == "READY")
            for k, s in enumerate(states):
                if s == "DEAD":  # the agent lives on but its engine died: no point waiting
                    a = self.agents[k]
                    raise ChildStartError(a.name, None, str(a.log_path), self._tail_with_engine(a),
                                          reason="marked its slot DEAD (its engine failed)")
            line = (f"[{time.monotonic() - t0:5.1f}s] workers ready {ready}/{cfg.num_workers}: "
                    + " ".join(f"{k}:{s}" for k, s in enumerate(states))
                    + (f" | {'envoy+epp' if cfg.envoy else 'router'}: {'up' if router_ok else 'starting'}"
                       if cfg.with_router else ""))
            if ready == cfg.num_workers and router_ok:
                self._progress(line, final=True)
                self.report_ready()
                return
            now = time.monotonic()
            # print on every change; on a log (not a TTY) also every 15 s so a long model load shows life
            if line.split("] ", 1)[1] != last.split("] ", 1)[-1] or self._tty or now - last_print >= 15:
                self._progress(line)
                last_print = now
            last = line
            if time.monotonic() - t0 > cfg.start_timeout_s:
                pending = [f"worker {k} ({s})" for k, s in enumerate(states) if s != "READY"]
                if not router_ok:
                    pending += ["envoy", "dplb-epp"] if cfg.envoy else ["router"]
                tails = "\n".join(f"--- last lines of {c.log_path} ---\n{log_tail(c.log_path, 8)}"
                                  for c in self._children() if c.name in {p.split(' (')[0] for p in pending})
                raise StartTimeoutError(cfg.start_timeout_s, pending, tails)
            self._sleep(0.25)

    def front_ready(self) -> bool:
        """The front door answers: the router's ``GET /health`` is 200, or (``--gateway envoy``)
        Envoy's admin ``/ready`` is 200, the picker's ``/metrics`` answers and Envoy's pool cluster
        holds every worker (the picker writes the EDS file on its own health tick and Envoy loads it
        after that: until both happened a request is answered 503 although every slot is READY)."""
        cfg = self.cfg
        if cfg.envoy:
            from epp.envoy import POOL_CLUSTER

            return (http_ok(cfg.envoy_admin_url + "/ready")
                    and http_ok(f"http://{LOOPBACK}:{cfg.epp_metrics_port}/metrics")
                    and envoy_cluster_hosts(cfg.envoy_admin_url, POOL_CLUSTER) >= cfg.num_workers)
        return http_ok(cfg.url + "/health")

    def serve(self) -> int:
        """Step 6: stay in the foreground until a stop signal (returns 0) or the router dies (1)."""
        while True:
            self._check_stop()
            rc = self._check_children(starting=False)
            if rc is None:
                rc = self.restart_due_fronts()
            if rc is not None:
                return rc
            self.restart_due_agents()
            self.report_engines()
            self._sleep(respawn.next_tick(self._agent_due.values(), self._fronts.due.values()))

    def report_ready(self) -> None:
        """One line per worker once all are ready: its agent's and engine's pids and its model
        (:func:`describe_slot`), so an operator signals the process they mean."""
        try:
            snaps = self.segment.snapshot()
        except Exception:  # noqa: BLE001 - the lines are a courtesy; a torn read must not stop the launch
            return
        for k in range(min(self.cfg.num_workers, len(snaps))):
            self._say(f"dplb: worker {k}: READY, {describe_slot(snaps[k])}")

    def report_engines(self) -> None:
        """Print what changed in the workers' engines since the last call (from the slots): an
        engine that died (exit code, restart delay, log), each restart, READY again, gave up."""
        try:
            snaps = self.segment.snapshot()
        except Exception:  # noqa: BLE001 - a torn read is retried on the next call
            return
        now = now_ns()
        for k in range(min(self.cfg.num_workers, len(snaps))):
            if k in self._agent_due or k in self._agent_gave_up:
                continue   # no agent runs: its slot is the launcher's (agent_died)
            s = snaps[k]
            state = getattr(getattr(s, "state", None), "name", "?")
            restarts = int(getattr(s, "restarts", 0) or 0)
            reason = getattr(getattr(s, "state_reason", None), "name", "NONE")
            cur = (state, restarts, reason)
            prev = self._engines.get(k)
            self._engines[k] = cur
            if k in self._agent_back:
                if state == "READY":
                    self._agent_back.discard(k)
                    self._say(f"dplb: worker {k}: READY again after agent restart {self._agent_restarts.get(k, 0)}, "
                              f"{describe_slot(s)}")
                if reason in ("AGENT_EXITED", "NONE"):
                    continue   # the agent restart itself (its own lines), not an engine's
            if prev is None or prev == cur:
                continue
            log = self.cfg.run_dir / f"engine-{k}.log"
            if restarts > prev[1]:
                # seen late, the slot may already be READY (reason none): the cause was the last one seen
                why = reason if reason != "NONE" else (prev[2] if prev[2] != "NONE" else "ENGINE_EXITED")
                self._say(f"dplb: worker {k}: engine restart {restarts} ({why.lower()})")
            if reason == "GAVE_UP" and prev[2] != "GAVE_UP":
                self._say(f"dplb: worker {k}: engine failed too often (last: {exit_words(int(s.last_exit_code))}); it stays "
                          f"DEAD until `curl -X POST {self.cfg.url}/dplb/workers/{k}/restart`; see {log}")
            elif state == "DEAD" and (prev[0] != "DEAD" or restarts > prev[1]):
                nxt = int(getattr(s, "next_restart_ns", 0) or 0)
                when = f"in {max(0.0, (nxt - now) / 1e9):.1f}s" if nxt else "after a backoff"
                self._say(f"dplb: worker {k}: engine {exit_words(int(s.last_exit_code))} ({reason.lower()}); "
                          f"its agent restarts it {when}; see {log}")
            elif state == "READY" and prev[0] != "READY" and restarts:
                self._say(f"dplb: worker {k}: READY again after engine restart {restarts}, {describe_slot(s)}")

    def shutdown(self) -> None:
        """Drain and stop the workers (:meth:`drain_workers`), then stop every child tree, unlink the
        segment, remove sockets. Safe to call twice. A launch that owns nothing (refused at step 0:
        another launch runs on this run dir or segment) leaves everything as it is."""
        if not self._locks:
            return
        children = self._children()
        if children:
            self.drain_workers(self.cfg.drain_timeout_s + STOP_MARGIN_S)
            stop_tree(children, grace_s=10.0)
        self.agents, self.router, self.epp = [], None, None
        if self.segment is not None:
            seg, self.segment = self.segment, None
            for fn in (seg.close, seg.unlink):
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 - cleanup must go on; report it
                    self._say(f"dplb: segment cleanup: {type(e).__name__}: {e}")
            if os.path.exists(f"/dev/shm/{self.cfg.shm_name}"):
                try:
                    os.unlink(f"/dev/shm/{self.cfg.shm_name}")
                except OSError:
                    pass
        remove_sockets(self.cfg.run_dir)
        locks, self._locks = self._locks, []
        for f in locks:
            release_lock(f)
        front = (" and Envoy and dplb-epp" if self.cfg.envoy else " and the router") if self.cfg.with_router else ""
        self._say(f"dplb: stopped (workers, engines{front} stopped, segment {self.cfg.shm_name} removed)")

    def drain_workers(self, timeout_s: float = DRAIN_TIMEOUT_S + STOP_MARGIN_S) -> None:
        """SIGTERM to the agents alone, while the router still runs, and wait up to ``timeout_s``
        (the drain limit + :data:`STOP_MARGIN_S`) for them to exit: each marks its slot DRAINING
        (the router stops sending it requests), waits until the router's in-flight count for it is
        0 and stays so, or its drain limit has passed, and stops its engine. Stopping everything at
        once instead made each engine abort what it was generating (a stream ended with
        ``finish_reason: "abort"``). Skipped when our router is gone: nothing is in flight through
        it (with ``--no-router`` the routers are elsewhere and may still relay: always drained). A
        second Ctrl-C (:meth:`_on_signal`) kills everything at once."""
        router = self.router
        agents = [a for a in self.agents if a.poll() is None]
        if not agents:
            return
        if self.cfg.with_router and (router is None or router.poll() is not None):
            return
        if self.cfg.envoy and (self.epp is None or self.epp.poll() is not None):
            return   # no picker: Envoy routes nothing, nothing is in flight
        for a in agents:
            try:
                os.kill(a.pid, signal.SIGTERM)
            except OSError:
                pass
        start = time.monotonic()
        told = False
        while any(a.poll() is None for a in agents) and time.monotonic() - start < timeout_s:
            if not told and time.monotonic() - start > 1.0:
                told = True
                limit = timeout_s - STOP_MARGIN_S
                self._say(f"dplb: waiting for the workers to drain their requests and stop (drain limit {limit:g} s, "
                          f"--drain-timeout; up to {timeout_s:g} s in all; Ctrl-C again to stop at once)")
            time.sleep(0.05)

    def slot_states(self) -> list[str]:
        """State name of each worker's slot (``"-"`` before the agent claims it)."""
        try:
            snaps = self.segment.snapshot()
        except Exception:  # noqa: BLE001 - a torn read while starting is not fatal
            return ["?"] * self.cfg.num_workers
        out = []
        for k in range(self.cfg.num_workers):
            s = snaps[k] if k < len(snaps) else None
            name = getattr(getattr(s, "state", None), "name", None) or "-"
            out.append("-" if name == "EMPTY" else name)
        return out

    def served_models(self) -> list[str]:
        """Model names the workers serve (from their slots, in worker order), else the planned ones."""
        out: list[str] = []
        for k in range(self.cfg.num_workers):
            try:
                m = str(self.segment.read_slot(k).model or "")
            except Exception:  # noqa: BLE001 - the banner must not fail over a torn read
                m = ""
            if m and m not in out:
                out.append(m)
        return out or self.cfg.models or [DEFAULT_SIM_MODEL]

    def served_model(self) -> str:
        """The first model served (the banner's example request)."""
        return self.served_models()[0]

    def print_banner(self) -> None:
        """The ready banner (:func:`launcher.banner.banner`) with the models the workers serve."""
        self._say(banner(self.cfg, self.served_models()))

    # ---------------------------------------------------------------- helpers
    def _start(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> Child:
        try:
            return start_child(name, argv, log, env)
        except OSError as e:
            raise ChildStartError(name, None, str(log), "", reason=f"could not be started ({e})") from None

    def _tail_with_engine(self, c: Child) -> str:
        """Last lines of ``c``'s log, plus its engine's log (``engine-K.log``) for a worker."""
        text = log_tail(c.log_path, 20)
        if c in self.agents:
            eng = self.cfg.run_dir / f"engine-{self.agents.index(c)}.log"
            tail = log_tail(eng, 15)
            if tail:
                text += f"\n--- last lines of {eng} ---\n{tail}"
        return text

    def _children(self) -> list[Child]:
        return [*([self.router] if self.router else []), *([self.epp] if self.epp else []), *self.agents]

    def _check_children(self, starting: bool) -> int | None:
        reap_orphans({c.pid for c in self._children()})
        for c in self._children():
            rc = c.poll()
            if rc is None:
                continue
            if starting:
                raise ChildStartError(c.name, rc, str(c.log_path), self._tail_with_engine(c))
            if c.pid in self._reported_dead:
                continue
            self._reported_dead.add(c.pid)
            if c is self.router or c is self.epp:
                if self.front_died(c, rc) is not None:
                    return 1
                continue
            self.agent_died(self.agents.index(c), rc)
        if self.agents and all(a.poll() is not None for a in self.agents) and not self._agent_due:
            self._say("dplb: every worker is gone; stopping")
            return 1
        return None

    # ------------------------------------------------- dead router, Envoy, picker
    def front_died(self, c: Child, rc: int) -> int | None:
        """A front-door process (router, Envoy, ``dplb-epp``) died after start-up: print it with
        its log's last lines, kill what it left in its process group and schedule its restart
        (:mod:`launcher.respawn`); 1 (stop the launch) past the restart budget."""
        respawn.kill_group(c.pid)
        delay = self._fronts.died(c.name)
        p, n = self._fronts.params, self._fronts.in_window(c.name)
        tail = f"last lines of {c.log_path}:\n{log_tail(c.log_path, 10)}"
        if delay is None:
            self._say(f"dplb: {c.name} {exit_words(rc)}; it died {n} times within {p.window_s:g}s: not restarted; {tail}")
            self._say(f"dplb: the {'gateway' if self.cfg.envoy else 'router'} is gone; stopping")
            return 1
        self._say(f"dplb: {c.name} {exit_words(rc)}; restarting it in {delay:.2f}s (restart {n} of at most "
                  f"{p.max_restarts} within {p.window_s:g}s); {tail}")
        return None

    def restart_due_fronts(self) -> int | None:
        """Start every front-door process whose restart is due (same command line, same log); one
        line each, and one when the front door serves again. 1 when one cannot be started past
        the restart budget."""
        cfg = self.cfg
        for name, n in self._fronts.take_due():
            argv, log = {"router": (cfg.router_argv, "router.log"), "envoy": (cfg.envoy_argv, "envoy.log"),
                         "dplb-epp": (cfg.epp_argv, "epp.log")}[name]
            try:
                child = self._start(name, argv(), cfg.run_dir / log, cfg.child_env(None))
            except LaunchError as e:
                self._say(f"dplb: {name}: restart {n} failed: {e}")
                return 1 if self._fronts.died(name) is None else None
            self.epp, self.router = (child, self.router) if name == "dplb-epp" else (self.epp, child)
            self._say(f"dplb: {name} restarted (restart {n}, pid {child.pid})")
        if self._fronts.back and not self._fronts.due and self.front_ready():
            self._fronts.back.clear()
            self._say(f"dplb: the {'gateway' if cfg.envoy else 'router'} serves again ({cfg.url})")
        return None

    # ------------------------------------------------------------ dead agents
    def agent_died(self, k: int, rc: int) -> None:
        """Worker ``k``'s agent exited with status ``rc`` after start-up: print it on one line (with
        its log's last lines), mark its slot DEAD and schedule its restart after the backoff of
        its :class:`RestartPolicy`, or give up past ``--agent-restart-max`` (module docstring)."""
        c = self.agents[k]
        tail = log_tail(c.log_path, 10)
        if rc == 0:
            self._say(f"dplb: {c.name} exited with status 0 (it was stopped and released its slot); not "
                      f"restarted; last lines of {c.log_path}:\n{tail}")
            return
        p = self.cfg.agent_restart
        policy = self._agent_policy.setdefault(k, RestartPolicy.from_params(p))
        delay = policy.failure()
        if delay is None:
            self._agent_gave_up.add(k)
            self._mark_slot_dead(k, "GAVE_UP", 0)
            engine = stop_recorded_engine(self.cfg.run_dir / f"engine-{k}.pid")
            self._say(f"dplb: {c.name} {exit_words(rc)}; its agent died {policy.failures_in_window()} times "
                      f"within {p.window_s:g}s (--agent-restart-max {p.max_restarts}): not restarted again, its "
                      f"slot stays DEAD until the launch restarts"
                      + (f" (its engine, pid {engine}, is stopped)" if engine else "")
                      + f"; last lines of {c.log_path}:\n{tail}")
            return
        self._agent_due[k] = time.monotonic() + delay
        self._mark_slot_dead(k, "AGENT_EXITED", now_ns() + int(delay * 1e9))
        self._say(f"dplb: {c.name} {exit_words(rc)}; restarting its agent in {delay:.1f}s (restart "
                  f"{policy.failures_in_window()} of at most {p.max_restarts} within {p.window_s:g}s; its engine "
                  f"keeps running); last lines of {c.log_path}:\n{tail}")

    def restart_due_agents(self) -> None:
        """Start a new agent for every worker whose restart backoff has passed (same command line,
        same slot, same log appended to); one line each."""
        now = time.monotonic()
        for k, due in sorted(self._agent_due.items()):
            if now < due:
                continue
            del self._agent_due[k]
            n = self._agent_restarts[k] = self._agent_restarts.get(k, 0) + 1
            if not (self.cfg.shm_dir / self.cfg.shm_name).exists():   # a new agent could not attach
                self._say(respawn.segment_gone(k, self.cfg.shm_dir / self.cfg.shm_name))
                self._agent_gave_up.add(k)
                continue
            try:
                self.agents[k] = self._start(f"worker {k}", self.cfg.agent_argv(k), self.cfg.run_dir / f"agent-{k}.log",
                                             self.cfg.child_env(k))
            except LaunchError as e:
                self._say(f"dplb: worker {k}: agent restart {n} failed: {e}")
                self._agent_gave_up.add(k)
                continue
            self._engines.pop(k, None)
            self._agent_back.add(k)
            self._say(f"dplb: worker {k}: agent restarted (restart {n}, pid {self.agents[k].pid}); it claims slot "
                      f"{k} again and re-attaches to its engine (a fresh one if it is gone)")

    def _mark_slot_dead(self, k: int, reason: str, next_restart_ns: int) -> None:
        """Mark worker ``k``'s slot DEAD for its dead agent (:func:`launcher.respawn.mark_slot_dead`)."""
        err = respawn.mark_slot_dead(self.segment, k, reason, next_restart_ns)
        if err:
            self._say(f"dplb: worker {k}: could not mark its slot DEAD ({err})")

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._stop_sig is None:
            self._stop_sig = signum
        else:  # a second Ctrl-C: no more patience for graceful engine shutdown
            for c in self._children():
                try:
                    os.killpg(c.pid, signal.SIGKILL)
                except OSError:
                    pass

    def _check_stop(self) -> None:
        if self._stop_sig is not None:
            raise _Stop()

    def _sleep(self, s: float) -> None:
        """Sleep ``s`` seconds in steps of at most 50 ms, returning early on a stop signal."""
        end = time.monotonic() + s
        while self._stop_sig is None:
            left = end - time.monotonic()   # read the clock once: a second read may already be past ``end``
            if left <= 0:
                return
            time.sleep(min(0.05, left))

    def _progress(self, line: str, final: bool = False) -> None:
        if self._tty:
            self.out.write("\r\033[K" + line + ("\n" if final else ""))
        else:
            self.out.write(line + "\n")
        self.out.flush()

    def _say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()
