"""This replica's side of the rate limits shared through Redis (:class:`ReplicaRateLimits`):
a request's take reserved in the buckets before dispatch (pre-checked against the levels
last seen, batched with the concurrent ones), served from the local share while Redis
cannot be reached, and the corrections after it (settle, refund), buffered for the next
sync. The rules it follows, and why a request costs its limits once, are
:mod:`proxy.shared.rate_limits`; the sync that carries the corrections is
:mod:`proxy.shared.sync`.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from qos import RateLimit

from .keys import Keys
from .local_buckets import LocalBuckets
from .rate_corrections import PendingAdjustments
from .rate_limits import RateLimited, Reservation, adjust_args, buckets_for, parse_reserve, reserve_args
from .rate_mirror import Mirror
from .redis_link import UNREACHABLE, ScriptCall, still_cancelled
from .reserve_batcher import ReserveBatcher
from .reserve_log import ReserveLog

_NO_LIMITS = Reservation((), 0, done=True)


class ReplicaRateLimits:
    """The rate-limit takes and corrections of one replica.

    Args:
        keys: the key layout.
        send: sends one pipeline of reserve calls (:meth:`proxy.shared.redis_link.RedisLink.reserves`).
        log_key: this replica's reserve log in Redis (:meth:`proxy.shared.keys.Keys.reserve_log`).
        keep_ms: the idle lifetime of the replica's keys in Redis (milliseconds).
        timeout_s: the bound on a Redis call (a reserve waits at most twice that: its
            pipeline may wait for the one in flight).
        mirror_age_s: how long a level seen in Redis is used for the pre-check (the sync
            interval).
        clock: monotonic seconds.
        shared: whether Redis is to be asked now (the shared state's mode is ``shared``).
        share: N, the divisor of the local shares (limits ÷ N) while it is not.
        on_unreachable: called with the error when a reserve finds Redis unreachable.

    Attributes:
        mirror: the levels last seen (:class:`proxy.shared.rate_mirror.Mirror`).
        local_buckets: the local share's buckets (:class:`proxy.shared.local_buckets.LocalBuckets`).
        adjustments: the corrections waiting for the next sync
            (:class:`proxy.shared.rate_corrections.PendingAdjustments`).
        reserve_log: the reserves whose outcome is not known here yet
            (:class:`proxy.shared.reserve_log.ReserveLog`).
        reserves: the batcher of concurrent reserves
            (:class:`proxy.shared.reserve_batcher.ReserveBatcher`).
    """

    def __init__(
        self,
        keys: Keys,
        send: Callable[[list], Awaitable[list]],
        log_key: str,
        keep_ms: int,
        timeout_s: float,
        mirror_age_s: float,
        clock: Callable[[], float],
        shared: Callable[[], bool],
        share: Callable[[], int],
        on_unreachable: Callable[[BaseException], None],
    ) -> None:
        self._keys = keys
        self._log_key = log_key
        self._keep_ms = keep_ms
        self._timeout = timeout_s
        self._shared = shared
        self._share = share
        self._on_unreachable = on_unreachable
        self.adjustments = PendingAdjustments()
        self.mirror = Mirror(mirror_age_s, clock=clock)
        self.local_buckets = LocalBuckets(clock=clock)
        self.reserve_log = ReserveLog()
        self.reserves = ReserveBatcher(
            send,
            lambda buckets, tokens: self.adjustments.add(buckets, -1, -tokens),
            on_read=self.reserve_log.settle,
            on_lost=self._write_off,
        )

    # ------------------------------------------------------------ request path

    async def reserve(self, user_id: str, group: str, user_limit: RateLimit, group_limit: RateLimit, tokens: int) -> Reservation:
        """Take one request and ``tokens`` from the user's and the group's buckets (see
        :meth:`proxy.shared.sync.SharedState.reserve_rate`).

        Raises:
            RateLimited: it does not fit now (``retry_after_s`` says when it would).
        """
        buckets = buckets_for(self._keys, user_id, group, user_limit, group_limit)
        if not buckets:
            return _NO_LIMITS
        if self._shared():
            self.mirror.check(buckets, tokens)
            try:
                # its pipeline may wait for the one in flight: two timeouts at most
                async with asyncio.timeout(self._timeout * 2):
                    number = self.reserve_log.open()
                    call = reserve_args(buckets, tokens, self._log_key, number, self.reserve_log.floor, self._keep_ms)
                    reply = await self.reserves.reserve(call, buckets, tokens, number)
            except UNREACHABLE as e:
                still_cancelled()
                self._on_unreachable(e)
            else:
                wait, scope, unit, levels = parse_reserve(reply, buckets)
                self.mirror.record(buckets, levels)
                if wait > 0:
                    raise RateLimited(wait, scope, unit)
                return Reservation(buckets, tokens)
        self.local_buckets.take(buckets, tokens, self._share(), self.mirror)
        self.adjustments.add(buckets, 1, tokens)  # charged to Redis when it answers again
        return Reservation(buckets, tokens, local=True)

    def settle(self, reservation: Reservation, actual_tokens: int) -> None:
        """Correct the token buckets to the real usage (``actual_tokens``); no await."""
        if reservation.done:
            return
        reservation.done = True
        delta = actual_tokens - reservation.tokens
        if delta:
            self.adjustments.add(reservation.buckets, 0, delta)
            if reservation.local:
                self.local_buckets.adjust(reservation.buckets, 0, delta)

    def refund(self, reservation: Reservation) -> None:
        """Give the whole take back; no await."""
        if reservation.done:
            return
        reservation.done = True
        self.adjustments.add(reservation.buckets, -1, -reservation.tokens)
        if reservation.local:
            self.local_buckets.adjust(reservation.buckets, -1, -reservation.tokens)

    def _write_off(self, number: int, buckets, tokens: int) -> None:
        """Reserve ``number`` was sent but its reply is lost: its request is served from the
        local share (charged to Redis with the next sync), so Redis must give the reserve's
        take back if it ran, or never run it (:class:`proxy.shared.reserve_log.ReserveLog`)."""
        if not self.adjustments.write_off(number, buckets, tokens):
            self.reserve_log.settle(number)  # dropped past the bound: it may cost twice

    # -------------------------------------------------------------------- sync

    def batch(self) -> tuple[int, dict[str, list], list] | None:
        """The corrections to send with this sync (:meth:`PendingAdjustments.freeze`), or
        None when there are none."""
        return self.adjustments.freeze()

    def adjust_call(self, replica_key: str, batch: tuple[int, dict[str, list], list]) -> ScriptCall:
        """The ``adjust`` script call that carries ``batch`` (from :meth:`batch`)."""
        return ("adjust", *adjust_args(replica_key, self._log_key, batch[0], self._keep_ms, batch[1], batch[2]))

    def batch_applied(self) -> None:
        """Redis applied the batch sent: the reserves it wrote off are settled."""
        for number in self.adjustments.confirm():  # written off in Redis: settled
            self.reserve_log.settle(number)

    def redis_is_back(self) -> None:
        """Redis answers again: its buckets are the truth, the local share's are dropped."""
        self.local_buckets.clear()
