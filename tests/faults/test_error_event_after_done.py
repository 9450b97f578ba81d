"""An error event followed an engine's ``data: [DONE]`` (issue 46).

The failure: an engine that aborts a stream (vLLM's ``finish_reason: "abort"``) still ends it with
``data: [DONE]``; the router relayed that ``[DONE]`` and wrote the abort's SSE error event after it,
where a client (the ``openai`` client, any loop reading to ``[DONE]``) has stopped reading and took
the truncated answer for a whole one. Now the ``[DONE]`` of an aborted stream is held back, in the
Python relay and in the native one (``router._relay.ChunkRelay.held_done``), and written after the
error event. The end-to-end check, both paths through a live router, is
``tests/faults/test_engine_abort_is_a_failure.py`` (``stream_ending(...) == "error_event"``).
"""
from __future__ import annotations

from router._relay import ChunkRelay
from router.stream_meter import split_done

ABORT = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"abort"}]}\n\n'
CONTENT = b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
DONE = b"data: [DONE]\n\n"


class _Client:
    disconnected = False


class _Flow:
    write_paused = False


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _relay(*reads: bytes) -> tuple[ChunkRelay, bytes]:
    out: list[bytes] = []
    r = ChunkRelay(out.append, _Client(), _Flow(), b"\n", True)
    for data in reads:
        r.feed(data)
    return r, b"".join(out)


def test_the_native_relay_holds_back_the_done_of_an_aborted_stream():
    # the abort and the [DONE] in two reads, then in one read with the body's end
    for reads in ((_chunk(CONTENT + ABORT), _chunk(DONE) + b"0\r\n\r\n"),
                  (_chunk(CONTENT), _chunk(ABORT + DONE) + b"0\r\n\r\n")):
        r, written = _relay(*reads)
        assert r.done and r.held_done, reads
        assert b"[DONE]" not in written and b"abort" in written
        assert not r.ended            # the router's writer ends the body: error event, then [DONE]


def test_the_native_relay_writes_the_done_of_a_whole_stream():
    r, written = _relay(_chunk(CONTENT), _chunk(DONE) + b"0\r\n\r\n")
    assert r.done and r.ended and not r.held_done
    assert written.endswith(_chunk(DONE) + b"0\r\n\r\n")


def test_split_done_takes_only_a_trailing_done_event():
    assert split_done(ABORT + DONE) == (ABORT, DONE)
    assert split_done(DONE) == (b"", DONE)
    assert split_done(b"data:[DONE]\n\n") == (b"", b"data:[DONE]\n\n")
    assert split_done(ABORT) == (ABORT, b"")
    assert split_done(b'{"x": "data: [DONE]\n\n') == (b'{"x": "data: [DONE]\n\n', b"")


def test_an_abort_event_split_across_chunks_is_not_missed_before_the_done():
    from router.stream_meter import StreamMeter

    m = StreamMeter(True)
    half = len(ABORT) - 10   # the chunk boundary inside the abort event, inside its "abort"
    m.feed(CONTENT + ABORT[:half])
    assert m.mentions_abort(ABORT[half:] + DONE)
    m2 = StreamMeter(True)
    m2.feed(CONTENT)
    assert not m2.mentions_abort(CONTENT + DONE)


def test_the_native_relay_holds_the_done_when_a_read_split_the_abort_word():
    """A read that ended inside ``"abort"`` (a network read splits an event anywhere): the native
    relay looked for the word in its relayed tail and in the new read, not across the two, so it
    wrote the engine's ``[DONE]`` and the body's end, and the client read a truncated answer
    ending in ``[DONE]`` without the error event (6 cut positions of this event, before)."""
    whole = _chunk(CONTENT + ABORT)
    missed = []
    for cut in range(1, len(whole)):
        r, written = _relay(whole[:cut], whole[cut:] + _chunk(DONE) + b"0\r\n\r\n")
        if not (r.done and r.held_done and not r.ended) or b"[DONE]" in written:
            missed.append(whole[max(0, cut - 8):cut])
    assert not missed, missed


def test_the_native_relay_holds_the_done_when_a_chunk_split_the_abort_word_at_the_hand_over():
    """An engine (or a proxy before it) whose chunk ended inside ``"abort"`` where the native relay
    took the stream over (router/relay.py hands over at a chunk boundary, after the first
    content; the meter cannot tell an abort yet, its event is not whole): the relay's tail starts
    empty there, so it missed the word (across the hand-over, or wholly before it) and wrote the
    ``[DONE]`` and the body's end: a truncated answer without the error event (every cut from
    inside the word to the event's end, before ``before`` carried the meter's tail). However the abort's rest
    falls into reads: with the [DONE] and the end, alone, or byte by byte."""
    from router.stream_meter import StreamMeter

    missed = []
    for cut in range(1, len(ABORT)):
        m = StreamMeter(True)
        m.feed(CONTENT)
        m.feed(ABORT[:cut])           # the chunk before the hand-over, through the Python relay
        if m.aborted():
            assert b'"abort"' in ABORT[:cut]   # the whole word before: relay.py hands no stream over
            continue
        rest, end = _chunk(ABORT[cut:]), _chunk(DONE) + b"0\r\n\r\n"
        for reads in ((rest + end,), (rest, end), (*(rest[i:i + 1] for i in range(len(rest))), end)):
            out: list[bytes] = []
            r = ChunkRelay(out.append, _Client(), _Flow(), m.carry, True, m.tail)
            for data in reads:
                r.feed(data)
            written = b"".join(out)
            if not (r.done and r.held_done and not r.ended) or b"[DONE]" in written:
                missed.append((ABORT[max(0, cut - 8):cut], len(reads)))
    assert not missed, missed


