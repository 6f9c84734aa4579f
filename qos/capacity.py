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

from collections import deque
from typing import TYPE_CHECKING, Callable, Collection, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from .policy import SchedulerPolicy
    from .ticket import Ticket


PEAK_WINDOW_S = 10.0  # how long a higher class's most in flight at once keeps its room (RecentPeaks)
LATE_STEP = 0.1  # per late first token, the fraction of the capacity the classes below the late one keep more (RecentPeaks.late)
MAX_KEPT_SHARE = 0.5  # the most of an engine the measured part of the headroom keeps from a lower class


def room_for(capacity: int, headroom: float, vacant: int = 0) -> int:
    """The most requests a class with ``headroom`` (a fraction, 0 <= h < 1) may have an
    engine of ``capacity`` requests run at once (the classes above it counted in that
    number with what they run now), when the classes above it (those with a smaller
    headroom) ran ``vacant`` more requests there at once recently than they run now
    (:meth:`RecentPeaks.vacant`): ``capacity - kept``, where the room *kept* free for
    the classes above is ``floor(headroom x capacity) + vacant``, the measured part at
    most ``floor(MAX_KEPT_SHARE x capacity)`` in all. Never less than 1 while
    ``capacity`` >= 1, so no class is starved by its headroom; the top class (headroom 0)
    keeps nothing and may fill the whole capacity.

    Why the measured part: the fixed fraction alone is too little when the engine's
    capacity is small and the load of the classes above comes and goes by more than it.
    Measured on vLLM's CPU build: capacity 33, bronze's 7.5 % kept 2 places, platinum's
    probes ran between 3 and 7 at once, bronze took each place a probe gave back, and a
    probe past the second free place waited for a 128-token bronze stream to end
    (platinum's first token 18 s at the median). Counting the classes above at their
    recent peak (over :data:`PEAK_WINDOW_S`) keeps the room their load as it is now
    comes back to; the fraction is the margin for a burst beyond that. A class's own
    requests are never limited by it, and a lower class loses the room only while the
    classes above used it within the window.

    Examples: capacity 128, headroom 0.15, nothing vacant: 109 (19 kept); capacity 33,
    headroom 0.075, platinum at 2 now after 6 at once: 29 in all, 2 of them platinum's
    (2 + 4 kept); capacity 33 with 40 vacant: 17 (at most half kept); capacity 6,
    headroom 0.15: 6 (0.9 rounds down)."""
    if capacity <= 0:
        return capacity
    return capacity - min(capacity - 1, kept_for_above(capacity, headroom, vacant))


def kept_for_above(capacity: int, headroom: float, measured: int = 0) -> int:
    """Places of an engine of ``capacity`` a class with ``headroom`` leaves to the classes
    above it: ``floor(headroom x capacity) + measured``, the sum at most
    ``floor(MAX_KEPT_SHARE x capacity)`` unless the fraction alone is more; the fraction
    alone when ``headroom`` is 0 (a class set to keep nothing) or nothing is measured.
    ``measured``: what the classes above ran recently and do not run now, for dispatch
    (:func:`room_for`); their recent peak, for the excess of :func:`occupied` (the two
    agree: a class is never dispatched past the room its excess is counted from)."""
    fixed = int(headroom * capacity)
    if measured <= 0 or headroom <= 0.0:
        return fixed
    return max(fixed, min(fixed + measured, int(MAX_KEPT_SHARE * capacity)))


