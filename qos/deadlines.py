"""The queued requests' deadlines (``queue_timeout_s``), earliest first: a heap with lazy
deletion, so a ticket that leaves the queue costs nothing here until its entry reaches
the top."""

from __future__ import annotations

import heapq
from typing import Iterator

from .ticket import Ticket, TicketState


class Deadlines:
    """The deadline of every queued ticket (clock seconds, :attr:`qos.Ticket.deadline`).
    An entry is stale once its ticket is no longer QUEUED or has a later deadline (a
    preempted ticket queued again); stale entries are dropped when they reach the top,
    and all at once when they outnumber the live ones (amortized O(1) per :meth:`add`).
    """

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Ticket]] = []  # (deadline, seq, ticket)

    def add(self, ticket: Ticket, queued: int) -> None:
        """Track ``ticket``'s deadline; ``queued``: tickets queued now (``ticket`` among
        them), the live entries to expect."""
        heap = self._heap
        heapq.heappush(heap, (ticket.deadline, ticket.seq, ticket))
        if len(heap) > 2 * queued + 1024:
            # entries of tickets no longer queued are dropped lazily from the top only;
            # compact now and then so they cannot pile up
            self._heap = [e for e in heap if e[2].state is TicketState.QUEUED]
            heapq.heapify(self._heap)

    def due(self, now: float) -> Iterator[Ticket]:
        """Yield each queued ticket whose deadline is at or before ``now``, earliest
        first, dropping its entry (and the stale ones on the way). The caller takes each
        out of the queue before the next. O(k log n) for k entries dropped."""
        heap = self._heap
        while heap and (heap[0][2].state is not TicketState.QUEUED or heap[0][0] <= now):
            d, _s, t = heapq.heappop(heap)
            if t.state is TicketState.QUEUED and d == t.deadline:  # not a requeued ticket's old entry
                yield t

    def earliest(self) -> float | None:
        """The earliest deadline of a queued ticket, or ``None`` when nothing waits."""
        heap = self._heap
        while heap and (heap[0][2].state is not TicketState.QUEUED or heap[0][0] != heap[0][2].deadline):
            heapq.heappop(heap)
        return heap[0][0] if heap else None
