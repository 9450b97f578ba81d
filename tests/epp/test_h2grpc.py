"""The picker's own HTTP/2 gRPC server (epp/h2grpc.py) against grpcio's client: answers in order,
long messages across frames and flow-control windows, a handler that raises, admission holding a
stream, a cancelled call; every stream's exchange closed exactly once."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from epp.h2grpc import H2GrpcServer


class Echo:
    """A stand-in for epp.stream.Exchange: answers a request body with a response body carrying the
    same bytes (so long messages come back long); a body ``b"raise"`` raises; a body ``b"hold"``
    asks admission to hold the stream until ``gate`` is set; after a body ``b"last"`` the exchange
    is done (Exchange.done: the response ended)."""

    def __init__(self, log: list[Echo], gate: asyncio.Event) -> None:
        self.seen: list[bytes] = []
        self.closed = 0
        self.waiting: bytes | None = None
        self.done = False
        self.gate = gate
        log.append(self)

    def on_message(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        body = req.request_body.body
        self.seen.append(body)
        if body == b"raise":
            raise RuntimeError("boom")
        if body == b"hold":
            self.waiting = body
            return []
        self.done = body == b"last"
        return [self._answer(body)]

    async def admit(self) -> list[pb.ProcessingResponse]:
        await self.gate.wait()
        body, self.waiting = self.waiting, None
        assert body is not None
        return [self._answer(b"admitted")]

    @staticmethod
    def _answer(body: bytes) -> pb.ProcessingResponse:
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
            body_mutation=pb.BodyMutation(body=body))))

    def close(self) -> None:
        self.closed += 1


def body(data: bytes) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data))


async def until(pred, timeout: float = 10.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < end, "condition not reached"
        await asyncio.sleep(0.01)


@pytest.fixture
def served():
    """(run, exchanges, gate): ``run(coro_fn)`` runs ``coro_fn(stub)`` against a started server."""
    exchanges: list[Echo] = []

    def run(fn):
        async def main():
            gate = asyncio.Event()
            served.gate = gate
            server = H2GrpcServer(lambda side: Echo(exchanges, gate))   # type: ignore[arg-type, return-value]
            port = await server.start("127.0.0.1", 0)
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                    await fn(pb_grpc.ExternalProcessorStub(ch), gate)
            finally:
                await server.stop(1.0)
        asyncio.run(main())
    return run, exchanges


def test_answers_come_back_in_order_and_each_exchange_closes_once(served):
    run, exchanges = served

    async def fn(stub, gate):
        for _ in range(3):   # several calls on one connection (Envoy's pattern: one stream per request)
            out = [r.request_body.response.body_mutation.body async for r in stub.Process(
                iter([body(b"a"), body(b"bb"), body(b"ccc")]))]
            assert out == [b"a", b"bb", b"ccc"]
        await until(lambda: len(exchanges) == 3 and all(e.closed for e in exchanges))

    run(fn)
    assert [e.closed for e in exchanges] == [1, 1, 1]


def test_long_messages_cross_frames_and_windows_both_ways(served):
    run, exchanges = served
    big = bytes(range(256)) * 12_000   # 3 MB: far above the 16 KB frame and 64 KB initial window

    async def fn(stub, gate):
        out = [r.request_body.response.body_mutation.body async for r in stub.Process(iter([body(big), body(big[:7])]))]
        assert out == [big, big[:7]]

    run(fn)
    assert exchanges[0].seen == [big, big[:7]]


def test_a_handler_that_raises_ends_the_call_unknown_and_closes_the_exchange(served):
    run, exchanges = served

    async def fn(stub, gate):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.Process(iter([body(b"ok"), body(b"raise")])):
                pass
        assert e.value.code() == grpc.StatusCode.UNKNOWN
        assert "boom" in (e.value.details() or "")
        await until(lambda: exchanges[0].closed == 1)

    run(fn)


def test_admission_holds_the_stream_and_later_messages_wait_their_turn(served):
    run, exchanges = served

    async def fn(stub, gate):
        call = stub.Process(iter([body(b"hold"), body(b"after")]))
        first = asyncio.ensure_future(call.read())
        await until(lambda: exchanges and exchanges[0].seen == [b"hold"])
        await asyncio.sleep(0.2)
        assert not first.done() and exchanges[0].seen == [b"hold"]   # "after" waits behind admission
        gate.set()
        assert (await first).request_body.response.body_mutation.body == b"admitted"
        assert (await call.read()).request_body.response.body_mutation.body == b"after"
        assert await call.read() == grpc.aio.EOF

    run(fn)
    assert exchanges[0].closed == 1


def test_a_cancelled_call_closes_its_exchange(served):
    run, exchanges = served

    async def fn(stub, gate):
        q: asyncio.Queue[pb.ProcessingRequest | None] = asyncio.Queue()

        async def reqs():
            while (m := await q.get()) is not None:
                yield m

        call = stub.Process(reqs())
        await q.put(body(b"x"))
        assert (await call.read()).request_body.response.body_mutation.body == b"x"
        assert exchanges[0].closed == 0   # the stream is open: nothing released yet
        call.cancel()                      # Envoy resets the stream (client gone, timeout)
        await until(lambda: exchanges[0].closed == 1)

    run(fn)


def test_a_done_exchange_closes_at_its_last_answer_and_the_call_ends_when_the_client_does(served):
    # the answer to the response's end is the last: the exchange is closed with it (its lease
    # released), without waiting for the client; the call itself sends no trailers until the client
    # half-closes (Envoy resets the stream instead, reading none: epp.h2grpc._answered)
    run, exchanges = served

    async def fn(stub, gate):
        q: asyncio.Queue[pb.ProcessingRequest | None] = asyncio.Queue()

        async def reqs():
            while (m := await q.get()) is not None:
                yield m

        call = stub.Process(reqs())
        await q.put(body(b"x"))
        assert (await call.read()).request_body.response.body_mutation.body == b"x"
        await q.put(body(b"last"))
        assert (await call.read()).request_body.response.body_mutation.body == b"last"
        assert exchanges[0].closed == 1   # closed with the last answer, the client's side still open
        assert not call.done()
        await q.put(None)                 # the client half-closes: the trailers follow
        assert await asyncio.wait_for(call.read(), 10) == grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK

    run(fn)
    assert exchanges[0].closed == 1


def test_received_frames_are_not_rendered_for_the_trace_log(served, monkeypatch):
    """h2 renders every received frame with ``repr`` for a trace log nobody reads (epp.h2grpc's
    module-level shadow): a stream's frames arrive and are answered without hyperframe's
    ``__repr__`` running once."""
    from hyperframe.frame import Frame

    rendered: list[str] = []
    original = Frame.__repr__
    monkeypatch.setattr(Frame, "__repr__", lambda self: rendered.append(type(self).__name__) or original(self))
    run, exchanges = served

    async def fn(stub, gate):
        out = [r.request_body.response.body_mutation.body async for r in stub.Process(iter([body(b"a"), body(b"b")]))]
        assert out == [b"a", b"b"]

    run(fn)
    assert len(exchanges) == 1
    assert rendered == []
