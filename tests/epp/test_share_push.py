"""The push of router/share.py against a real redis-server on loopback (tests/epp/redis_server.py):
a replica's change (a request dispatched, past prefill, ended; a placement; a goodbye) reaches the
other replicas through the loads stream at once, not at the next poll of every replica's hash
(the poll here is a minute: a change seen before it came by the push); a late answer of the poll
never undoes a newer push."""
from __future__ import annotations

import asyncio
import time

import pytest

from dplb_shm import Segment
from router.accounting import RequestAccount
from router.share import Share
from router.share_state import Notifying
from tests.helpers import until

pytestmark = [pytest.mark.timeout(120)]

E1, E2 = "10.0.0.1:8000", "10.0.0.2:8000"
SLOW = {"interval_s": 60.0, "ttl_s": 180.0}   # no poll within the test: what arrives was pushed


def line(seg: Segment, slot: int) -> tuple[int, int, int, int]:
    ln = seg.router_line(slot)
    return (int(ln["router_inflight"]), int(ln["prefill_tokens"]), int(ln["decode_reqs"]), int(ln["decode_ctx_tokens"]))


async def test_a_requests_dispatch_prefill_and_end_are_pushed_to_the_other_replica(redis, segs):
    a_seg, b_seg = segs(), segs()
    a = Share(redis.url, a_seg, lambda: {E1: 0, E2: 1}, replica="a", **SLOW)
    b = Share(redis.url, b_seg, lambda: {E1: 1, E2: 0}, replica="b", **SLOW)   # its own slot order
    await a.start()
    await b.start()
    try:
        polls = (a.refreshes, b.refreshes)
        acct = Notifying(a_seg, a)                # what a's scheduler hands its request accounts
        req = RequestAccount(acct, 0, 1000, 1000, time.monotonic())   # dispatched to E1
        await until(lambda: line(b_seg, 1) == (1, 1000, 0, 0), what="b sees a's dispatch")
        req.first_token(time.monotonic())
        await until(lambda: line(b_seg, 1) == (1, 0, 1, 1000), what="b sees a's request in decode")
        req.finish(time.monotonic())
        await until(lambda: line(b_seg, 1) == (0, 0, 0, 0), what="b sees a's request end")
        assert b.refreshes == polls[1] and b.pushed >= 3    # no poll of b's: each change came by a push
        assert a.refreshes > polls[0]                        # a's pushes are its round trips
        assert line(a_seg, 0) == (0, 0, 0, 0) and line(b_seg, 0) == (0, 0, 0, 0)
    finally:
        await a.close()
        await b.close()


async def test_a_placement_and_a_goodbye_are_pushed(redis, segs):
    got: list[tuple[str, list[int], list[int], float]] = []
    a_seg, b_seg = segs(), segs()
    a = Share(redis.url, a_seg, lambda: {E1: 0}, on_place=lambda *x: None, replica="a", **SLOW)
    b = Share(redis.url, b_seg, lambda: {E1: 0}, on_place=lambda *x: got.append(x), replica="b", **SLOW)
    await a.start()
    await b.start()
    try:
        a.place(E1, [11, 12], [])
        await until(lambda: len(got) == 1, what="b receives the placement")
        assert got[0][:3] == (E1, [11, 12], [])
        a_seg.router_inflight_add(0, 2)          # a change outside the accounting: poked by hand
        a.poke()
        await until(lambda: line(b_seg, 0)[0] == 2, what="b adds a's 2")
        await a.close()                           # the goodbye is pushed: b drops a's load before any poll
        await until(lambda: line(b_seg, 0)[0] == 0, what="b drops a's load")
        assert b.refreshes == 1                   # its catch-up only
    finally:
        await a.close()
        await b.close()


def test_a_late_poll_answer_does_not_undo_a_newer_push(segs):
    seg = segs()
    s = Share("redis://127.0.0.1:1/0", seg, lambda: {E1: 0}, replica="me")
    now = time.monotonic()
    assert s._take("x", 5, {E1: (3, 0, 0, 0)}, now)          # pushed: write 5 of x
    assert not s._take("x", 4, {E1: (1, 0, 0, 0)}, now)      # the poll's answer held write 4
    s._sum()
    assert line(seg, 0) == (3, 0, 0, 0)
    assert s._take("x", 6, {}, now)                          # x said goodbye
    s._sum()
    assert line(seg, 0) == (0, 0, 0, 0) and s.remote == {}


