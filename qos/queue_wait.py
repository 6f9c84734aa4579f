"""How long a queue takes to drain, measured: the ``Retry-After`` of a refusal and the
estimated wait of a request in the queue.

Pure (no I/O, no clock of its own): every method takes the caller's clock reading
``now`` (seconds, monotonic).

:class:`DrainRate` measures the rate at which a queue *starts* requests (dispatches per
second) while it has work waiting. It is what the engines behind the queue really take,
whatever set their capacity (a hand-set ``max_inflight``, the adaptive controller of
:mod:`qos.capacity_control`, a lease, an engine ejected) and whatever took room back
(preemption requeues a request: it is started again later and counted again, as it
waits again). Only time with work waiting counts: an idle queue starts what arrives, at
the arrival rate, which says nothing of what the engines could take. The estimate is the
inverse of an exponentially weighted moving average of the *busy* time between starts
(weight :data:`DRAIN_WEIGHT`: about the last ten starts; a plain mean of the first ten); idle time changes nothing, so
what was learned survives a quiet spell. While work waits and nothing starts (an engine
stalled), the busy time since the last start is used once it exceeds the average, so
the rate falls at once.

:meth:`QueueWait.retry_after_s` turns a rate into the wait before a request arriving now would be
*admitted*: it has a place in the queue and is started before its queue timeout. With
``R`` the drain rate (requests/s), ``T`` the queue timeout (s), and for a request of a
class of priority rank ``r`` (strict priority serves higher classes first):

* ``n_room = queued + 1 - max_queue``: starts until the pool's queue has a free place;
* ``n_group = waiting_above + len(own class) + 1 - group max_queue``: until its class's
  queue has one (its class drains only after the classes above it);
* ``n_timely = waiting_ahead + 1 - R * T``: until the requests ahead of it (its own
  class's and the classes above) are few enough to be started within ``T``;

``wait = max(n_room, n_group, n_timely) / R``. Refused clients told to come back are
counted too: each :class:`QueueWait` keeps, per class, the start the last one was
expected at (its *promise*, before the 1 s floor), and a new refusal is told
``max(wait, last promise + 1/R - now)``, so clients refused together come back one
start apart instead of all at once (each would otherwise find the one free place taken
by the first). The answer is bounded to
``[1 s, MAX_RETRY_AFTER_S]``; the header says it in whole seconds, rounded up
(RFC 9110 §10.2.3: ``Retry-After`` is a non-negative integer of seconds).

Before any start has been measured the rate is the old guess, one request per second per
slot of capacity (:data:`FALLBACK_RATE_PER_SLOT`).

What it does not model: arrivals after the answer (a higher class arriving later goes
first), ``min_share`` (a class below its share is served out of priority order), and
users' fair order inside a class (a waiting request's position counts every request of
its class that arrived before it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

DRAIN_WEIGHT = 0.1
"""Weight of each new interval between starts in the drain-rate average."""

MIN_STARTS = 2
"""Starts counted before the measured rate is used (else the fallback)."""

FALLBACK_RATE_PER_SLOT = 1.0
"""Requests per second per slot of capacity assumed before any start was measured."""

MIN_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 300.0
"""Bounds of a ``Retry-After`` (seconds): at least 1 s, at most 5 min whatever the queue."""


class DrainRate:
    """Requests started per second from a queue while it has work waiting: the inverse
    of an exponentially weighted moving average of the busy time between starts (the
    module docstring).

    Args:
        weight: the weight of each new interval in the average (0 < weight <= 1; the
            default :data:`DRAIN_WEIGHT` remembers about the last ten starts).
    """

    __slots__ = ("weight", "_mean", "_intervals", "_open", "_at", "_waiting")

    def __init__(self, weight: float = DRAIN_WEIGHT) -> None:
        if not 0.0 < weight <= 1.0:
            raise ValueError("weight must be in (0, 1]")
        self.weight = weight
        self._mean = 0.0  # the average busy time between starts (s)
        self._intervals = 0  # intervals averaged (up to MIN_STARTS: then the rate is used)
        self._open = 0.0  # busy time since the last start counted (s)
        self._at: float | None = None  # the last observation
        self._waiting = False  # work waited since the last observation

    def _busy_since_start(self, now: float) -> float:
        if self._at is None or not self._waiting or now <= self._at:
            return self._open
        return self._open + (now - self._at)

    def observe(self, now: float, waiting: int) -> None:
        """The queue holds ``waiting`` requests from ``now`` on. Call after every change
        of the queue's length (O(1))."""
        self._open = self._busy_since_start(now)
        self._at = now
        self._waiting = waiting > 0

    def started(self, now: float, waiting: int) -> None:
        """A request left the queue for an engine at ``now``, leaving ``waiting``
        requests in it. Counted when work was waiting just before (a request started the
        moment it arrived at an empty queue says nothing of the drain rate). O(1)."""
        counted = self._waiting
        self.observe(now, waiting)
        if counted:
            gap, self._open = self._open, 0.0
            self._intervals += 1
            # a plain mean of the first 1/weight intervals, then the moving average (so
            # the first interval does not weigh more than the others)
            self._mean += max(self.weight, 1.0 / self._intervals) * (gap - self._mean)

    def rate(self, now: float) -> float | None:
        """Requests started per second while work waited, as of ``now``: ``1 / mean``,
        or less while the busy time since the last start is already longer than the mean
        (a stall shows at once); ``None`` until :data:`MIN_STARTS` have been counted."""
        if self._intervals < MIN_STARTS:
            return None
        gap = max(self._mean, self._busy_since_start(now))
        return 1.0 / gap if gap > 0.0 else None


