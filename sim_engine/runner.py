"""The asyncio step loop that drives :class:`sim_engine.engine.EngineCore` in (scaled) real time.

One task, no threads. Each iteration runs one *burst*: ``schedule`` + ``complete`` of one step — or
of several back to back when ``--time-scale`` makes a step shorter than ``MIN_SLICE_S`` (1 ms, the
resolution of uvloop's timers), each step at its own simulated time — then sleeps until the burst's
modelled end (``sum(duration) / time_scale`` wall seconds after it started, so the loop's own CPU
time is absorbed), handing each step's tokens to their requests' :class:`OutputChannel` when that
step's modelled end has passed (one wake-up per request per step: a stream carries one token per
write at the pace the model computes them). Simulated time follows the model while busy and the wall clock
(times ``time_scale``) while idle: see :meth:`EngineRunner.now`.
"""

from __future__ import annotations

import asyncio
import time
from typing import cast

from sim_engine.engine import EngineCore
from sim_engine.kv_events import ZmqEventPublisher, wire_events
from sim_engine.request import SimRequest


class OutputChannel:
    """Tokens of one HTTP request (one or more choices), buffered between steps.

    ``items``: ``(choice_index, request, n_tokens)`` events, one per emitted token (``n_tokens`` =
    the request's output length after it; -1 = finished without a token, i.e. aborted by the
    engine). The consumer reads ``request.output[n_tokens - 1]`` and ``finish_reason``. Wake-ups are
    batched per step."""

    __slots__ = ("event", "items", "open_choices")

    def __init__(self, n_choices: int) -> None:
        self.items: list[tuple[int, SimRequest, int]] = []
        self.event = asyncio.Event()
        self.open_choices = n_choices

    def push(self, index: int, req: SimRequest, k: int) -> None:
        """Record that ``req`` (choice ``index``) emitted its ``k``-th token (1-based)."""
        self.items.append((index, req, k))
        if k == len(req.output) and req.finish_reason not in (None, "abort"):  # aborts: push_finish
            self.open_choices -= 1
        self.event.set()

    def push_finish(self, index: int, req: SimRequest) -> None:
        """Record that ``req`` finished without a new token (aborted): ``n_tokens`` is -1."""
        self.items.append((index, req, -1))
        self.open_choices -= 1
        self.event.set()

    async def drain(self) -> list[tuple[int, SimRequest, int]]:
        """Wait for at least one event and return all buffered ``(index, request, n_tokens)``."""
        while not self.items:
            self.event.clear()
            await self.event.wait()
        items, self.items = self.items, []
        return items

    @property
    def done(self) -> bool:
        """True when every choice has finished and every buffered event has been drained (a
        consumer suspended in a write while the runner pushes a burst's last tokens still has
        them to send)."""
        return self.open_choices <= 0 and not self.items


