"""The engines' KV-cache events as the picker's prefix index (``dplb-epp --kv-events``), off the
request path: the picker's name for :mod:`router.events_index`, which the router uses too.

Every picker replica subscribes to every engine's KV-cache events, so each one knows which prompt
blocks each engine holds, whichever replica placed them: two pickers behind one Envoy then send a
session's turns to the engine that holds its history. The endpoints file names each engine's
publisher::

    - address: 10.0.0.5:8000
      kv_events: tcp://10.0.0.5:5557          # the engine's "endpoint"
      kv_events_replay: tcp://10.0.0.5:5558   # its "replay_endpoint" (catch-up and gaps)
"""
from __future__ import annotations

from router.events_index import (
    ROLES,
    EventsFeed,
    EventsIndex,
    Tokenize,
    WordTokenizer,
    install,
    wanted,
)

__all__ = ["ROLES", "EventsFeed", "EventsIndex", "Tokenize", "WordTokenizer", "install", "wanted"]
