"""Rate limits: token buckets per user and per group (requests and tokens per minute),
and :class:`RateLimiter`, the object a scheduler reserves from, refunds to and settles
with."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .policy import RateLimit


class TokenBucket:
    """A token bucket that may go into debt.

    The bucket holds up to ``capacity`` units and refills at ``rate_per_s``. A take of ``n``
    units is allowed when the level covers ``min(n, capacity)`` (so a request larger than
    the whole bucket is still served once the bucket is full); the level then drops by
    ``n`` and may go negative, which delays later takes until the debt is refilled. This
    lets the caller charge an estimate first and correct it later with :meth:`adjust`.

    This is the one statement of the rule in Python: the refill (:meth:`refilled`) and the
    wait (:meth:`wait_for`) are also what :class:`proxy.shared.rate_mirror.Mirror` applies
    to levels read from Redis. Its Lua twin, which Redis runs for the shared limits, is
    ``proxy/shared/lua/bucket.lua`` (with the takes and corrections of ``reserve.lua`` and
    ``adjust.lua``); ``tests/test_shared_lua.py`` holds the two to the same answers.

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
    def per_minute(cls, per_minute: float, now: float, level: float | None = None) -> "TokenBucket":
        """A bucket allowing ``per_minute`` units per minute with a one-minute burst; full,
        or at ``level`` (clipped at the capacity; may be a debt)."""
        b = cls(per_minute, per_minute / 60.0, now)
        if level is not None:
            b.level = min(per_minute, level)
        return b

    @staticmethod
    def refilled(level: float, capacity: float, rate_per_s: float, elapsed_s: float) -> float:
        """The level ``elapsed_s`` seconds after it was ``level``: refilled at
        ``rate_per_s`` and clipped at ``capacity`` (no time, or time going backwards,
        refills nothing; a level above the capacity, as after a lower limit, is clipped)."""
        return min(capacity, level + max(0.0, elapsed_s) * rate_per_s)

    @staticmethod
    def wait_for(level: float, n: float, capacity: float, rate_per_s: float) -> float:
        """Seconds until a bucket at ``level`` allows a take of ``n`` units: 0.0 when the
        level covers ``min(n, capacity)``, else the time the refill needs to get there."""
        need = min(n, capacity)
        if level >= need:
            return 0.0
        return (need - level) / rate_per_s

    def _refill(self, now: float) -> None:
        if now > self.updated_at:
            self.level = self.refilled(self.level, self.capacity, self.rate_per_s, now - self.updated_at)
            self.updated_at = now

    def wait_time(self, n: float, now: float) -> float:
        """Seconds until a take of ``n`` units would be allowed (0.0 if allowed now)."""
        self._refill(now)
        return self.wait_for(self.level, n, self.capacity, self.rate_per_s)

    def take(self, n: float, now: float) -> None:
        """Take ``n`` units unconditionally (call :meth:`wait_time` first)."""
        self._refill(now)
        self.level -= n

    def adjust(self, delta: float, now: float) -> None:
        """Charge ``delta`` more units (negative refunds), keeping the level <= capacity."""
        self._refill(now)
        self.level = min(self.capacity, self.level - delta)

    def is_full(self, now: float) -> bool:
        """Whether the bucket has refilled completely (then it equals a new one)."""
        self._refill(now)
        return self.level >= self.capacity

    def reconfigure(self, per_minute: float, now: float) -> None:
        """Change the rate to ``per_minute`` keeping the current level (clipped)."""
        self._refill(now)
        self.capacity = per_minute
        self.rate_per_s = per_minute / 60.0
        self.level = min(self.level, per_minute)


def _limited(limits: RateLimit) -> bool:
    return limits.requests_per_minute is not None or limits.tokens_per_minute is not None


@dataclass(slots=True)
class RateReservation:
    """What one request took from the rate limits at submit, so that it can be refunded
    or settled exactly once.

    Attributes:
        user_id, group: whose buckets were charged.
        requests: requests taken (1, or 0 when neither side limits requests).
        tokens: tokens taken (the request's reservation: prompt + reserved output).
        done: set once refunded or settled (a second call does nothing).
    """

    user_id: str
    group: str
    requests: int
    tokens: int
    done: bool = False


