"""Relaying a streamed answer to the client (:func:`relay_stream`): the head with the first
chunk, then chunk by chunk, each gap bounded by ``router.idle_timeout_s``; a stream that breaks or
stalls after its first byte ends with an SSE ``error`` event (504 ``timeout_error`` for a stall,
502 otherwise), and so does one whose engine aborted it (``finish_reason: "abort"`` in its last
events: 502, an ``engine_abort`` error, :meth:`router.director.Director.aborted_stream`). Where the router's own protocol serves the request the chunks are piped from the
engine connection's callback into a :class:`router.server.ChunkedWriter` and, after the first
content, by the native relay: one client write per engine read. The stream meter
(:class:`router.stream_meter.StreamMeter`) finds the TTFT and the end of the answer
(:func:`delivered`); request control (:class:`router.director.Director`) keeps the books."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from router.director import Director
from router.drain import cut_by_stop, stream_cut
from router.errors import TransportError, sse_error_event
from router.exchange import Attempt, Exchange
from router.metrics import Metrics
from router.server import ChunkedWriter, ClientGone, chunked_writer, start_chunked
from router.stream_meter import (
    StreamMeter,
    done_start,
    events_aborted,
    is_event_stream,
    split_done,
)
from router.upstream import Upstream

if TYPE_CHECKING:
    from router._relay import ChunkRelay


def delivered(meter: StreamMeter, writer: ChunkedWriter | None) -> bool:
    """Did the client of a stream relayed through ``writer`` get its whole answer: the body's
    terminating chunk written (by the writer or its native relay), or, for an event stream, a last
    event written that is ``data: [DONE]`` (OpenAI's end of stream; the official sync ``openai``
    client closes its connection there, before the engine's terminating chunk follows)? The meter
    has seen exactly what was written to the client (the sink feeds it only while the client is
    there, the native relay meters what it wrote). False without a writer (behind another ASGI
    server ``send`` does not say what reached the client)."""
    if writer is None:
        return False
    return writer.body_ended() or meter.ended_with_done()


async def relay_stream(ex: Exchange, att: Attempt, up: Upstream, first: bytes, headers: list[tuple[bytes, bytes]],
                       director: Director, idle_timeout_s: float) -> bool | None:
    """Relay ``up``'s streamed body (status ``up.status``, ``headers`` as the client gets them),
    starting with ``first`` (already read); a broken or stalled upstream ends with an SSE error
    event. The first chunk that carries content (:mod:`router.stream_meter`) is the TTFT and ends
    the request's prefill in the lease's accounting. Returns False when the stream broke (a
    breaker failure), None when the router's stop cut it at its drain limit (no verdict on the
    worker: a 503 ``drain_cut`` and an SSE error event for the client). Counts the request (``dplb_router_requests_total``) and writes its
    access-log line at the end (:meth:`Director.finished`).

    When the router's own uvicorn protocol serves the request (``ex.scope``), the head leaves
    with the first chunk in one write (:func:`router.server.start_chunked`), the chunks after it
    are written to the client from the upstream connection's callback (:meth:`Upstream.pipe` into
    :class:`router.server.ChunkedWriter`): no ASGI message and no task wake-up per chunk, and the
    last one carries the body's end. Otherwise each chunk goes through ``ex.send``."""
    status, send, scope, wid = up.status, ex.send, ex.scope, att.handle.worker_id
    meter = StreamMeter(is_event_stream(headers))
    ttft: list[float] = []   # the TTFT once seen (set from the connection's callback too)
    held: list[bytes] = []   # an engine's [DONE] held back from an aborted stream (its error event goes first)
    pend = bytearray()       # the start of such a [DONE], cut by a read: the next chunk tells
    first = _hold_done(first, meter, held, pend, up.complete())
    if first and meter.feed(first):
        ttft.append(director.first_content(ex.route, ex.t0, att.lease))
    # a body already whole and aborted by its engine is not ended here: its error event follows
    end = up.complete() and not held and not meter.aborted()
    writer = start_chunked(scope, status, headers, first, end) if scope is not None else None
    if writer is None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        if first:
            await send({"type": "http.response.body", "body": first, "more_body": True})
            writer = chunked_writer(scope) if scope is not None else None
    ok: bool | None = True
    complete = False
    final, last, cause = status, b"", None
    try:
        if first:
            await _relay_rest(ex, att, up, writer, meter, ttft, director, held, pend)
        complete = True
    except (asyncio.CancelledError, ClientGone) as e:
        if cut_by_stop(ex, e) and not delivered(meter, writer):
            # the router's stop reached its drain limit (router.drain): 503 and an SSE error event
            ok, (final, cause, last) = None, stream_cut(ex, meter, att.handle.label, director)
        elif not delivered(meter, writer):
            ex.cut = (meter.output_tokens(), ttft[0] if ttft else None)   # what reached it, for the 499 line
            raise
        else:   # the client had the whole answer when it left: a complete stream, not a disconnect
            complete = True
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                task.uncancel()
    except TransportError as e:
        ok = False
        final, cause, last = _stream_failed(e, wid, director.metrics, idle_timeout_s)
    finally:
        up.release(abort=not complete)
        tokens = director.stream_end(meter, att.lease, complete)
    done = b"".join(held)
    if done and not meter.aborted():
        last = done    # a false alarm ("abort" in the tail, no abort event): the engine's [DONE] as it was
    elif complete and final < 500 and (cut := director.aborted_stream(meter, wid)) is not None:
        # the engine aborted what the client was reading (its drain limit, a stop): a truncated
        # answer is a failure, ended with an SSE error event after the events relayed, before the
        # engine's [DONE] (vLLM's own order for an error), never after it
        ok = False
        final, cause, last = cut
        last += done
    if meter.ended_with_done():
        last = b""     # a [DONE] the client was written already (split across reads): nothing after it
    if writer is not None:
        await writer.finish(last)
    else:
        if last:
            await send({"type": "http.response.body", "more_body": True, "body": last})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    info = ex.info
    director.finished(att.handle.label, final, ex.route, ex.t0, ex.rid, ex.method, info.path, info.model,
                      ttft[0] if ttft else None, None if tokens is None else tokens[0],
                      None if tokens is None else tokens[1], att.number + 1,
                      cause or (None if final < 500 else f"the engine answered {final}"), queue_s=info.queued_s)
    return ok


