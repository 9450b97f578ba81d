"""The picker's pre-encoded HPACK blocks (epp.h2grpc.FixedBlocks) and its cached answers to a
response head (epp.answers.head_answer): the same headers as encoding them each time, the peer's
dynamic table untouched, a pending table-size change still sent first."""
from __future__ import annotations

import hpack
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.answers import WHOLE_ANSWER, head_answer, response_status
from epp.h2grpc import FIXED_BLOCKS, OK_TRAILERS, RESPONSE_HEAD, FixedBlocks, trailers


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
