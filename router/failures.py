"""What a failed attempt means for its request: whether it may go to another worker, and the
error its client gets when no attempt succeeded (:meth:`router.proxy.Proxy.forward`).

    retryable(e, broken, retry_on_timeout, retry_on_disconnect) -> bool
    final_error(e, wid, tried, mid_body, broken, no_worker, idle_timeout_s, first_byte_timeout_s) -> RouterError
"""
from __future__ import annotations

from router.errors import (
    GatewayTimeout,
    NoEligibleWorker,
    RouterError,
    TransportError,
    UpstreamError,
)

#: a request whose connection broke on this many workers after they read it, before any byte
#: reached the client, is answered 502 and not tried again (a query of death: each try crashed an engine)
BROKEN_ENGINES_LIMIT = 2


def retryable(e: TransportError, broken: int, retry_on_timeout: bool, retry_on_disconnect: bool) -> bool:
    """May a request whose attempt failed with ``e`` before its first byte reached the client go
    to another worker? ``broken``: how many workers' connections it broke after they read it,
    this attempt's included (:func:`breaks`). Never read by the worker (refused, reset before
    reading): always; a timeout: only with ``retries.retry_on_timeout``; a connection that
    broke after the worker read the request (the engine exited or reset it): with
    ``retries.retry_on_disconnect`` (the default) while fewer than
    :data:`BROKEN_ENGINES_LIMIT` broke."""
    if e.kind == "timeout":
        return retry_on_timeout
    if e.kind == "connect" and (e.refused or e.unsent):
        return True
    return retry_on_disconnect and broken < BROKEN_ENGINES_LIMIT


def breaks(e: TransportError) -> bool:
    """Did ``e`` break a worker's connection after the worker read the request (not refused, not
    unread, not a timeout)? Such a request may have crashed its engine."""
    return e.kind != "timeout" and not (e.kind == "connect" and (e.refused or e.unsent))


def final_error(e: Exception | None, wid: int | None, tried: int, mid_body: bool, broken: int,
                no_worker: NoEligibleWorker | None, idle_timeout_s: float, first_byte_timeout_s: float) -> RouterError:
    """The error a client gets when no attempt succeeded. ``e``: the last attempt's failure, on
    worker ``wid``; ``tried``: the workers tried; ``mid_body``: a non-streamed body stalled or
    broke after its first byte; ``broken``: the workers whose connection it broke after they
    read it; ``no_worker``: the pipeline found no worker for another attempt; the two timeouts
    (s, ``router.idle_timeout_s`` / ``router.first_byte_timeout_s``) are named in a 504.

    504 after a timeout; 502 when the request broke :data:`BROKEN_ENGINES_LIMIT` workers (a
    query of death) or failed in a way that is not retried; otherwise no worker was left to
    take it, or every one tried refused it: 503 + Retry-After (:class:`NoEligibleWorker`)."""
    if isinstance(e, TransportError) and e.kind == "timeout" and mid_body:
        return GatewayTimeout(f"worker {wid} stalled mid-response: no data within the idle timeout "
                              f"(router.idle_timeout_s={idle_timeout_s:g})", worker_id=wid)
    if isinstance(e, TransportError) and e.kind == "timeout":
        return GatewayTimeout(f"worker {wid} sent no response within the first-byte timeout "
                              f"(router.first_byte_timeout_s={first_byte_timeout_s:g}); a timed-out "
                              "request is not retried on another worker (retries.retry_on_timeout)", worker_id=wid)
    if broken >= BROKEN_ENGINES_LIMIT:
        return UpstreamError(f"the request broke the connection of {broken} workers after they read it, before "
                             f"the first byte (last: worker {wid}: {e}); it is not tried again: a request that "
                             "crashes engines would crash the next one", worker_id=wid)
    if no_worker is not None or (isinstance(e, TransportError) and (e.refused or e.unsent)):
        why = no_worker.message if no_worker is not None else "no worker can take the request now"
        return NoEligibleWorker(f"{why}; {tried} worker(s) tried failed before the first byte (last: worker "
                                f"{wid}: {e})", reason="all_failed")
    if tried > 1:
        return UpstreamError(f"all {tried} worker(s) tried failed before the first byte: {e}", worker_id=wid)
    return UpstreamError(f"worker {wid} failed before the first byte: {e}", worker_id=wid)
