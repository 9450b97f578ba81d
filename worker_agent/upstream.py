"""The agent's client to its engine, off the request path: readiness, warm-up, ``/metrics``.

Requests never pass through the agent (one hop: routers forward to the engine's own socket, the
slot's ``endpoint``). The agent talks to its engine only for control: the health poll and the
warm-up request while it starts, ``/v1/models``, and the ``/metrics`` scrape every state interval.
One pooled aiohttp session over a Unix socket or loopback TCP (:meth:`Upstream.get`).
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import aiohttp
from yarl import URL

from .errors import UpstreamError

#: engine listen hosts that mean "every interface": routers on this node reach them on loopback
UNSPECIFIED = frozenset({"0.0.0.0", "::", ""})


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

    @property
    def endpoint(self) -> str:
        """The address routers forward requests to, as the slot's ``endpoint`` holds it: the socket
        path, or ``host:port`` (an engine bound to every interface is reached on 127.0.0.1 here;
        IPv6 hosts bracketed). Raises ValueError for an ``https://`` URL (the data path is plain
        HTTP/1.1: put TLS in front of the router, not between router and engine)."""
        if self.uds:
            return self.uds
        u = URL(str(self.url))
        if u.scheme != "http":
            raise ValueError(f"engine URL {self.url}: routers forward plain HTTP to engines (http://host:port)")
        host = u.host or ""
        if host in UNSPECIFIED:
            host = "127.0.0.1"
        try:
            if ipaddress.ip_address(host).version == 6:
                host = f"[{host}]"
        except ValueError:
            pass
        return f"{host}:{u.port or 80}"


class Upstream:
    """Pooled HTTP client for one engine's control paths (health, warm-up, metrics).

    Args:
        address: the engine's :class:`EngineAddress`.
        connect_timeout_s: bound on establishing a connection.
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