def occupied(inflight: int, held: dict[float, int], capacity: int, peaks: RecentPeaks | None = None) -> int:
    """Requests in flight on an engine of ``capacity`` as the classes' headroom counts
    them: ``inflight`` less each class's excess over its own room, ``held`` giving the
    requests in flight per headroom level (``{headroom: count}``; requests not in it
    count in full), ``peaks`` the classes' recent most in flight (:class:`RecentPeaks`;
    ``None``: the fixed fraction alone). A class's request fits while this is below its
    own :func:`room_for`.

    When the capacity is cut below what a lower class already runs (the engine
    queued), that class's excess drains as its requests end but does not take the room
    kept for the classes above: measured on vLLM, a 10 % cut with bronze's streams
    filling its room left platinum 2 slots, and its requests waited up to 15 s behind
    128-token streams. What runs then may pass ``capacity`` by that excess: at most one
    cut's worth, draining.

    A class's own room for this count is the capacity less what it keeps for the classes
    above with those counted at their recent peak (:meth:`RecentPeaks.above`, ended
    steps only), the bound :func:`room_for` sets at dispatch: so while a lower class
    drains an excess, the classes above get back the load they ran recently and the
    fraction's places beyond it, at once, together at most :data:`MAX_KEPT_SHARE` of
    the capacity (or the fraction). Measured on vLLM's CPU build (capacity ~17, latency
    cuts every few seconds leaving bronze above its room): with the classes above held
    to the fraction, or to a quarter of the capacity, platinum's probes (about 6 at once)
    ran 4 at a time and queued for up to 14 s.

    Example: capacity 121, bronze (headroom 0.075, room 112) holding 119: occupied is
    112, so platinum (room 121) has 9 places, bronze none."""
    return inflight - sum(excess(level, k, capacity, peaks) for level, k in held.items() if level > 0.0)


def excess(level: float, count: int, capacity: int, peaks: RecentPeaks | None = None) -> int:
    """Requests a class at ``level`` (headroom) runs on an engine of ``capacity`` beyond
    its own room there, ``count`` in flight: what it drains after a cut
    (:func:`occupied`; the classes above counted at their recent peak, ``peaks``, not at
    what they run now). 0 when within its room."""
    above = peaks.above(level) if peaks is not None else 0
    return max(0, count - room_for(capacity, level, above))


