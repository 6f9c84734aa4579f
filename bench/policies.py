"""Baseline admission policies for the fairness benchmark, with the interface of
:class:`qos.Scheduler` (they subclass it, so the proxy can run them unchanged):

* ``fcfs``: plain first come, first served over all groups and users (one global arrival
  order; no priority, no weights, no ``min_share``).
* ``reqcount``: request-count ratio sharing the way LMDeploy-QoS does it
  (``lmdeploy/serve/qos_engine``): strict priority between groups (no ``min_share``);
  inside a group, the waiting user whose share of the group's requests dispatched in the
  last 60 s (six 10 s buckets), divided by its quota (its weight's share), is smallest;
  a user with no request in the window goes first. It counts requests, not tokens.
* ``ours``: :class:`qos.Scheduler` itself, the product under test.

Capacity, queue bounds, timeouts and rate limits are the inherited ones.
"""

from __future__ import annotations

from collections import deque

from qos import Scheduler, SchedulerPolicy
from qos.fair_queue import FairQueue, UserAccount
from qos.ticket import Ticket


class _ArrivalQueue(FairQueue):
    """A class's waiting tickets without the virtual-counter heap."""

    def _push(self, acct: UserAccount, seq: int) -> None:  # no heap at all
        return None

    def head(self) -> Ticket | None:
        self._sort()
        return self._tickets[next(iter(self._tickets))] if self._tickets else None


class FIFOQueue(_ArrivalQueue):
    """Serves its tickets in arrival order."""

    def peek(self, accounts: dict[str, UserAccount]) -> tuple[Ticket, UserAccount] | None:
        t = self.head()
        return None if t is None else (t, accounts[t.user_id])


class RequestRatioQueue(_ArrivalQueue):
    """LMDeploy-QoS's inner-group scheduling: by dispatched request counts in a sliding
    window, relative to each user's quota."""

    def __init__(self, name: str, scheduler: "RequestCountScheduler") -> None:
        super().__init__(name)
        self._sched = scheduler
        self._recent: deque[tuple[float, str]] = deque()  # (dispatch time, user)
        self._counts: dict[str, int] = {}

    def _trim(self, now: float) -> None:
        horizon = now - self._sched.window_s
        bucket = self._sched.window_s / 6  # LMDeploy drops whole 10 s buckets
        horizon = (horizon // bucket) * bucket
        while self._recent and self._recent[0][0] < horizon:
            _t, u = self._recent.popleft()
            self._counts[u] -= 1

    def peek(self, accounts: dict[str, UserAccount]) -> tuple[Ticket, UserAccount] | None:
        self._trim(self._sched.now())
        total = len(self._recent)
        quotas = self._sched.quotas(self.name)
        best: UserAccount | None = None
        best_usage = float("inf")
        for uid, acct in self._backlogged.items():
            quota = quotas.get(uid, 0.0)
            if quota <= 0:
                continue
            share = self._counts.get(uid, 0) / total if total else 0.0
            usage = share / quota
            if usage == 0:
                best = acct
                break
            if usage < best_usage:
                best, best_usage = acct, usage
        if best is not None:
            return best.queue[next(iter(best.queue))], best
        if self._zero_lane:
            t = self._zero_lane[next(iter(self._zero_lane))]
            return t, accounts[t.user_id]
        return None

    def pop(self, accounts: dict[str, UserAccount]) -> Ticket | None:
        t = super().pop(accounts)
        if t is not None:
            self._recent.append((self._sched.now(), t.user_id))
            self._counts[t.user_id] = self._counts.get(t.user_id, 0) + 1
        return t


def _swap_queues(s: Scheduler, make) -> None:
    assert not s.queued, "swap queues before anything is queued"
    s._queues = {name: make(name) for name in s._queues}
    s._order = [s._queues[g.name] for g in s.policy.groups]


class FCFSScheduler(Scheduler):
    """First come, first served across all groups (see the module docstring)."""

    name = "fcfs"

    def __init__(self, policy: SchedulerPolicy, *args, **kw) -> None:
        super().__init__(policy, *args, **kw)
        _swap_queues(self, FIFOQueue)

    def _candidates(self) -> list[FairQueue]:
        best, best_seq = None, None
        for q in self._order:
            t = q.head()  # type: ignore[attr-defined]
            if t is not None and (best_seq is None or t.seq < best_seq):
                best, best_seq = q, t.seq
        return [] if best is None else [best]


class RequestCountScheduler(Scheduler):
    """LMDeploy-QoS-style request-count ratio sharing (see the module docstring).

    Args:
        window_s: the sliding window of dispatched requests (LMDeploy: 60 s).
    """

    name = "reqcount"

    def __init__(self, policy: SchedulerPolicy, *args, window_s: float = 60.0, **kw) -> None:
        super().__init__(policy, *args, **kw)
        self.window_s = window_s
        self._quota_cache: dict[str, dict[str, float]] = {}
        _swap_queues(self, lambda name: RequestRatioQueue(name, self))

    def now(self) -> float:
        return self._clock()

    def quotas(self, group: str) -> dict[str, float]:
        q = self._quota_cache.get(group)
        if q is None:
            members = {u.user_id: u.weight for u in self.policy.users.values() if u.group == group}
            total = sum(members.values())
            q = self._quota_cache[group] = {u: w / total for u, w in members.items()} if total else {}
        return q

    def _candidates(self) -> list[FairQueue]:
        for q in self._order:  # strict priority, no min_share
            if len(q):
                return [q]
        return []


POLICIES = ("ours", "fcfs", "reqcount")
LABELS = {"ours": "llm-qos (VTC)", "fcfs": "FCFS", "reqcount": "request-count"}


def make_scheduler(kind: str, policy: SchedulerPolicy, time_scale: float = 1.0, **kw) -> Scheduler:
    """A scheduler of policy ``kind`` (one of :data:`POLICIES`); ``kw`` are
    :class:`qos.Scheduler`'s keyword arguments (clock, on_admit, on_refuse)."""
    if kind == "ours":
        return Scheduler(policy, **kw)
    if kind == "fcfs":
        return FCFSScheduler(policy, **kw)
    if kind == "reqcount":
        return RequestCountScheduler(policy, window_s=60.0 / time_scale, **kw)
    raise ValueError(f"unknown policy {kind!r}; one of {POLICIES}")
