"""The statistics the benchmarks (``bench.stats``) and the simulator (``simulate.stats``) share,
so a figure means the same in both reports."""
from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks (numpy's
    default, ``method="linear"``); ``None`` for no values.

    Raises ``ValueError`` when ``q`` is outside 0..100.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in 0..100, got {q}")
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
