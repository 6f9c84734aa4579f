"""What one sample of the dashboard holds, read from the Prometheus series: the counters'
cumulative values (through the public ``collect()``), differences of two samples, and the
quantiles of a cumulative histogram. Rates are differences of two :class:`Sample` over the
time between them (:mod:`proxy.api.dashboard_data`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class CumulativeHistogram:
    """A cumulative histogram: (upper bound, cumulative count) pairs, count and sum."""

    buckets: list[tuple[float, float]] = field(default_factory=list)
    count: float = 0.0
    total: float = 0.0


@dataclass(slots=True)
class Sample:
    """The cumulative figures at one moment (rates are differences of two samples)."""

    t: float  # the scheduler's clock
    tokens: dict[tuple[str, str], float]  # (group, direction) -> cumulative tokens
    refusals: dict[tuple[str, str], float]  # (group, reason) -> cumulative refusals
    waits: dict[str, CumulativeHistogram]  # group -> cumulative queue-wait histogram
    routed: dict[str, float]  # engine id -> requests placed on it since start
    failed: dict[str, float]  # engine id -> failed requests since start


def counter_values(metric, *labels: str) -> dict[tuple[str, ...], float]:
    """``{label values: value}`` of a labelled counter, through the public ``collect()``."""
    out = {}
    for fam in metric.collect():
        for s in fam.samples:
            if s.name.endswith("_total"):
                out[tuple(s.labels[k] for k in labels)] = s.value
    return out


def group_histograms(metric) -> dict[str, CumulativeHistogram]:
    """``{group: CumulativeHistogram}`` of a histogram labelled by ``group``."""
    out: dict[str, CumulativeHistogram] = {}
    for fam in metric.collect():
        for s in fam.samples:
            h = out.setdefault(s.labels["group"], CumulativeHistogram())
            if s.name.endswith("_bucket"):
                h.buckets.append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_count"):
                h.count = s.value
            elif s.name.endswith("_sum"):
                h.total = s.value
    return out


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The ``q``-quantile (0..1) of a cumulative histogram, interpolated linearly inside
    the bucket it falls in, as Prometheus's ``histogram_quantile`` does (the lowest
    bucket starts at 0; a quantile in the ``+Inf`` bucket is the highest finite bound).
    ``None`` when the histogram is empty."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def difference(now: dict, base: dict | None) -> dict:
    """``now - base`` key by key (a key missing from ``base`` counts from 0); all zeros
    when there is no ``base`` yet."""
    if base is None:
        return dict.fromkeys(now, 0.0)
    return {k: v - base.get(k, 0.0) for k, v in now.items()}


def histogram_difference(now: CumulativeHistogram, base: CumulativeHistogram | None) -> CumulativeHistogram:
    """``now - base`` of two cumulative histograms; empty when there is no ``base``."""
    if base is None:
        return CumulativeHistogram([(le, 0.0) for le, _ in now.buckets])
    before = dict(base.buckets)
    return CumulativeHistogram([(le, c - before.get(le, 0.0)) for le, c in now.buckets], now.count - base.count, now.total - base.total)


def share(part: float, whole: float) -> float | None:
    """``part / whole``, or ``None`` when ``whole`` is not positive (nothing to share)."""
    return part / whole if whole > 0 else None
