"""The asyncio step loop that drives :class:`sim_engine.engine.EngineCore` in (scaled) real time.

One task, no threads. Each iteration: ``schedule`` → sleep until the step's end
(``duration / time_scale`` wall seconds after it started, so the loop's own CPU time is absorbed)
→ ``complete`` → push every produced token to its request's :class:`OutputChannel` (one wake-up per
request per step). Simulated time is ``(monotonic - t0) * time_scale``.
"""

from __future__ import annotations

import asyncio
import time

from sim_engine.engine import EngineCore
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

    def push(self, index: int, req: SimRequest) -> None:
        """Record that ``req`` (choice ``index``) emitted its newest token."""
        self.items.append((index, req, len(req.output)))
        if req.finish_reason is not None:
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
        """True when every choice has finished."""
        return self.open_choices <= 0


class EngineRunner:
    """Owns the core and its step loop. ``time_scale`` > 1 runs faster than real time."""

    CATCH_UP_S = 0.005

    def __init__(self, core: EngineCore, time_scale: float = 1.0) -> None:
        self.core = core
        self.time_scale = time_scale
        self._t0 = time.monotonic()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.wall_busy = 0.0  # wall seconds spent in schedule/complete (the core's own CPU cost)
        self.wall_active = 0.0  # wall seconds from each step's start to its completion (incl. sleep)

    def now(self) -> float:
        """Current simulated time, seconds."""
        return (time.monotonic() - self._t0) * self.time_scale

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
                    ch, idx = req.sink
                    ch.push_finish(idx, req)
        return n

    async def _loop(self) -> None:
        core, mono = self.core, time.monotonic
        deadline = 0.0  # wall time at which the previous step was due to end
        while True:
            if not core.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            t_start = mono()
            plan = core.schedule(self.now())
            if not plan.scheduled:
                # nothing fits this instant (cannot persist: see EngineCore.validate); yield a moment
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), 0.001)
                except TimeoutError:
                    pass
                continue
            t_mid = mono()
            # Pace steps against a running deadline so that coarse event-loop timers (uvloop: 1 ms)
            # average out; after a stall longer than CATCH_UP_S the schedule restarts from now.
            base = deadline if abs(t_start - deadline) < self.CATCH_UP_S else t_start
            deadline = base + plan.duration / self.time_scale
            delay = deadline - t_mid
            await asyncio.sleep(max(0, delay))  # sleep(0) lets handlers run when CPU-bound
            t_c = mono()
            produced = core.complete(plan, self.now())
            for req in produced:
                ch, idx = req.sink
                ch.push(idx, req)
            t_end = mono()
            self.wall_busy += (t_mid - t_start) + (t_end - t_c)
            self.wall_active += t_end - t_start
