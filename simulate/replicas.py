"""Router replicas in the simulator (``dplb-simulate --replicas R``): R routers, each as on its own node,
behind a front that spreads requests over them, the engines shared.

Each :class:`Replica` has what a router or picker replica on another node has to itself:

* its own segment (a private one: the router lines hold *its* in-flight requests, outstanding
  prefill tokens, decoding requests and learned prefill rates only);
* its own policy state (prefix index, round-robin cursor, random stream) and registry;
* its own scraper per engine (an :class:`~worker_agent.agent.Agent` writing into its segment, as
  the picker's scraper, ``epp/discovery.py``, or the node's agent would): at each state interval
  it publishes the engine's true running / waiting / KV usage together with *this replica's*
  in-flight count of the same instant, so the kernel's ``X_i`` (requests in the engine that no
  router here dispatched, csrc/dplb_kernel.h) holds the other replicas' requests as of that
  scrape. What the other replicas dispatched since is what this replica cannot see.

The front (:class:`RoundRobinFront`) spreads requests round robin over the replicas, as Envoy's or
a Kubernetes Service's default load balancing does. Replica 0 is the simulator's usual router:
with R = 1 the run is the one-router run, event for event.

The accounting error (:class:`AccountingError`) compares, at every load sample, each replica's
view of each engine's in-flight requests (its router line) and outstanding prefill tokens with the
truth (the sum over all replicas, which is what every replica would see if they shared one segment).

Shared load (:class:`SharedLoad`, ``--share-load-ms D``): each replica publishes the changes of its
own router lines (in-flight requests, outstanding prefill work, decoding requests and their
context: what :class:`router.accounting.RequestAccount` moves at dispatch, first token and end) to
a store every replica reads, as ``HINCRBY`` on per-replica Redis hashes with a TTL (or a NATS
subject) would; each other replica adds them to its own router lines ``D`` ms later. A replica's
router line then holds every replica's work on the engine as of ``D`` ms ago, as one segment on one
node holds every router process's, and its scraper's ``inflight`` (and so the outside requests
``X_i``) counts them too.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from dplb_shm import Segment
from router.kv_events import BlockSet, PendingBlocks
from router.policies.base import Policy
from router.scheduling import Scheduler
from router.workers import Registry
from sim_engine.kv_cache import KVCacheManager
from simulate.settings import Figures, SimSettings
from simulate.virtual import OracleIndex, SimWorker, start_agent


class Replica:
    """One router replica: ``seg`` (its segment), ``policy``, ``registry``, ``scheduler`` and, with
    ``oracle_prefix`` or ``events_prefix``, ``oracle`` (its policy's index answering with the truth)."""

    __slots__ = ("oracle", "policy", "r", "registry", "scheduler", "seg")

    def __init__(self, r: int, seg: Segment, policy: Policy, registry: Registry, scheduler: Scheduler,
                 oracle: OracleIndex | None) -> None:
        self.r = r
        self.seg = seg
        self.policy = policy
        self.registry = registry
        self.scheduler = scheduler
        self.oracle = oracle


def add_scrapers(engines: Sequence[SimWorker], segs: Sequence[Segment], s: SimSettings, now_ns: int) -> None:
    """For each segment of ``segs`` (replicas 1, 2, ...), one agent per engine writing its slot
    there: each replica's own scraper of the shared engines."""
    for seg in segs:
        for e in engines:
            agent = start_agent(seg, e.k, s.engines[e.k], s, now_ns)
            e.agents.append(agent)
            e.writers.append(agent.writer)


def apply_kv_events(kv: KVCacheManager, blocks: BlockSet) -> None:
    """Move the engine's KV-cache events since the last call (:attr:`KVCacheManager.events`) into
    ``blocks``, in order (what a replica's subscriber does with the published batch; the hashes
    are the engine's own, so the simulator matches requests with the engine's hashes)."""
    raw = kv.events
    if not raw:
        return
    kv.events = []
    for ev in raw:
        kind = ev[0]
        if kind == "stored" and len(ev) == 4:
            blocks.store((ev[1],), ev[2])
        elif kind == "removed" and len(ev) == 2:
            blocks.remove((ev[1],))
        else:
            blocks.clear()


def keep_pending(replicas: Sequence[Replica], block_sets: Sequence[BlockSet], ttl_s: float,
                 share: SharedLoad | None) -> None:
    """Give each replica's events index its placements not yet stored, per engine
    (:class:`router.kv_events.PendingBlocks`, dropped when the engine's events store them: each is
    a watcher of the engine's block set): its own, and with ``share`` the other replicas' too
    (:meth:`SharedLoad.place`, as a store would carry them beside the load)."""
    for rp in replicas:
        if rp.oracle is None:
            continue
        rp.oracle.pending = [PendingBlocks(ttl_s) for _ in block_sets]
        for bs, p in zip(block_sets, rp.oracle.pending):
            bs.watchers.append(p)

    def place_into(r: int, slot: int, keys: list[int], now: float) -> None:
        oracle = replicas[r].oracle
        if oracle is not None and oracle.pending:
            oracle.pending[slot].place(keys, now)

    if share is not None:
        share.place_into = place_into


class RoundRobinFront:
    """Spreads requests over ``n`` replicas in turn (Envoy's and a Kubernetes Service's default)."""

    __slots__ = ("n", "next")

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"replicas must be >= 1 (got {n})")
        self.n = n
        self.next = 0

    def pick(self) -> int:
        """The replica that takes the next request."""
        r = self.next
        self.next = (r + 1) % self.n
        return r


