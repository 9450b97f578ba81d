"""Repeated warnings, rate-limited with a count.

One WARNING per 5xx buried the state changes during a drain (every request answered 503 while
the workers drained: 144 lines in 2 s). :class:`RepeatLimiter` writes the first line of a kind
(its *key*: the status and the cause) at once, holds back the same kind for ``interval_s``
seconds (10 s by default) and then says how many it held back, on the next line of that kind or
at the next :meth:`RepeatLimiter.flush` (the router's health tick calls it), e.g.::

    request 4f2a (POST /v1/chat/completions, model m) answered 503 by worker -: no worker can take it
    503 "no worker can take it": 143 more like it in the last 10.0 s (rate-limited)

The set of keys is bounded (:attr:`RepeatLimiter.max_keys`): past it the oldest are forgotten.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Seen:
    """A key's last written line (monotonic s) and the lines held back since."""

    last: float
    held: int = 0


class RepeatLimiter:
    """At most one line per key per ``interval_s`` seconds on ``logger`` (module docstring).

    Args:
        logger: where the lines go (WARNING).
        interval_s: seconds during which further lines of the same key are only counted.
        clock: monotonic clock in seconds (injectable for tests).
    """

    max_keys = 256

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self._seen: dict[str, _Seen] = {}

    def warning(self, key: str, msg: str, *args: object) -> bool:
        """Write ``msg % args`` at WARNING unless a line of ``key`` was written less than
        ``interval_s`` ago (then count it). Returns True when written."""
        now = self.clock()
        s = self._seen.get(key)
        if s is not None and now - s.last < self.interval_s:
            s.held += 1
            return False
        if s is not None and s.held:
            self._summary(key, s, now)
        self.logger.warning(msg, *args)
        if key not in self._seen and len(self._seen) >= self.max_keys:
            self._seen.pop(next(iter(self._seen)))
        self._seen[key] = _Seen(now)
        return True

    def flush(self) -> None:
        """Write the count of every key whose interval has passed with lines held back."""
        now = self.clock()
        for key, s in list(self._seen.items()):
            if s.held and now - s.last >= self.interval_s:
                self._summary(key, s, now)
                s.last, s.held = now, 0

    def _summary(self, key: str, s: _Seen, now: float) -> None:
        self.logger.warning("%s: %d more like it in the last %.1f s (rate-limited)", key, s.held, now - s.last)


__all__ = ["RepeatLimiter"]
