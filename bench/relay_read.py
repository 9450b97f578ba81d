"""The router's work per engine read of a relayed stream, without sockets: ``python -m bench.relay_read``.

One :class:`router.connection.Connection` whose body the native relay
(:class:`router._relay.ChunkRelay`) has, fed the same chunk-framed SSE event (a ~150-byte chat
chunk, as one engine read brings it) over and over, two ways in alternating rounds:

- ``connection``: through ``Connection.data_received`` (a Python frame per read: the liveness
  times, the relay's ``feed``, the checks after it);
- ``protocol``: through :class:`router._relay.RelayProtocol`, what the event loop calls once the
  relay took the body (the same work with no Python frame).

The client transport is a list's ``append`` (next to nothing) and the connection's transport a
stub, so what is timed is the router's own per-read work, not the kernel's. Prints the median
ns per read of each way over ``--rounds`` rounds (``time.perf_counter_ns`` of a tight loop: wall
time, so compare the two ways within one run) and their ratio.
"""
from __future__ import annotations

import argparse
import statistics
import time

from router._relay import ChunkRelay, RelayProtocol
from router.connection import Connection

EVENT = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
         b'"choices":[{"index":0,"delta":{"content":" tok"},"finish_reason":null}]}\n\n')
READ = b"%x\r\n%s\r\n" % (len(EVENT), EVENT)


class _Client:
    """The client's transport and uvicorn's cycle and flow control as the relay sees them."""

    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.disconnected = False
        self.write_paused = False


class _Transport:
    def is_closing(self) -> bool:
        return False


class _Pool:
    last_rx = 0.0


def _setup() -> tuple[Connection, RelayProtocol, _Client]:
    conn = Connection()
    conn.transport = _Transport()
    conn.home = _Pool()  # type: ignore[assignment]
    conn.start()
    c = _Client()
    r = ChunkRelay(c.out.append, c, c)
    conn.relay = r
    return conn, RelayProtocol(conn, r), c


def _round(n: int) -> tuple[float, float]:
    conn, proto, c = _setup()
    feed_c, feed_p = conn.data_received, proto.data_received
    t0 = time.perf_counter_ns()
    for _ in range(n):
        feed_c(READ)
    t1 = time.perf_counter_ns()
    for _ in range(n):
        feed_p(READ)
    t2 = time.perf_counter_ns()
    assert len(c.out) == 2 * n and not conn.done and conn.error is None
    return (t1 - t0) / n, (t2 - t1) / n


def main(argv: list[str] | None = None) -> int:
    """Run the rounds and print ns per read of each way; returns 0."""
    ap = argparse.ArgumentParser(prog="python -m bench.relay_read", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reads", type=int, default=100_000, help="reads per way and round")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args(argv)
    _round(10_000)   # warm-up
    via_conn: list[float] = []
    via_proto: list[float] = []
    for _ in range(a.rounds):
        x, y = _round(a.reads)
        via_conn.append(x)
        via_proto.append(y)
    mc, mp = statistics.median(via_conn), statistics.median(via_proto)
    print(f"per engine read ({len(READ)} bytes), median of {a.rounds} rounds of {a.reads:,}: "
          f"connection {mc:.0f} ns [{min(via_conn):.0f}-{max(via_conn):.0f}], protocol {mp:.0f} ns "
          f"[{min(via_proto):.0f}-{max(via_proto):.0f}]; protocol / connection {mp / mc:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
