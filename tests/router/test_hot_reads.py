"""The request path's plain reads: the admission queue's copy of its config section
(:meth:`router.config.AdmissionSection.values`) and the running-loop lookup without a system call
(:func:`router.connection.running_loop`, :func:`router.server.current_task`), and the access
line's request id without :func:`router.logtext.field`'s checks when it needs none."""
from __future__ import annotations

import asyncio
import random
import threading

import pytest
from pydantic import BaseModel

from router.admission import AdmissionQueue
from router.config import AdmissionSection, load_config
from router.connection import running_loop
from router.logtext import MAX_FIELD, _checked, _plain, field
from router.server import current_task


def _section() -> AdmissionSection:
    return load_config(None, {"admission.headroom": 0.7, "admission.queue_budget_s": 12.0,
                              "admission.ttft_slo_per_1k_s": 0.3,
                              "admission.classes": {2: {"queue_budget_s": 3.0}, 1: {}}}).admission


def test_values_copy_every_field_and_answer_as_the_section() -> None:
    s = _section()
    v = s.values()
    assert not isinstance(v, BaseModel)   # a plain object: no pydantic hook on each read
    for name in type(s).model_fields:
        assert getattr(v, name) == getattr(s, name), name
    for p in (0, 1, 2, 5):
        assert v.budget_s(p) == s.budget_s(p)
    assert (v.budget_s(2), v.budget_s(1)) == (3.0, 12.0)
    for n in (0, 1, 777, 50_000):
        assert v.ttft_budget_s(n) == s.ttft_budget_s(n)
    assert v.values() is v


def test_the_queue_reads_the_plain_copy() -> None:
    s = _section()
    q: AdmissionQueue[str] = AdmissionQueue(s)
    assert not isinstance(q.cfg, BaseModel)
    assert q.cfg.headroom == 0.7
    t = q.ticket("a", 0.0, 2000, priority=2)
    assert (t.expires, t.ttft_budget) == (3.0, s.ttft_budget_s(2000))


def test_running_loop_follows_the_loop_that_runs() -> None:
    with pytest.raises(RuntimeError):
        running_loop()

    async def probe() -> tuple[asyncio.AbstractEventLoop, asyncio.AbstractEventLoop, object, object]:
        return running_loop(), asyncio.get_running_loop(), current_task(), asyncio.current_task()

    for _ in range(2):   # a second loop in the same thread: not the first one's
        loop = asyncio.new_event_loop()
        try:
            got, real, task, real_task = loop.run_until_complete(probe())
        finally:
            loop.close()
        assert got is real is loop and task is real_task and task is not None
    with pytest.raises(RuntimeError):   # the last loop stopped: no running loop now
        running_loop()
    out: list[object] = []

    def other() -> None:   # another thread, its own loop, while this thread's is not running
        out.append(asyncio.run(probe()))

    th = threading.Thread(target=other)
    th.start()
    th.join()
    got, real, _, _ = out[0]   # type: ignore[misc]
    assert got is real


def test_field_shortcut_returns_what_the_checks_make_of_a_value() -> None:
    # field() returns an id-like string as it is; every string must read as the checks make it
    rng = random.Random(7)
    alphabet = "aZ09_.:/+-= \"\\\t\né\x00"
    seen = {True: 0, False: 0}
    for _ in range(20_000):
        s = "".join(rng.choice(alphabet) for _ in range(rng.choice((0, 1, 3, 8, 40))))
        seen[_plain(s) is not None] += 1
        for limit in (MAX_FIELD, 5):
            assert field(s, limit) == _checked(s, limit), (s, limit)
    for s in ("x" * MAX_FIELD, "3f2a9c0d1b4e5f60-000001", "9b1deb4d-3b7d-4bad-9bdd-2b0d7b3dcb6d", "POST"):
        assert field(s) == s
    long = "x" * (MAX_FIELD + 1)
    assert field(long) == _checked(long, MAX_FIELD) != long
    assert field("") == '""' and field(b"ab") == "ab"
    assert seen[True] > 100 and seen[False] > 100


def test_running_loop_in_a_child_forked_while_a_loop_ran() -> None:
    """A child forked while its parent's loop ran (the parent's running_loop() had found that loop)
    runs a loop of its own: running_loop() there is the child's loop, as asyncio's own lookup says
    (CPython's getpid() check exists for this case), not the parent's copy, which never runs there."""
    import os

    async def parent() -> int:
        running_loop()   # the parent's loop is now this thread's cached one
        pid = os.fork()
        if pid == 0:   # the child: its own loop; exit status 0 only if the lookup is that loop
            code = 1
            try:
                async def child() -> bool:
                    return running_loop() is asyncio.get_running_loop()
                code = 0 if asyncio.run(child()) else 3
            finally:
                os._exit(code)
        return pid

    pid = asyncio.run(parent())
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
