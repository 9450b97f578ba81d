"""The picker replicas' shared load and placements (epp/share.py) against a real redis-server on
loopback (tests/epp/redis_server.py: a free port, no persistence, killed at teardown): two
replicas' router lines agree on every engine's in-flight work, a replica that stops refreshing
expires from the others, a replica that starts catches up before it says so, and with Redis gone
each replica falls back to its own view (logged once, counted) and comes back when Redis does."""
from __future__ import annotations

import asyncio
import logging
import time

import pytest

from dplb_shm import Segment
from epp.share import LoadShare, Share, decode_counts, encode_counts
from tests.helpers import until

pytestmark = [pytest.mark.timeout(120)]

E1, E2 = "10.0.0.1:8000", "10.0.0.2:8000"


def inflight(seg: Segment, slot: int) -> int:
    return int(seg.router_line(slot)["router_inflight"])


def test_counts_encode_and_decode():
    assert decode_counts(encode_counts((3, 1200, 2, 900))) == (3, 1200, 2, 900)
    assert decode_counts(b"1 2 3") == (0, 0, 0, 0)
    assert decode_counts("x 1 2 3") == (0, 0, 0, 0)
    # a negative count would be clamped at 0 on the line while own() (line minus the others) grew
    # by it, and this replica would push the inflated count on
    assert decode_counts(b"2 -5 0 0") == (0, 0, 0, 0)


def test_load_share_adds_the_others_and_keeps_its_own(segs):
    seg = segs()
    engines = {E1: 0, E2: 1}
    ls = LoadShare(seg, lambda: engines)
    seg.router_inflight_add(0, 2)
    ls.apply({E1: (3, 500, 1, 100), E2: (1, 0, 0, 0)})
    assert inflight(seg, 0) == 5 and inflight(seg, 1) == 1
    assert seg.router_line(0)["prefill_tokens"] == 500
    assert ls.own() == {E1: (2, 0, 0, 0)}            # the others' are not its own
    ls.apply({E1: (1, 0, 0, 0)})                     # the others finished some, E2's left
    assert inflight(seg, 0) == 3 and inflight(seg, 1) == 0
    assert seg.router_line(0)["prefill_tokens"] == 0
    del engines[E1]                                   # the engine left: what was added goes back
    engines[E2] = 1
    ls.apply({E2: (4, 0, 0, 0)})
    assert inflight(seg, 0) == 2 and inflight(seg, 1) == 4
    ls.clear()
    assert inflight(seg, 0) == 2 and inflight(seg, 1) == 0


async def test_two_replicas_agree_on_every_engines_in_flight_work(redis, segs):
    a_seg, b_seg = segs(), segs()
    # the same engines in different slots on each replica (each its own scrape order)
    a_eng, b_eng = {E1: 0, E2: 1}, {E1: 1, E2: 0}
    a = Share(redis.url, a_seg, lambda: a_eng, replica="a")
    b = Share(redis.url, b_seg, lambda: b_eng, replica="b")
    await a.start()
    await b.start()
    try:
        assert a.caught_up() and b.caught_up() and a.up and b.up
        a_seg.router_inflight_add(0, 3)          # a: 3 requests on E1, 1200 prefill tokens
        a_seg.prefill_add(0, 1200)
        b_seg.router_inflight_add(0, 2)          # b: 2 on E2
        b_seg.decode_add(0, 2, 700)

        def agree() -> bool:
            return (inflight(a_seg, 0) == inflight(b_seg, 1) == 3 and inflight(a_seg, 1) == inflight(b_seg, 0) == 2
                    and b_seg.router_line(1)["prefill_tokens"] == 1200
                    and a_seg.router_line(1)["decode_reqs"] == 2 and a_seg.router_line(1)["decode_ctx_tokens"] == 700)

        await until(agree, what="both replicas' lines hold both replicas' work")
        assert a.load.own() == {E1: (3, 1200, 0, 0)} and b.load.own() == {E2: (2, 0, 2, 700)}
        a_seg.router_inflight_add(0, -3)         # a's requests end
        a_seg.prefill_add(0, -1200)
        await until(lambda: inflight(b_seg, 1) == 0 and b_seg.router_line(1)["prefill_tokens"] == 0,
                    what="b sees a's requests end")
        assert inflight(b_seg, 0) == 2 and inflight(a_seg, 1) == 2
    finally:
        await a.close()
        await b.close()
    # a goodbye takes the others' work back: each line holds its own only
    assert inflight(a_seg, 1) == 0 and inflight(b_seg, 0) == 2


