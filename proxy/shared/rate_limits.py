"""Rate limits exact across replicas: token buckets (requests and tokens per minute, per user
and per group) kept in Redis, taken atomically before dispatch, corrected after. This
module holds what a request is charged to (:class:`Bucket`, :class:`Reservation`), the
refusal (:class:`RateLimited`), and the two scripts' calls; the machinery around them has
a module each (below).

The bucket is :class:`qos.TokenBucket`'s, moved into a Lua script: capacity = the
per-minute limit (one minute of burst), refilled continuously at limit / 60 per second,
a take of n allowed when the level covers min(n, capacity), the level may go into debt,
and a correction is clipped at the capacity. Time is Redis's ``TIME``. The scripts live
in ``proxy/shared/lua/`` (``bucket.lua``, ``reserve.lua``, ``adjust.lua``; see
:mod:`proxy.shared.lua`); the Python side (the mirror's refill and wait, the local
buckets) uses :class:`qos.TokenBucket`'s rule and restates none of it.

- **reserve** (:data:`RESERVE_SCRIPT`, one round trip on the request's path): check every
  bucket the request touches (user and group, requests and tokens) and take from all of
  them, or from none and answer the longest wait. Atomic, so however many replicas take
  at once, a bucket never gives out more than it holds. Concurrent reserves of one
  process share round trips (:class:`proxy.shared.reserve_batcher.ReserveBatcher`): those
  that arrive while one pipeline is in flight go together in the next. A reserve whose
  reply is read after its request stopped waiting is given back; one whose reply is lost
  (the request was served from the local share instead) is written off through the
  replica's reserve log (:class:`proxy.shared.reserve_log.ReserveLog`): given back if it
  ran, never run if it had not. Either way the request costs its limits once.
- **settle / refund** (:data:`ADJUST_SCRIPT`): the difference between the real tokens and
  the estimate taken, or the whole take back for a request that never reached an engine.
  These are not on any request's path: they are buffered
  (:class:`proxy.shared.rate_corrections.PendingAdjustments`) and sent with the next sync
  (:mod:`proxy.shared.sync`), as one batch with a sequence number that Redis applies at
  most once (a batch whose reply was lost is resent, not double-counted).

So a limit is exceeded only by what estimates missed: at any moment by at most the sum,
over requests in flight or settled within the last sync interval, of (real tokens -
estimated tokens); with ``max_tokens`` charged at reserve that is the prompt estimate's
error.

**Local pre-check** (:class:`proxy.shared.rate_mirror.Mirror`): each reply carries the
buckets' levels, kept for one sync interval; a request they say cannot fit is refused
without a Redis call.

**Fallback** (:class:`proxy.shared.local_buckets.LocalBuckets`): while Redis is
unreachable, each limit ÷ (live replicas last seen) is enforced in the process, starting
from the levels last seen, and every take and correction is kept (bounded) and charged to
Redis when it answers again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import orjson

from qos import RateLimit

from .lua import script

RESERVE_SCRIPT = script("reserve")  # proxy/shared/lua/bucket.lua + reserve.lua
ADJUST_SCRIPT = script("adjust")  # proxy/shared/lua/bucket.lua + adjust.lua


class RateLimited(Exception):
    """A request does not fit a rate limit now.

    Attributes:
        retry_after_s: seconds until it would fit (if nothing else takes first).
        scope: ``"user"`` or ``"group"``: whose limit refused it.
        unit: ``"requests"`` or ``"tokens"``.
    """

    def __init__(self, retry_after_s: float, scope: str, unit: str) -> None:
        super().__init__(f"{scope} rate limit ({unit} per minute): retry in {retry_after_s:.1f} s")
        self.retry_after_s = retry_after_s
        self.scope = scope
        self.unit = unit


class Bucket(NamedTuple):
    """One bucket pair a request is charged to: its Redis key, whose it is, its limits
    (per minute; 0 means none)."""

    key: str
    scope: str
    requests_per_minute: float
    tokens_per_minute: float


@dataclass(slots=True)
class Reservation:
    """What :meth:`SharedState.reserve_rate` took for one request; hand it back to
    ``settle_rate`` or ``refund_rate`` exactly once (a second call does nothing).

    Attributes:
        buckets: the buckets charged (empty: no limit applies, nothing was taken).
        tokens: tokens taken (the estimate: prompt + ``max_tokens``).
        local: taken from the local fallback buckets (Redis was unreachable).
        done: settled or refunded already.
    """

    buckets: tuple[Bucket, ...]
    tokens: int
    local: bool = False
    done: bool = False


def buckets_for(keys, user_id: str, group: str, user_limit: RateLimit, group_limit: RateLimit) -> tuple[Bucket, ...]:
    """The buckets a request of ``user_id`` in ``group`` is charged to (those with a limit).

    Args:
        keys: a :class:`proxy.shared.keys.Keys`.
        user_limit, group_limit: the limits from the policy (``None`` fields: unlimited).
    """
    out = []
    for key, scope, lim in ((keys.user_bucket(user_id), "user", user_limit), (keys.group_bucket(group), "group", group_limit)):
        rpm, tpm = lim.requests_per_minute or 0.0, lim.tokens_per_minute or 0.0
        if rpm or tpm:
            out.append(Bucket(key, scope, float(rpm), float(tpm)))
    return tuple(out)


def reserve_args(buckets: tuple[Bucket, ...], tokens: int, log_key: str, number: int, floor: int, keep_ms: int) -> tuple[list[str], list]:
    """KEYS and ARGV of :data:`RESERVE_SCRIPT`.

    Args:
        log_key: the replica's reserve log (:meth:`proxy.shared.keys.Keys.reserve_log`).
        number, floor: this reserve's number and the replica's floor
            (:class:`proxy.shared.reserve_log.ReserveLog`).
        keep_ms: the log's idle lifetime.
    """
    args: list = [tokens, number, floor, keep_ms]
    for b in buckets:
        args += [b.requests_per_minute, b.tokens_per_minute]
    return [log_key] + [b.key for b in buckets], args


def parse_reserve(reply: str | bytes, buckets: tuple[Bucket, ...]) -> tuple[float, str, str, list[tuple[float, float]]]:
    """(wait_s, scope, unit, levels) from a reserve reply; wait 0.0 means taken."""
    r = orjson.loads(reply)
    lv = [(float(a), float(b)) for a, b in (r.get("lv") or [])]  # cjson writes an empty list as {}
    if int(r["ok"]):
        return 0.0, "", "", lv
    return float(r["wait"]), buckets[int(r["i"]) - 1].scope, r["u"], lv


def adjust_args(
    replica_key: str, log_key: str, seq: int, keep_ms: int, batch: dict[str, list], lost: list[tuple[int, tuple[Bucket, ...], int]] = ()
) -> tuple[list[str], list]:
    """KEYS and ARGV of :data:`ADJUST_SCRIPT` for one frozen batch (``lost``: the reserves
    written off, as
    :meth:`proxy.shared.rate_corrections.PendingAdjustments.freeze` gives them)."""
    keys = [replica_key, log_key]
    args: list = [seq, keep_ms, len(batch)]
    for key, (rpm, tpm, dr, dt) in batch.items():
        keys.append(key)
        args += [rpm, tpm, dr, dt]
    for number, buckets, tokens in lost:
        args += [number, tokens, len(buckets)]
        for b in buckets:
            keys.append(b.key)
            args += [len(keys), b.requests_per_minute, b.tokens_per_minute]
    return keys, args