class AccountingError:
    """How far each replica's view of each engine's load is from the truth, over the run's load samples.

    A replica's view of engine ``k``'s requests (what the ``dplb`` kernel counts, csrc/dplb_kernel.h):
    its own live in-flight count (its router line) plus ``X_k``, the requests in the engine that
    it did not dispatch, as of its scraper's last publication (``running + waiting − inflight`` of
    that scrape). The truth: the requests in the engine now (running + waiting; the simulator
    hands a request to its engine at dispatch). With one replica the two agree; with several, a
    replica misses what the others dispatched (or finished) since its last scrape.

    :meth:`result`: ``Σ |view − truth| / Σ truth`` over samples, engines and replicas (None when
    the engines were always idle)."""

    def __init__(self) -> None:
        self.err = 0.0
        self.total = 0.0
        self.samples = 0

    def sample(self, segs: Sequence[Segment], truth: Sequence[int]) -> None:
        """Read every replica's slots once; ``truth[k]``: engine ``k``'s running + waiting now."""
        self.samples += 1
        for seg in segs:
            for s in seg.snapshot():
                k = s.worker_id
                if k >= len(truth):
                    continue
                outside = max(0, s.num_running + s.num_waiting - s.inflight)
                view = max(0, s.router_inflight) + outside
                self.err += abs(view - truth[k])
                self.total += truth[k]

    def result(self) -> Figures:
        """``{"inflight": e, "samples": n}`` (see the class docstring)."""
        return {"inflight": round(self.err / self.total, 4) if self.total > 0 else None, "samples": self.samples}


#: the router-line counters a replica shares (``Segment.router_line`` keys), in delta order
SHARED_FIELDS = ("router_inflight", "prefill_tokens", "decode_reqs", "decode_ctx_tokens")

Delta = tuple[int, int, int, int]


