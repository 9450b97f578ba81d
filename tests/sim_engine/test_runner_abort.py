"""The step loop's paced delivery against an abort at shutdown (``EngineRunner.abort_all``).

CI of stop 42 lost a request to this: a burst's tokens are computed at once and delivered when
their modelled time has passed; ``abort_all`` (SIGTERM) ended a request whose next tokens were
still waiting, the waiting tokens were delivered after its end, the channel read "not done"
again, and the non-streamed handler answered 499 to a client that was still there."""
from __future__ import annotations

import asyncio

from sim_engine.config import EngineConfig
from sim_engine.engine import EngineCore
from sim_engine.request import SimRequest
from sim_engine.runner import EngineRunner


def test_tokens_planned_before_an_abort_are_not_delivered_after_its_end():
    async def scenario() -> tuple[list, list, bool]:
        core = EngineCore(EngineConfig())
        runner = EngineRunner(core, time_scale=1.0)   # steps take their modelled time (ms) of wall time
        runner.start()
        try:
            req = SimRequest("r0", [f"w{i}" for i in range(64)], 200, core.config.block_size)
            ch = runner.submit([req])
            got = await ch.drain()   # woken by a push: the loop has planned the next step and waits for its time
            assert got and all(k > 0 for _, _, k in got) and req.finish_reason is None
            assert runner.abort_all() == 1
            end = await ch.drain()
            await asyncio.sleep(0.2)  # many steps' worth: anything still pending would have arrived
            return end, list(ch.items), ch.done
        finally:
            await runner.stop()

    end, late, done = asyncio.run(scenario())
    assert end[-1][2] == -1 and end[-1][1].finish_reason == "abort", end
    assert late == [] and done, late
