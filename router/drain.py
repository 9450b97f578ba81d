"""A request cut short while the router relays it: its client left, or the router's own stop
reached its drain limit.

On SIGTERM the router stops accepting connections and relays what is in flight until it ends, up
to ``--drain-timeout`` seconds (uvicorn's ``timeout_graceful_shutdown``); then uvicorn cancels the
requests' tasks. A cancelled task whose client is still connected (:attr:`Exchange.gone` unset:
the client leaving is told by the router's protocol, :meth:`router.proxy.Proxy._serve`) was cut
by the stop, not by its client: a truncated answer is a failure, counted 503 with a
``drain_cut`` error (:data:`router.director.DRAIN_CUT`), never the 499 of a client that left.

- a stream already started ends with an OpenAI-shaped SSE error event (:func:`stream_cut`,
  called by :func:`router.relay.relay_stream`);
- a request not yet answered (waiting for its engine, in admission, between retries) gets a 503
  with ``Retry-After`` (:func:`settle_cut`): it is not retried on another worker from a router
  that is stopping; the client's retry reaches one that serves (another replica, or this one
  restarted by the launcher).
"""
from __future__ import annotations

import asyncio

from router.answers import send_error
from router.director import NO_WORKER, Director
from router.exchange import Exchange
from router.server import ClientGone
from router.stream_meter import StreamMeter


def cut_by_stop(ex: Exchange, e: BaseException) -> bool:
    """Was ``ex``'s task cancelled (``e``) by the server, with its client still connected (the
    drain limit of a stop), rather than by its client leaving?"""
    task = asyncio.current_task()
    return (isinstance(e, asyncio.CancelledError) and not ex.gone and task is not None
            and task.cancelling() > 0)


def stream_cut(ex: Exchange, meter: StreamMeter, label: str, director: Director) -> tuple[int, str, bytes]:
    """A started stream the stop cut (:func:`cut_by_stop`): the task's cancellation is taken back
    (its SSE error event still goes out); returns ``(503, cause, the error event)``, counted
    ``drain_cut`` on the worker labelled ``label`` (:meth:`Director.drain_cut_stream`)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        task.uncancel()
    return director.drain_cut_stream(meter, label)


async def settle_cut(ex: Exchange, label: str, director: Director, e: BaseException) -> bool:
    """``ex`` was cut before its answer was complete (``e``: CancelledError or ClientGone; a
    stream already started was settled by :func:`router.relay.relay_stream`). The router's stop
    (:func:`cut_by_stop`, nothing answered yet): answer 503 + ``Retry-After`` (counted 503 and
    ``drain_cut`` under ``label``, the current attempt's worker) and return True. Otherwise the
    client left: count it 499 (:meth:`Director.client_left`, with what a cut stream had sent)
    and return False (the caller re-raises)."""
    if ex.cut is None and cut_by_stop(ex, e):
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        err = director.drain_cut(label)
        try:
            await send_error(ex.send, err, ex.rid)
        except (OSError, RuntimeError, ClientGone):   # the head had left, or the client went meanwhile
            pass
        else:
            director.finished(label, err.status, ex.route, ex.t0, ex.rid, ex.method, ex.info.path, ex.info.model,
                              None, ex.info.prompt_len, None, len(ex.tried) + (label != NO_WORKER), err.message,
                              queue_s=ex.info.queued_s)
            return True
    sent, ttft = ex.cut if ex.cut is not None else (None, None)   # a stream cut: the tokens it was sent
    director.client_left(label, ex.route, ex.t0, ex.rid, ex.method, ex.info.path, ex.info.model, ttft,
                         ex.info.prompt_len, sent, len(ex.tried) + 1, queue_s=ex.info.queued_s)
    return False


__all__ = ["cut_by_stop", "settle_cut", "stream_cut"]