class SharedLoad:
    """The replicas' router lines shared through a store with a publication delay (the module
    docstring). ``segs``: every replica's segment (replica order); ``slots``: the engines' slots;
    ``delay_ms``: from a replica's change to the other replicas' view of it, ms (>= 0; raises
    ValueError below).

    :meth:`publish` (after every event that may move a lease) queues each replica's changes since
    its last publication, due ``delay_ms`` later; :meth:`deliver` (the SHARE event) applies those
    due by then to the other replicas' lines (``router_inflight_add``, ``prefill_add``,
    ``decode_add``). Deliveries keep publication order (one delay for all). ``published``: changes
    queued; ``delivered``: changes applied (per receiving replica)."""

    def __init__(self, segs: Sequence[Segment], slots: int, delay_ms: float) -> None:
        if delay_ms < 0:
            raise ValueError(f"share delay must be >= 0 ms (got {delay_ms})")
        self.segs = list(segs)
        self.slots = slots
        self.delay_s = delay_ms / 1000.0
        n = len(self.segs)
        zero: Delta = (0, 0, 0, 0)
        #: per replica and slot: its own counters as last published / the others' applied to it
        self.sent: list[list[Delta]] = [[zero] * slots for _ in range(n)]
        self.got: list[list[Delta]] = [[zero] * slots for _ in range(n)]
        self.queue: deque[tuple[float, int, int, Delta]] = deque()
        self.pending = False   # a SHARE event is scheduled
        #: placements not yet stored (:func:`keep_pending`), shared the same way: (due, source,
        #: slot, block keys), delivered through ``place_into(replica, slot, keys, now)``
        self.placed: deque[tuple[float, int, int, list[int]]] = deque()
        self.place_into: Callable[[int, int, list[int], float], None] | None = None
        self.published = 0
        self.delivered = 0

    def _own(self, r: int, k: int) -> Delta:
        line = self.segs[r].router_line(k)
        g = self.got[r][k]
        return (int(line["router_inflight"]) - g[0], int(line["prefill_tokens"]) - g[1],
                int(line["decode_reqs"]) - g[2], int(line["decode_ctx_tokens"]) - g[3])

    def publish(self, now: float) -> float | None:
        """Queue every replica's own changes since its last publication, due at ``now`` + the delay.
        Returns when a SHARE event must run (None: one is scheduled already, or nothing is queued)."""
        due = now + self.delay_s
        for r in range(len(self.segs)):
            sent = self.sent[r]
            for k in range(self.slots):
                own = self._own(r, k)
                old = sent[k]
                if own != old:
                    sent[k] = own
                    self.queue.append((due, r, k, (own[0] - old[0], own[1] - old[1], own[2] - old[2],
                                                   own[3] - old[3])))
                    self.published += 1
        if self.pending:
            return None
        due_at = self.next_due()
        self.pending = due_at is not None
        return due_at

    def place(self, now: float, src: int, slot: int, keys: list[int]) -> None:
        """Replica ``src`` placed a prompt of block ``keys`` on ``slot``: the others see it as a
        pending placement ``delay_ms`` later (nothing without ``place_into``)."""
        if self.place_into is not None:
            self.placed.append((now + self.delay_s, src, slot, keys))
            self.published += 1

    def next_due(self) -> float | None:
        """When the oldest queued change or placement is due (None: nothing queued)."""
        heads = [q[0][0] for q in (self.queue, self.placed) if q]
        return min(heads) if heads else None

    def deliver(self, now: float, k: int = -1) -> None:
        """Apply the changes due by ``now`` to every replica but their source (``k``: unused, the
        simulation's event signature)."""
        self.pending = False
        placed, place_into = self.placed, self.place_into
        while placed and placed[0][0] <= now and place_into is not None:
            due, src, slot, keys = placed.popleft()
            for r in range(len(self.segs)):
                if r != src:
                    place_into(r, slot, keys, due)
        q = self.queue
        while q and q[0][0] <= now:
            _, src, slot, d = q.popleft()
            for r, seg in enumerate(self.segs):
                if r == src:
                    continue
                if d[0]:
                    seg.router_inflight_add(slot, d[0])
                if d[1]:
                    seg.prefill_add(slot, d[1])
                if d[2] or d[3]:
                    seg.decode_add(slot, d[2], d[3])
                g = self.got[r][slot]
                self.got[r][slot] = (g[0] + d[0], g[1] + d[1], g[2] + d[2], g[3] + d[3])
                self.delivered += 1
