"""A pool's engines as its scheduler's capacity: :class:`PoolCapacity`, the seam between
one pool's :class:`qos.Scheduler` and its :class:`proxy.routing.router.PoolRouter`.

The scheduler asks its capacity the questions of :class:`qos.capacity.Capacity` (is there
room? place this request; free it; could any engine ever hold it?); this module answers
them from the router's engines, so the scheduler knows nothing of engines.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .router import NoEngineFits, PoolRouter

__all__ = ["PoolCapacity"]


class PoolCapacity:
    """A pool's engines as the scheduler's :class:`qos.capacity.Capacity`: the seam
    between one pool's :class:`qos.Scheduler` and its :class:`PoolRouter`.

    ``fits(tokens)``: some engine in rotation has room (:meth:`PoolRouter.choose`);
    ``reserve(ticket)``: place it on the chosen engine and set ``ticket.placement`` to
    that :class:`proxy.routing.engine_state.EngineState` (bind late); ``release(ticket)``: free its place.
    ``slots``: the requests the engines may run now, together (an engine out of rotation
    counts only what still runs there), so the scheduler's "is there room at all?" test
    stays exact. ``admissible(tokens)``: some engine of the pool (draining ones aside)
    could ever take a request that large (its ``max_inflight_tokens``): the scheduler
    refuses one that none could at submit (400 ``request_too_large``), and the router
    places the others only on an engine that can hold them.

    Args:
        router: the pool's router.
        affinity_of: the affinity key of a ticket being placed, or ``None``.
    """

    def __init__(self, router: PoolRouter, affinity_of: Callable[[Any], str | None] | None = None) -> None:
        self.router = router
        self._headroom: dict[str, float] = {}
        if affinity_of is not None:
            router.affinity_of = affinity_of

    def configure(self, policy: Any) -> None:
        """Take the classes' ``headroom`` from ``policy``; a pool's limits are its
        engines' (``pools[].engines[]``, or ``admission.max_inflight`` /
        ``max_inflight_tokens`` and ``admission.capacity`` for the single upstream),
        applied by :meth:`PoolRouter.reconfigure`.

        A class with a ``min_share`` floor keeps only its fixed fraction for the classes
        above, not their recent load (:class:`qos.capacity.RecentPeaks`): its floor is
        service promised while they are busy, and the room their load came back to would
        hold it below the floor whenever they are (measured: bronze with ``min_share``
        0.3 got 1 % of an engine of 2 that gold kept full)."""
        headroom = {g.name: g.headroom for g in policy.groups if g.headroom > 0}
        if headroom != self._headroom:
            for e in self.router.engines.values():
                e.peaks.forget_late()  # the places kept for late classes were keyed by the old levels
        self._headroom = headroom
        fixed = self.router.fixed_levels
        fixed.clear()
        fixed.update(g.headroom for g in policy.groups if g.headroom > 0 and g.min_share > 0)

    @property
    def max_inflight_tokens(self) -> int | None:
        """The largest engine token cap (``None`` when some engine has none): what the
        scheduler names when it refuses a request as too large."""
        caps = [e.spec.max_inflight_tokens for e in self.router.engines.values() if not e.draining]
        return None if not caps or None in caps else max(caps)

    @property
    def slots(self) -> int:
        n = 0
        for e in self.router.engines.values():
            n += e.capacity if e.in_rotation else e.inflight
        return n

    @property
    def inflight(self) -> int:
        return self.router.inflight

    @property
    def occupied(self) -> int:
        """:attr:`inflight` as the classes' headroom counts it (:func:`qos.capacity.occupied`
        per engine in rotation; the others in full, as :attr:`slots` counts them)."""
        return sum(e.occupied() if e.in_rotation else e.inflight for e in self.router.engines.values())

    @property
    def inflight_tokens(self) -> int:
        return sum(e.inflight_tokens for e in self.router.engines.values())

    def set_limit(self, limit: int | None) -> None:
        """Set every engine's load-signal capacity limit (``None`` lifts it); the load
        signal sets each engine's own limit through
        :meth:`proxy.routing.engine_state.EngineState.set_load`.

        Raises:
            ValueError: ``limit`` is below 1.
        """
        if limit is not None and limit < 1:
            raise ValueError(f"a capacity limit must be at least 1, got {limit}")
        for e in self.router.engines.values():
            e.capacity_limit = limit

    def admissible(self, tokens: int) -> bool:
        some = False
        for e in self.router.engines.values():
            if e.draining:
                continue
            if e.can_hold(tokens):
                return True
            some = True
        return not some

    def fits(self, tokens: int) -> bool:
        return self.router.choose(tokens, commit=False) is not None

    def reserve(self, ticket: Any) -> bool:
        ticket.headroom = level = self._headroom.get(ticket.group, 0.0)  # the level its engine holds it at
        try:
            ticket.placement = self.router.reserve(ticket, headroom=level)
        except NoEngineFits:
            return False
        return True

    def fits_without(self, ticket: Any, victim: Any) -> bool:
        """Whether :meth:`reserve` would place ``ticket`` now if ``victim`` gave its place
        back first (no side effect): preemption's question
        (:meth:`qos.Scheduler.preempt`). Only the victim's own engine gains room, and
        only an engine in rotation counts."""
        placed = self.router.placement(victim)
        if placed is None or not placed[0].in_rotation:
            return False
        engine, freed, level = placed
        engine.inflight -= 1
        engine.inflight_tokens -= freed
        engine.held[level] -= 1
        try:
            return self.router.choose(ticket.reserved_tokens, commit=False, headroom=self._headroom.get(ticket.group, 0.0)) is not None
        finally:
            engine.inflight += 1
            engine.inflight_tokens += freed
            engine.held[level] += 1

    def release(self, ticket: Any) -> None:
        self.router.release(ticket)
