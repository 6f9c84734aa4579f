"""The local pre-check of the rate limits: the bucket levels last seen in Redis's replies
(:class:`Mirror`), so a request that cannot fit is refused without a Redis call.

Each reserve reply carries the buckets' levels; the mirror keeps them for one sync
interval. A request the mirror says cannot fit (the levels it saw, plus refill since) is
refused at once, so a client hammering an exhausted limit costs Redis at most one call per
bucket per interval. It can only be early by what other replicas refunded within that
interval. The refill and the wait are :class:`qos.TokenBucket`'s rule, restated nowhere
here (:meth:`qos.TokenBucket.refilled`, :meth:`qos.TokenBucket.wait_for`).
"""

from __future__ import annotations

import time

from qos import TokenBucket

from .rate_limits import Bucket, RateLimited


class Mirror:
    """The bucket levels last seen in Redis replies, for the local pre-check.

    Args:
        max_age_s: a reading older than this is not used (the sync interval).
        max_entries: bound on memory; the oldest readings are dropped first.
        clock: monotonic seconds.
    """

    def __init__(self, max_age_s: float, max_entries: int = 50_000, clock=time.monotonic) -> None:
        self.max_age_s = max_age_s
        self.max_entries = max_entries
        self._clock = clock
        self._seen: dict[str, tuple[float, float, float]] = {}  # key -> (requests, tokens, at)

    def record(self, buckets: tuple[Bucket, ...], levels: list[tuple[float, float]]) -> None:
        """Remember the levels of a reply (one pair per bucket, -1 for an absent limit)."""
        now = self._clock()
        for b, (r, t) in zip(buckets, levels):
            self._seen.pop(b.key, None)
            self._seen[b.key] = (r, t, now)
        while len(self._seen) > self.max_entries:
            del self._seen[next(iter(self._seen))]

    def level(self, b: Bucket, now: float | None = None, max_age_s: float | None = None) -> tuple[float, float] | None:
        """The bucket's levels as last seen plus refill since, or None if the reading is
        older than ``max_age_s`` (default: the mirror's)."""
        seen = self._seen.get(b.key)
        now = self._clock() if now is None else now
        if seen is None or now - seen[2] > (self.max_age_s if max_age_s is None else max_age_s):
            return None
        dt = now - seen[2]
        rpm, tpm = b.requests_per_minute, b.tokens_per_minute
        r = TokenBucket.refilled(seen[0], rpm, rpm / 60.0, dt) if rpm else seen[0]
        t = TokenBucket.refilled(seen[1], tpm, tpm / 60.0, dt) if tpm else seen[1]
        return r, t

    def check(self, buckets: tuple[Bucket, ...], tokens: int) -> None:
        """Refuse locally when a fresh reading says the request cannot fit.

        Raises:
            RateLimited: with the wait the reading implies.
        """
        now = self._clock()
        worst = None
        for b in buckets:
            lv = self.level(b, now)
            if lv is None:
                continue
            for unit, level, limit, need in (("requests", lv[0], b.requests_per_minute, 1), ("tokens", lv[1], b.tokens_per_minute, tokens)):
                if limit:
                    wait = TokenBucket.wait_for(level, need, limit, limit / 60.0)
                    if wait > 0 and (worst is None or wait > worst[0]):
                        worst = (wait, b.scope, unit)
        if worst is not None:
            raise RateLimited(*worst)
