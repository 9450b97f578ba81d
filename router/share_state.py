"""A :class:`router.share.Share` wired into a router's state: the policy's prefix index sends its
placements (:class:`SharedIndex`), the request accounting pushes each change of a router line
(:class:`Notifying`), the other replicas' placements enter the index (and, with the engines'
KV-cache events, their pending placements). :class:`StateShare` is the wiring; the router names
its engines by the registry's workers (:class:`StateShare` itself), the picker by its scraped endpoints
(:class:`epp.share.PickerShare`). Settings: the config file's ``share`` section
(:class:`router.config.ShareSection`)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from router.share import Share

if TYPE_CHECKING:
    from dplb_shm import Segment
    from router.config import ShareSection
    from router.events_index import EventsFeed
    from router.ledger import AccountedSegment
    from router.policies.prefix_index import PrefixIndex
    from router.state import RouterState

_T = TypeVar("_T")
_P = ParamSpec("_P")


class SharedIndex:
    """A policy's prefix index whose insertions are also sent to the other replicas
    (:meth:`Share.place`): ``inner`` is the index it stands in front of (the policy's own, or the
    :class:`router.events_index.EventsIndex` over it), ``addr_of`` the engine address of a slot (None: not
    shared). With the engines' events (``feed``), the prompt's token block keys that the events
    index places as pending go with it (:attr:`router.events_index.EventsFeed.on_place`). Everything else
    is the inner index's."""

    def __init__(self, inner: PrefixIndex, share: Share, addr_of: Callable[[int], str | None],
                 feed: EventsFeed | None = None) -> None:
        self.inner = inner
        self.share = share
        self.addr_of = addr_of
        self._keys: Sequence[int] = ()
        self._last: tuple[str, str | None, Sequence[int]] = ("", None, ())   # the last text hashed
        if feed is not None:
            feed.on_place = self._placed

    def _placed(self, slot: int, keys: Sequence[int]) -> None:
        self._keys = keys

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def chunk_chars(self) -> int:
        """The inner index's."""
        return int(self.inner.chunk_chars)

    def hashes(self, text: str, model: str | None = None) -> Sequence[int]:
        """The inner index's hashes of ``text``; the same string asked again (the share's
        :meth:`StateShare.wants_lookup`, then the policy) is hashed once."""
        last = self._last
        if text is last[0] and model == last[1]:
            return last[2]
        h = self.inner.hashes(text, model)
        self._last = (text, model, h)
        return h

    def match(self, hashes: Sequence[int]) -> dict[int, int]:
        """The inner index's match."""
        return dict(self.inner.match(hashes))

    def insert(self, hashes: Sequence[int], worker_id: int) -> None:
        """Into the inner index, then queued for the other replicas with the engine's address."""
        self._keys = ()
        self.inner.insert(hashes, worker_id)
        addr = self.addr_of(worker_id)
        if addr is not None:
            self.share.place(addr, hashes, self._keys)

    def size(self, worker_id: int) -> int:
        """The inner index's size for ``worker_id``."""
        return int(self.inner.size(worker_id))

    def remove_worker(self, worker_id: int) -> None:
        """Forget ``worker_id`` in the inner index."""
        self.inner.remove_worker(worker_id)


class Notifying:
    """The request accounting's view of the segment (``inner``: the segment or the router's
    :class:`router.ledger.AccountedSegment`) that also pokes ``share`` (:meth:`Share.poke`) on each
    change of a router line, so the change is pushed to the other replicas at once. Only the
    methods a :class:`router.accounting.RequestAccount` calls are offered."""

    __slots__ = ("decode_add", "dispatched_add", "latency_observe", "outcome_add", "prefill_add", "prefill_rate_observe",
                 "router_inflight_add", "router_line", "share")

    def __init__(self, inner: Segment | AccountedSegment, share: Share) -> None:
        self.share = share
        self.dispatched_add = inner.dispatched_add
        self.latency_observe = inner.latency_observe
        self.outcome_add = inner.outcome_add
        self.prefill_rate_observe = inner.prefill_rate_observe
        self.router_line = inner.router_line
        self.router_inflight_add = self._poking(inner.router_inflight_add)
        self.prefill_add = self._poking(inner.prefill_add)
        self.decode_add = self._poking(inner.decode_add)

    def _poking(self, f: Callable[_P, _T]) -> Callable[_P, _T]:
        poke = self.share.poke

        def add(*a: _P.args, **k: _P.kwargs) -> _T:
            r = f(*a, **k)
            poke()
            return r
        return add