async def test_a_replica_that_stops_refreshing_expires_from_the_others(redis, segs):
    a_seg, b_seg = segs(), segs()
    a = Share(redis.url, a_seg, lambda: {E1: 0}, replica="a", ttl_s=0.5)
    b = Share(redis.url, b_seg, lambda: {E1: 0}, replica="b", ttl_s=0.5)
    await a.start()
    await b.start()
    try:
        a_seg.router_inflight_add(0, 4)
        await until(lambda: inflight(b_seg, 0) == 4, what="b sees a's 4")
        a._closed = True                         # a stops refreshing without a goodbye (as kill -9 would)
        await asyncio.wait(a._tasks)
        t0 = time.monotonic()
        await until(lambda: inflight(b_seg, 0) == 0, what="a's share expires on b")
        assert time.monotonic() - t0 >= 0.2      # by the TTL, not at once
        assert "a" not in b.others
    finally:
        a._closed = True
        for r in (a.redis, a.reader):
            await r.aclose()
        await b.close()


async def test_placements_reach_the_others_and_a_late_replica_catches_up(redis, segs):
    got_b: list[tuple[str, list[int], list[int], float]] = []
    got_c: list[tuple[str, list[int], list[int], float]] = []
    a = Share(redis.url, segs(), lambda: {E1: 0}, on_place=lambda *x: None, replica="a")
    b = Share(redis.url, segs(), lambda: {E1: 0}, on_place=lambda *x: got_b.append(x), replica="b")
    await a.start()
    await b.start()
    c = None
    try:
        big = 2**64 - 1   # the prefix index's hashes are unsigned 64-bit, token keys signed
        a.place(E1, [1, 2, big], [-5, 7])
        a.place(E2, [9], [])
        await until(lambda: len(got_b) == 2, what="b receives a's placements")
        assert got_b[0][:3] == (E1, [1, 2, big], [-5, 7]) and got_b[1][:3] == (E2, [9], [])
        assert a.sent == 2 and a.received == 0    # its own are not handed back to it
        c = Share(redis.url, segs(), lambda: {E1: 0}, on_place=lambda *x: got_c.append(x), replica="c")
        assert not c.caught_up()
        await c.start()
        assert c.caught_up() and [g[:3] for g in got_c] == [g[:3] for g in got_b]   # replayed before ready
        assert all(0 <= g[3] < 30 for g in got_c)
    finally:
        for s in (a, b, c):
            if s is not None:
                await s.close()


async def test_redis_down_each_replica_falls_back_to_its_own_view_and_recovers(redis, segs, caplog):
    caplog.set_level(logging.WARNING, logger="dplb.share")
    a_seg, b_seg = segs(), segs()
    a = Share(redis.url, a_seg, lambda: {E1: 0}, on_place=lambda *x: None, replica="a", ttl_s=0.5, timeout_s=0.3)
    b = Share(redis.url, b_seg, lambda: {E1: 0}, on_place=lambda *x: None, replica="b", ttl_s=0.5, timeout_s=0.3)
    await a.start()
    await b.start()
    try:
        a_seg.router_inflight_add(0, 2)
        b_seg.router_inflight_add(0, 1)
        await until(lambda: inflight(a_seg, 0) == inflight(b_seg, 0) == 3, what="shared before the outage")
        redis.stop()
        await until(lambda: not a.up and not b.up, what="both see Redis gone")
        await until(lambda: inflight(a_seg, 0) == 2 and inflight(b_seg, 0) == 1, what="own views")
        a.place(E1, [1], [])                      # the request path never fails, nothing queued
        assert a.outbox == []
        await until(lambda: a.errors >= 3, what="more failed refreshes")
        down = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(down) == 2, [r.getMessage() for r in down]   # once per replica, not per refresh
        redis.start()
        await until(lambda: inflight(a_seg, 0) == inflight(b_seg, 0) == 3, timeout=30, what="shared again")
        assert a.up and b.up
        assert any("answers again" in r.getMessage() for r in caplog.records)
    finally:
        await a.close()
        await b.close()


async def test_an_unreachable_redis_at_start_is_a_fallback_not_a_failure(procs, run_dir, segs):
    from launcher.stack import free_port

    s = Share(f"redis://127.0.0.1:{free_port()}/0", segs(), lambda: {E1: 0}, replica="x", timeout_s=0.3)
    await s.start()
    try:
        assert s.caught_up() and not s.up and s.errors == 1
    finally:
        await s.close()