def starts_needed(
    queued: int,
    max_queue: int,
    waiting_above: int,
    waiting_class: int,
    group_max_queue: int | None,
    rate: float,
    queue_timeout_s: float,
) -> float:
    """Requests that must start before one of this class, arriving now, would be admitted
    (a place in the queue, and started within its queue timeout); the module docstring's
    ``max(n_room, n_group, n_timely)``, at least 0.

    Args:
        queued: requests waiting in the pool's queue, all classes.
        max_queue: the pool's queue bound.
        waiting_above: requests waiting in the classes above this one.
        waiting_class: requests waiting in this class.
        group_max_queue: this class's own queue bound, or ``None``.
        rate: the drain rate (requests/s, > 0).
        queue_timeout_s: how long a request may wait (s).
    """
    n_room = queued + 1 - max_queue
    n_group = waiting_above + waiting_class + 1 - group_max_queue if group_max_queue is not None and waiting_class + 1 > group_max_queue else 0
    n_timely = waiting_above + waiting_class + 1 - rate * queue_timeout_s
    return max(0.0, float(n_room), float(n_group), n_timely)


def bounded(wait_s: float) -> float:
    """``wait_s`` within ``[MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S]``."""
    return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, wait_s))


class QueueWait:
    """One queue's drain rate and the promises made to refused clients (per class).

    Attributes:
        drain: the measured :class:`DrainRate`.
    """

    __slots__ = ("drain", "_promised")

    def __init__(self, weight: float = DRAIN_WEIGHT) -> None:
        self.drain = DrainRate(weight)
        self._promised: dict[str, float] = {}  # class -> when the last refused client was told to return

    def rate(self, now: float, slots: int) -> float:
        """The drain rate to plan with (requests/s): the measured one, else
        :data:`FALLBACK_RATE_PER_SLOT` per slot of capacity (``slots``, at least 1)."""
        r = self.drain.rate(now)
        return r if r is not None else FALLBACK_RATE_PER_SLOT * max(1, slots)

    def retry_after_s(self, now: float, group: str, needed: float, rate: float, promise: bool = True) -> float:
        """The ``Retry-After`` (seconds, bounded) for a client of ``group`` refused now:
        ``needed`` starts (:func:`starts_needed`) at ``rate``, and no earlier than one
        start after the last client of ``group`` told to return. ``promise``: this
        answer goes to a client (it is recorded, and the next is told later)."""
        wait = needed / rate
        last = self._promised.get(group)
        if last is not None and last + 1.0 / rate > now + wait:
            wait = last + 1.0 / rate - now
        if promise:
            self._promised[group] = now + min(wait, MAX_RETRY_AFTER_S)  # the start it is expected at, before the 1 s floor
        return bounded(wait)

    def forget(self, groups: Sequence[str]) -> None:
        """Keep promises only for ``groups`` (the classes of a new policy)."""
        self._promised = {g: t for g, t in self._promised.items() if g in groups}


__all__ = [
    "DRAIN_WEIGHT",
    "FALLBACK_RATE_PER_SLOT",
    "MAX_RETRY_AFTER_S",
    "MIN_RETRY_AFTER_S",
    "MIN_STARTS",
    "DrainRate",
    "QueueWait",
    "bounded",
    "starts_needed",
]
