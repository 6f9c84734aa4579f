"""Freed slots kept for a moment for the user they are owed to (anticipation).

A closed-loop client (one that sends its next request when its last one ends) has
nothing waiting at the instant its requests end, so a work-conserving dispatcher hands
the slots they free to whoever else waits, and the client's next requests, a round trip
later, find the slots taken. On a continuously-batching engine this is the rule, not a
race: every request in the batch advances one token per engine step, so requests of the
same length started together end in the same step, and a user's whole share of the
slots frees at one moment, is given away, and stays away for a whole request's time.
The scheduler's order (weighted fair keys) never gets a say: at each such moment only
one user waits. This is the "deceptive idleness" of synchronous clients, and the remedy
is theirs: keep the freed resource idle for a short while for the client that is about
to ask again (S. Iyer and P. Druschel, "Anticipatory scheduling: a disk scheduling
framework to overcome deceptive idleness in synchronous I/O", SOSP 2001).

:class:`SlotHolds` is the bookkeeping: each hold keeps one slot for one user until a
deadline or until that user's next request is dispatched. Who gets a hold and who it
blocks is the scheduler's rule (:class:`qos.Scheduler`, ``hold_slot_s`` in
:class:`qos.SchedulerPolicy`).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Iterator


class SlotHolds:
    """Slots kept, one per hold, each for one user until its end (clock seconds) or
    until :meth:`take` consumes it. Size: at most one hold per request released, so at
    most the requests released within one hold's time; operations O(log holds),
    :meth:`holders` O(holders)."""

    __slots__ = ("_heap", "_live", "_skip", "_seq", "total", "taken", "expired")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []  # (end, seq, user), lazy deletion
        self._live: dict[str, int] = {}  # user -> holds it has now
        self._skip: dict[str, int] = {}  # user -> heap entries already taken (dropped when they reach the top)
        self._seq = itertools.count()
        self.total = 0
        """Holds live now."""
        self.taken = 0
        """Holds consumed by their user's next request (since start)."""
        self.expired = 0
        """Holds that ended unused: their slot went to the queue (since start)."""

    def __len__(self) -> int:
        return self.total

    def hold(self, user_id: str, end: float) -> None:
        """Keep one slot for ``user_id`` until clock reading ``end``."""
        heapq.heappush(self._heap, (end, next(self._seq), user_id))
        self._live[user_id] = self._live.get(user_id, 0) + 1
        self.total += 1

    def take(self, user_id: str) -> bool:
        """Consume one of ``user_id``'s holds (its request was dispatched into the slot).
        Returns False when it has none."""
        n = self._live.get(user_id)
        if not n:
            return False
        if n == 1:
            del self._live[user_id]
        else:
            self._live[user_id] = n - 1
        self._skip[user_id] = self._skip.get(user_id, 0) + 1  # its earliest entry goes
        self.total -= 1
        self.taken += 1
        return True

    def prune(self, now: float) -> int:
        """Drop the holds whose end is at or before ``now``. Returns how many live ones
        ended (their slots are free for the queue again)."""
        ended = 0
        heap = self._heap
        while heap and heap[0][0] <= now:
            _end, _seq, uid = heapq.heappop(heap)
            skip = self._skip.get(uid)
            if skip:
                if skip == 1:
                    del self._skip[uid]
                else:
                    self._skip[uid] = skip - 1
                continue
            n = self._live[uid]
            if n == 1:
                del self._live[uid]
            else:
                self._live[uid] = n - 1
            self.total -= 1
            ended += 1
        self.expired += ended
        return ended

    def next_end(self) -> float | None:
        """The earliest end of a live hold, or ``None`` when there is none. Amortized
        O(log holds): entries already taken are dropped from the top here."""
        heap = self._heap
        while heap:
            uid = heap[0][2]
            skip = self._skip.get(uid)
            if not skip:
                return heap[0][0]
            # the top is its user's earliest entry, and that user has taken as many holds
            # as it has skips: its earliest entries are the ones taken
            heapq.heappop(heap)
            if skip == 1:
                del self._skip[uid]
            else:
                self._skip[uid] = skip - 1
        return None

    def holders(self) -> Iterator[tuple[str, int]]:
        """``(user, holds)`` for every user with live holds."""
        return iter(self._live.items())

    def clear(self) -> None:
        """Drop every hold (not counted as expired)."""
        self._heap.clear()
        self._live.clear()
        self._skip.clear()
        self.total = 0