def test_the_hand_over_context_raises_no_false_alarm_on_a_whole_stream():
    # the bytes before the hand-over are only read for the word across it: a whole stream that
    # never says "abort" still ends with its [DONE] and the terminating chunk in one write
    for before in (b"", b"\n", CONTENT, CONTENT[-3:], b'"abor'):
        r, written = _relay_before(before, _chunk(b"t is a verb\n\n"), _chunk(DONE) + b"0\r\n\r\n")
        assert r.done and r.ended and not r.held_done, before
        assert written.endswith(_chunk(DONE) + b"0\r\n\r\n")


def _relay_before(before: bytes, *reads: bytes) -> tuple[ChunkRelay, bytes]:
    out: list[bytes] = []
    r = ChunkRelay(out.append, _Client(), _Flow(), before[-1:], True, before)
    for data in reads:
        r.feed(data)
    return r, b"".join(out)


WHOLE_END = _chunk(DONE) + b"0\r\n\r\n"


def _client_view(written: bytes, held: bool) -> bytes:
    # what the client reads: the relayed bytes, then (an aborted stream) the router's writer's
    # error event and the [DONE] held back
    return written + (b"event: error\n\n" + DONE if held else b"")


def test_the_native_relay_holds_a_done_that_a_read_cut_after_an_abort():
    """A read that cut inside ``data: [DONE]`` of an aborted stream (also inside the chunk's size
    line): the relay held back only a [DONE] whole in one read, so the client got the [DONE] (in
    pieces) before the error event and took the truncated answer for a whole one (cuts 4 to 16)."""
    r0, w0 = _relay(_chunk(CONTENT + ABORT), WHOLE_END)
    want = _client_view(w0, r0.held_done)
    assert want.index(b"event: error") < want.index(b"[DONE]")
    missed = []
    for cut in range(1, len(WHOLE_END)):
        r, written = _relay(_chunk(CONTENT + ABORT), WHOLE_END[:cut], WHOLE_END[cut:])
        if not (r.done and r.held_done and not r.ended) or _client_view(written, r.held_done) != want:
            missed.append(cut)
    assert not missed, missed


def test_the_native_relay_writes_what_follows_an_abort_unchanged_when_it_is_no_done():
    # the start of an event held back after an abort goes out first when the next read shows no
    # [DONE]; without an abort nothing waits (no extra latency)
    more = _chunk(b"data: {}\n\n") + WHOLE_END
    _, w0 = _relay(_chunk(CONTENT + ABORT), more)
    for cut in range(1, len(more)):
        r, written = _relay(_chunk(CONTENT + ABORT), more[:cut], more[cut:])
        assert _payload(written) == _payload(w0) and r.held_done, cut   # each read its own chunk
    out: list[bytes] = []
    r = ChunkRelay(out.append, _Client(), _Flow(), b"\n", True)
    r.feed(_chunk(CONTENT))
    r.feed(WHOLE_END[:10])
    assert out[-1] == _chunk(DONE[:7])


def _payload(framed: bytes) -> bytes:
    out = b""
    while framed:
        size, _, framed = framed.partition(b"\r\n")
        n = int(size, 16)
        out, framed = out + framed[:n], framed[n + 2:]
    return out


def _python_relay(*payloads: bytes) -> tuple[bytes, list[bytes]]:
    # router/relay.py's _hold_done over the payloads of the reads (the last one ends the body)
    from router.relay import _hold_done
    from router.stream_meter import StreamMeter

    m = StreamMeter(True)
    held: list[bytes] = []
    pend = bytearray()
    out = []
    for i, data in enumerate(payloads):
        chunk = _hold_done(data, m, held, pend, i == len(payloads) - 1)
        m.feed(chunk)
        out.append(chunk)
    return b"".join(out), held


def test_the_python_relay_holds_a_done_that_a_read_cut_after_an_abort():
    # the cuts of chunk(DONE) + the terminator, as the payloads of the reads (a 3-byte size line)
    w0, held0 = _python_relay(CONTENT + ABORT, DONE)
    assert held0 == [DONE] and b"[DONE]" not in w0
    missed = []
    for cut in range(1, len(WHOLE_END)):
        k = min(max(cut - 3, 0), len(DONE))
        reads = [p for p in (DONE[:k], DONE[k:]) if p]
        written, held = _python_relay(CONTENT + ABORT, *reads)
        if (written, held) != (w0, held0):
            missed.append(cut)
    assert not missed, missed


def test_the_python_relay_writes_what_follows_an_abort_unchanged_when_it_is_no_done():
    more = b"data: {}\n\n" + DONE
    for cut in range(1, len(more)):
        written, held = _python_relay(CONTENT + ABORT, more[:cut], more[cut:])
        assert (written, held) == (CONTENT + ABORT + b"data: {}\n\n", [DONE]), cut
    from router.relay import _hold_done
    from router.stream_meter import StreamMeter

    m = StreamMeter(True)
    m.feed(CONTENT)
    assert _hold_done(DONE[:7], m, [], bytearray(), False) == DONE[:7]   # no abort: nothing waits