class EngineRunner:
    """Owns the core and its step loop. ``time_scale`` > 1 runs faster than real time."""

    CATCH_UP_S = 0.005
    MIN_SLICE_S = 0.001

    def __init__(self, core: EngineCore, time_scale: float = 1.0) -> None:
        self.core = core
        self.time_scale = time_scale
        self._t0 = time.monotonic()
        self._sim_last = 0.0  # simulated end of the last burst
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.wall_busy = 0.0  # wall seconds spent in schedule/complete (the core's own CPU cost)
        self.wall_active = 0.0  # wall seconds from each step's start to its completion (incl. sleep)
        #: where the core's KV-cache events go (``--kv-events-config``; None: nowhere)
        self.kv_publisher: ZmqEventPublisher | None = None

    def flush_kv_events(self) -> None:
        """Publish the core's KV-cache events since the last call as one batch (none: nothing)."""
        pub, kv = self.kv_publisher, self.core.kv
        if pub is not None and kv.events:
            raw, kv.events = kv.events, []
            cfg = self.core.config
            pub.publish(wire_events(raw, cfg.block_size, cfg.vocab_size))

    def now(self) -> float:
        """Current simulated time, seconds.

        While the engine is busy, simulated time advances only by modelled step durations: it is
        the end of the last computed burst (a request arriving now is first scheduled there). When
        idle it follows the wall clock, ``(monotonic - t0) * time_scale``. So CPU stalls of this
        process (multiplied by the time scale) never show up as simulated latency."""
        if self.core.has_work():
            return max(self._sim_last, self.core.last_arrival)
        return max(self._sim_last, (time.monotonic() - self._t0) * self.time_scale)

    def start(self) -> None:
        """Start the step loop on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="sim-engine-step-loop")

    async def stop(self) -> None:
        """Cancel the step loop and wait for it."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def submit(self, reqs: list[SimRequest]) -> OutputChannel:
        """Queue ``reqs`` (the choices of one HTTP request) and return their shared channel.

        Raises :class:`sim_engine.errors.InvalidRequestError` before queuing anything when one of
        them can never be served."""
        for r in reqs:
            self.core.validate(r.num_prompt_tokens, r.max_tokens)
        ch = OutputChannel(len(reqs))
        now = self.now()
        for i, r in enumerate(reqs):
            r.sink = (ch, i)
            self.core.add_request(r, now)
        self._wake.set()
        return ch

    def abort(self, reqs: list[SimRequest]) -> int:
        """Abort the unfinished ones among ``reqs`` (blocks freed now). Returns how many."""
        n = 0
        now = self.now()
        for r in reqs:
            if r.finish_reason is None and self.core.abort(r.request_id, now) is not None:
                n += 1
        self.flush_kv_events()
        return n

    def abort_all(self) -> int:
        """Abort every in-flight request and tell its consumer (streams end with finish_reason
        ``abort``); used at shutdown. Returns how many were aborted."""
        now = self.now()
        n = 0
        for req in list(self.core.requests.values()):
            if self.core.abort(req.request_id, now) is not None:
                n += 1
                if req.sink is not None:
                    ch, idx = cast("tuple[OutputChannel, int]", req.sink)
                    ch.push_finish(idx, req)
        self.flush_kv_events()
        return n

    async def _loop(self) -> None:
        core, mono, scale = self.core, time.monotonic, self.time_scale
        deadline = 0.0  # wall time at which the previous burst was due to end
        idle = True
        # per step of the current burst: (wall time its tokens are due, its tokens)
        steps: list[tuple[float, list[tuple[OutputChannel, int, SimRequest, int]]]] = []
        while True:
            if not core.has_work():
                self._wake.clear()
                await self._wake.wait()
                idle = True
                continue
            t_start = mono()
            # Pace bursts against a running deadline so that coarse event-loop timers (uvloop: 1 ms)
            # average out; after a stall longer than CATCH_UP_S the schedule restarts from now.
            base = deadline if abs(t_start - deadline) < self.CATCH_UP_S else t_start
            # Simulated time (see now()): after idling it catches up with the wall clock; while
            # busy a burst starts where the previous one ended.
            if idle:
                sim_t = max(self._sim_last, (t_start - self._t0) * scale)
                idle = False
            else:
                sim_t = max(self._sim_last, core.last_arrival)
            # One burst: steps back to back until they add up to MIN_SLICE_S of wall time (one step
            # unless --time-scale makes steps shorter than the event loop's timer resolution).
            wall = 0.0
            while True:
                plan = core.schedule(sim_t)
                if not plan.scheduled:
                    break
                sim_t += plan.duration
                wall += plan.duration / scale
                events = []
                for req in core.complete(plan, sim_t):
                    ch, idx = cast("tuple[OutputChannel, int]", req.sink)
                    events.append((ch, idx, req, len(req.output)))
                steps.append((base + wall, events))
                self.flush_kv_events()
                if wall >= self.MIN_SLICE_S or not core.has_work():
                    break
            self._sim_last = sim_t
            if wall == 0.0:
                # nothing fits this instant (cannot persist: see EngineCore.validate); yield a moment
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), 0.001)
                except TimeoutError:
                    pass
                continue
            t_mid = mono()
            deadline = base + wall
            self.wall_busy += t_mid - t_start
            # each step's tokens leave when its modelled time has passed (one wake-up of the
            # consumers per step, so a stream gets one token per write at the model's pace; the
            # sleep(0) of an overdue step still lets handlers run when CPU-bound)
            for due, events in steps:
                await asyncio.sleep(max(0.0, due - mono()))
                t_c = mono()
                for ch, idx, req, k in events:
                    # tokens of a request aborted since this burst was planned (abort_all at
                    # shutdown already told its consumer it ended): too late to deliver
                    if req.finish_reason != "abort":
                        ch.push(idx, req, k)
                self.wall_busy += mono() - t_c
            steps.clear()
            self.wall_active += mono() - t_start
