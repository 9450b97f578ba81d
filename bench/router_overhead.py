"""Router overhead: added latency (p50/p99) of routed vs direct-to-worker requests, and the
requests/s one router process sustains. ``python -m bench.router_overhead [--policy dplb] ...``

Setup (everything on loopback, cleaned up on exit):

* an *instant worker* (:mod:`bench.instant_worker`): a minimal asyncio HTTP/1.1 server on a Unix
  socket that claims slot 0 of a fresh segment, publishes READY with its socket as endpoint,
  heartbeats, and answers every POST with a fixed ~300-byte chat completion (the role nginx plays
  in the field's measurements, see ``docs/peers-and-engines.md``);
* one router process (``python -m router``) in front of it, optionally pinned to one core.

Latency: ``--requests`` sequential requests over one keep-alive connection, with the same raw
socket client (:mod:`bench.rawclient`), first straight to the worker's socket, then to the
router's TCP port (interleaved in rounds so machine noise hits both alike). Added latency = routed percentile − direct percentile.

Throughput: ``--conns`` keep-alive connections in a closed loop for ``--seconds``; reports the
measured req/s (bounded by whatever the 2-core machine has left for client and worker) and the
router's CPU seconds per request (psutil), hence req/s per fully used router core.

SSE relay (``--streams`` > 0): that many concurrent streamed requests, each answered by the instant
worker with one SSE event (a ~150-byte chat chunk) every ``--chunk-interval-ms`` (each event its own
write, as an engine emits one per token), ``--chunks`` events per stream, streams restarted as
they end, for ``--seconds`` (``--burst K``: K events per engine write, each its own HTTP chunk, K ×
the interval apart: the same event rate with the tokens arriving together, as a router finds
them when an engine's writes pile up in the socket; a router that relays one write per read pays
its per-read cost once per K events, one that handles each HTTP chunk pays per event). Prints the events
the client received and the router's CPU seconds: **SSE chunks relayed per router core per
second** = events / router CPU seconds, the client's socket reads per event, and the inter-token
latency the client saw (p50/p90/p99 of the gap since the event before, 0 for an event that came
in the same read as the one before): a router that holds events back to write several at once
relays more per core-second and adds that to the ITL.

``--versus PEER``: DPLB's router and the peer's (bench/peers.py), both pinned to the same core in
front of the same instant worker (TCP), measured in alternating blocks within one run instead of
one system per run: ``--blocks`` blocks, each ``--block-requests`` sequential requests straight to
the worker and through each router (the routers' order alternating from block to block), so the
machine's drift, which on a shared VM moves a p50 by tens of µs between runs, hits both alike.
Prints each router's added p50 (median over the blocks) and, per block, DPLB's minus the peer's;
then ``--rounds`` closed loops per router, alternating, for the CPU per request. ``--versus`` may
be given several times (the order rotates per block and round); ``--versus baseline`` runs a second
DPLB checkout (``--baseline-dir``, built) as the peer: before/after figures from one run.

Long prompts (``--prompt-bytes N``): the latency blocks and closed loops send chat requests of
about N bytes, 10/11 of each one of 20 shared documents (:func:`long_prompt_requests`), after one
pass over them (the prefix index warm); ``--rate R`` paces the closed loops at R requests/s in all.

``--kv-events``: engines that publish KV-cache events and DPLB's router routing on
them, mirrored as remote nodes' workers (:mod:`bench.events_rig`).

``--profile FILE``: record the router with py-spy during the closed loop (and the SSE phase, to
``FILE`` with ``.sse`` before the suffix) and write the functions with the most samples (own and
inclusive) as text.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable

from bench.events_rig import add_arguments as add_events_arguments
from bench.events_rig import make_rig as make_events_rig
from bench.instant_worker import serve_worker
from bench.pyspy import Profiler
from bench.rawclient import (
    NON_200,
    STREAM_ERRORS,
    closed_loop,
    connector,
    long_prompt_requests,
    pct,
    sequential,
    stream_loop,
)
from launcher.stack import agent_argv, free_port, router_argv, wait_for_port


def build_parser() -> argparse.ArgumentParser:
    """The bench's command line (one ``add_argument`` per flag; see the module docstring)."""
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="python -m bench.router_overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="dplb")
    ap.add_argument("--requests", type=int, default=3000, help="sequential requests per path (latency)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conns", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--pin", type=int, default=0, help="pin the router to this CPU (-1: no pinning)")
    ap.add_argument("--shm", help="segment name to create (default: a fresh dplb-bench-<hex>)")
    ap.add_argument("--through-agent", action="store_true",
                    help="attach a real worker agent (--engine openai) to the instant engine, as deployed: the "
                         "agent publishes the engine's address and the router forwards straight to it (one hop)")
    ap.add_argument("--streams", type=int, default=32, help="concurrent streams of the SSE phase (0: skip it)")
    ap.add_argument("--chunks", type=int, default=64, help="SSE events per stream")
    ap.add_argument("--chunk-interval-ms", type=float, default=2.0, help="gap between two events of a stream")
    ap.add_argument("--burst", type=int, default=1, help="SSE events per engine write (one write every burst x "
                    "--chunk-interval-ms)")
    ap.add_argument("--workers", type=int, default=0, help="router processes (--workers of the router; 0: one, "
                    "unpinned with --pin -1, else pinned to CPUs pin..pin+k-1)")
    ap.add_argument("--tcp", action="store_true", help="the instant worker listens on loopback TCP (as the peers need)")
    ap.add_argument("--peer", choices=("sglang", "vllm", "smg"), help="measure this peer router (bench/peers.py) instead of "
                    "DPLB's, pinned the same way, in front of the same instant worker (implies --tcp)")
    ap.add_argument("--peer-policy", default="round_robin", help="the peer's policy (default: round_robin)")
    ap.add_argument("--versus", choices=("sglang", "vllm", "smg", "baseline", "no-access-log", "no-admission", "own-index"),
                    action="append",
                    help="run DPLB's router and this peer's (repeatable; baseline: DPLB from --baseline-dir; "
                    "no-access-log: DPLB's router with --access-log off, the access log's share; no-admission: with "
                    "admission.enabled false, the admission step's share; own-index: with "
                    "--kv-events, DPLB's router on its own prefix index) side by "
                    "side and measure them in alternating blocks (implies --tcp; see the module docstring)")
    ap.add_argument("--baseline-dir", help="a second DPLB checkout, built (make build), run as --versus baseline: "
                    "before/after figures in the same run")
    ap.add_argument("--blocks", type=int, default=20, help="alternating blocks of --versus")
    ap.add_argument("--block-requests", type=int, default=300, help="sequential requests per path and block (--versus)")
    ap.add_argument("--profile", metavar="FILE", help="py-spy the router during the closed loop; top functions to FILE")
    ap.add_argument("--skip-latency", action="store_true", help="skip the sequential latency phase")
    ap.add_argument("--prompt-bytes", type=int, default=0, help="long prompts of about this many bytes (20 shared "
                    "documents making 10/11 of each, bench.rawclient.long_prompt_requests) instead of the tiny "
                    "chat, in the closed loops and the latency blocks")
    ap.add_argument("--rate", type=float, default=0.0, help="pace the closed loops at this many requests/s in all "
                    "(0: as fast as answers come)")
    add_events_arguments(ap)
    ap.add_argument("--serve-worker", nargs=4, metavar=("SHM", "SOCK", "CHUNKS", "INTERVAL"), help=argparse.SUPPRESS)
    ap.add_argument("--serve-burst", type=int, default=1, help=argparse.SUPPRESS)
    return ap


# ----------------------------------------------------------------------------------------- rig


class Rig:
    """The bench's processes and their ground: a fresh segment (``--shm`` or ``dplb-bench-<hex>``)
    of 8 slots, a run directory under /tmp, the instant worker (on a Unix socket in the run
    directory, or loopback TCP with ``--tcp``/``--peer``/``--versus``), with ``--through-agent`` a
    real worker agent attached to it, and every router :meth:`launch` started. :meth:`close` stops
    them all (SIGTERM to each process group, SIGKILL after 5 s) and removes the segment and the
    directory."""

    def __init__(self, a: argparse.Namespace) -> None:
        from dplb_shm import Segment

        self.a = a
        self.shm = a.shm or f"dplb-bench-{uuid.uuid4().hex[:8]}"
        self.dir = tempfile.mkdtemp(prefix="dplb-bench-", dir="/tmp")
        self.tcp = a.tcp or a.peer is not None or a.versus is not None
        self.sock = f"127.0.0.1:{free_port()}" if self.tcp else os.path.join(self.dir, "w0.sock")
        self.seg = Segment.create(self.shm, num_slots=8)
        self.children: list[subprocess.Popen[bytes]] = []
        self.root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def start_worker(self) -> None:
        """Start the instant worker (owning slot 0, or bare behind an agent with ``--through-agent``)."""
        a, sock = self.a, self.sock
        self.children.append(subprocess.Popen([sys.executable, "-m", "bench.router_overhead", "--serve-worker",
                                               "-" if a.through_agent else self.shm, sock, str(a.chunks),
                                               str(a.chunk_interval_ms / 1000.0), "--serve-burst", str(a.burst)],
                                              cwd=self.root, start_new_session=True))
        if self.tcp:
            wait_for_port(int(sock.rpartition(":")[2]), timeout=20)
        if a.through_agent:
            t_end = time.monotonic() + 20
            while not self.tcp and not os.path.exists(sock) and time.monotonic() < t_end:
                time.sleep(0.05)
            self.children.append(subprocess.Popen(
                agent_argv(0, self.shm, os.path.join(self.dir, "agent-0.sock"), engine="openai",
                           engine_url=f"http://{sock}" if self.tcp else f"unix:{sock}", model="bench", run_dir=self.dir),
                cwd=self.root, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def _router_command(self, peer: str | None, port: int) -> tuple[list[str], str, dict[str, str] | None]:
        """(argv, cwd, env) of DPLB's router (``peer`` None), a variant of it or ``peer``'s."""
        a = self.a
        if peer == "baseline":
            if not a.baseline_dir:
                raise SystemExit("--versus baseline needs --baseline-dir")
            env = {**os.environ, "PYTHONPATH": os.path.abspath(a.baseline_dir)}
            return router_argv(port=port, shm=self.shm, policy=a.policy, log_level="warning"), a.baseline_dir, env
        if peer == "no-access-log":
            return router_argv(port=port, shm=self.shm, policy=a.policy, log_level="warning",
                               extra=["--access-log", "off"]), self.root, None
        if peer == "no-admission":
            conf = os.path.join(self.dir, "no-admission.yaml")
            with open(conf, "w") as f:
                f.write("admission:\n  enabled: false\n")
            return router_argv(port=port, shm=self.shm, config=conf, policy=a.policy,
                               log_level="warning"), self.root, None
        if peer:
            from bench.peers import ensure_peer, peer_command

            ensure_peer(peer)
            return peer_command(peer, a.peer_policy, port, free_port(), [f"http://{self.sock}"]), self.root, None
        return router_argv(port=port, shm=self.shm, policy=a.policy, log_level="warning",
                           workers=a.workers or None), self.root, None

    def launch(self, peer: str | None, log: str) -> tuple[int, int]:
        """Start DPLB's router (``peer`` None) or ``peer``'s in front of the worker, pinned as
        asked, its output to ``log`` in the run directory; wait until it has a ready worker
        (GET /health → 200; SystemExit after 60 s). Returns (port, pid)."""
        a = self.a
        port = free_port()
        rcmd, cwd, env = self._router_command(peer, port)
        rlog = open(os.path.join(self.dir, log), "wb")  # noqa: SIM115 - closed with the run dir
        if a.pin >= 0:
            cpus = f"{a.pin}" if a.workers <= 1 else f"{a.pin}-{a.pin + a.workers - 1}"
            rcmd = ["taskset", "-c", cpus] + rcmd
        self.children.append(subprocess.Popen(rcmd, cwd=cwd, env=env, start_new_session=True, stdout=rlog, stderr=rlog))
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                raise SystemExit("router or worker did not come up")
            time.sleep(0.2)
        return port, self.children[-1].pid

    def direct(self) -> socket.socket:
        """A connection straight to the instant worker."""
        if self.tcp:
            s = socket.create_connection(("127.0.0.1", int(self.sock.rpartition(":")[2])))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return s
        s = socket.socket(socket.AF_UNIX)
        s.connect(self.sock)
        return s

    @staticmethod
    def cpu_of(pid: int) -> Callable[[], float]:
        """A reader of the CPU seconds (user + system) of process ``pid`` and its children (the
        router's --workers processes); taskset execs the router in place: same pid."""
        import psutil

        proc = psutil.Process(pid)

        def router_cpu() -> float:
            tot = 0.0
            for p in [proc] + proc.children(recursive=True):
                try:
                    tot += sum(p.cpu_times()[:2])
                except psutil.NoSuchProcess:
                    pass
            return tot
        return router_cpu

    def log_tail(self, log: str = "router.log", lines: int = 15) -> str:
        """The last ``lines`` lines of a router's log in the run directory."""
        with open(os.path.join(self.dir, log), errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def close(self) -> None:
        """Stop every process started (SIGTERM to its group, SIGKILL after 5 s); remove the
        segment and the run directory."""
        import shutil

        import dplb_shm

        for c in self.children:
            try:
                os.killpg(c.pid, 15)
            except ProcessLookupError:
                pass
        for c in self.children:
            try:
                c.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(c.pid, 9)
        self.seg.close()
        dplb_shm.unlink(self.shm, missing_ok=True)
        shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------------------------- one system


def single(a: argparse.Namespace, rig: Rig) -> int:
    """One system (DPLB's router, or ``--peer``'s): latency, closed loop, SSE relay. Returns the
    exit status."""
    port, router_pid = rig.launch(a.peer, "router.log")
    routed = connector(port)
    router_cpu = rig.cpu_of(router_pid)
    hop = a.peer + " router" if a.peer else "router" if not a.through_agent else "router (agent attached)"
    print(f"system={a.peer + '/' + a.peer_policy if a.peer else 'dplb'}  worker on {'TCP' if rig.tcp else 'a Unix socket'}  "
          f"policy={a.policy}  router pinned to CPU {a.pin if a.pin >= 0 else 'none'}"
          + (f"  router processes={a.workers}" if a.workers else ""))
    reqs = long_prompt_requests(a.prompt_bytes) if a.prompt_bytes else None
    one = reqs[0] if reqs else None
    if reqs:
        closed_loop(port, 2, 3.0, reqs)   # the shared documents seen once (the prefix index warm)
    if not a.skip_latency:
        _latency(a, rig.direct, routed, one, hop)
    with Profiler(router_pid, a.profile):
        c0 = router_cpu()
        t0 = time.perf_counter()
        n = closed_loop(port, a.conns, a.seconds, reqs, a.rate)
        wall = time.perf_counter() - t0
        cpu = router_cpu() - c0
    print(f"closed loop, {a.conns} connections, {a.seconds:.0f} s: {n / wall:,.0f} req/s measured; "
          f"router CPU {cpu * 1e6 / max(n, 1):.0f} µs/request → {n / max(cpu, 1e-9):,.0f} req/s per router core")
    if NON_200:
        print(f"  INVALID: {len(NON_200)} answers were not 200 ({dict(Counter(NON_200))}); slot 0: "
              f"{rig.seg.read_slot(0).state.name}; router's view: "
              f"{urllib.request.urlopen(f'http://127.0.0.1:{port}/dplb/status', timeout=5).read()[:600]!r}; "
              "router log tail:")
        print(rig.log_tail())
    if a.streams > 0:
        _sse(a, rig, port, router_cpu, router_pid)
    return 0


def _latency(a: argparse.Namespace, direct: Callable[[], socket.socket], routed: Callable[[], socket.socket],
             one: bytes | None, hop: str) -> None:
    """The sequential latency phase: ``a.rounds`` rounds of direct then routed requests; prints p50/p99."""
    sequential(direct, 500, one)
    sequential(routed, 500, one)   # warm-up: pools, caches, JIT-free but allocator warm
    dl: list[float] = []
    rl: list[float] = []
    for _ in range(a.rounds):
        dl += sequential(direct, a.requests // a.rounds, one)
        rl += sequential(routed, a.requests // a.rounds, one)
    print(f"{len(dl)} sequential requests per path")
    print(f"direct to {'engine' if a.through_agent else 'worker'} : p50 {pct(dl, 50):.3f} ms   "
          f"p99 {pct(dl, 99):.3f} ms")
    print(f"through {hop:14s}: p50 {pct(rl, 50):.3f} ms   p99 {pct(rl, 99):.3f} ms")
    print(f"added by {hop:13s}: p50 {pct(rl, 50) - pct(dl, 50):.3f} ms   p99 {pct(rl, 99) - pct(dl, 99):.3f} ms")


def _sse(a: argparse.Namespace, rig: Rig, port: int, router_cpu: Callable[[], float], router_pid: int) -> None:
    """The SSE relay phase: ``a.streams`` concurrent streams for ``a.seconds``; prints events per
    router core-second, client reads per event and the inter-token latency the client saw."""
    prof = None
    if a.profile:
        root_, ext = os.path.splitext(a.profile)
        prof = root_ + ".sse" + ext
    import psutil

    proc = psutil.Process(router_pid)
    with Profiler(router_pid, prof):
        t_0, x_0 = proc.cpu_times(), proc.num_ctx_switches()
        c0 = router_cpu()
        t0 = time.perf_counter()
        gaps: list[float] = []
        ev, reads = stream_loop(port, a.streams, a.seconds, gaps)
        wall = time.perf_counter() - t0
        cpu = router_cpu() - c0
        t_1, x_1 = proc.cpu_times(), proc.num_ctx_switches()
    print(f"  router process: user {(t_1.user - t_0.user) * 1e6 / max(ev, 1):.1f} µs, system "
          f"{(t_1.system - t_0.system) * 1e6 / max(ev, 1):.1f} µs per event; context switches per event: "
          f"voluntary {(x_1.voluntary - x_0.voluntary) / max(ev, 1):.2f}, involuntary "
          f"{(x_1.involuntary - x_0.involuntary) / max(ev, 1):.2f}")
    print(f"SSE relay, {a.streams} streams, one event per {a.chunk_interval_ms:g} ms ({a.burst} per engine write): "
          f"{ev / wall:,.0f} "
          f"events/s measured; router CPU {cpu:.2f} s → {ev / max(cpu, 1e-9):,.0f} SSE chunks relayed "
          f"per router core per second; {reads / max(ev, 1):.2f} client reads per event")
    if gaps:
        held = sum(1 for g in gaps if g == 0.0) / len(gaps)
        print(f"  inter-token latency at the client (the engine sends one event per {a.chunk_interval_ms:g} "
              f"ms): p50 {pct(gaps, 50) * 1e3:.2f} ms, p90 {pct(gaps, 90) * 1e3:.2f} ms, p99 "
              f"{pct(gaps, 99) * 1e3:.2f} ms; {held:.0%} of events arrived in the same read as the one "
              "before")
    if STREAM_ERRORS:
        print(f"  {len(STREAM_ERRORS)} stream(s) failed; first: {STREAM_ERRORS[0][:300]}")
        print("  router log tail:\n" + rig.log_tail())


# ------------------------------------------------------------------------------------- versus


def versus(a: argparse.Namespace, rig: Rig) -> int:
    """``--versus``: DPLB's router and each of ``a.versus`` (peers, or ``baseline``: DPLB from
    ``--baseline-dir``) side by side, measured in alternating blocks and rounds (module
    docstring; the order rotates from one block or round to the next). Prints the figures;
    returns the exit status (1 when an answer was not 200: the figures are invalid)."""
    systems = [("dplb", *rig.launch(None, "router.log"))]
    systems += [(v, *rig.launch(v, f"{v}.log")) for v in a.versus]
    others = [name for name, _, _ in systems[1:]]
    print(f"dplb versus {', '.join(others)} (peer policy {a.peer_policy}, dplb policy {a.policy}): all pinned to CPU "
          f"{a.pin if a.pin >= 0 else 'none'}, worker on TCP; {a.blocks} blocks of {a.block_requests} sequential "
          "requests per path")
    reqs = long_prompt_requests(a.prompt_bytes) if a.prompt_bytes else None
    one = reqs[0] if reqs else None
    warm = 500 if not reqs else 50
    failed: dict[str, list[int]] = {name: [] for name, _, _ in systems}
    for name, port, _ in systems:
        if reqs:
            before = len(NON_200)
            closed_loop(port, 2, 3.0, reqs)   # the shared documents seen once (the prefix index warm)
            failed[name] += NON_200[before:]
        sequential(connector(port), warm, one)   # warm-up
    sequential(rig.direct, warm, one)
    _versus_blocks(a, rig, systems, others, one)
    _versus_rounds(a, systems, others, reqs, failed)
    if a.streams > 0:
        _versus_sse(a, systems, others)
    if NON_200 or STREAM_ERRORS:
        print(f"  INVALID: {len(NON_200)} answers were not 200, {len(STREAM_ERRORS)} streams failed: "
              + ", ".join(f"{k} {dict(Counter(v))}" for k, v in failed.items() if v)
              + (f"; first stream error: {STREAM_ERRORS[0][:300]}" if STREAM_ERRORS else ""))
        return 1
    return 0


def _order(systems: list[tuple[str, int, int]], k: int) -> list[tuple[str, int, int]]:
    """The systems rotated by ``k`` (block or round ``k``'s order)."""
    r = k % len(systems)
    return systems[r:] + systems[:r]


def _versus_blocks(a: argparse.Namespace, rig: Rig, systems: list[tuple[str, int, int]], others: list[str],
                   one: bytes | None) -> None:
    """The added p50 of each system per block (routed p50 minus the block's direct p50); prints
    the medians and DPLB minus each other system per block."""
    added: dict[str, list[float]] = {name: [] for name, _, _ in systems}
    for b in range(a.blocks):
        d_p50 = pct(sequential(rig.direct, a.block_requests, one), 50)
        for name, port, _ in _order(systems, b):
            added[name].append(pct(sequential(connector(port), a.block_requests, one), 50) - d_p50)
    if a.blocks:
        for name, xs in added.items():
            print(f"added p50, {name:8s}: {1000 * statistics.median(xs):.0f} µs median of blocks "
                  f"[{1000 * min(xs):.0f}–{1000 * max(xs):.0f}]")
        for other in others:
            diff = [x - y for x, y in zip(added["dplb"], added[other], strict=True)]
            print(f"dplb minus {other}, per block: median {1000 * statistics.median(diff):+.0f} µs; dplb at or "
                  f"below in {sum(x <= 0 for x in diff)} of {len(diff)} blocks")


def _versus_sse(a: argparse.Namespace, systems: list[tuple[str, int, int]], others: list[str]) -> None:
    """The SSE relay of each system over ``a.rounds`` rounds of ``a.streams`` concurrent streams
    for ``a.seconds`` (order rotating): router CPU per event and the inter-token gaps the client
    saw (p50/p99 of the round's gaps, :func:`bench.rawclient.stream_loop`); prints the medians
    over the rounds and DPLB's ratios to each other system."""
    cpu: dict[str, list[float]] = {name: [] for name, _, _ in systems}
    p50: dict[str, list[float]] = {name: [] for name, _, _ in systems}
    p99: dict[str, list[float]] = {name: [] for name, _, _ in systems}
    rpe: dict[str, list[float]] = {name: [] for name, _, _ in systems}
    for r in range(a.rounds):
        for name, port, pid in _order(systems, r):
            measure = Rig.cpu_of(pid)
            gaps: list[float] = []
            c0 = measure()
            ev, reads = stream_loop(port, a.streams, a.seconds, gaps)
            cpu[name].append((measure() - c0) * 1e6 / max(ev, 1))
            rpe[name].append(reads / max(ev, 1))
            p50[name].append(pct(gaps, 50) * 1e3 if gaps else float("nan"))
            p99[name].append(pct(gaps, 99) * 1e3 if gaps else float("nan"))
    if not a.rounds:
        return
    for name, xs in cpu.items():
        print(f"SSE relay, {name:8s}: router CPU {statistics.median(xs):.1f} µs per event median of "
              f"{a.rounds} rounds [{min(xs):.1f}–{max(xs):.1f}]; inter-token gap p50 "
              f"{statistics.median(p50[name]):.2f} ms, p99 {statistics.median(p99[name]):.2f} ms "
              f"[{min(p99[name]):.2f}–{max(p99[name]):.2f}]; {statistics.median(rpe[name]):.2f} client reads per "
              f"event ({a.streams} streams, one event per {a.chunk_interval_ms:g} ms, {a.burst} per engine write, "
              f"{a.seconds:g} s each)")
    for other in others:
        ratios = [x / y for x, y in zip(cpu["dplb"], cpu[other], strict=True)]
        gap99 = [x / y for x, y in zip(p99["dplb"], p99[other], strict=True)]
        print(f"SSE dplb / {other}: CPU per event {statistics.median(cpu['dplb']) / statistics.median(cpu[other]):.2f}× "
              f"(per round [{min(ratios):.2f}–{max(ratios):.2f}]); inter-token gap p99 "
              f"{statistics.median(p99['dplb']) / statistics.median(p99[other]):.2f}× "
              f"(per round [{min(gap99):.2f}–{max(gap99):.2f}])")


def _versus_rounds(a: argparse.Namespace, systems: list[tuple[str, int, int]], others: list[str],
                   reqs: list[bytes] | None, failed: dict[str, list[int]]) -> None:
    """The router CPU per request of each system over ``a.rounds`` closed loops (answers other
    than 200 into ``failed``); prints the medians and DPLB's ratio to each other system."""
    cpu: dict[str, list[float]] = {name: [] for name, _, _ in systems}
    for r in range(a.rounds):
        for name, port, pid in _order(systems, r):
            measure = Rig.cpu_of(pid)
            c0 = measure()
            before = len(NON_200)
            n = closed_loop(port, a.conns, a.seconds, reqs, a.rate)
            cpu[name].append((measure() - c0) * 1e6 / max(n, 1))
            failed[name] += NON_200[before:]
    if a.rounds:
        what = f"{a.prompt_bytes / 1000:g} KB prompts" if reqs else "tiny chat"
        pace = f"paced at {a.rate:g}/s" if a.rate > 0 else "closed loops"
        for name, xs in cpu.items():
            print(f"router CPU per request ({what}), {name:8s}: {statistics.median(xs):.0f} µs median of {len(xs)} "
                  f"rounds [{min(xs):.0f}–{max(xs):.0f}] ({a.conns} connections, {pace}, {a.seconds:g} s each)")
        for other in others:
            ratios = [x / y for x, y in zip(cpu["dplb"], cpu[other], strict=True)]
            print(f"dplb / {other}: {statistics.median(cpu['dplb']) / statistics.median(cpu[other]):.2f}× "
                  f"(per round [{min(ratios):.2f}–{max(ratios):.2f}])")


# ---------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    """Run the measurement and print the figures (see module docstring); returns the exit status."""
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.serve_worker:
        shm_, sock_, ch, iv = a.serve_worker
        serve_worker(shm_, sock_, int(ch), float(iv), a.serve_burst)
        return 0
    if a.versus and (a.peer or a.workers or a.through_agent):
        ap.error("--versus runs DPLB's router beside the peer: not with --peer, --workers or --through-agent")
    rig = make_events_rig(a, Rig) if a.kv_events else Rig(a)
    try:
        rig.start_worker()
        return versus(a, rig) if a.versus else single(a, rig)
    finally:
        rig.close()


if __name__ == "__main__":
    sys.exit(main())
