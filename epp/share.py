"""Picker replicas on different nodes share their load and their placements through Redis
(``dplb-epp --share-url``, or the config file's ``share`` section): the picker's wiring of
:mod:`router.share` (the Redis part, which the router uses too) and :mod:`router.share_state`.
The engines are the picker's scraped endpoints, matched across replicas by their address as the
endpoints file or the pool names it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from router.share import LoadShare, Share, decode_counts, encode_counts
from router.share_state import SharedIndex, StateShare

if TYPE_CHECKING:
    from epp.discovery import ScrapeManager
    from router.config import ShareSection
    from router.events_index import EventsFeed
    from router.state import RouterState


class PickerLike(Protocol):
    """What :class:`PickerShare` reads of an :class:`epp.picker.Picker` (which holds it: no import
    back): its router state, its scrape of the endpoints and its KV-events feed."""

    state: RouterState
    scrape: ScrapeManager | None
    events: EventsFeed | None


class PickerShare(StateShare):
    """A :class:`router.share_state.StateShare` wired into a :class:`epp.picker.Picker` (started
    by :meth:`epp.picker.Picker.start` before its first readiness): the engines are the picker's
    scraped endpoints (address → its slot in the picker's private segment). ``settings``: the
    ``share`` section. Metrics: ``dplb_epp_share_errors_total``, ``dplb_epp_share_replicas``."""

    metric = "dplb_epp_share"
    what = "picker"

    def __init__(self, picker: PickerLike, settings: ShareSection) -> None:
        super().__init__(picker.state, settings)
        self.picker = picker

    def engines(self) -> dict[str, int]:
        """``{engine address: slot}`` of the picker's scraped endpoints that have a slot."""
        scrape = self.picker.scrape
        if scrape is None:
            return {}
        out = {}
        for addr in scrape.wanted:
            slot = scrape.slot_of(addr)
            if slot is not None:
                out[addr] = slot
        return out

    async def start(self) -> None:
        """Take the picker's events feed (set by then), then :meth:`StateShare.start`."""
        self.events = self.picker.events
        await super().start()


__all__ = ["LoadShare", "PickerLike", "PickerShare", "Share", "SharedIndex", "decode_counts", "encode_counts"]
