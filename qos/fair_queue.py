"""Weighted fair queue of one priority class, by virtual token counters.

The algorithm is the Virtual Token Counter (VTC) of Sheng et al., "Fairness in Serving
Large Language Models" (OSDI 2024), extended with weights as in start-time fair queueing,
and with the accounting made robust against clients that game it:

* Each user ``u`` has a **counter** ``c_u``: the cost (token units, see
  :class:`qos.policy.CostModel`) of the service it has been *seen to receive*, divided by
  its weight: output tokens as they are produced, the prompt and the real counts when a
  request ends (VTC's own rule), plus the lifts below. A request's ``max_tokens`` never
  enters it.
* Each user also has a **pending** part ``p_u`` (token units): the *expected* cost of its
  requests in flight not confirmed yet (:class:`qos.usage_model.UsageModel`: the
  request's estimates scaled by how the user's own recent requests turned out; little
  output expected until one has ended). Users are ordered by their **key**
  ``k_u = c_u + p_u / w_u``, so requests in flight throttle their user.
* The next request served is the head of the queue of the *backlogged* user (one with a
  request waiting) whose key is smallest; ties go to the earlier arrival.
* The class's **virtual time** ``V`` is the largest key a user had when it was picked
  (start-time fair queueing's virtual time, on keys), less the *speculative* part of its
  pending (what a user with no finished request yet claims: see
  :mod:`qos.usage_model`): where the users served now stand.
  A user that becomes backlogged is lifted so that its key is at least ``V``:
  ``c_u = max(c_u, V - p_u / w_u)``. Idle time is not banked as credit (the others'
  progress while it did not wait moved ``V``), a returning user gets no head start over
  the users waiting (``V`` includes their expected costs in flight), and a closed-loop
  client whose queue empties between two requests loses nothing (its own requests in
  flight count for it, and a user below ``V`` is one that ``V`` has not passed: it was
  picked at ``V`` or before). What a later refund can take from under a lifted user is
  only the *error* of learned expectations in flight when ``V`` was set, which the usage
  model keeps small: a user whose requests are refused or abandoned is expected to cost
  nothing after a few, and a new identity's claims (``max_tokens`` among them) never
  enter ``V`` at all.
* Counters are kept relative to the class: when ``V`` grows past :data:`REBASE_AT` every
  counter of the class (and ``V``) is shifted down by ``V``, so ordinary costs never
  vanish in float rounding next to a huge value (O(members) per shift, amortized over at
  least ``REBASE_AT`` units of service).

The fairness bound this gives, with its proof sketch, is in ``docs/scheduling.md``.

Users of weight 0 are served only when no user of positive weight in the class waits,
among themselves in arrival order.

Operations are O(log n) in the number of backlogged users (a heap with lazy deletion,
compacted when stale entries pile up), O(1) in the number of queued requests.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from .ticket import Ticket

REBASE_AT = 2.0**40
"""Virtual time (token units per weight) above which a class shifts its counters down.
Below ``2 * REBASE_AT`` a float still resolves 1/4096 of a token unit."""

_KEY_EPS = 1e-12  # a key change below this (relative) does not re-sort the heap
_STAMPS = itertools.count(1)  # heap-entry versions, unique across accounts and their
# reincarnations (a forgotten user's old entries must never match its new account)


@dataclass(slots=True)
class UserAccount:
    """Fair-sharing state of one user; survives config reloads.

    Attributes:
        user_id: the user.
        weight: current weight (>= 0).
        group: the class the user's requests queue in now (one class at a time).
        requested_group: the class a trusted source named with the user's latest
            request (``None``: the policy decides); kept so a reload can re-place it.
        counter: confirmed counter (token units / weight), relative to its class.
        pending: expected cost of the requests in flight not confirmed yet (token units).
        speculative: the part of ``pending`` that is a new user's own claim
            (:attr:`qos.Ticket.speculative`); it orders the user but never moves the
            virtual time.
        inflight: the user's requests in flight.
        version: stamp of the user's valid heap entry (a fresh one whenever the old
            entry goes stale; stamps are never reused).
        queue: the user's waiting tickets in arrival order (insertion-ordered dict).
        recent: decayed confirmed cost (token units), for status pages.
        recent_at: clock reading ``recent`` was last decayed to.
    """

    user_id: str
    weight: float
    group: str = ""
    requested_group: str | None = None
    counter: float = 0.0
    pending: float = 0.0
    speculative: float = 0.0
    inflight: int = 0
    version: int = 0
    queue: dict[int, Ticket] = field(default_factory=dict)
    recent: float = 0.0
    recent_at: float = 0.0

    @property
    def key(self) -> float:
        """The order of the user among backlogged users: ``counter + pending / weight``."""
        return self.counter + self.pending / self.weight if self.weight > 0 else self.counter


class FairQueue:
    """Waiting requests of one priority class, served by weighted virtual token counters.

    Args:
        name: the class's name (for diagnostics).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.vtime = 0.0
        self.rebases = 0
        self.members: dict[str, UserAccount] = {}  # every account whose class this is
        self._heap: list[tuple[float, int, int, str]] = []  # (key, seq, version, user)
        self._zero_lane: dict[int, Ticket] = {}  # tickets of weight-0 users, arrival order
        self._tickets: dict[int, Ticket] = {}  # every waiting ticket, arrival order
        self._backlogged: dict[str, UserAccount] = {}
        self._running: dict[str, UserAccount] = {}  # members with requests in flight
        self._unsorted = False  # tickets moved in out of arrival order (see push)

    def __len__(self) -> int:
        return len(self._tickets)

    def _sort(self) -> None:
        if self._unsorted:
            self._tickets = dict(sorted(self._tickets.items()))
            self._zero_lane = dict(sorted(self._zero_lane.items()))
            self._unsorted = False

    def tickets(self) -> list[Ticket]:
        """The waiting tickets in arrival order (a copy)."""
        self._sort()
        return list(self._tickets.values())

    def newest(self, evictable: bool = False) -> Ticket | None:
        """The most recently queued ticket, or ``None`` when empty. ``evictable``: the
        most recent one not waiting to be resumed (:attr:`Ticket.resuming`: its client
        is reading part of the answer), or ``None`` when every one is."""
        self._sort()
        for seq in reversed(self._tickets):
            t = self._tickets[seq]
            if not (evictable and t.resuming):
                return t
        return None

    # ------------------------------------------------------------- membership

    def join(self, acct: UserAccount, relative: float | None = None) -> None:
        """Make ``acct`` a member of this class. ``relative``: its counter's position
        against this class's virtual time (kept from the class it leaves); ``None``
        for a new account (placed at the virtual time)."""
        acct.group = self.name
        acct.counter = self.vtime + (0.0 if relative is None else relative)
        self.members[acct.user_id] = acct
        if acct.inflight > 0:
            self._running[acct.user_id] = acct

    def leave(self, acct: UserAccount) -> tuple[list[Ticket], float]:
        """Remove ``acct`` and its waiting tickets from this class. Returns the tickets
        (arrival order) and the counter's position relative to the virtual time."""
        moved = list(acct.queue.values())
        for t in moved:
            self.remove(t, acct)
        self.members.pop(acct.user_id, None)
        self._running.pop(acct.user_id, None)
        return moved, acct.counter - self.vtime

    # ---------------------------------------------------------------- the heap

    def _push(self, acct: UserAccount, seq: int) -> None:
        acct.version = next(_STAMPS)
        heap = self._heap
        heapq.heappush(heap, (acct.key, seq, acct.version, acct.user_id))
        if len(heap) > 2 * len(self._backlogged) + 64:
            # stale entries are dropped lazily from the top only: rebuild now and then so
            # they cannot pile up (amortized O(1) per push)
            self._heap = [(a.key, next(iter(a.queue)), a.version, uid) for uid, a in self._backlogged.items()]
            heapq.heapify(self._heap)

    def _top(self) -> UserAccount | None:
        heap = self._heap
        while heap:
            _key, _seq, version, uid = heap[0]
            acct = self._backlogged.get(uid)
            if acct is not None and acct.version == version:
                return acct
            heapq.heappop(heap)
        return None

    def push(self, ticket: Ticket, acct: UserAccount, lift: bool = True) -> None:
        """Queue ``ticket`` of the member ``acct``. A user that was not backlogged is
        lifted to the virtual time first, unless ``lift`` is false (a move from another
        class keeps its position; its tickets may arrive out of order, and are sorted
        back into arrival order when next needed)."""
        if not lift and self._tickets and ticket.seq < next(reversed(self._tickets)):
            self._unsorted = True
        self._tickets[ticket.seq] = ticket
        if acct.weight <= 0:
            acct.queue[ticket.seq] = ticket
            self._zero_lane[ticket.seq] = ticket
            return
        was_idle = not acct.queue
        if was_idle and lift:
            # lift the user's key (its own requests in flight count) to the virtual time
            need = self.vtime - acct.pending / acct.weight
            if acct.counter < need:
                acct.counter = need
        acct.queue[ticket.seq] = ticket
        if was_idle:
            self._backlogged[acct.user_id] = acct
            self._push(acct, ticket.seq)

    def push_front(self, ticket: Ticket, acct: UserAccount) -> None:
        """Queue ``ticket`` of the member ``acct`` *ahead of* its user's other waiting
        tickets, without lifting the user (a preempted request going back to the head
        of its queue: :meth:`qos.Scheduler.requeue`). In the class's arrival order it
        takes its own place (its ``seq``)."""
        if self._tickets and ticket.seq < next(reversed(self._tickets)):
            self._unsorted = True
        self._tickets[ticket.seq] = ticket
        was_idle = not acct.queue
        rest = acct.queue
        acct.queue = {ticket.seq: ticket}
        acct.queue.update(rest)
        if acct.weight <= 0:
            self._zero_lane[ticket.seq] = ticket
            return
        if was_idle:
            self._backlogged[acct.user_id] = acct
        self._push(acct, ticket.seq)  # a new head: a fresh entry (the old one goes stale)

    def peek(self, accounts: dict[str, UserAccount]) -> tuple[Ticket, UserAccount] | None:
        """The ticket that would be served next and its user's account (weight-0 users'
        accounts are looked up in ``accounts``), without removing it; ``None`` when the
        class has nothing waiting."""
        acct = self._top()
        if acct is not None:
            return acct.queue[next(iter(acct.queue))], acct
        if self._zero_lane:
            self._sort()
            t = self._zero_lane[next(iter(self._zero_lane))]
            return t, accounts[t.user_id]
        return None

    def pop(self, accounts: dict[str, UserAccount]) -> Ticket | None:
        """Remove and return the next ticket to serve (see :meth:`peek`), advancing the
        virtual time to its user's confirmed counter. The caller charges it after."""
        head = self.peek(accounts)
        if head is None:
            return None
        ticket, acct = head
        if acct.weight > 0:
            # a new user's own claims (speculative) never move the virtual time
            v = acct.key - acct.speculative / acct.weight
            if v > self.vtime:
                self.vtime = v
                if v > REBASE_AT:
                    self.rebase(v)
        self.remove(ticket, acct)
        return ticket

    def remove(self, ticket: Ticket, acct: UserAccount) -> None:
        """Remove a waiting ``ticket`` (served, cancelled, timed out or evicted)."""
        del self._tickets[ticket.seq]
        del acct.queue[ticket.seq]
        if acct.weight <= 0:
            self._zero_lane.pop(ticket.seq, None)
            return
        if not acct.queue:
            self._backlogged.pop(acct.user_id, None)
            acct.version = next(_STAMPS)  # invalidates its heap entry
        elif ticket.seq < next(iter(acct.queue)):
            # the head changed; the entry's tie-break seq follows the new head
            self._push(acct, next(iter(acct.queue)))

    # ----------------------------------------------------------------- charges

    def charge(self, acct: UserAccount, confirmed: float, pending: float, speculative: float = 0.0) -> None:
        """Add ``confirmed`` token units to the member ``acct``'s confirmed counter
        (divided by its weight; weight-0 users keep a counter of 0), ``pending`` token
        units to its pending part and ``speculative`` to the speculative share of that
        (negative values refund)."""
        old = acct.key
        if confirmed and acct.weight > 0:
            acct.counter += confirmed / acct.weight
        acct.pending += pending
        acct.speculative += speculative
        if acct.inflight == 0:
            acct.pending = acct.speculative = 0.0  # no float dust left once nothing is in flight
            self._running.pop(acct.user_id, None)
        elif acct.user_id in self.members:
            self._running[acct.user_id] = acct
        if acct.user_id in self._backlogged:
            new = acct.key
            if abs(new - old) > _KEY_EPS * max(1.0, abs(old)):
                self._push(acct, next(iter(acct.queue)))

    def most_owed_absent(self, released: UserAccount) -> UserAccount | None:
        """The member of positive weight with the smallest key among those with nothing
        waiting that have requests in flight, or are ``released`` (a member whose
        request just ended): the user a slot freed now is owed to when it ranks before
        every user waiting (:mod:`qos.slot_holds`). ``None`` when there is none.
        O(members with requests in flight)."""
        best = released if released.weight > 0 and not released.queue and released.user_id in self.members else None
        for acct in self._running.values():
            if acct.weight > 0 and not acct.queue and (best is None or acct.key < best.key):
                best = acct
        return best

    def rebase(self, shift: float) -> None:
        """Subtract ``shift`` from the virtual time and every member's counter (relative
        order and every difference unchanged), and rebuild the heap."""
        self.vtime -= shift
        for acct in self.members.values():
            acct.counter -= shift
        self._heap = [(a.key, next(iter(a.queue)), a.version, uid) for uid, a in self._backlogged.items()]
        heapq.heapify(self._heap)
        self.rebases += 1