def test_bad_settings_are_refused(segs):
    with pytest.raises(ValueError):
        Share("redis://127.0.0.1:1/0", segs(), dict, interval_s=0.0)
    with pytest.raises(ValueError):
        Share("redis://127.0.0.1:1/0", segs(), dict, interval_s=1.0, ttl_s=0.5)
    with pytest.raises(ValueError):
        Share("redis://127.0.0.1:1/0", segs(), dict, interval_s=1.0, ttl_s=2.5)   # under 3 intervals
    with pytest.raises(ValueError):
        Share("redis://127.0.0.1:1/0", segs(), dict, lookup_s=-0.001)


def test_dplb_epp_reads_the_share_section_of_its_config_file(tmp_path, capsys):
    import yaml

    from epp.__main__ import main

    cfg = tmp_path / "dplb.yaml"
    cfg.write_text(yaml.safe_dump({"share": {"url": "redis://127.0.0.1:1/0"}}))
    # the file's share.url is taken (no flag): refused with a node's segment, named in the message
    assert main(["--config", str(cfg), "--shm", "dplb-none"]) == 2
    assert "share.url (--share-url) goes with a picker's own segment" in capsys.readouterr().err
    # a TTL barely above the poll: the load could expire between two writes of a running replica
    cfg.write_text(yaml.safe_dump({"share": {"url": "redis://127.0.0.1:1/0", "interval_ms": 1000}}))
    assert main(["--config", str(cfg), "--endpoints-file", str(tmp_path / "eps.yaml")]) == 2
    assert "must be at least 3 x interval_ms" in capsys.readouterr().err   # validated by the config model
    assert main(["--config", str(cfg), "--share-ttl-s", "3", "--share-push-gap-ms", "-1",
                 "--endpoints-file", str(tmp_path / "eps.yaml")]) == 2
    assert "push_gap_ms" in capsys.readouterr().err   # the flag reaches the config model
    # a flag overrides the file
    assert main(["--config", str(cfg), "--share-interval-ms", "50", "--share-url", "http://x",
                 "--endpoints-file", str(tmp_path / "eps.yaml")]) == 2
    assert "not a Redis URL" in capsys.readouterr().err


def test_a_request_waits_for_a_lookup_only_on_a_prefix_miss(segs):
    """:meth:`StateShare.wants_lookup`: with other replicas sharing, a prompt whose head this
    replica's index holds on no engine (or holds less than half of) asks for a lookup; one whose
    prefix it holds does not; neither does any prompt without other replicas or with lookups off."""
    from types import SimpleNamespace

    from dplb_prefix import PrefixIndex
    from router.config import ShareSection
    from router.share_state import SharedIndex, StateShare

    share = Share("redis://127.0.0.1:1/0", segs(), lambda: {E1: 0}, on_place=lambda *x: None, replica="me")
    index = SharedIndex(PrefixIndex(chunk_chars=16), share, lambda slot: E1)
    st = StateShare(SimpleNamespace(policy=SimpleNamespace(index=index)), ShareSection(url="redis://x:1/0"))  # type: ignore[arg-type]
    st.share = share
    text = "".join(f"word{i:04d} " for i in range(64))     # 640 characters: 40 chunks
    share.up, share.others = True, ["other"]
    assert st.wants_lookup(text, "m")                       # held nowhere: a miss
    hashes = index.hashes(text, "m")
    assert index.hashes(text, "m") is hashes                # the policy's second ask is not hashed again
    index.inner.insert(hashes[:10], 0)
    assert st.wants_lookup(text, "m")                       # a quarter of its head: still a miss
    index.inner.insert(hashes[:30], 0)
    assert not st.wants_lookup(text, "m")                   # three quarters held on one engine
    assert not st.wants_lookup("short", "m")                # under one chunk: no prefix to miss
    other = "".join(f"else{i:04d} " for i in range(64))
    assert st.wants_lookup(other, "m")
    share.others = []
    assert not st.wants_lookup(other, "m")                  # alone: nobody could have placed it
    share.others, share.lookup_s = ["other"], 0.0
    assert not st.wants_lookup(other, "m")                  # lookups off
    share.lookup_s, share.up = 0.01, False
    assert not st.wants_lookup(other, "m")                  # Redis down: own view