async def test_a_push_is_one_round_trip_and_survives_a_flushed_script_cache(redis, segs):
    import redis.asyncio as aioredis

    seg = segs()
    a = Share(redis.url, seg, lambda: {E1: 0}, replica="a", **SLOW)
    admin = aioredis.Redis.from_url(redis.url)
    await a.start()
    try:
        await admin.config_resetstat()
        for k in range(5):
            seg.router_inflight_add(0, 1)
            a.poke()
            await until(lambda k=k: a.seq >= 2 + k, what="the push written")
        stats = await admin.info("commandstats")
        # EVALSHA only: no SCRIPT EXISTS before each pipeline (a second round trip per push)
        assert "cmdstat_script" not in stats and stats["cmdstat_evalsha"]["calls"] >= 5
        await admin.script_flush()   # as a restarted Redis: the script is loaded again, no error
        seg.router_inflight_add(0, 1)
        a.poke()
        await until(lambda: a.seq >= 7, what="the push after the flush")
        assert a.errors == 0 and a.up
    finally:
        await a.close()
        await admin.aclose()


async def test_a_replica_started_while_redis_was_down_takes_no_old_placement_as_new(redis, segs):
    """A replica whose start found Redis unreachable did not catch up; when Redis answers, the
    placements the stream held before are not handed to ``on_place`` as placed just now (age 0:
    fresh pending placements on engines that may have evicted them long ago), new ones are."""
    import msgspec
    import redis.asyncio as aioredis
    from redis.exceptions import ConnectionError as RedisConnectionError

    got: list[tuple[str, list[int], list[int], float]] = []
    admin = aioredis.Redis.from_url(redis.url)
    await admin.xadd("dplb:placements", {"r": "old", "p": msgspec.msgpack.encode([E1, [11, 12], [7]])})
    a = Share(redis.url, segs(), lambda: {E1: 0}, on_place=lambda *x: None, replica="a", **SLOW)
    b = Share(redis.url, segs(), lambda: {E1: 0}, on_place=lambda *x: got.append(x), replica="b",
              timeout_s=0.3, **SLOW)

    async def unreachable() -> None:
        raise RedisConnectionError("unreachable at start (test)")

    b.redis.ping = unreachable   # type: ignore[method-assign]   # the start's first call fails
    await a.start()
    await b.start()
    try:
        assert not b.up and b.caught_up()
        for _ in range(400):                  # until b's stream read (once Redis answers) has one
            a.place(E1, [21], [])
            await asyncio.sleep(0.05)
            if got:
                break
        assert got, "b never received a new placement"
        assert all(g[1] == [21] for g in got), got
    finally:
        await a.close()
        await b.close()
        await admin.aclose()


async def test_a_miss_reads_what_the_others_pushed_before_it_is_priced(redis, segs):
    """:meth:`Share.sync`: a placement and a dispatch pushed by replica a that b's blocking stream
    read has not delivered (as when the read's wake-up lags on a busy machine) are b's after one
    ``sync``; the blocking read, when it comes, does not apply them twice."""
    got: list[tuple[str, list[int], list[int], float]] = []
    a_seg, b_seg = segs(), segs()
    a = Share(redis.url, a_seg, lambda: {E1: 0}, on_place=lambda *x: None, replica="a", **SLOW)
    b = Share(redis.url, b_seg, lambda: {E1: 0}, on_place=lambda *x: got.append(x), replica="b", lookup_s=10.0,
              **SLOW)   # a lookup bound no busy machine reaches: what is read, not how fast
    await a.start()
    await b.start()
    reader = next(t for t in b._tasks if t.get_name() == "share-read")
    reader.cancel()                          # b's push delivery held back
    try:
        await until(lambda: b.others == ["a"] or reader.done(), what="b's reader stopped")
        RequestAccount(Notifying(a_seg, a), 0, 1000, 1000, time.monotonic())   # a dispatches to E1
        a.place(E1, [11, 12], [])
        await until(lambda: a.sent == 1 and a._written == {E1: (1, 1000, 0, 0)}, what="a's push in Redis")
        await asyncio.sleep(0.05)
        assert got == [] and line(b_seg, 0) == (0, 0, 0, 0)   # not arrived: b would price E1 as empty
        assert await b.sync()
        assert [g[:3] for g in got] == [(E1, [11, 12], [])] and line(b_seg, 0) == (1, 1000, 0, 0)
        assert b.lookups == 1 and b.lookups_late == 0
        assert await b.sync() and len(got) == 1   # nothing new: nothing applied again
        loop = asyncio.get_running_loop()
        b._tasks.append(loop.create_task(b._read_loop(), name="share-read"))   # the blocking read resumes
        a.place(E1, [13], [])
        await until(lambda: len(got) == 2, what="the next placement by the blocking read")
        assert [g[1] for g in got] == [[11, 12], [13]] and b.received == 2
    finally:
        await a.close()
        await b.close()


