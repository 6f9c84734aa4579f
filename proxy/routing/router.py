"""The router: which engine of a pool serves a request, chosen when it is dispatched.

Bind late. A request waits in its pool's queue, where the scheduler orders it (strict
priority, token-fair); it is given an engine only at dispatch, to the engine with the
most headroom at that moment. :class:`PoolRouter` is the pool's capacity as the
scheduler sees it: ``fits(ticket)`` (does some engine have room for the head of the
queue?), ``reserve(ticket)`` (place it on the chosen engine) and ``release(ticket)``
(free it), the same three questions ``admission.max_inflight`` /
``max_inflight_tokens`` answered for one engine;
:class:`proxy.routing.pool_capacity.PoolCapacity` asks them for the pool's
:class:`qos.Scheduler`. It is pure: no I/O, no tasks; health comes from
:mod:`proxy.routing.engine_health`, load readings from whoever polls them.

What one engine's capacity, rotation, fit and headroom are: :mod:`.engine_state`. Which
of the engines that fit is chosen (``least_headroom``, ``round_robin``, affinity):
:mod:`.placement`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol

from qos.capacity_control import CapacityController
from qos.capacity_control import fixed as fixed_capacity

from .engine_health import EngineHealth, max_passive_ejections
from .engine_state import EngineState
from .placement import by_affinity, round_robin, within_lease
from ..config.pools import PoolSpec

__all__ = ["Changes", "NoEngineFits", "PoolRouter", "Reservable"]


class Reservable(Protocol):
    """What the router needs of a request: hashable by identity (a
    :class:`qos.Ticket`), and the tokens it reserves."""

    @property
    def reserved_tokens(self) -> int: ...


class NoEngineFits(LookupError):
    """:meth:`PoolRouter.reserve` was asked to place a request no engine has room for
    (the caller skipped :meth:`PoolRouter.fits`)."""


@dataclass(frozen=True, slots=True)
class Changes:
    """What a :meth:`PoolRouter.reconfigure` did, engines by name.

    Attributes:
        added: new engines (start healthy).
        updated: engines kept (counts, health and routing history carried over).
        reset: of ``updated``, those whose URL or kind changed: their health starts over.
        draining: removed engines with requests still in flight.
        removed: removed engines that left at once (nothing in flight).
    """

    added: tuple[str, ...] = ()
    updated: tuple[str, ...] = ()
    reset: tuple[str, ...] = ()
    draining: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()


class PoolRouter:
    """The engines of one pool and the choice among them (module docstring).

    Args:
        pool: the pool's resolved config.
        clock: monotonic seconds (passed to each engine's health).
        rng: float in [0, 1) (ejection jitter).
        affinity_of: returns the affinity key of a ticket given to :meth:`reserve`
            without one (see :func:`proxy.routing.placement.affinity_key`); default: none.
        leased: the engines are shared with other replicas through leases
            (:mod:`proxy.admission.lease_binding`): an engine added here starts with a lease of 0
            until one is granted.

    Attributes:
        name: the pool's name.
        health: the pool's health settings (``max_ejection_percent``: the floor).
        engines: name -> :class:`EngineState`, config order, draining engines last.
        on_engine_removed: called with an engine that left the pool (removed by a reload
            and drained); phase 2 closes its connections and health task there.
    """

    def __init__(
        self,
        pool: PoolSpec,
        clock: Callable[[], float] = time.monotonic,
        rng: Callable[[], float] = random.random,
        affinity_of: Callable[[Any], str | None] | None = None,
        leased: bool = False,
    ) -> None:
        self.name = pool.name
        self.leased = leased
        self._clock = clock
        self._rng = rng
        self.affinity_of = affinity_of or (lambda _t: None)
        self.engines: dict[str, EngineState] = {}
        self.routing = pool.routing
        self.health = pool.health
        self._placed: dict[Any, tuple[EngineState, int, float]] = {}  # ticket -> (engine, reserved tokens, its class's headroom)
        # headroom levels of classes with a min_share floor: they keep only the fixed
        # fraction for the classes above (qos.capacity.RecentPeaks.fixed_levels; set by
        # proxy.routing.pool_capacity.PoolCapacity.configure, shared by every engine)
        self.fixed_levels: set[float] = set()
        self._turn = 0
        self.on_engine_removed: Callable[[EngineState], None] | None = None
        self.reconfigure(pool)

    # ---------------------------------------------------------------- config

    def reconfigure(self, pool: PoolSpec) -> Changes:
        """Take a reloaded pool config: add engines, update kept ones (matched by name;
        counts and history kept; a changed URL or kind resets their health and load),
        and drain removed ones (no new requests; they leave when their last request is
        released). Nothing in flight is touched."""
        self.routing = pool.routing
        self.health = pool.health
        new: dict[str, EngineState] = {}
        added, updated, reset = [], [], []
        for spec in pool.engines:
            e = self.engines.get(spec.name)
            if e is None:
                e = EngineState(spec, EngineHealth(pool.health, spec.name, self._clock, self._rng))
                e.peaks.fixed_levels = self.fixed_levels
                if self.leased:  # nothing goes there before this replica's lease is granted
                    e.set_lease(0, 0 if spec.max_inflight_tokens is not None else None)
                added.append(spec.name)
            else:
                old_url, old_kind = e.spec.url, e.spec.kind
                if (e.spec.url, e.spec.kind) != (spec.url, spec.kind):
                    e.health.reset()
                    e.set_load(None)
                    reset.append(spec.name)
                e.configure(spec)
                if (e.spec.url, e.spec.kind) != (old_url, old_kind):
                    e.control = CapacityController(spec.control) if spec.control is not None else fixed_capacity(spec.max_inflight)
                e.draining = False
                e.health.reconfigure(pool.health)
                updated.append(spec.name)
            new[spec.name] = e
        draining, removed = [], []
        for name, e in self.engines.items():
            if name in new:
                continue
            if e.inflight > 0:
                e.draining = True
                new[name] = e
                draining.append(name)
            else:
                removed.append(name)
        gone = [self.engines[n] for n in removed]
        self.engines = new
        for e in gone:
            self._removed(e)
        return Changes(tuple(added), tuple(updated), tuple(reset), tuple(draining), tuple(removed))

    def _removed(self, engine: EngineState) -> None:
        engine.draining = True
        if self.on_engine_removed is not None:
            self.on_engine_removed(engine)

    # ---------------------------------------------------------------- choice

    def choose(
        self,
        tokens: int,
        key: str | None = None,
        exclude: Collection[EngineState] = (),
        commit: bool = True,
        over: bool = False,
        headroom: float = 0.0,
    ) -> EngineState | None:
        """The engine for a request reserving ``tokens``, or ``None`` when none fits.

        Args:
            tokens: reserved tokens (prompt + max output).
            key: affinity key (:func:`proxy.routing.placement.affinity_key`), or ``None``.
            exclude: engines not to choose (already tried for this request).
            commit: advance the policy's rotation (False for a mere "is there one?").
            over: when no engine fits, take the engine in rotation with the most headroom
                even if it is full (a request already dispatched whose engine failed
                before it was sent: :meth:`reroute`), but never past a lease (a lease is
                this replica's part of an engine other replicas also fill) and never one
                whose token capacity cannot hold the request at all.
            headroom: the requesting class's headroom (:func:`qos.capacity.room_for`).
        """
        cands = [e for e in self.engines.values() if e not in exclude and e.fits(tokens, headroom)]
        if not cands and over:
            rest = [e for e in self.engines.values() if e not in exclude and e.in_rotation and e.can_hold(tokens) and within_lease(e, tokens)]
            return max(rest, key=lambda e: e.headroom(tokens), default=None)
        if not cands:
            return None
        if len(cands) == 1 and len(self.engines) == 1:
            return cands[0]  # the only engine (the single-upstream form): nothing to choose
        if self.routing.policy == "round_robin":
            pick = by_affinity(key, [e for e in cands if not e.saturated]) if key else None
            return pick or round_robin(cands, commit)
        scores = {e: e.headroom(tokens) for e in cands}
        best = max(scores.values())
        if key:
            floor = best - self.routing.affinity.tolerance - 1e-12
            pick = by_affinity(key, [e for e in cands if not e.saturated and scores[e] >= floor])
            if pick is not None:
                return pick
        tied = [e for e in cands if scores[e] >= best - 1e-12]
        return self._next_in_turn(tied, commit)

    def _next_in_turn(self, tied: list[EngineState], commit: bool) -> EngineState:
        if len(tied) == 1:
            pick = tied[0]
        else:
            order = {e: i for i, e in enumerate(self.engines.values())}
            n = len(order)
            pick = min(tied, key=lambda e: (order[e] - self._turn) % n)
        if commit:
            self._turn = list(self.engines.values()).index(pick) + 1
        return pick

    # ------------------------------------------------- the scheduler's seam

    def fits(self, ticket: Reservable) -> bool:
        """Whether some engine in rotation has room for ``ticket`` now."""
        return self.choose(ticket.reserved_tokens, commit=False) is not None

    def reserve(self, ticket: Reservable, key: str | None = None, headroom: float = 0.0) -> EngineState:
        """Place ``ticket`` on the engine :meth:`choose` picks (affinity key ``key``,
        else ``affinity_of(ticket)``; its class's ``headroom`` kept free) and count it there.

        Raises:
            NoEngineFits: no engine has room (call :meth:`fits` first).
            ValueError: ``ticket`` is already placed.
        """
        if ticket in self._placed:
            raise ValueError("this request is already placed on an engine")
        if key is None and self.routing.affinity.enabled:
            key = self.affinity_of(ticket)
        engine = self.choose(ticket.reserved_tokens, key, headroom=headroom)
        if engine is None:
            raise NoEngineFits(f"no engine of pool {self.name!r} has room for {ticket.reserved_tokens} tokens")
        self._place(ticket, engine, headroom)
        return engine

    def release(self, ticket: Reservable) -> EngineState | None:
        """Free ``ticket``'s place; returns its engine, or ``None`` when it had none (a
        second release changes nothing). A draining engine whose last request this was
        leaves the pool."""
        placed = self._placed.pop(ticket, None)
        if placed is None:
            return None
        engine, tokens, level = placed
        engine.inflight -= 1
        engine.inflight_tokens -= tokens
        engine.held[level] -= 1
        if engine.draining and engine.inflight == 0 and self.engines.get(engine.name) is engine:
            del self.engines[engine.name]
            self._removed(engine)
        return engine

    def place_outside(self, holder: Reservable, key: str | None = None) -> EngineState | None:
        """Place a request admission does not govern (``passthrough.admit: false``) on the
        engine :meth:`choose` picks for it (no tokens; a full engine too, as a reroute is),
        counted in that engine's in flight until :meth:`release` of ``holder``, so that a
        reload drains the engine instead of closing it under the request. ``None``: no
        engine is in rotation."""
        engine = self.choose(holder.reserved_tokens, key, over=True)
        if engine is not None:
            self._place(holder, engine)
        return engine

    def engine_of(self, ticket: Reservable) -> EngineState | None:
        """The engine ``ticket`` is placed on, or ``None``."""
        placed = self._placed.get(ticket)
        return placed[0] if placed is not None else None

    def placement(self, ticket: Reservable) -> tuple[EngineState, int, float] | None:
        """Where ``ticket`` is placed: (engine, its reserved tokens there, the headroom
        of its class it is held at), or ``None``."""
        return self._placed.get(ticket)

    def reroute(
        self, ticket: Reservable, exclude: Collection[EngineState] = (), key: str | None = None, over: bool = False
    ) -> EngineState | None:
        """Move ``ticket`` to another engine (its request never reached the one it was
        on): frees its place, then places it on the engine :meth:`choose` picks among
        those not in ``exclude`` and not the one it leaves (``over``: see :meth:`choose`).
        Returns the new engine, or ``None`` (then it is placed nowhere and the caller
        answers the client)."""
        placed = self.placement(ticket)
        level = placed[2] if placed is not None else 0.0
        old = self.release(ticket)
        skip = set(exclude)
        if old is not None:
            skip.add(old)
        engine = self.choose(ticket.reserved_tokens, key if key is not None else self.affinity_of(ticket), exclude=skip, over=over)
        if engine is not None:
            self._place(ticket, engine, level)
        return engine

    def _place(self, ticket: Reservable, engine: EngineState, level: float = 0.0) -> None:
        """Count ``ticket`` on ``engine``, held at its class's headroom ``level``."""
        tokens = ticket.reserved_tokens
        self._placed[ticket] = (engine, tokens, level)
        engine.inflight += 1
        engine.peak_inflight = max(engine.peak_inflight, engine.inflight)
        engine.inflight_tokens += tokens
        engine.held[level] = n = engine.held.get(level, 0) + 1
        engine.peaks.note(level, n)
        engine.routed += 1

    # --------------------------------------------------------------- health

    def report(self, engine: EngineState, ok: bool, reason: str | None = None, detail: str = "", *, status: int | None = None) -> bool:
        """Record the result of a request sent to ``engine`` (see
        :meth:`proxy.routing.engine_health.EngineHealth.record_request`; ``status``: the 5xx it
        answered, when known); True if it ejected it. A failure ejects it only while the
        pool stays above its floor (:meth:`may_eject_passively`)."""
        return engine.health.record_request(ok, reason, detail, status=status, may_eject=lambda: self.may_eject_passively(engine))

    def may_eject_passively(self, engine: EngineState) -> bool:
        """Whether failed requests may eject ``engine`` now: after it, at most
        :func:`proxy.routing.engine_health.max_passive_ejections` of the pool's engines (draining
        ones aside) are ejected, for whatever reason (``health.max_ejection_percent``; at
        least one engine stays in rotation). A draining engine (out of rotation anyway),
        or one no longer in the pool, may always be."""
        if engine.draining or self.engines.get(engine.name) is not engine:
            return True
        counted = [e for e in self.engines.values() if not e.draining]
        ejected = sum(1 for e in counted if e is not engine and not e.health.healthy)
        return ejected + 1 <= max_passive_ejections(len(counted), self.health.max_ejection_percent)

    @property
    def available(self) -> bool:
        """Whether any engine is in rotation (else: answer 503 at once, never queue)."""
        return any(e.in_rotation for e in self.engines.values())

    def retry_after_s(self) -> float:
        """A ``Retry-After`` for a 503 when no engine is in rotation: seconds until the
        first ejected engine is probed, at least 1."""
        waits = [w for e in self.engines.values() if not e.draining and (w := e.health.retry_after_s()) is not None]
        return max(1.0, min(waits)) if waits else 1.0

    # ----------------------------------------------------------- inspection

    @property
    def capacity(self) -> int:
        """Requests the engines in rotation may run now, together."""
        return sum(e.capacity for e in self.engines.values() if e.in_rotation)

    @property
    def inflight(self) -> int:
        """Requests placed and not released, on all engines (draining ones included)."""
        return len(self._placed)

    def snapshot(self) -> list[dict]:
        """Every engine's :meth:`EngineState.status`, config order."""
        return [e.status() for e in self.engines.values()]
