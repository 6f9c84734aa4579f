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
deadline or until that user's next request is dispatched. The rule is
:func:`owed_slot` (who gets a hold) and :func:`held_before` (whom it blocks); the
scheduler applies it for ``hold_slot_s`` of :class:`qos.SchedulerPolicy`.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, Iterator, Mapping

if TYPE_CHECKING:  # pragma: no cover
    from .fair_queue import FairQueue, UserAccount


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


def owed_slot(queue: FairQueue, released: UserAccount, accounts: dict[str, UserAccount]) -> UserAccount | None:
    """The user the slot a request of ``released`` just freed is kept for, or ``None``
    (the queue takes it): ``released`` itself when it has nothing waiting and no user of
    its class (``queue``) waits; when users of its class wait, the most owed user of the
    class with nothing waiting (``released``, or one with requests in flight ending,
    maybe, in the same engine step: :meth:`qos.fair_queue.FairQueue.most_owed_absent`)
    if it ranks before every one of them. ``accounts``: every user tracked, by id (for
    :meth:`~qos.fair_queue.FairQueue.peek`). A closed-loop client has nothing waiting
    at the instant its requests end, and on a batching engine requests started together
    end together: without the hold, its share of the slots goes to whoever waits or
    comes first, for a whole request's time (module docstring)."""
    head = queue.peek(accounts)
    if head is None:
        return released if released.weight > 0 and not released.queue else None
    owed = queue.most_owed_absent(released)
    if owed is not None and head[1].weight > 0 and head[1].key <= owed.key:
        return None  # a user waiting ranks first: the slot is its
    return owed


def held_before(holds: SlotHolds, acct: UserAccount, rank: Mapping[str, int], accounts: Mapping[str, UserAccount]) -> int:
    """Slots ``holds`` keeps for users who rank before ``acct`` (a head about to be
    served): holds of users of a higher class, and of users of its class with a smaller
    key (every holder ranks before a weight-0 user). ``rank``: class name -> priority
    index (0 highest); ``accounts``: every user tracked, by id. O(holders)."""
    last = len(rank)
    mine = rank.get(acct.group, last)
    n = 0
    for uid, count in holds.holders():
        if uid == acct.user_id:
            continue
        holder = accounts.get(uid)
        if holder is None:
            continue
        r = rank.get(holder.group, last)
        if r < mine or (r == mine and (acct.weight <= 0 or holder.key < acct.key)):
            n += count
    return n
