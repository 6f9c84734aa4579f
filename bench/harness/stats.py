"""Statistics the benchmarks report: percentiles and medians of samples."""

from __future__ import annotations

import statistics


def percentile(values: list[float], p: float) -> float | None:
    """The ``p``-th percentile (``p`` in 0..100) of ``values`` by rank, in their unit;
    ``None`` when empty.

    The sample of rank ``round(p / 100 * n + 0.5)`` (1-based, clamped to 1..n): the
    nearest rank, ``ceil(p / 100 * n)``, except where ``p / 100 * n`` is a whole odd
    number, where Python's round-half-to-even takes the next sample up."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(p / 100 * len(s) + 0.5)) - 1))
    return s[k]


def median(values: list[float | None]) -> float | None:
    """The median of the values that are not ``None``; ``None`` when there are none."""
    xs = [x for x in values if x is not None]
    return statistics.median(xs) if xs else None