def _hold_done(chunk: bytes, meter: StreamMeter, held: list[bytes], pend: bytearray, last: bool) -> bytes:
    """``chunk`` without its trailing ``data: [DONE]`` event when the stream may report an
    engine-side abort (in ``chunk`` or before it, :meth:`StreamMeter.mentions_abort`): that event
    goes to ``held``, written after the abort's error event, or as it was when the stream was not
    aborted after all (:func:`relay_stream`). Such a chunk that ends with the start of that event
    (a read cut inside it; not the body's ``last`` chunk) keeps the start in ``pend``, put before
    the next chunk, which then decides. Anything else is returned unchanged."""
    if pend:
        chunk = bytes(pend) + chunk
        pend.clear()
    if held:
        return chunk
    if chunk.endswith(b"[DONE]\n\n"):
        body, done = split_done(chunk)
        if done and meter.mentions_abort(chunk):   # a false alarm writes the [DONE] at the end (relay_stream)
            held.append(done)
            return body
    elif not last and (k := done_start(chunk)) and meter.mentions_abort(chunk):
        pend += chunk[-k:]
        return chunk[:-k]
    return chunk


async def _relay_rest(ex: Exchange, att: Attempt, up: Upstream, writer: ChunkedWriter | None, meter: StreamMeter,
                      ttft: list[float], director: Director, held: list[bytes], pend: bytearray) -> None:
    """The chunks after the first: piped into ``writer`` from the connection's callback (then by
    the native relay after the first content), else sent one ASGI message each; every chunk the
    client was written goes through ``meter`` (the first content appends the TTFT to ``ttft``).
    An aborted stream's trailing ``data: [DONE]`` is not written but appended to ``held`` (by the
    native relay: its ``held_done``), the start of such an event cut by a read to ``pend``
    (:func:`_hold_done`; no hand-over to the native relay then). Raises TransportError (broken, stalled), ClientGone or
    CancelledError (the client left, or the router's stop cut the stream)."""
    route, t0, lease, first_content = ex.route, ex.t0, att.lease, director.first_content
    if writer is None:
        lease.progress = meter.content_events   # output tokens so far, for the TPOT-SLO term
        async for chunk in up.chunks():
            chunk = _hold_done(chunk, meter, held, pend, up.complete())
            if meter.feed(chunk):
                ttft.append(first_content(route, t0, lease))
            if chunk:
                await ex.send({"type": "http.response.body", "body": chunk, "more_body": True})
        return
    write = writer.write
    relays: list[ChunkRelay] = []
    # output tokens so far (router.policies.tpot_slo, read for every stream in flight on the
    # worker at each routing decision there): the meter's events, then from the hand-over the
    # native relay's on top (it meters what it writes; its counts reach the meter only at the
    # end, and the meter is fed nothing while it has the body): at the hand-over one C call
    lease.progress = meter.content_events

    def sink(chunk: bytes) -> bool:
        # the body's last bytes carry its end (one write, not two), unless the engine aborted the
        # stream (its error event follows, then the [DONE] held back); the meter sees what the
        # client was written, nothing after it left (see delivered)
        chunk = _hold_done(chunk, meter, held, pend, up.complete())
        end = up.complete() and not held and not events_aborted(chunk)
        if not chunk:
            return not writer.gone
        sent = write(chunk, end)
        if (sent or not writer.gone) and meter.feed(chunk):
            ttft.append(first_content(route, t0, lease))
        return sent

    def handoff() -> ChunkRelay | None:
        # after the first content the meter only counts events and keeps the
        # tail, which the native relay does as it writes; a stream already aborted stays here
        # (the relay would not know to hold back the [DONE] that follows)
        if not meter.first_seen or meter.aborted() or pend:
            return None
        r = writer.native_relay(meter.carry, meter.tail)
        r.base = meter.content_events()
        lease.progress = r.progress
        relays.append(r)
        return r

    try:
        await up.pipe(sink, writer.drain, handoff)
    finally:
        for r in relays:
            meter.absorb(r.events, r.tail(), r.last_byte())
            if r.held_done:
                held.append(b"data: [DONE]\n\n")


def _stream_failed(e: TransportError, wid: int, metrics: Metrics, idle_timeout_s: float) -> tuple[int, str, bytes]:
    """A stream that broke or stalled after its first byte: ``(status counted, cause, the SSE
    error event that ends it)``; 504 ``timeout_error`` for a stall, else 502 ``upstream_error``."""
    if e.kind == "timeout":
        metrics.errors.labels(str(wid), "timeout").inc()
        cause = (f"worker {wid} stream stalled: no data within the idle timeout "
                 f"(router.idle_timeout_s={idle_timeout_s:g})")
        return 504, cause, sse_error_event(cause, "timeout_error", 504)
    metrics.errors.labels(str(wid), "stream_broken").inc()
    cause = f"worker {wid} stream broke: {e.kind}"
    return 502, cause, sse_error_event(cause, "upstream_error", 502)
