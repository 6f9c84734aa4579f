"""Token buckets for per-user and per-group rate limits (requests and tokens per minute)."""

from __future__ import annotations


class TokenBucket:
    """A token bucket that may go into debt.

    The bucket holds up to ``capacity`` units and refills at ``rate_per_s``. A take of ``n``
    units is allowed when the level covers ``min(n, capacity)`` (so a request larger than
    the whole bucket is still served once the bucket is full); the level then drops by
    ``n`` and may go negative, which delays later takes until the debt is refilled. This
    lets the caller charge an estimate first and correct it later with :meth:`adjust`.

    Args:
        capacity: burst size (units).
        rate_per_s: refill rate (units per second), > 0.
        now: current clock reading (seconds); the bucket starts full.
    """

    __slots__ = ("capacity", "rate_per_s", "level", "updated_at")

    def __init__(self, capacity: float, rate_per_s: float, now: float) -> None:
        self.capacity = capacity
        self.rate_per_s = rate_per_s
        self.level = capacity
        self.updated_at = now

    @classmethod
    def per_minute(cls, per_minute: float, now: float) -> "TokenBucket":
        """A bucket allowing ``per_minute`` units per minute with a one-minute burst."""
        return cls(per_minute, per_minute / 60.0, now)

    def _refill(self, now: float) -> None:
        if now > self.updated_at:
            self.level = min(self.capacity, self.level + (now - self.updated_at) * self.rate_per_s)
            self.updated_at = now

    def wait_time(self, n: float, now: float) -> float:
        """Seconds until a take of ``n`` units would be allowed (0.0 if allowed now)."""
        self._refill(now)
        need = min(n, self.capacity)
        if self.level >= need:
            return 0.0
        return (need - self.level) / self.rate_per_s

    def take(self, n: float, now: float) -> None:
        """Take ``n`` units unconditionally (call :meth:`wait_time` first)."""
        self._refill(now)
        self.level -= n

    def adjust(self, delta: float, now: float) -> None:
        """Charge ``delta`` more units (negative refunds), keeping the level <= capacity."""
        self._refill(now)
        self.level = min(self.capacity, self.level - delta)

    def reconfigure(self, per_minute: float, now: float) -> None:
        """Change the rate to ``per_minute`` keeping the current level (clipped)."""
        self._refill(now)
        self.capacity = per_minute
        self.rate_per_s = per_minute / 60.0
        self.level = min(self.level, per_minute)
