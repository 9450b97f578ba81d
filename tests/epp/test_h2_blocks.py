"""The picker's pre-encoded HPACK blocks (epp.h2grpc.FixedBlocks), its kept decoded blocks
(epp.h2grpc.CachedDecoder) and its cached answers to a response head (epp.answers.head_answer):
the same headers as encoding or decoding them each time, the dynamic tables in step, a pending
table-size change still sent first."""
from __future__ import annotations

import random

import hpack
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.answers import (
    WHOLE_ANSWER,
    grpc_frame,
    head_answer,
    response_status,
    route_answer,
    shared,
)
from epp.h2grpc import (
    FIXED_BLOCKS,
    OK_TRAILERS,
    RESPONSE_HEAD,
    CachedDecoder,
    FixedBlocks,
    trailers,
)


def test_fixed_blocks_decode_to_their_headers_without_touching_the_table() -> None:
    dec = hpack.Decoder()
    for headers, block in FIXED_BLOCKS.items():
        assert [tuple(h) for h in dec.decode(block, raw=True)] == list(headers)
    assert len(dec.header_table.dynamic_entries) == 0
    assert trailers(0) is OK_TRAILERS and trailers(2, "boom") != OK_TRAILERS


def test_encoder_uses_blocks_and_keeps_the_peer_in_sync() -> None:
    enc, dec = FixedBlocks(hpack.Encoder()), hpack.Decoder()
    other = [(b"grpc-status", b"2"), (b"grpc-message", b"boom")]
    seq = [RESPONSE_HEAD, other, RESPONSE_HEAD + OK_TRAILERS, other, OK_TRAILERS, other]
    for headers in seq:
        block = enc.encode(list(headers))
        if tuple(headers) in FIXED_BLOCKS:
            assert block == FIXED_BLOCKS[tuple(headers)]
        assert [tuple(h) for h in dec.decode(block, raw=True)] == list(headers)
    # the peer shrinks its table: the next block, even a fixed one, must start with the size update
    enc.header_table_size = 1024
    block = enc.encode(list(OK_TRAILERS))
    assert block != FIXED_BLOCKS[tuple(OK_TRAILERS)] and 0x20 <= block[0] < 0x40
    dec.header_table_size = 1024
    assert [tuple(h) for h in dec.decode(block, raw=True)] == OK_TRAILERS
    assert enc.encode(list(OK_TRAILERS)) == FIXED_BLOCKS[tuple(OK_TRAILERS)]


def test_head_answer_is_shared_and_its_whole_variant_separate() -> None:
    whole, plain = head_answer("w7", True), head_answer("w7", False)
    assert head_answer("w7", False) is plain
    assert whole.mode_override == WHOLE_ANSWER and not plain.HasField("mode_override")
    hv = plain.response_headers.response.header_mutation.set_headers[0].header
    assert (hv.key, hv.raw_value) == ("x-dplb-worker-id", b"w7")


def test_response_status_reads_status_and_content_type() -> None:
    def head(**kv: str) -> pb.HttpHeaders:
        return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=k.replace("_", "-").replace("status", ":status"), raw_value=v.encode())
            for k, v in kv.items()]))
    assert response_status(head(status="200", content_type="text/event-stream", server="x")) == (200, "text/event-stream")
    assert response_status(head(status="nope")) == (0, "")
    assert response_status(pb.HttpHeaders()) == (0, "")


#: the block Envoy 1.40's gRPC client sends at the head of each ext_proc stream once its table is
#: warm (recorded behind a real Envoy): indexed fields and ``:path`` as a Huffman literal without indexing
ENVOY_HEAD = bytes.fromhex("8304a560b5773fa5d05b3b98855cbe5315761c8bf7657c1e525b2a1d1aec390a841ec635d8721508c286c1c0bfbe")


class _Counting(hpack.Decoder):
    """A decoder that counts the blocks it really decodes."""

    calls = 0

    def decode(self, data: bytes, raw: bool = False) -> list[hpack.HeaderTuple]:  # type: ignore[override]
        self.calls += 1
        return list(super().decode(data, raw))


def _warm(dec: hpack.Decoder | CachedDecoder) -> None:
    """The entries ENVOY_HEAD refers to, as Envoy's first stream put them in the table."""
    enc = hpack.Encoder()
    dec.decode(enc.encode([(":method", "POST"), (":scheme", "http"), (":authority", "epp"),
                           ("content-type", "application/grpc"), ("te", "trailers"),
                           ("x-envoy-internal", "true"), ("x-forwarded-for", "127.0.0.1")]), raw=True)


def test_cached_decoder_decodes_a_repeated_block_once() -> None:
    inner = _Counting()
    dec = CachedDecoder(inner)
    _warm(dec)
    first = dec.decode(ENVOY_HEAD, raw=True)
    calls = inner.calls
    for _ in range(5):
        assert dec.decode(ENVOY_HEAD, raw=True) == first
    assert inner.calls == calls   # the repeats came from the cache
    assert (b":path", b"/envoy.service.ext_proc.v3.ExternalProcessor/Process") in [tuple(h) for h in first]


def test_cached_decoder_follows_the_table_and_the_limits() -> None:
    """The same block means other headers once the table changed: decoded again, never stale."""
    enc, dec, plain = hpack.Encoder(), CachedDecoder(hpack.Decoder()), hpack.Decoder()
    ref = bytes([0x80 | 62])   # the newest dynamic entry
    rng = random.Random(7)
    for i in range(200):
        if rng.random() < 0.3:   # a block that adds an entry (literal with incremental indexing)
            block = enc.encode([(f"x-h{rng.randrange(5)}", f"v{i}")])
        elif rng.random() < 0.1:   # the peer resizes its table (evicting), then refers to what is left
            enc.header_table_size = rng.choice([0, 64, 4096])
            block = enc.encode([("x-after", "resize")])
        else:
            block = ref
        try:
            want = [tuple(h) for h in plain.decode(block, raw=True)]
        except (hpack.HPACKDecodingError, IndexError):
            want = None
        try:
            got = [tuple(h) for h in dec.decode(block, raw=True)]
        except (hpack.HPACKDecodingError, IndexError):
            got = None
        assert got == want, i
    # a smaller header-list limit applies to a block kept before it
    dec2 = CachedDecoder(hpack.Decoder())
    block = hpack.Encoder().encode([("x-big", "v" * 100)])
    dec2.decode(block, raw=True)
    dec2.max_header_list_size = 50
    try:
        dec2.decode(block, raw=True)
        raise AssertionError("the smaller limit was not applied")
    except hpack.OversizedHeaderListError:
        pass


def test_shared_answers_are_framed_once_and_others_each_time() -> None:
    """grpc_frame: a registered (shared) answer's frame is its gRPC message; another answer, also
    a changed copy of a shared one, is serialized as it is now (never a stale frame)."""
    def frame(m: pb.ProcessingResponse) -> bytes:
        b = m.SerializeToString()
        return len(b).to_bytes(5, "big") + b

    for m in (route_answer(("10.0.0.1:8000", "10.0.0.2:8000"), True), head_answer("w3", True),
              pb.ProcessingResponse(request_body=pb.BodyResponse())):
        assert grpc_frame(m) == frame(m) and m.ByteSize() > 0
    own = pb.ProcessingResponse(response_body=pb.BodyResponse())
    assert shared(own) is own and grpc_frame(own) == frame(own)
    other = pb.ProcessingResponse()
    other.CopyFrom(own)
    other.response_body.response.body_mutation.body = b"changed"
    assert grpc_frame(other) == frame(other) != grpc_frame(own)
