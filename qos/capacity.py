"""Capacity accounting: may the next request go upstream now, and where.

The scheduler decides *who* goes next (priority, fair share); a :class:`Capacity`
decides *whether there is room* for that request and reserves it. Keeping the two apart
is what lets capacity grow later without touching the scheduler: a pool of engines that
binds a request to the engine with the most headroom at dispatch, or capacity leased
from a store shared by several proxy processes, is another :class:`Capacity`.

:class:`LocalCapacity` is the one engine, one process case: ``max_inflight`` slots,
optionally ``max_inflight_tokens`` tokens of reservations, a lower slot limit while
an outside signal (the engine's load) asks for one, and a *lease*: the part of the
engine's slots and tokens this process may use when several processes share it
(granted by a shared store; see :meth:`LocalCapacity.set_lease`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from .policy import SchedulerPolicy
    from .ticket import Ticket


def room_for(capacity: int, headroom: float) -> int:
    """The most requests a class with ``headroom`` (a fraction, 0 <= h < 1) may have an
    engine of ``capacity`` requests run at once: ``capacity - floor(headroom x
    capacity)``, and never less than 1 while ``capacity`` >= 1, so no class is starved by
    its headroom (the top class, headroom 0, may fill the whole capacity).

    Example: capacity 128 with headroom 0.15 leaves 19 requests' room to the classes above
    (109 for this class); capacity 6 leaves none (0.9 rounds down)."""
    if capacity <= 0:
        return capacity
    return capacity - min(capacity - 1, int(headroom * capacity))


def occupied(inflight: int, held: dict[float, int], capacity: int) -> int:
    """Requests in flight on an engine of ``capacity`` as the classes' headroom counts
    them: ``inflight`` less each class's excess over its own room, ``held`` giving the
    requests in flight per headroom level (``{headroom: count}``; requests not in it
    count in full). A class's request fits while this is below its own
    :func:`room_for`.

    When the capacity is cut below what a lower class already runs (the engine
    queued), that class's excess drains as its requests end but does not take the room
    kept for the classes above: measured on vLLM, a 10 % cut with bronze's streams
    filling its room left platinum 2 slots, and its requests waited up to 15 s behind
    128-token streams. What runs then may pass ``capacity`` by that excess: at most one
    cut's worth, draining.

    Example: capacity 121, bronze (headroom 0.075, room 112) holding 119: occupied is
    112, so platinum (room 121) has 9 places, bronze none."""
    excess = 0
    for level, k in held.items():
        if level > 0.0:
            excess += max(0, k - room_for(capacity, level))
    return inflight - excess


class Capacity(Protocol):
    """What the scheduler asks about capacity (all sizes in tokens of reservation:
    prompt + reserved output, :attr:`qos.Ticket.reserved_tokens`).

    Implementations are called synchronously from inside the scheduler's methods and
    must not call back into it; after capacity grows outside the scheduler's own calls
    (a lease granted, an engine back), the owner calls :meth:`qos.Scheduler.dispatch`.
    """

    def configure(self, policy: SchedulerPolicy) -> None:
        """Apply a new policy (its ``max_inflight`` and ``max_inflight_tokens``, if
        this implementation takes its limits from the policy)."""

    @property
    def slots(self) -> int:
        """Requests allowed in flight now (>= 1, or >= 0 under a lease)."""

    @property
    def inflight(self) -> int:
        """Requests holding room now."""

    @property
    def occupied(self) -> int:
        """Requests holding room now as the classes' headroom counts them
        (:func:`occupied`): at most :attr:`inflight`; while it is below :attr:`slots`
        some class may have room."""

    @property
    def inflight_tokens(self) -> int:
        """Sum of the reservations holding room now (tokens)."""

    def set_limit(self, limit: int | None) -> None:
        """Lower the slots for as long as an outside load signal asks (``None`` lifts
        it); raises ValueError below 1."""

    def admissible(self, tokens: int) -> bool:
        """Whether a request of this reservation could *ever* get room (when nothing
        else is in flight); one that cannot is refused at once."""

    def fits(self, tokens: int) -> bool:
        """Whether a request of this reservation would get room now (no side effect)."""

    def fits_without(self, ticket: Ticket, victim: Ticket) -> bool:
        """Whether :meth:`reserve` would give ``ticket`` room now if ``victim`` (in
        flight) gave its room back first (no side effect): what preemption asks
        (:meth:`qos.Scheduler.preempt`). Optional: a capacity without it is never
        preempted on."""

    def reserve(self, ticket: Ticket) -> bool:
        """Give ``ticket`` room now if it fits, its class's headroom kept free for the
        classes above (:func:`room_for`), and, for a pool, choose where (set
        ``ticket.placement``); False and no change if it does not."""

    def release(self, ticket: Ticket) -> None:
        """Give back the room ``reserve`` gave ``ticket`` (exactly once per reserve)."""


class LocalCapacity:
    """Slots and tokens of one engine as seen by one process.

    Args:
        max_inflight: slots (>= 1).
        max_inflight_tokens: cap on the sum of reservations in flight, or ``None``.
    """

    def __init__(self, max_inflight: int = 8, max_inflight_tokens: int | None = None) -> None:
        self.max_inflight = max_inflight
        self.max_inflight_tokens = max_inflight_tokens
        self.limit: int | None = None
        self.lease_slots: int | None = None
        self.lease_tokens: int | None = None
        self._inflight = 0
        self._inflight_tokens = 0
        self._held: dict[float, int] = {}  # in flight by the headroom of its class (:func:`occupied`)
        self._level: dict[Ticket, float] = {}
        self._policy: SchedulerPolicy | None = None

    def configure(self, policy: SchedulerPolicy) -> None:
        """Take ``max_inflight``, ``max_inflight_tokens`` and the classes' headroom from
        ``policy`` (requests in flight keep their room; a lower limit lets the surplus
        finish)."""
        self.max_inflight = policy.max_inflight
        self.max_inflight_tokens = policy.max_inflight_tokens
        self._policy = policy

    def set_limit(self, limit: int | None) -> None:
        """Lower the slots below ``max_inflight`` (``None`` lifts the limit).

        Raises:
            ValueError: ``limit`` is below 1.
        """
        if limit is not None and limit < 1:
            raise ValueError(f"a capacity limit must be at least 1, got {limit}")
        self.limit = limit

    def set_lease(self, slots: int | None, tokens: int | None = None) -> None:
        """Cap this process's use of the engine at ``slots`` requests and ``tokens``
        reserved tokens (``None``: no lease, the engine is this process's alone). Unlike
        :meth:`set_limit`, a lease may be 0 (another process holds the whole engine) and
        the token lease has no exception for an idle engine: several processes share the
        engine, so one process's idle share is not an idle engine. A lease lowered below
        what is in flight lets the surplus finish. After raising it, call
        :meth:`qos.Scheduler.dispatch`.

        Raises:
            ValueError: a negative lease.
        """
        if (slots is not None and slots < 0) or (tokens is not None and tokens < 0):
            raise ValueError(f"a lease cannot be negative, got {slots} slots, {tokens} tokens")
        self.lease_slots, self.lease_tokens = slots, tokens

    @property
    def slots(self) -> int:
        """``max_inflight``, or the limit from :meth:`set_limit` or the lease from
        :meth:`set_lease` when lower (0 only by a lease)."""
        n = self.max_inflight if self.limit is None else min(self.limit, self.max_inflight)
        return n if self.lease_slots is None else min(n, self.lease_slots)

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def occupied(self) -> int:
        return occupied(self._inflight, self._held, self.slots)

    @property
    def inflight_tokens(self) -> int:
        return self._inflight_tokens

    def admissible(self, tokens: int) -> bool:
        cap = self.max_inflight_tokens
        return cap is None or tokens <= cap

    def fits(self, tokens: int) -> bool:
        return self.occupied < self.slots and self._tokens_fit(tokens)

    def _tokens_fit(self, tokens: int) -> bool:
        """Whether ``tokens`` more reserved tokens stay within the token lease and
        ``max_inflight_tokens``."""
        lease = self.lease_tokens
        if lease is not None and self._inflight_tokens + tokens > lease:
            return False
        cap = self.max_inflight_tokens
        return cap is None or self._inflight_tokens + tokens <= cap

    def fits_without(self, ticket: Ticket, victim: Ticket) -> bool:
        level = self._level_of(victim)
        self.release(victim)
        try:
            if not self.reserve(ticket):  # the very rule reserve applies, then undone
                return False
            self.release(ticket)
            return True
        finally:
            self._take(victim, level)

    def reserve(self, ticket: Ticket) -> bool:
        """Take room for ``ticket`` if it :meth:`fits`, its class's headroom kept free
        for the classes above (:func:`room_for`, counted by :func:`occupied`)."""
        level = self._level_of(ticket)
        if self.occupied >= room_for(self.slots, level) or not self._tokens_fit(ticket.reserved_tokens):
            return False
        self._take(ticket, level)
        return True

    def release(self, ticket: Ticket) -> None:
        level = self._level.pop(ticket, 0.0)
        self._inflight -= 1
        self._inflight_tokens -= ticket.reserved_tokens
        if level in self._held:
            self._held[level] -= 1

    def _level_of(self, ticket: Ticket) -> float:
        if ticket in self._level:
            return self._level[ticket]
        return self._policy.headroom_of(ticket.group) if self._policy is not None else 0.0

    def _take(self, ticket: Ticket, level: float) -> None:
        self._inflight += 1
        self._inflight_tokens += ticket.reserved_tokens
        self._level[ticket] = level
        self._held[level] = self._held.get(level, 0) + 1
