"""Rate limits exact across replicas: token buckets (requests and tokens per minute, per user
and per group) kept in Redis, taken atomically before dispatch, corrected after.

The bucket is :class:`qos.TokenBucket`'s, moved into a Lua script: capacity = the
per-minute limit (one minute of burst), refilled continuously at limit / 60 per second,
a take of n allowed when the level covers min(n, capacity), the level may go into debt,
and a correction is clipped at the capacity. Time is Redis's ``TIME``. The scripts live
in ``proxy/shared/lua/`` (``bucket.lua``, ``reserve.lua``, ``adjust.lua``; see
:mod:`proxy.shared.lua`); the Python side here (the mirror's refill and wait, the local
buckets) uses :class:`qos.TokenBucket`'s rule and restates none of it.

- **reserve** (:data:`RESERVE_SCRIPT`, one round trip on the request's path): check every
  bucket the request touches (user and group, requests and tokens) and take from all of
  them, or from none and answer the longest wait. Atomic, so however many replicas take
  at once, a bucket never gives out more than it holds. Concurrent reserves of one
  process share round trips (:class:`ReserveBatcher`): those that arrive while one
  pipeline is in flight go together in the next. A reserve whose reply is read after its
  request stopped waiting is given back; one whose reply is lost (the request was served
  from the local share instead) is written off through the replica's reserve log
  (:class:`ReserveLog`): given back if it ran, never run if it had not. Either way the
  request costs its limits once.
- **settle / refund** (:data:`ADJUST_SCRIPT`): the difference between the real tokens and
  the estimate taken, or the whole take back for a request that never reached an engine.
  These are not on any request's path: they are buffered and sent with the next sync
  (:mod:`proxy.shared.sync`), as one batch with a sequence number that Redis applies at
  most once (a batch whose reply was lost is resent, not double-counted).

So a limit is exceeded only by what estimates missed: at any moment by at most the sum,
over requests in flight or settled within the last sync interval, of (real tokens -
estimated tokens); with ``max_tokens`` charged at reserve that is the prompt estimate's
error.

**Local pre-check.** Each reply carries the buckets' levels; :class:`Mirror` keeps them
for one sync interval. A request the mirror says cannot fit (the levels it saw, plus
refill since) is refused without a Redis call, so a client hammering an exhausted limit
costs Redis at most one call per bucket per interval. It can only be early by what other
replicas refunded within that interval.

**Fallback.** While Redis is unreachable, :class:`LocalBuckets` enforces each limit ÷
(live replicas last seen) in the process, starting from the levels last seen, and every
take and correction is kept (bounded) and charged to Redis when it answers again.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, NamedTuple

import orjson

from qos import RateLimit, TokenBucket

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
        number, floor: this reserve's number and the replica's floor (:class:`ReserveLog`).
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


@dataclass(slots=True)
class PendingAdjustments:
    """Corrections waiting for the next sync: per bucket, requests and tokens to charge
    (negative: give back), with the bucket's limits; and the reserves written off (sent,
    their reply never read: see :class:`ReserveLog`). Bounded: past ``max_buckets``
    distinct buckets (or written-off reserves), new ones are dropped and counted in
    ``dropped``.

    A batch (at most ``batch_size`` buckets and written-off reserves, so no script call runs
    long) is frozen by :meth:`freeze` with a sequence number and resent unchanged until
    Redis confirms it (:meth:`confirm`), so it is applied exactly once.
    """

    max_buckets: int = 100_000
    batch_size: int = 1000
    dropped: int = 0
    seq: int = 0
    _open: dict[str, list] = field(default_factory=dict)
    _lost: list[tuple[int, tuple[Bucket, ...], int]] = field(default_factory=list)
    _frozen: tuple[dict[str, list], list] | None = None

    def add(self, buckets: tuple[Bucket, ...], requests: float, tokens: float) -> None:
        """Add a correction for each bucket."""
        for b in buckets:
            entry = self._open.get(b.key)
            if entry is None:
                if len(self._open) >= self.max_buckets:
                    self.dropped += 1
                    continue
                entry = self._open[b.key] = [b.requests_per_minute, b.tokens_per_minute, 0.0, 0.0]
            entry[0], entry[1] = b.requests_per_minute, b.tokens_per_minute
            entry[2] += requests if b.requests_per_minute else 0.0
            entry[3] += tokens if b.tokens_per_minute else 0.0

    def write_off(self, number: int, buckets: tuple[Bucket, ...], tokens: int) -> bool:
        """Reserve ``number`` (one request and ``tokens`` from ``buckets``) was sent and its
        reply never read: with the next batch, Redis gives its take back if it ran and makes
        sure it never runs later. Returns False when dropped (past the bound)."""
        if len(self._lost) >= self.max_buckets:
            self.dropped += 1
            return False
        self._lost.append((number, buckets, tokens))
        return True

    def freeze(self) -> tuple[int, dict[str, list], list[tuple[int, tuple[Bucket, ...], int]]] | None:
        """The batch to send now (the unconfirmed one, else the open corrections and
        written-off reserves), as (sequence number, corrections per bucket key, written-off
        reserves), or None when there is nothing to send."""
        if self._frozen is None:
            batch: dict[str, list] = {}
            while self._open and len(batch) < self.batch_size:
                key = next(iter(self._open))
                entry = self._open.pop(key)
                if entry[2] or entry[3]:
                    batch[key] = entry
            room = max(0, self.batch_size - len(batch))
            lost, self._lost = self._lost[:room], self._lost[room:]
            if not batch and not lost:
                return None
            self.seq += 1
            self._frozen = (batch, lost)
        return self.seq, self._frozen[0], self._frozen[1]

    def confirm(self) -> list[int]:
        """Redis applied the frozen batch; returns the numbers of the reserves it wrote off
        (now settled)."""
        frozen, self._frozen = self._frozen, None
        return [n for n, _, _ in frozen[1]] if frozen is not None else []

    def __len__(self) -> int:
        frozen = len(self._frozen[0]) + len(self._frozen[1]) if self._frozen is not None else 0
        return len(self._open) + len(self._lost) + frozen


def adjust_args(
    replica_key: str, log_key: str, seq: int, keep_ms: int, batch: dict[str, list], lost: list[tuple[int, tuple[Bucket, ...], int]] = ()
) -> tuple[list[str], list]:
    """KEYS and ARGV of :data:`ADJUST_SCRIPT` for one frozen batch (``lost``: the reserves
    written off, as :meth:`PendingAdjustments.freeze` gives them)."""
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


class ReserveLog:
    """This replica's reserves whose outcome in Redis it may not know yet: what makes a
    reserve whose reply came late (or never) cost its limits once.

    Every reserve sent to Redis gets a number (increasing). :data:`RESERVE_SCRIPT` records
    a take under its number in the replica's log (``{P}:rsv:<replica id>``). When the reply
    is read, the number is settled. When it is not (the pipeline timed out or its
    connection broke, so the request was served from the local share, whose take is
    charged to Redis as well), the reserve is *written off*: the next adjust batch asks
    Redis to give its take back if it ran, and to mark it so that it never runs later (a
    frozen Redis runs what it had received when it thaws); once Redis confirms, the number
    is settled. Each reserve also tells Redis the *floor*, the smallest number not settled
    here: Redis forgets the records below it (in steps of 32 numbers, to spare calls), so
