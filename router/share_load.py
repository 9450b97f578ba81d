"""The load half of :mod:`router.share`, without Redis: the four router-line counters a replica
shares per engine, their encoding, and :class:`LoadShare` (what this replica's own counters are and
how the other replicas' are added to its router lines)."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dplb_shm import Segment

#: the router-line counters shared (``Segment.router_line`` keys), in the order they are encoded
FIELDS = ("router_inflight", "prefill_tokens", "decode_reqs", "decode_ctx_tokens")
Counts = tuple[int, int, int, int]
ZERO: Counts = (0, 0, 0, 0)


def encode_counts(c: Counts) -> str:
    """The four counters as a hash value: ``"inflight prefill decode_reqs decode_ctx"``."""
    return " ".join(str(v) for v in c)


def decode_counts(v: bytes | str) -> Counts:
    """The inverse of :func:`encode_counts`; a malformed value, or one with a negative count (no
    replica writes one: its counts are its own in-flight requests and tokens), reads as zeros."""
    try:
        parts = [int(x) for x in (v.decode() if isinstance(v, bytes) else v).split()]
    except ValueError:
        return ZERO
    if len(parts) != 4 or min(parts) < 0:
        return ZERO
    return parts[0], parts[1], parts[2], parts[3]


class LoadShare:
    """The load half of :class:`Share`, without Redis: what this replica's own counters are and how
    the others' are added to its router lines.

    ``seg``: the replica's segment (``router_line``, ``router_inflight_add``, ``prefill_add``,
    ``decode_add``); ``engines``: a callable answering ``{engine address: slot}`` now. The others'
    counters added so far are kept per address (:attr:`got`, with the slot they went to), so
    :meth:`own` is the line minus them, and :meth:`apply` moves only the difference. Single
    threaded (the picker's event loop, as the request accounting)."""

    def __init__(self, seg: Segment, engines: Callable[[], dict[str, int]]) -> None:
        self.seg = seg
        self.engines = engines
        #: per engine address: (slot, the other replicas' counters added to that slot's line)
        self.got: dict[str, tuple[int, Counts]] = {}

    def own(self) -> dict[str, Counts]:
        """This replica's own counters per engine address (never below zero), zeros left out."""
        out: dict[str, Counts] = {}
        for addr, slot in self.engines().items():
            line = self.seg.router_line(slot)
            g = self.got.get(addr)
            add = g[1] if g is not None and g[0] == slot else ZERO
            c: Counts = (max(0, int(line["router_inflight"]) - add[0]), max(0, int(line["prefill_tokens"]) - add[1]),
                         max(0, int(line["decode_reqs"]) - add[2]), max(0, int(line["decode_ctx_tokens"]) - add[3]))
            if any(c):
                out[addr] = c
        return out

    def apply(self, others: dict[str, Counts]) -> None:
        """Make the router lines hold the other replicas' counters ``others`` (per engine address,
        summed over replicas; an address missing: zeros) on top of this replica's own."""
        engines = self.engines()
        for addr in [a for a, (slot, _) in self.got.items() if engines.get(a) != slot]:
            slot, add = self.got.pop(addr)   # the engine left, or moved to another slot: take it back
            self._add(slot, tuple(-v for v in add))   # type: ignore[arg-type]
        for addr, slot in engines.items():
            want = others.get(addr, ZERO)
            have = self.got.get(addr, (slot, ZERO))[1]
            if want != have:
                self._add(slot, (want[0] - have[0], want[1] - have[1], want[2] - have[2], want[3] - have[3]))
                if any(want):
                    self.got[addr] = (slot, want)
                else:
                    self.got.pop(addr, None)

    def clear(self) -> None:
        """Take every other replica's counters back (this replica's own view only)."""
        for slot, add in self.got.values():
            self._add(slot, (-add[0], -add[1], -add[2], -add[3]))
        self.got.clear()

    def _add(self, slot: int, d: Counts) -> None:
        seg = self.seg
        if d[0] and seg.router_inflight_add(slot, d[0]) < 0:   # never below zero (a line reset meanwhile)
            seg.router_inflight_add(slot, -seg.router_inflight_get(slot))
        if d[1] and seg.prefill_add(slot, d[1]) < 0:
            seg.prefill_add(slot, -int(seg.router_line(slot)["prefill_tokens"]))
        if d[2] or d[3]:
            reqs, ctx = seg.decode_add(slot, d[2], d[3])
            if reqs < 0 or ctx < 0:
                seg.decode_add(slot, -min(0, reqs), -min(0, ctx))


__all__ = ["FIELDS", "ZERO", "Counts", "LoadShare", "decode_counts", "encode_counts"]