class RecentPeaks:
    """The most requests each headroom level (class) ran at once on one engine over the
    last ``window_s`` seconds, for the measured part of :func:`room_for`.

    :meth:`note` is called as a request of a level is placed (with the level's count in
    flight then), :meth:`roll` once per control step with the time; a peak counts from
    the end of the step it was seen in until ``window_s`` after it. Only ended steps
    count, so what a class adds within a step does not raise its own peak at once: while
    a lower class drains an excess (:func:`occupied`) the classes above get back their
    recent peak and the fraction, and grow past it by at most the fraction a step, up to
    :data:`MAX_KEPT_SHARE`. Memory: one entry per step in the window (``window_s`` / the
    step interval) of one count per level. Without :meth:`roll` nothing is measured.

    **Late first tokens** (:meth:`late`, once per control step before :meth:`roll`): a
    class whose first token came later than its objective after dispatch, on this
    engine, is late *there*: the engine runs more than that class can afford. The
    classes below it then keep :data:`LATE_STEP` of the capacity more for it, at each
    step with a late first token of it once their excess over the room they had has
    drained (one step per round trip), and give one of its places back per step once
    none of its first tokens was late for ``window_s``. Each late class's places are
    its own; a class keeps the most that any late class above it asks. They count in
    the measured part of :func:`kept_for_above`, so with the recent peaks they keep at
    most :data:`MAX_KEPT_SHARE` of the engine. The late class and those above it are not
    limited by its places: a class whose own load fills the engine would only wait for
    itself. Levels are headrooms, so a class at the same headroom as the late one (the
    default's cap, or ``headroom: 0`` set on a lower class) keeps nothing for it.
    Measured on vLLM's CPU build on an AVX2 host (objectives bench, 2x overload): with the
    capacity at 20-33, bronze and gold filled it, and platinum's first tokens took 0.8 s
    after dispatch at the median against its 0.5 s objective; a cut of the whole
    engine's capacity instead (reverted, docs/real-engine.md) queued platinum's own load
    at 5x and 10x.
    """

    __slots__ = ("window_s", "fixed_levels", "_step", "_steps", "_max", "_above", "_late")

    def __init__(self, window_s: float = PEAK_WINDOW_S) -> None:
        self.window_s = window_s
        # levels that keep only the fixed fraction for the classes above (a class with a
        # min_share floor); the pool's router shares one set with every engine and
        # updates it in place at a reload (proxy.routing.router.PoolRouter.fixed_levels)
        self.fixed_levels: set[float] = set()
        self._step: dict[float, int] = {}  # the step now: the most of each level at once
        self._steps: deque[tuple[float, dict[float, int]]] = deque()  # (ended at, peaks) of the steps in the window
        self._max: dict[float, int] = {}  # over the ended steps in the window
        self._above: dict[float, int] = {}  # above(level), kept until the next roll (asked on every placement)
        self._late: dict[float, list] = {}  # late class's headroom -> [places kept for it, its last late first token]

    def note(self, level: float, count: int) -> None:
        """A request of ``level`` was placed; ``count`` of that level run now."""
        if count > self._step.get(level, 0):
            self._step[level] = count

    def roll(self, now: float, held: dict[float, int] | None = None) -> None:
        """End the step now at ``now`` (seconds, monotonic) and forget the steps that
        ended more than ``window_s`` ago. ``held``: what runs now per level, which starts
        the next step's peaks (requests placed before this step still run in it)."""
        self._steps.append((now, self._step))
        self._step = {lv: k for lv, k in (held or {}).items() if k > 0}
        while self._steps and self._steps[0][0] < now - self.window_s:
            self._steps.popleft()
        top: dict[float, int] = dict(self._step)
        for _, peaks in self._steps:
            for lv, k in peaks.items():
                if k > top.get(lv, 0):
                    top[lv] = k
        self._max = top
        self._above = {}

    def late(self, now: float, levels: Collection[float], capacity: int, draining: Callable[[float], bool]) -> None:
        """One control step's late first tokens (class docstring): ``levels``, the
        headrooms of the classes with a first token later than their objective after
        dispatch since the last step (empty: none); ``capacity``, the engine's now;
        ``draining(level)``, whether the classes below ``level`` still run more than
        their room (the last step's effect is not in yet: no further step for it). Each
        late class's places are kept, grown and given back on their own."""
        most = int(MAX_KEPT_SHARE * capacity)
        for level in levels:
            entry = self._late.get(level)
            if entry is None:
                entry = self._late[level] = [0, now]
            entry[1] = now
            if not draining(level):
                entry[0] += max(1, int(LATE_STEP * capacity))
                self._above = {}
        for level, entry in list(self._late.items()):
            entry[0] = min(entry[0], most)  # never more than half, however the capacity moved
            if now - entry[1] >= self.window_s:
                entry[0] -= 1
            if entry[0] <= 0 and now - entry[1] >= self.window_s:
                del self._late[level]
        self._above = {}

    def forget_late(self) -> None:
        """Drop every late class's places (the classes' levels changed: a reload)."""
        self._late.clear()
        self._above = {}

    def late_kept(self) -> dict[float, int]:
        """Per late class (its headroom), the places the classes below it keep for it
        now (:meth:`late`; a copy)."""
        return {level: entry[0] for level, entry in self._late.items()}

    def _late_for(self, level: float) -> int:
        """Places a class at ``level`` keeps for the late classes above it: the most any
        of them asks (their places overlap: each is room for the classes above)."""
        return max((e[0] for lv, e in self._late.items() if lv < level), default=0) if self._late else 0

    def above(self, level: float) -> int:
        """The sum of the recent peaks of the levels below ``level`` (the classes above
        it), and the places kept for a class above it whose first tokens came late
        (:meth:`late`); 0 for the top class and for a level in :attr:`fixed_levels`."""
        if level in self.fixed_levels:
            return 0
        n = self._above.get(level)
        if n is None:
            n = self._above[level] = sum(k for lv, k in self._max.items() if lv < level) + self._late_for(level)
        return n

    def vacant(self, level: float, held: dict[float, int]) -> int:
        """How many more requests the levels below ``level`` (the classes above it) ran
        at once within the window than they run now (``held``: in flight per level): the
        room their load as it is now comes back to, summed over the levels; and the
        places kept for a class above it whose first tokens came late (:meth:`late`). 0
        for the top class and for a level in :attr:`fixed_levels`."""
        if level in self.fixed_levels:
            return 0
        return sum(k - held.get(lv, 0) for lv, k in self._max.items() if lv < level and k > held.get(lv, 0)) + self._late_for(level)

    def peaks(self) -> dict[float, int]:
        """Each level's most in flight at once over the window (a copy)."""
        return dict(self._max)


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