async def test_a_lookup_waits_at_most_lookup_s_for_a_slow_redis(redis, segs):
    """A Redis that does not answer (stopped with SIGSTOP) holds a lookup for ``lookup_s``, not
    longer; the read goes on in the background and later lookups wait for the same one."""
    import os
    import signal

    b = Share(redis.url, segs(), lambda: {E1: 0}, on_place=lambda *x: None, replica="b", lookup_s=0.05,
              timeout_s=5.0, **SLOW)
    await b.start()
    pid = redis.child.popen.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert not await b.sync()
        first = b._sync_task
        assert not await b.sync()
        assert time.monotonic() - t0 < 4.0     # two lookups of 0.05 s, far from the 5 s socket timeout
        assert b._sync_task is first and b.lookups == 2 and b.lookups_late == 2
    finally:
        os.kill(pid, signal.SIGCONT)
        await b.close()
    b.lookup_s = 0.0
    assert not await b.sync()                  # off (and closed): nothing asked


async def test_a_push_only_writes_and_wakes_only_the_other_replicas(redis, segs):
    """A push writes this replica's counters to its own stream without reading the others' hashes
    (that is the poll's, once an interval), and the replica's own blocking read never gets its
    own pushes back: with one stream for all, every push woke its sender's reader too."""
    import redis.asyncio as aioredis

    a_seg, b_seg = segs(), segs()
    a = Share(redis.url, a_seg, lambda: {E1: 0}, replica="a", **SLOW)
    b = Share(redis.url, b_seg, lambda: {E1: 0}, replica="b", **SLOW)
    admin = aioredis.Redis.from_url(redis.url)
    woke: list[object] = []
    xread = a.reader.xread

    async def counting(*args: object, **kw: object) -> object:
        got = await xread(*args, **kw)   # type: ignore[arg-type]
        if got:
            woke.append(got)
        return got

    a.reader.xread = counting   # type: ignore[method-assign]
    await a.start()
    await b.start()
    try:
        await admin.config_resetstat()
        for k in range(1, 8):
            a_seg.router_inflight_add(0, 1)
            a.poke()
            await until(lambda k=k: line(b_seg, 0)[0] == k, what="b sees a's push")
        stats = await admin.info("commandstats")
        assert "cmdstat_hgetall" not in stats and "cmdstat_smembers" not in stats   # no read of the others
        assert stats["cmdstat_evalsha"]["calls"] >= 7 and b.pushed >= 7
        def own_entries() -> int:
            return sum(1 for got in woke for name, entries in got if name != b"dplb:hello"   # type: ignore[attr-defined]
                       for _, fields in entries if fields.get(b"r") == b"a")

        assert own_entries() == 0            # a's own reader: none of its 7 pushes came back to it
        b_seg.router_inflight_add(0, 2)
        b.poke()
        await until(lambda: line(a_seg, 0)[0] == 9, what="a sees b's push")
        assert a.pushed >= 1 and own_entries() == 0
    finally:
        await a.close()
        await b.close()
        await admin.aclose()


async def test_the_placements_stream_is_bounded_in_bytes(redis, segs):
    """Long prompts' placements (here ~10 KB each: 1,100 chunk hashes) with ``max_stream_bytes`` 1
    MB: the stream keeps about 100 of 400 entries (its length bound lowered by the entries' mean
    size; Redis trims whole nodes of 100), not all 400 as a bound of 100,000 entries alone would."""
    import redis.asyncio as aioredis

    a = Share(redis.url, segs(), lambda: {E1: 0}, on_place=lambda *x: None, replica="a", max_stream_bytes=1 << 20,
              **SLOW)
    admin = aioredis.Redis.from_url(redis.url)
    await a.start()
    try:
        big = [2**62 + i for i in range(1100)]   # 9 bytes each in msgpack
        for k in range(400):
            a.place(E1, big[k % 7:], [])
            if k % 50 == 49:
                await until(lambda k=k: a.sent == k + 1, what="the placements sent")
        await until(lambda: a.sent == 400, what="all sent")
        n = await admin.xlen("dplb:placements")
        size = await admin.memory_usage("dplb:placements")
        assert 100 <= n <= 250, n
        assert size is not None and size < 3 << 20, size
        assert 9_000 < a.entry_bytes < 11_000
    finally:
        await a.close()
        await admin.aclose()
