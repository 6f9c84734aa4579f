"""The same surface as :class:`proxy.shared.sync.SharedState`, for one process alone: no
Redis, nothing shared. The proxy holds one of the two and never asks which."""

from __future__ import annotations

from typing import Callable

from qos import RateLimit

from .keys import Keys
from .local_buckets import LocalBuckets
from .rate_limits import Reservation, buckets_for
from .sync import SyncReport

_NO_LIMITS = Reservation((), 0, done=True)


class StandaloneState:
    """Standalone: grants are not limited by anyone else, rate limits are local buckets,
    service counters are this process's own.

    Args:
        clock: monotonic seconds (for the local buckets).
    """

    mode = "standalone"
    live_replicas = 1

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self.keys = Keys("local")
        self.local_buckets = LocalBuckets() if clock is None else LocalBuckets(clock=clock)
        self._service: dict[tuple[str, str], float] = {}

    def set_reporter(self, reporter: Callable[[], SyncReport]) -> None:
        """Accepted and unused (nothing to report to)."""

    def set_on_change(self, callback: Callable[[], None]) -> None:
        """Accepted and unused (grants never change)."""

    def set_on_sync(self, callback: Callable[[], None]) -> None:
        """Accepted and unused (there are no syncs)."""

    def request_sync(self) -> None:
        """Nothing to sync."""

    async def start(self) -> None:
        """Nothing to start."""

    async def stop(self) -> None:
        """Nothing to stop."""

    def grant(self, key: str) -> int | None:
        """None: no other replica shares the capacity; the scheduler's own applies."""
        return None

    async def reserve_rate(self, user_id: str, group: str, user_limit: RateLimit, group_limit: RateLimit, tokens: int) -> Reservation:
        """Take from this process's buckets (see :meth:`SharedState.reserve_rate`).

        Raises:
            RateLimited: it does not fit now.
        """
        buckets = buckets_for(self.keys, user_id, group, user_limit, group_limit)
        if not buckets:
            return _NO_LIMITS
        self.local_buckets.take(buckets, tokens)
        return Reservation(buckets, tokens, local=True)

    def settle_rate(self, reservation: Reservation, actual_tokens: int) -> None:
        """Correct the token buckets to the real usage."""
        if not reservation.done:
            reservation.done = True
            self.local_buckets.adjust(reservation.buckets, 0, actual_tokens - reservation.tokens)

    def refund_rate(self, reservation: Reservation) -> None:
        """Give the whole take back."""
        if not reservation.done:
            reservation.done = True
            self.local_buckets.adjust(reservation.buckets, -1, -reservation.tokens)

    def report_service(self, pool: str, user_id: str, cost: float) -> None:
        """Count service rendered here (the only replica)."""
        k = (pool, user_id)
        self._service[k] = self._service.get(k, 0.0) + cost

    def global_service(self, pool: str, user_id: str) -> float | None:
        """This process's own total: it is the global one."""
        return self._service.get((pool, user_id))

    def take_remote_service(self) -> dict[tuple[str, str], float]:
        """Always empty: there are no other replicas."""
        return {}

    def status(self) -> dict:
        """A summary for ``/admin/status``."""
        return {"mode": self.mode, "live_replicas": 1}