the log holds the reserves in flight plus at most 32.

    Exact while the log lives: it expires ``keep`` (10 leases, at least a minute) after its
    last write, so a write-off that reaches Redis later than that (a replica cut off for
    longer) finds no record and gives nothing back; by then a bucket has refilled anyway,
    unless it is in debt.
    """

    def __init__(self) -> None:
        self.number = 0
        self._open: list[int] = []  # a heap of the numbers not settled (lazy deletion)
        self._settled: set[int] = set()

    def open(self) -> int:
        """A number for a new reserve (unsettled until :meth:`settle`)."""
        self.number += 1
        heapq.heappush(self._open, self.number)
        return self.number

    def settle(self, number: int) -> None:
        """Its reply was read, or Redis confirmed its write-off, or it was never sent."""
        self._settled.add(number)
        while self._open and self._open[0] in self._settled:
            self._settled.discard(heapq.heappop(self._open))

    @property
    def floor(self) -> int:
        """The smallest number not settled (the next one when all are)."""
        return self._open[0] if self._open else self.number + 1

    def __len__(self) -> int:
        return len(self._open) - len(self._settled)


Call = tuple[list[str], list]


class ReserveBatcher:
    """Group the reserves of concurrent requests into pipelines: one pipeline in flight at
    a time, and every reserve that arrives meanwhile goes in the next one. A burst of N
    requests costs about two round trips and one connection instead of N of each (the
    group commit of databases; Redis's own manual, "Pipelining").

    Args:
        send: sends one pipeline of reserve calls (KEYS, ARGV) and returns one reply or
            exception per call, in order; bounded in time by the caller's timeout.
        on_orphan: called with (buckets, tokens) for a reserve that succeeded in Redis
            after its request stopped waiting (cancelled or timed out), so that the take
            is given back.
        on_read: called with a reserve's number once its outcome is known here (its reply
            read, or it was never sent: its request stopped waiting first).
        on_lost: called with (number, buckets, tokens) for a reserve sent in a pipeline
            whose replies were lost (a timeout, a broken connection): it may have run.
    """

    def __init__(
        self,
        send: Callable[[list[Call]], Awaitable[list]],
        on_orphan: Callable[[tuple[Bucket, ...], int], None],
        on_read: Callable[[int], None] = lambda _n: None,
        on_lost: Callable[[int, tuple[Bucket, ...], int], None] = lambda _n, _b, _t: None,
    ) -> None:
        self._send = send
        self._on_orphan = on_orphan
        self._on_read = on_read
        self._on_lost = on_lost
        self._queue: list[tuple[Call, asyncio.Future, tuple[Bucket, ...], int, int]] = []
        self._task: asyncio.Task | None = None
        self.pipelines = 0  # sent, for the benchmark and tests

    async def reserve(self, call: Call, buckets: tuple[Bucket, ...], tokens: int, number: int = 0):
        """The raw reply of :data:`RESERVE_SCRIPT` for ``call`` (reserve ``number``).

        Raises:
            whatever ``send`` raised for the pipeline, or the call's own error reply.
        """
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((call, fut, buckets, tokens, number))
        if self._task is None:
            self._task = asyncio.create_task(self._drain(), name="llm-qos rate-limit reserves")
        return await fut

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                sent = []
                for item in batch:
                    if item[1].done():  # its request stopped waiting before it was sent
                        self._on_read(item[4])
                    else:
                        sent.append(item)
                if not sent:
                    continue
                self.pipelines += 1
                try:
                    replies = await self._send([call for call, *_ in sent])
                except Exception as e:  # Redis unreachable: every request of the batch learns it
                    for _, fut, buckets, tokens, number in sent:
                        self._on_lost(number, buckets, tokens)  # it may have run: written off
                        if not fut.done():
                            fut.set_exception(type(e)(*e.args) if _copyable(e) else RuntimeError(str(e)))
                    continue
                for (_, fut, buckets, tokens, number), reply in zip(sent, replies):
                    self._on_read(number)
                    if fut.done():  # the request stopped waiting: undo a take it never used
                        if not isinstance(reply, BaseException) and orjson.loads(reply).get("ok"):
                            self._on_orphan(buckets, tokens)
                    elif isinstance(reply, BaseException):
                        fut.set_exception(reply)
                    else:
                        fut.set_result(reply)
        finally:
            self._task = None


def _copyable(e: Exception) -> bool:
    try:
        type(e)(*e.args)
    except Exception:
        return False
    return True
