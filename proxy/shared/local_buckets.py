"""Rate-limit buckets kept in this process (:class:`LocalBuckets`): the fallback while
Redis is unreachable (each limit ÷ the live replicas last seen, starting from the levels
last seen), and the whole story for :class:`proxy.shared.standalone.StandaloneState`.

The buckets are :class:`qos.TokenBucket`'s; every take and correction made here while
Redis is away is also kept (:class:`proxy.shared.rate_corrections.PendingAdjustments`) and
charged to Redis when it answers again.
"""

from __future__ import annotations

import time

from qos import TokenBucket

from .rate_limits import Bucket, RateLimited
from .rate_mirror import Mirror


class LocalBuckets:
    """Buckets kept in this process: the fallback while Redis is unreachable (each limit
    divided by the live replicas), and the whole story for :class:`StandaloneState`.

    Args:
        max_entries: bound on memory; the least recently used pairs are dropped (a
            dropped pair comes back full, as a Redis bucket past its expiry does).
        clock: monotonic seconds.
    """

    def __init__(self, max_entries: int = 100_000, clock=time.monotonic) -> None:
        self.max_entries = max_entries
        self._clock = clock
        self._pairs: dict[str, tuple[TokenBucket | None, TokenBucket | None]] = {}

    def _pair(self, b: Bucket, share: int, mirror: Mirror | None, now: float) -> tuple[TokenBucket | None, TokenBucket | None]:
        rpm, tpm = b.requests_per_minute / share, b.tokens_per_minute / share
        pair = self._pairs.pop(b.key, None)
        if pair is None:
            # start from the level last seen (a minute refills any bucket), not full
            seen = mirror.level(b, now, max_age_s=60.0) if mirror is not None else None
            pair = (_bucket(rpm, seen[0] / share if seen else None, now), _bucket(tpm, seen[1] / share if seen else None, now))
        else:
            pair = (_reconfigured(pair[0], rpm, now), _reconfigured(pair[1], tpm, now))
        self._pairs[b.key] = pair  # most recently used last
        while len(self._pairs) > self.max_entries:
            del self._pairs[next(iter(self._pairs))]
        return pair

    def take(self, buckets: tuple[Bucket, ...], tokens: int, share: int = 1, mirror: Mirror | None = None) -> None:
        """Take one request and ``tokens`` from every bucket, each limit ÷ ``share``.

        Raises:
            RateLimited: some bucket cannot cover it (nothing is taken).
        """
        now = self._clock()
        pairs = [self._pair(b, share, mirror, now) for b in buckets]
        worst = None
        for b, (rq, tk) in zip(buckets, pairs):
            for unit, bucket, need in (("requests", rq, 1), ("tokens", tk, tokens)):
                if bucket is not None:
                    wait = bucket.wait_time(need, now)
                    if wait > 0 and (worst is None or wait > worst[0]):
                        worst = (wait, b.scope, unit)
        if worst is not None:
            raise RateLimited(*worst)
        for rq, tk in pairs:
            if rq is not None:
                rq.take(1, now)
            if tk is not None:
                tk.take(tokens, now)

    def adjust(self, buckets: tuple[Bucket, ...], requests: float, tokens: float) -> None:
        """Charge ``requests`` and ``tokens`` more (negative: give back) to the buckets
        this process holds (unknown ones are left alone)."""
        now = self._clock()
        for b in buckets:
            pair = self._pairs.get(b.key)
            if pair is None:
                continue
            if pair[0] is not None and requests:
                pair[0].adjust(requests, now)
            if pair[1] is not None and tokens:
                pair[1].adjust(tokens, now)

    def clear(self) -> None:
        """Forget every local bucket (Redis is the truth again)."""
        self._pairs.clear()

    def __len__(self) -> int:
        return len(self._pairs)


def _bucket(per_minute: float, level: float | None, now: float) -> TokenBucket | None:
    if not per_minute:
        return None
    return TokenBucket.per_minute(per_minute, now, level)


def _reconfigured(bucket: TokenBucket | None, per_minute: float, now: float) -> TokenBucket | None:
    if not per_minute:
        return None
    if bucket is None:
        return TokenBucket.per_minute(per_minute, now)
    if bucket.capacity != per_minute:
        bucket.reconfigure(per_minute, now)
    return bucket
