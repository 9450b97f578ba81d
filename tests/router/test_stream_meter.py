"""router.stream_meter: the first chunk that carries content, and token counts (issue 16)."""
from __future__ import annotations

import orjson
import pytest

from router.stream_meter import StreamMeter, has_content, usage_from_body


def ev(obj: dict | str) -> bytes:
    return b"data: " + (obj.encode() if isinstance(obj, str) else orjson.dumps(obj)) + b"\n\n"


ROLE = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}


def tok(text: str, fr: str | None = None) -> dict:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": fr}]}


def test_role_only_chunk_is_not_first_content():
    m = StreamMeter(sse=True)
    assert m.feed(ev(ROLE)) is False and not m.first_seen
    assert m.feed(ev(tok(" hi"))) is True and m.first_seen
    assert m.feed(ev(tok(" there", "stop"))) is False  # only once
    m.feed(ev("[DONE]"))
    assert m.output_tokens() == 2 and m.usage() == (None, None)


def test_first_content_split_across_chunks_and_sharing_a_chunk_with_the_role():
    m = StreamMeter()
    raw = ev(ROLE) + ev(tok(" a"))
    cut = len(ev(ROLE)) + 9  # inside the first content event
    assert m.feed(raw[:cut]) is False
    assert m.feed(raw[cut:]) is True
    m = StreamMeter()
    assert m.feed(ev(ROLE) + ev(tok(" a")) + ev(tok(" b"))) is True
    m.feed(ev(tok(" c", "length")) + ev("[DONE]"))
    assert m.output_tokens() == 3


def test_usage_wins_over_counted_events_and_gives_prompt_tokens():
    m = StreamMeter()
    for i in range(5):
        m.feed(ev(tok(f" w{i}")))
    m.feed(ev({"choices": [], "usage": {"prompt_tokens": 17, "completion_tokens": 9}}) + ev("[DONE]"))
    assert m.usage() == (17, 9) and m.output_tokens() == 9


def test_the_last_events_are_read_again_after_more_is_fed_or_absorbed():
    """The stream's end parses its last events once for the usage and the token count; whatever
    is fed (or absorbed from the native relay) after a read must be seen by the next one."""
    m = StreamMeter()
    m.feed(ev(tok(" a")) + ev(tok(" b")))
    assert m.usage() == (None, None) and m.output_tokens() == 2
    m.feed(ev({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7}}))
    assert m.usage() == (5, 7) and m.output_tokens() == 7
    tail = ev(tok(" c")) + ev({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 8}})
    m.absorb(2, tail, tail[-1:])
    assert m.usage() == (5, 8) and m.output_tokens() == 8


def test_separator_straddling_two_chunks_is_counted_once():
    m = StreamMeter()
    m.feed(ev(tok(" a")))
    body = ev(tok(" b")) + ev(tok(" c")) + ev("[DONE]")
    for i in range(len(body)):  # byte by byte: every separator straddles
        m.feed(body[i:i + 1])
    assert m.output_tokens() == 3


@pytest.mark.parametrize("obj,want", [
    ({"choices": [{"text": " x"}]}, True),
    ({"choices": [{"text": ""}]}, False),
    ({"choices": [{"delta": {"reasoning_content": "hm"}}]}, True),
    ({"choices": [{"delta": {"tool_calls": [{"id": "1"}]}}]}, True),
    ({"choices": []}, False),
    ({"text": " sglang", "meta_info": {}}, True),
    ({"text": "", "meta_info": {}}, False),
])
def test_what_counts_as_content(obj, want):
    assert has_content(obj) is want


def test_stream_without_any_content_is_not_buffered_without_bound():
    m = StreamMeter()
    for _ in range(3000):
        m.feed(b": keep-alive comment " + b"x" * 500)  # no separator ever
    assert not m.first_seen and len(m._head) <= 1 << 20
    assert m.output_tokens() == 0


def test_non_sse_body_counts_its_first_byte_and_reads_usage():
    m = StreamMeter(sse=False)
    assert m.feed(b'{"id": "x", "choices": [') is True
    m.feed(b'], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}')
    assert m.usage() == (3, 4) and m.output_tokens() == 4


def test_usage_from_body():
    assert usage_from_body(b'{"usage": {"prompt_tokens": 7, "total_tokens": 12, "completion_tokens": 5}}') == (7, 5)
    # an SGLang batch: one meta_info per item
    batch = orjson.dumps([{"text": "a", "meta_info": {"prompt_tokens": 2, "completion_tokens": 3}},
                          {"text": "b", "meta_info": {"prompt_tokens": 4, "completion_tokens": 1}}])
    assert usage_from_body(batch) == (6, 4)
    # the key inside generated text is escaped and does not count
    assert usage_from_body(orjson.dumps({"text": 'say "completion_tokens": 99'})) == (None, None)


@pytest.mark.parametrize("chunks,want", [
    ([b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n', b"data: [DONE]\n\n"], True),
    ([b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\ndata: [DONE]\r\n\r\n'], True),
    ([b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\ndata:[DONE]\n\n'], True),
    ([b"data: [DONE]\n\n"], True),
    ([b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'], False),
    ([b'data: {"choices": [{"delta": {"content": "[DONE]"}}]}\n\n'], False),   # the word inside an event
    ([b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\ndata: [DO'], False),
])
def test_a_stream_is_ended_by_its_done_event_only(chunks, want):
    """What proxy.delivered reads when a client leaves (issue 27, item 8): a client that had
    ``data: [DONE]`` had its whole answer."""
    m = StreamMeter()
    for c in chunks:
        m.feed(c)
    assert m.ended_with_done() is want
    assert StreamMeter(sse=False).ended_with_done() is False


def _last_events_by_full_split(tail: bytes) -> list[dict | None]:
    """The reference for StreamMeter._last_events: every event of the tail, the last three parsed."""
    from router.stream_meter import event_json

    return [event_json(e) for e in [e for e in tail.split(b"\n\n") if e.strip()][-3:]]


def test_the_last_events_equal_those_of_splitting_the_whole_tail():
    # the fast path splits only the tail's last separators; separator runs, blank pieces, a cut
    # first event and tails with fewer than three events must give what splitting it all gives
    import random

    rng = random.Random(7)
    pieces = [ev(tok(" a")), ev(tok(" b", "stop")), ev("[DONE]"), b": comment\n\n", b"\n", b"\n\n\n",
              ev({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}), b"data: {\"x\":", b"\n\n\n\n\n"]
    for _ in range(3000):
        tail = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 9)))
        tail = tail[rng.randint(0, 12):] if rng.random() < 0.3 else tail
        m = StreamMeter()
        m._tail = tail
        assert m._last_events() == _last_events_by_full_split(tail), tail


def test_the_abort_test_agrees_with_the_pattern_alone():
    import random

    from router.stream_meter import _ABORT, _abort_key

    rng = random.Random(11)
    words = [b'"finish_reason"', b'"type"', b":", b" ", b'"abort"', b'"abor', b't"', b"abort", b'"stop"', b"\n\n", b"x"]
    for _ in range(5000):
        s = b"".join(rng.choice(words) for _ in range(rng.randint(0, 8)))
        assert _abort_key(s) == (_ABORT.search(s) is not None), s