class StateShare:
    """A :class:`Share` wired into a :class:`router.state.RouterState` (``state``; started before
    :meth:`start`): the engines are :meth:`engines` (engine address → slot in the state's
    segment); the policy's prefix index is wrapped in a :class:`SharedIndex`; the scheduler's
    request accounting in a :class:`Notifying`; the other replicas' placements enter the policy's
    own index under the engine's local slot and, with the engines' events (``events``), the events
    index's pending placements (aged by their time in the stream). ``settings``: the ``share``
    section (``url`` set). The metrics ``<metric>_errors_total`` (failed Redis round trips) and
    ``<metric>_replicas`` (the other replicas seen) go on the state's registry."""

    metric = "dplb_share"
    what = "router"

    def __init__(self, state: RouterState, settings: ShareSection, events: EventsFeed | None = None) -> None:
        assert settings.url, "share.url is not set"
        self.state = state
        self.settings = settings
        self.events = events
        self.share: Share | None = None

    def engines(self) -> dict[str, int]:
        """``{engine address: slot}`` of the registry's workers (the router's)."""
        return {h.endpoint: wid for wid, h in self.state.registry.handles.items()}

    def addr_of(self, slot: int) -> str | None:
        """The engine address of ``slot`` (None: none)."""
        for addr, s in self.engines().items():
            if s == slot:
                return addr
        return None

    def caught_up(self) -> bool:
        """True once the share caught up (or fell back: Redis unreachable at the start)."""
        return self.share is not None and self.share.caught_up()

    def wants_lookup(self, text: str, model: str | None) -> bool:
        """Should a request with prompt ``text`` for ``model`` wait for :meth:`Share.sync` before it
        is priced? True when other replicas share with this one (Redis up, lookups on) and this
        replica's prefix index holds less than half of the prompt's leading chunks on any engine:
        a prefix miss, where another replica may have placed the prompt's head a moment ago and its
        push is still on the way (a back-to-back client: the next turn of a session, the next
        question on a document). Costs the hashing of the prompt, which the policy reuses."""
        share = self.share
        index = getattr(self.state.policy, "index", None)
        if (share is None or not text or not isinstance(index, SharedIndex) or share.lookup_s <= 0 or not share.up
                or not share.others):
            return False
        hashes = index.hashes(text, model)
        if not hashes:
            return False
        return 2 * max(index.match(hashes).values(), default=0) < len(hashes)

    async def start(self) -> None:
        """Build the share over the state's segment, wrap the policy's index and the accounting,
        catch up, run."""
        from prometheus_client import Counter, Gauge

        st, s = self.state, self.settings
        assert st.seg is not None and s.url
        inner = getattr(st.policy, "index", None)
        share = self.share = Share(s.url, st.seg, self.engines, self._on_place if inner is not None else None,
                                   prefix=s.prefix, interval_s=s.interval_ms / 1000.0, ttl_s=s.ttl_s,
                                   push_gap_s=s.push_gap_ms / 1000.0, lookup_s=s.lookup_ms / 1000.0,
                                   max_stream_bytes=int(s.max_stream_mb * (1 << 20)))
        if inner is not None:
            st.policy.index = SharedIndex(inner, share, self.addr_of, self.events)   # type: ignore[attr-defined]
        st.scheduler.accounts = Notifying(st.scheduler.accounts, share)   # type: ignore[assignment]
        reg = st.metrics.registry
        errors = Counter(f"{self.metric}_errors", f"Failed round trips to the shared store (Redis) of the {self.what} "
                         "replicas; while it fails this replica routes on its own view", registry=reg)
        share.on_error = errors.inc
        Gauge(f"{self.metric}_replicas", f"Other {self.what} replicas whose load this replica adds (Redis)",
              registry=reg).set_function(lambda: len(share.others))
        await share.start()

    def _on_place(self, addr: str, hashes: list[int], keys: list[int], age_s: float) -> None:
        slot = self.engines().get(addr)
        index = getattr(self.state.policy, "index", None)
        if slot is None or index is None:
            return
        base = index.inner if isinstance(index, SharedIndex) else index
        from router.events_index import EventsIndex

        if isinstance(base, EventsIndex):
            base = base.inner
        if hashes:
            base.insert(hashes, slot)
        events = self.events
        if events is not None and keys and age_s < float("inf"):
            events.place(slot, keys, events.clock() - age_s)

    async def close(self) -> None:
        """Close the share (idempotent)."""
        if self.share is not None:
            await self.share.close()


__all__ = ["Notifying", "SharedIndex", "StateShare"]
