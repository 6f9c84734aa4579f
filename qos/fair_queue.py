"""Weighted fair queue of one priority class, by virtual token counters.

The algorithm is the Virtual Token Counter (VTC) of Sheng et al., "Fairness in Serving
Large Language Models" (OSDI 2024), extended with weights as in start-time fair queueing:

* Each user ``u`` has a counter ``c_u``: the cost (token units, see
  :class:`qos.policy.CostModel`) of the service it has been charged, divided by its weight.
* The next request served is the head of the queue of the *backlogged* user (one with a
  request waiting) whose counter is smallest; ties go to the earlier arrival.
* When a user becomes backlogged, its counter is lifted to the smallest counter of the
  users already backlogged, or, when none is, to the class's virtual time (the counter the
  last served user had when it was picked). An idle user therefore cannot bank credit and
  later starve the others.
* Dispatching charges the estimated cost; :meth:`FairQueue.charge` adds (or refunds)
  cost later, as real output is counted and when the request ends.

Fairness bound (weighted service of two users ``a`` and ``b`` backlogged over an interval,
when every request's charged cost is final at dispatch): the difference of their counters
never exceeds ``max(C_a / w_a, C_b / w_b)`` where ``C_u`` is the largest cost of one
request of ``u``, so the difference of weighted service over the interval is at most
``2 * max(C_a / w_a, C_b / w_b)`` (the VTC paper proves the unweighted form of this bound;
weights scale each counter's increments, and the same argument holds). Costs charged after
dispatch (streamed output beyond the estimate, or a refund at the end) move a counter by at
most the estimate error of that user's requests in flight, which adds to the bound.

Users of weight 0 are served only when no user of positive weight in the class waits,
among themselves in arrival order.

All operations are O(log n) in the number of backlogged users (a heap with lazy
deletion), O(1) in the number of queued requests.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from .ticket import Ticket


@dataclass(slots=True)
class UserAccount:
    """Fair-sharing state of one user; survives config reloads.

    Attributes:
        user_id: the user.
        weight: current weight (>= 0).
        group: the class the user's requests currently queue in.
        counter: virtual token counter, cost / weight (token units).
        version: bumped whenever the heap entry of this user goes stale.
        queue: the user's waiting tickets in arrival order (insertion-ordered dict).
    """

    user_id: str
    weight: float
    group: str = ""
    counter: float = 0.0
    version: int = 0
    queue: dict[int, Ticket] = field(default_factory=dict)


class FairQueue:
    """Waiting requests of one priority class, served by weighted virtual token counters.

    Args:
        name: the class's name (for diagnostics).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.vtime = 0.0
        self._heap: list[tuple[float, int, int, str]] = []  # (counter, seq, version, user)
        self._zero_lane: dict[int, Ticket] = {}  # tickets of weight-0 users, arrival order
        self._tickets: dict[int, Ticket] = {}  # every waiting ticket, arrival order
        self._backlogged: dict[str, UserAccount] = {}

    def __len__(self) -> int:
        return len(self._tickets)

    def tickets(self) -> list[Ticket]:
        """The waiting tickets in arrival order (a copy)."""
        return list(self._tickets.values())

    def newest(self) -> Ticket | None:
        """The most recently queued ticket, or ``None`` when empty."""
        if not self._tickets:
            return None
        return self._tickets[next(reversed(self._tickets))]

    def _min_backlogged_counter(self) -> float | None:
        heap = self._heap
        while heap:
            counter, _seq, version, uid = heap[0]
            acct = self._backlogged.get(uid)
            if acct is not None and acct.version == version:
                return counter
            heapq.heappop(heap)
        return None

    def _push(self, acct: UserAccount, seq: int) -> None:
        acct.version += 1
        heapq.heappush(self._heap, (acct.counter, seq, acct.version, acct.user_id))

    def push(self, ticket: Ticket, acct: UserAccount) -> None:
        """Queue ``ticket`` of the user whose account is ``acct`` (lifting its counter if
        the user was not backlogged)."""
        self._tickets[ticket.seq] = ticket
        if acct.weight <= 0:
            acct.queue[ticket.seq] = ticket
            self._zero_lane[ticket.seq] = ticket
            return
        was_idle = not acct.queue
        acct.queue[ticket.seq] = ticket
        if was_idle:
            floor = self._min_backlogged_counter()
            acct.counter = max(acct.counter, self.vtime if floor is None else floor)
            self._backlogged[acct.user_id] = acct
            self._push(acct, ticket.seq)

    def pop(self, accounts: dict[str, UserAccount]) -> Ticket | None:
        """Remove and return the next ticket to serve (see :meth:`peek`).

        The caller charges its cost with :meth:`charge` afterwards.
        """
        head = self.peek(accounts)
        if head is None:
            return None
        ticket, acct = head
        self.remove(ticket, acct)
        if acct.weight > 0:
            self.vtime = max(self.vtime, acct.counter)
        return ticket

    def peek(self, accounts: dict[str, UserAccount]) -> tuple[Ticket, UserAccount] | None:
        """The ticket that would be served next and its user's account (weight-0 users'
        accounts are looked up in ``accounts``), without removing it; ``None`` when the
        class has nothing waiting."""
        heap = self._heap
        while heap:
            _counter, _seq, version, uid = heap[0]
            acct = self._backlogged.get(uid)
            if acct is not None and acct.version == version:
                return acct.queue[next(iter(acct.queue))], acct
            heapq.heappop(heap)
        if self._zero_lane:
            t = self._zero_lane[next(iter(self._zero_lane))]
            return t, accounts[t.user_id]
        return None

    def remove(self, ticket: Ticket, acct: UserAccount) -> None:
        """Remove a waiting ``ticket`` (served, cancelled, timed out or evicted)."""
        del self._tickets[ticket.seq]
        del acct.queue[ticket.seq]
        if acct.weight <= 0:
            self._zero_lane.pop(ticket.seq, None)
            return
        if not acct.queue:
            self._backlogged.pop(acct.user_id, None)
            acct.version += 1  # invalidates its heap entry
        elif ticket.seq < next(iter(acct.queue)):
            # the head changed; the entry's tie-break seq follows the new head
            self._push(acct, next(iter(acct.queue)))

    def charge(self, acct: UserAccount, cost: float) -> None:
        """Add ``cost`` token units (negative refunds) to ``acct``'s counter, scaled by
        its weight. Weight-0 users keep a counter of 0."""
        if acct.weight <= 0 or cost == 0:
            return
        acct.counter += cost / acct.weight
        if acct.user_id in self._backlogged:
            self._push(acct, next(iter(acct.queue)))

    def detach(self, acct: UserAccount) -> list[Ticket]:
        """Remove all of ``acct``'s waiting tickets from this class and return them (used
        when a reload moves the user to another class or changes its weight)."""
        moved = list(acct.queue.values())
        for t in moved:
            self.remove(t, acct)
        return moved

    def min_counter(self) -> float:
        """Smallest counter among backlogged users (``inf`` when none)."""
        c = self._min_backlogged_counter()
        return math.inf if c is None else c
