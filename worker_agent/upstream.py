"""Transport to the engine: one pooled aiohttp session over a Unix socket or loopback TCP.

This module is the only place that touches the engine's socket. Its interface is two methods,
:meth:`Upstream.open` (a request whose response is streamed back) and :meth:`Upstream.get`
(a small control request, e.g. ``/metrics``); relay code and tests work against them.

Aborting: closing an :class:`UpstreamResponse` before its body ended drops the TCP/UDS connection
(never returns it to the pool), which is how vLLM and SGLang learn that a client went away and
abort the request (both watch ``request.is_disconnected()``).
"""
from __future__ import annotations

import errno
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import aiohttp
from yarl import URL

from .errors import EngineUnavailableError, UpstreamError

#: hop-by-hop headers (RFC 9110 §7.6.1); never relayed in either direction
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "transfer-encoding", "upgrade",
})
#: errors that mean the peer process never read the request (it was gone or going): connection
#: reset (RST: data arrived at a closed socket) and broken pipe (written after the peer closed)
UNREAD_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE})
#: request headers the client library recomputes for the engine hop
REQUEST_DROP = HOP_BY_HOP | {"host", "content-length"}


@dataclass(frozen=True)
class EngineAddress:
    """Where the engine listens: a Unix socket path (``uds``) or an HTTP base URL (``url``)."""

    uds: str | None = None
    url: str | None = None

    def __post_init__(self) -> None:
        if bool(self.uds) == bool(self.url):
            raise ValueError("EngineAddress needs exactly one of uds or url")

    @property
    def base(self) -> str:
        """Base URL requests are built on (``http://localhost`` for a Unix socket)."""
        return "http://localhost" if self.uds else str(self.url).rstrip("/")

    def __str__(self) -> str:
        return f"unix:{self.uds}" if self.uds else str(self.url)


class UpstreamResponse:
    """A response from the engine whose body is read chunk by chunk.

    Attributes:
        status: HTTP status code.
        headers: response headers minus hop-by-hop ones, as ``(bytes, bytes)`` pairs for ASGI.
    """

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status = resp.status
        self.headers = [(k.lower(), v) for k, v in resp.raw_headers
                        if k.decode("latin-1").lower() not in HOP_BY_HOP]
        self.content_type = resp.headers.get("content-type", "")

    async def chunks(self) -> AsyncIterator[bytes]:
        """Yield body bytes as they arrive (no re-buffering: one yield per network read).

        Raises:
            UpstreamError: when the connection breaks mid-body.
        """
        try:
            async for data in self._resp.content.iter_any():
                yield data
        except (aiohttp.ClientError, ConnectionError) as e:
            raise UpstreamError(f"engine connection broke mid-response: {e}") from e

    def close(self, *, abort: bool = False) -> None:
        """Finish with the response: release the pooled connection, or drop it when ``abort``."""
        if abort:
            self._resp.close()
        else:
            self._resp.release()


class Upstream:
    """Pooled HTTP client for one engine.

    Args:
        address: the engine's :class:`EngineAddress`.
        connect_timeout_s: bound on establishing a connection (not on the response, which for
            LLM requests may legitimately take minutes).
    """

    def __init__(self, address: EngineAddress, *, connect_timeout_s: float = 5.0) -> None:
        self.address = address
        self._connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            if self.address.uds:
                conn: aiohttp.BaseConnector = aiohttp.UnixConnector(path=self.address.uds, limit=0)
            else:
                conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
            self._session = aiohttp.ClientSession(
                connector=conn, auto_decompress=False, skip_auto_headers=("User-Agent", "Accept-Encoding"),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout_s),
            )
        return self._session

    async def open(self, method: str, path: str, headers: Iterable[tuple[str, str]], body: bytes) -> UpstreamResponse:
        """Send one request and return once the response status and headers arrived.

        Args:
            method: HTTP method.
            path: path plus query string, starting with ``/``.
            headers: request headers to pass (hop-by-hop ones are dropped here).
            body: the request body, unchanged.

        Raises:
            EngineUnavailableError: the connection was refused (nothing listens: the engine is
                dead or restarting) or reset before the engine read the request; it never saw it.
            UpstreamError: the connection broke or the engine closed it before answering (the
                engine may have begun the work).
        """
        hdrs = [(k, v) for k, v in headers if k.lower() not in REQUEST_DROP]
        try:
            # encoded=True: the path and query go out byte for byte, not re-quoted
            resp = await self._get_session().request(method, URL(self.address.base + path, encoded=True), headers=hdrs,
                                                     data=body if body else None, allow_redirects=False)
        except (aiohttp.ClientConnectorError, ConnectionRefusedError, FileNotFoundError) as e:
            raise EngineUnavailableError(f"engine at {self.address} is not accepting connections: {e}") from e
        except aiohttp.ClientOSError as e:
            if e.errno in UNREAD_ERRNOS:
                # reset: our bytes reached a socket its process no longer reads (a pooled connection
                # of an engine that just died): the engine never saw the request
                raise EngineUnavailableError(f"engine at {self.address} reset the connection before reading "
                                             f"the request: {e}") from e
            raise UpstreamError(f"cannot reach engine at {self.address}: {e}") from e
        except (aiohttp.ClientError, ConnectionError, OSError) as e:
            raise UpstreamError(f"cannot reach engine at {self.address}: {e}") from e
        return UpstreamResponse(resp)

    async def get(self, path: str, *, timeout_s: float = 2.0, json_body: object | None = None,
                  method: str = "GET") -> tuple[int, bytes]:
        """Small control request (``/metrics``, ``/health``, warm-up); returns ``(status, body)``.

        Raises:
            UpstreamError: on any transport failure or when ``timeout_s`` elapses.
        """
        try:
            async with self._get_session().request(
                method, self.address.base + path, json=json_body,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, ConnectionError, OSError, TimeoutError) as e:
            raise UpstreamError(f"{method} {path} on engine at {self.address} failed: {e!r}") from e

    async def close(self) -> None:
        """Close every pooled connection."""
        if self._session is not None:
            await self._session.close()
            self._session = None