class RateLimiter:
    """Per-user and per-group token buckets (requests and tokens per minute), with
    reserve / refund / settle and bounded state.

    The contract a scheduler relies on (and a shared implementation, e.g. one backed by
    Redis, must keep):

    * :meth:`check` says how long a request would have to wait (0: it may go now); it
      changes nothing, so a refused request consumes nothing.
    * :meth:`reserve` takes one request and the request's reserved tokens from the
      user's and the group's buckets, and returns a :class:`RateReservation`.
    * :meth:`refund` gives all of it back (the request was never dispatched: refused,
      evicted, timed out, cancelled while queued, drained at shutdown).
    * :meth:`settle` keeps the request and trues the tokens up to what was really used
      (the request was dispatched).

    Limits travel with each call (from the policy in force), so a reload needs no
    separate step: a bucket whose limit changed is reconfigured when next touched, and
    one several schedulers share (one per engine pool) sees one policy.

    State is bounded: a bucket that has refilled completely is indistinguishable from a
    new one and is dropped when idle (checked a few at a time, oldest first, so the cost
    is amortized O(1) per call); beyond ``max_buckets`` the least recently used bucket
    is dropped even if not full (the only case where forgetting changes a limit, and
    only in the user's favour). Users without limits have no buckets at all.

    Args:
        max_buckets: hard cap on buckets kept (>= 1).
    """

    def __init__(self, max_buckets: int = 40000) -> None:
        self.max_buckets = max_buckets
        self._buckets: OrderedDict[tuple[str, str, str], TokenBucket] = OrderedDict()
        self.forgotten = 0

    def __len__(self) -> int:
        return len(self._buckets)

    def _pairs(self, user_id: str, user_limits: RateLimit, group: str, group_limits: RateLimit):
        yield ("u", user_id, "r"), user_limits.requests_per_minute
        yield ("u", user_id, "t"), user_limits.tokens_per_minute
        yield ("g", group, "r"), group_limits.requests_per_minute
        yield ("g", group, "t"), group_limits.tokens_per_minute

    def _bucket(self, key: tuple[str, str, str], per_minute: float | None, now: float, create: bool) -> TokenBucket | None:
        b = self._buckets.get(key)
        if per_minute is None:
            return None
        if b is None:
            if not create:
                return None
            b = self._buckets[key] = TokenBucket.per_minute(per_minute, now)
        else:
            if b.capacity != per_minute:
                b.reconfigure(per_minute, now)
            self._buckets.move_to_end(key)
        return b

    def check(self, user_id: str, user_limits: RateLimit, group: str, group_limits: RateLimit, tokens: int, now: float) -> float:
        """Seconds until a request of ``tokens`` tokens would be allowed (0.0: now).
        Changes nothing (an absent bucket counts as full)."""
        return self.tripped(user_id, user_limits, group, group_limits, tokens, now)[0]

    def tripped(
        self, user_id: str, user_limits: RateLimit, group: str, group_limits: RateLimit, tokens: int, now: float
    ) -> tuple[float, str | None, str | None]:
        """As :meth:`check`, and which bucket needs the longest wait: ``(wait_s, scope,
        limit)`` with ``scope`` ``"user"`` or ``"group"`` and ``limit``
        ``"requests_per_minute"`` or ``"tokens_per_minute"`` (the config keys); both
        ``None`` when the wait is 0. Changes nothing."""
        if not (_limited(user_limits) or _limited(group_limits)):
            return 0.0, None, None
        wait, scope, limit = 0.0, None, None
        for key, per_minute in self._pairs(user_id, user_limits, group, group_limits):
            if per_minute is None:
                continue
            b = self._buckets.get(key)
            if b is None:
                b = TokenBucket.per_minute(per_minute, now)
            elif b.capacity != per_minute:
                b.reconfigure(per_minute, now)
            w = b.wait_time(1 if key[2] == "r" else tokens, now)
            if w > wait:
                wait = w
                scope = "user" if key[0] == "u" else "group"
                limit = "requests_per_minute" if key[2] == "r" else "tokens_per_minute"
        return wait, scope, limit

    def reserve(self, user_id: str, user_limits: RateLimit, group: str, group_limits: RateLimit, tokens: int, now: float) -> RateReservation | None:
        """Take one request and ``tokens`` tokens (call :meth:`check` first). Returns
        ``None`` when neither the user nor the group has a limit (nothing to give back)."""
        if not (_limited(user_limits) or _limited(group_limits)):
            return None
        limited_requests = False
        for key, per_minute in self._pairs(user_id, user_limits, group, group_limits):
            b = self._bucket(key, per_minute, now, create=True)
            if b is not None:
                if key[2] == "r":
                    b.take(1, now)
                    limited_requests = True
                else:
                    b.take(tokens, now)
        self._trim(now)
        return RateReservation(user_id, group, 1 if limited_requests else 0, tokens)

    def _adjust(self, res: RateReservation, requests: int, tokens: int, now: float) -> None:
        for side, name in (("u", res.user_id), ("g", res.group)):
            if requests:
                b = self._buckets.get((side, name, "r"))
                if b is not None:
                    b.adjust(requests, now)
            if tokens:
                b = self._buckets.get((side, name, "t"))
                if b is not None:
                    b.adjust(tokens, now)

    def refund(self, res: RateReservation | None, now: float) -> None:
        """Give back everything ``res`` took (the request was never dispatched)."""
        if res is None or res.done:
            return
        res.done = True
        self._adjust(res, -res.requests, -res.tokens, now)

    def settle(self, res: RateReservation | None, tokens_used: int, now: float) -> None:
        """Keep the request, true the tokens up to ``tokens_used`` (prompt + output
        really served)."""
        if res is None or res.done:
            return
        res.done = True
        self._adjust(res, 0, tokens_used - res.tokens, now)

    def _trim(self, now: float) -> None:
        buckets = self._buckets
        for _ in range(2):  # amortized: each call looks at the two oldest
            if not buckets:
                break
            key, b = next(iter(buckets.items()))
            if not b.is_full(now):
                break
            del buckets[key]
        while len(buckets) > self.max_buckets:
            buckets.popitem(last=False)
            self.forgotten += 1
