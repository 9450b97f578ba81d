"""router._relay.ChunkRelay (csrc/dplb_relay.pyx): the native stream relay decodes chunked framing
as httptools does, however the bytes are split into reads, re-frames each read as one chunk, and
counts SSE separators and keeps the tail as router.stream_meter.StreamMeter does; with ``end`` it
ends the client's body in the write that carries the engine's last bytes."""
from __future__ import annotations

from itertools import pairwise

import httptools
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from router._relay import CLIENT_FULL, CLIENT_GONE, OK, ChunkRelay
from router.stream_meter import StreamMeter
from tests.helpers import FakeClient


def frame(payloads: list[bytes], ext: bool = False, trailers: bool = False) -> bytes:
    out = b""
    for p in payloads:
        out += b"%x%s\r\n%s\r\n" % (len(p), b";x=1" if ext else b"", p)
    out += b"0\r\n" + (b"x-trailer: 1\r\n" if trailers else b"") + b"\r\n"
    return out


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    pts = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in pairwise(pts) if b > a]


sse_event = st.builds(lambda s: b"data: " + s + b"\n\n", st.binary(min_size=0, max_size=40).map(
    lambda b: b.replace(b"\n", b"")))
payload = st.one_of(sse_event, st.binary(min_size=1, max_size=300))


def no_abort(payloads: list[bytes]) -> bool:
    """No ``"abort"`` in the body: a body with one (an engine's abort, maybe) is not ended by the
    relay and its trailing ``[DONE]`` is held back (tests/faults/test_error_event_after_done.py);
    Hypothesis draws the word from the source's constants."""
    return b'"abort"' not in b"".join(payloads)


@settings(max_examples=300, deadline=None)
@given(st.lists(payload, min_size=0, max_size=12), st.lists(st.integers(0, 10_000), max_size=12),
       st.booleans(), st.booleans())
def test_decodes_like_httptools_and_meters_like_the_stream_meter_however_the_reads_fall(payloads, cuts, ext, trailers):
    assume(no_abort(payloads))
    raw = frame(payloads, ext, trailers)
    c = FakeClient()
    r = ChunkRelay(c.write, c, c)
    meter = StreamMeter()
    meter.first_seen = True   # the relay takes over after the first content
    for part in split(raw, cuts):
        assert r.feed(part) == OK
        assert not r.failed
    assert r.done and not r.extra
    body = b"".join(payloads)
    assert c.body() == body and r.relayed == len(body)

    # httptools on the same bytes: the same body
    got: list[bytes] = []

    class P:
        def on_body(self, b: bytes) -> None:
            got.append(b)

    hp = httptools.HttpResponseParser(P())
    hp.feed_data(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + raw)
    assert b"".join(got) == body

    # the meter fed the same reads' payloads counts the same separators and keeps the same tail
    for w in c.out:
        n, _, rest = w.partition(b"\r\n")
        meter.feed(rest[:int(n, 16)])
    assert r.events == meter._events_after
    assert r.tail() == meter._tail[-4096:]


@settings(max_examples=200, deadline=None)
@given(st.lists(payload, min_size=0, max_size=8), st.lists(st.integers(0, 10_000), max_size=10), st.booleans())
def test_with_end_the_terminating_chunk_rides_on_the_read_that_ends_the_body(payloads, cuts, trailers):
    assume(no_abort(payloads))
    raw = frame(payloads, trailers=trailers)
    plain, ending = FakeClient(), FakeClient()
    a = ChunkRelay(plain.write, plain, plain)
    b = ChunkRelay(ending.write, ending, ending, b"", True)
    parts = split(raw, cuts)
    for i, part in enumerate(parts):
        a.feed(part)
        b.feed(part)
        assert b.ended == b.done == (i == len(parts) - 1)
    # the same writes, but the last one also carries the terminating chunk: appended to the last
    # payload's write when that read ended the body, else a write of its own
    end = b"0\r\n\r\n"
    assert ending.out[-1].endswith(end)
    if len(ending.out) == len(plain.out):
        assert ending.out[:-1] == plain.out[:-1] and ending.out[-1] == plain.out[-1] + end
    else:
        assert ending.out == [*plain.out, end]
    assert b.relayed == a.relayed and b.events == a.events


def test_with_end_a_gone_client_gets_no_terminating_chunk():
    c = FakeClient()
    r = ChunkRelay(c.write, c, c, b"", True)
    r.feed(b"3\r\nabc\r\n")
    c.disconnected = True
    assert r.feed(b"0\r\n\r\n") == CLIENT_GONE and c.out == [b"3\r\nabc\r\n"] and not r.ended


def test_bad_framing_fails_and_bytes_after_the_end_are_flagged():
    c = FakeClient()
    r = ChunkRelay(c.write, c, c)
    r.feed(b"zz\r\n")
    assert r.failed and c.out == []
    r = ChunkRelay(c.write, c, c)
    r.feed(b"3\r\nabcX")            # no CRLF after the data
    assert r.failed
    r = ChunkRelay(c.write, c, c)
    r.feed(b"1" * 16 + b"\r\n")     # a size beyond 15 hex digits
    assert r.failed
    r = ChunkRelay(c.write, c, c)
    r.feed(b"3\r\nabc\r\n0\r\n\r\nHTTP/1.1")
    assert r.done and r.extra
    r = ChunkRelay(c.write, c, c)
    r.feed(b"0" * 20 + b"5\r\nhello\r\n" + b"0" * 17 + b"\r\n\r\n")   # leading zeros: valid (httptools agrees)
    assert not r.failed and r.done and c.out[-1] == b"5\r\nhello\r\n"


def test_a_full_client_pauses_and_a_gone_client_gets_nothing():
    c = FakeClient()
    r = ChunkRelay(c.write, c, c)
    c.write_paused = True
    assert r.feed(b"3\r\nabc\r\n") == CLIENT_FULL and c.out == [b"3\r\nabc\r\n"]
    c.write_paused = False
    c.disconnected = True
    assert r.feed(b"2\r\nde\r\n") == CLIENT_GONE and len(c.out) == 1


def test_a_separator_straddling_the_hand_over_is_counted_once():
    c = FakeClient()
    r = ChunkRelay(c.write, c, c, carry=b"\n")    # the meter's last byte before the relay took over
    r.feed(b"8\r\n\ndata: x\r\n")
    assert r.events == 1 and r.last_byte() == b"x"


def test_progress_is_the_meters_count_before_the_hand_over_plus_the_events_relayed():
    # the TPOT-SLO term's output-token count of a relayed stream (router/relay.py sets ``base``)
    c = FakeClient()
    r = ChunkRelay(c.write, c, c)
    assert r.progress() == 0
    r.base = 5
    raw = frame([b"data: a\n\ndata: b\n\ndata: c\n", b"\n"])
    cut = raw.index(b"\r\n1\r\n") + 2
    r.feed(raw[:cut])                  # the last event not yet whole
    assert r.events == 2 and r.progress() == 7
    r.feed(raw[cut:])
    assert r.events == 3 and r.progress() == 8
