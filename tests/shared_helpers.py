"""Simulated schedulers on top of real :class:`proxy.shared.SharedState` objects, for the
shared-state tests: each :class:`SimReplica` reports in-flight and waiting work per class
on one capacity key, and dispatches waiting work only while its grant allows, exactly as
the scheduler's capacity seam will."""

from __future__ import annotations

import asyncio
import time

from proxy.config.schema import SharedStateConfig
from proxy.shared import CapacityReport, ClassDemand, SharedState, SyncReport

KEY = "engine:test:slots"


def config(url: str, **kw) -> SharedStateConfig:
    """A ``shared_state`` section for tests: short interval and lease, prefix per test."""
    base = {"url": url, "sync_interval_s": 0.05, "lease_s": 0.6, "timeout_s": 0.05}
    return SharedStateConfig(**{**base, **kw})


class SimReplica:
    """One replica's scheduler, reduced to counts on one capacity key.

    Args:
        state: the replica's shared state (not started yet).
        capacity: the key's capacity as this replica's config says.
        classes: number of priority classes (0 highest).
    """

    def __init__(self, state: SharedState, capacity: int, classes: int = 3) -> None:
        self.state = state
        self.capacity = capacity
        self.inflight = [0] * classes
        self.waiting = [0] * classes
        self.weight = [1.0] * classes
        self.min_share = [0.0] * classes
        self.open = True  # False: this replica cannot dispatch to the resource now
        self.dispatched = [0] * classes
        state.set_reporter(self.report)
        state.set_on_change(self.fill)

    def report(self) -> SyncReport:
        demand = tuple(ClassDemand(f, w, self.weight[c] if w else 0.0, self.min_share[c]) for c, (f, w) in enumerate(zip(self.inflight, self.waiting)))
        if not self.open:
            demand = ()
        return SyncReport((CapacityReport(KEY, self.capacity, sum(self.inflight), demand, self.open),))

    @property
    def total_inflight(self) -> int:
        return sum(self.inflight)

    def arrive(self, cls: int, n: int = 1, weight: float | None = None) -> None:
        """``n`` requests of class ``cls`` start waiting; dispatch what the grant allows."""
        self.waiting[cls] += n
        if weight is not None:
            self.weight[cls] = weight
        self.fill()
        if self.waiting[cls]:
            self.state.request_sync()

    def fill(self) -> None:
        """Dispatch waiting work, highest class first, while in flight < grant."""
        grant = self.state.grant(KEY) if self.open else 0
        for c in range(len(self.waiting)):
            while self.waiting[c] and self.total_inflight < grant:
                self.waiting[c] -= 1
                self.inflight[c] += 1
                self.dispatched[c] += 1

    def complete(self, cls: int, n: int = 1) -> None:
        """``n`` requests of class ``cls`` finish; dispatch more if the grant allows."""
        n = min(n, self.inflight[cls])
        self.inflight[cls] -= n
        self.fill()


def claims(replicas: list[SimReplica]) -> int:
    """The sum over replicas of max(grant, in flight): never above the capacity."""
    return sum(max(r.state.grant(KEY), r.total_inflight) for r in replicas)


async def wait_for(pred, timeout_s: float, what: str, every_s: float = 0.01, check=None) -> float:
    """Wait (bounded) until ``pred()``; call ``check()`` at every look (an invariant).
    Returns the seconds waited. Raises AssertionError on timeout."""
    start = time.monotonic()
    while True:
        if check is not None:
            check()
        if pred():
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(every_s)


def settled(url: str, prefix: str) -> None:
    """Mark the deployment ``prefix`` as settled (its rebuild window long over), as if its
    replicas had been running for a while: tests not about rebuilding skip the wait."""
    import redis

    from proxy.shared.keys import Keys

    with redis.Redis.from_url(url) as r:
        r.hset(Keys(prefix).epoch, "rebuild_until", 0)


async def wait_rebuilt(states: list[SharedState], timeout_s: float = 10.0) -> None:
    """Wait until every state has synced and the rebuild window of a fresh Redis is over."""
    await wait_for(lambda: all(s.mode == "shared" and not s.rebuilding for s in states), timeout_s, "the rebuild window to close")
