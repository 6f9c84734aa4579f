"""The router: which engine of a pool serves a request, chosen when it is dispatched.

Bind late. A request waits in its pool's queue, where the scheduler orders it (strict
priority, token-fair); it is given an engine only at dispatch, to the engine with the
most headroom at that moment. :class:`PoolRouter` is the pool's capacity as the
scheduler sees it: ``fits(ticket)`` (does some engine have room for the head of the
queue?), ``reserve(ticket)`` (place it on the chosen engine) and ``release(ticket)``
(free it), the same three questions ``admission.max_inflight`` /
``max_inflight_tokens`` answered for one engine. It is pure: no I/O, no tasks; health
comes from :mod:`proxy.routing.engine_health`, load readings from whoever polls them.

Definitions (one engine ``e``, a request reserving ``t`` tokens, prompt + max output):

* **capacity** ``cap(e) = min(found, max_inflight, limit, lease)``, where ``found`` is
  what its capacity controller found (:mod:`qos.capacity_control`, stepped by the load
  poller; ``max_inflight`` itself with ``admission.capacity.mode: fixed``), ``limit`` is
  the capacity limit a fixed engine's load signal sets
  (:func:`proxy.runtime.load_signal.capacity_for`: 1 while it reports itself saturated; absent when
  there is none; an adaptive engine's controller reacts to the same reading), and ``lease`` is this
  process's part of the engine when several replicas share it (granted through Redis:
  :mod:`proxy.admission.lease_binding`; absent standalone). A lease may be 0, and a token lease
  caps ``inflight_tokens + t`` (another replica's requests may be running there).
* **in rotation**: healthy (not ejected) and not draining (removed by a reload).
* **headroom of a class**: a request of a class with ``headroom`` h (the fraction of each
  engine it leaves to the classes above it) fits only while
  ``occupied(e) < room_for(cap(e), h)`` (:func:`qos.capacity.room_for`), so lower classes
  never fill the last part of an engine and a higher class's request is dispatched at once.
  ``occupied`` counts each class's requests on the engine up to its own room only: when
  the capacity is cut below what a lower class already runs (the engine queued), that
  class's excess drains as its requests end, but it does not take the room kept for the
  classes above (measured on vLLM: a 10 % cut with bronze's streams filling its room left
  platinum 2 slots, and its probes waited up to 15 s behind 128-token streams). What runs
  then may pass ``cap(e)`` by that excess, at most one cut's worth.
* **fits** ``e`` for ``t``: in rotation, ``inflight < cap(e)``, and, when
  ``max_inflight_tokens`` is set, ``inflight_tokens + t <= max_inflight_tokens``. No
  exception for an idle engine: a request goes only to an engine whose token capacity
  can hold it (one above every engine's is refused at submit, 400 ``request_too_large``:
  :meth:`PoolCapacity.admissible`), so with engines of different token capacities a
  request too large for a small one waits for a large one instead of filling the small
  one while it is idle.
* **headroom** ``h(e, t)``: the fraction of the engine still free once the request is
  placed, the smallest of ``1 - (inflight + 1) / cap``, ``1 - (inflight_tokens + t) /
  max_inflight_tokens`` (when set) and ``1 - load / saturated_at`` (when a fresh load
  reading exists). Fractions, so engines of different sizes compare; after placing, so a
  big engine is preferred to a small one equally loaded, and a large request to the
  engine it dents least.
* **saturated**: its load signal says so (it then fits only while nothing of ours runs
  there, so the queue cannot stall behind an engine kept busy by someone else).

``least_headroom`` (default) picks, among the engines that fit, the one with the largest
``h``; exact ties go to the next engine in config order after the last one picked.
``round_robin`` picks by smooth weighted round robin (nginx's algorithm) among the engines
that fit. Never an engine that does not fit: a saturated, full, ejected or draining
engine gets nothing while another fits.

**Affinity** (optional, ``routing.affinity``): a key (a session header's value, or the
prompt's first ``prefix_chars`` characters) ranks the engines by weighted rendezvous
hashing (Thaler & Ravishankar, "Using name-based mappings to increase hit rates", 1998;
weights as in Schindelhauer & Schomaker, 2005: score ``-weight / ln(u)``, ``u`` a hash of
key and engine name in (0, 1)). Adding or removing an engine moves only the keys whose
first choice it is, about ``1/n`` of them. The request goes to the first engine in that
order that fits, is not saturated, and whose headroom is at least the best headroom minus
``tolerance``; if none qualifies, the policy decides as without a key. Affinity breaks
ties among engines with headroom; it never overrides saturation. No per-key state is kept,
so hostile keys cannot grow memory; a client can steer only its own requests, and only
among engines within ``tolerance`` of the best.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from qos.capacity import occupied, room_for
from qos.capacity_control import CapacityController
from qos.capacity_control import fixed as fixed_capacity

from .engine_health import EngineHealth, Health, max_passive_ejections
from .engine_meter import EngineMeter
from ..config.pools import EngineSpec, PoolSpec, RoutingConfig, public_url


class Reservable(Protocol):
    """What the router needs of a request: hashable by identity (a
    :class:`qos.Ticket`), and the tokens it reserves."""

    @property
    def reserved_tokens(self) -> int: ...


class NoEngineFits(LookupError):
    """:meth:`PoolRouter.reserve` was asked to place a request no engine has room for
    (the caller skipped :meth:`PoolRouter.fits`)."""


@dataclass(eq=False)
class EngineState:
    """One engine as the router sees it. Identity-compared.

    Attributes:
        spec: its resolved config (:class:`proxy.config.pools.EngineSpec`).
        health: its :class:`proxy.routing.engine_health.EngineHealth`.
        inflight: requests placed on it and not released.
        inflight_tokens: their reserved tokens.
        draining: removed from the config by a reload; gets nothing new, leaves the pool
            when its last request is released.
        load: its last fresh load reading (KV fraction, 0..1), or ``None``.
        waiting: requests waiting inside it, as last reported, or ``None``.
        saturated: its load signal says it is saturated.
        capacity_limit: the limit its load signal sets, or ``None``.
        load_signal: the poller's state for it, as the dashboard shows it (``off``,
            ``waiting``, ``ok``, ``stale``, ``no_signal``).
        routed: requests placed on it since start (a metric).
        client: its connections (a :class:`proxy.relay.upstream.Upstream`), set by the proxy.
        control: its capacity controller (:class:`qos.capacity_control.CapacityController`),
            stepped by its load poller (:mod:`proxy.runtime.load_signal`).
        meter: what the proxy measures of its requests there (:class:`proxy.routing.engine_meter.EngineMeter`).
    """

    spec: EngineSpec
    health: EngineHealth
    inflight: int = 0
    inflight_tokens: int = 0
    held: dict[float, int] = field(default_factory=dict, repr=False)  # in flight by the headroom of its class
    draining: bool = False
    load: float | None = None
    waiting: int | None = None
    saturated: bool = False
    capacity_limit: int | None = None
    load_signal: str = "off"
    routed: int = 0
    client: Any = field(default=None, repr=False)
    lease_slots: int | None = None
    lease_tokens: int | None = None
    control: CapacityController = field(default=None, repr=False)  # type: ignore[assignment]
    meter: EngineMeter = field(default_factory=EngineMeter, repr=False)
    _wrr: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        if self.control is None:
            spec = self.spec
            self.control = CapacityController(spec.control) if spec.control is not None else fixed_capacity(spec.max_inflight)

    @property
    def baseline_ttft_s(self) -> float | None:
        """Its time to first token with little load (seconds), as measured, or ``None``."""
        return self.control.baseline_ttft_s

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def kind(self) -> str:
        """``openai`` or ``lightllm``."""
        return self.spec.kind

    @property
    def max_inflight(self) -> int:
        """Its capacity in requests, all replicas together: :attr:`found_capacity` (the
        configured ``max_inflight`` is its ceiling; the capacity leases share this out)."""
        return self.found_capacity

    @property
    def max_inflight_tokens(self) -> int | None:
        """Its configured capacity in reserved tokens, or ``None``."""
        return self.spec.max_inflight_tokens

    @property
    def found_capacity(self) -> int:
        """Requests the engine as a whole may run now, as its capacity controller found
        (:mod:`qos.capacity_control`; ``max_inflight`` when fixed), lowered by an outside
        limit (``capacity_limit``: a fixed capacity's load-signal hold,
        :func:`proxy.runtime.load_signal.capacity_for`): what several replicas' leases share out
        (:mod:`proxy.admission.lease_binding`)."""
        cap = min(self.control.value, self.spec.max_inflight)
        limit = self.capacity_limit
        return cap if limit is None else max(1, min(limit, cap))

    @property
    def capacity(self) -> int:
        """Requests it may run now: :attr:`found_capacity`, lowered by this process's
        lease (the only thing that can make it 0) and by the controller's restart after
        idle (:attr:`qos.capacity_control.CapacityController.usable`: this process's own
        pace, never shared out)."""
        cap = min(self.found_capacity, self.control.usable)
        return cap if self.lease_slots is None else min(cap, self.lease_slots)

    def configure(self, spec: EngineSpec) -> None:
        """Take a reloaded ``spec``; the controller keeps what it found, clipped into the
        new ceiling and floor (a switch between fixed and adaptive starts it anew)."""
        old, self.spec = self.spec, spec
        if spec.control is None:
            if self.control.adaptive or self.control.value != spec.max_inflight:
                self.control = fixed_capacity(spec.max_inflight)
        elif not self.control.adaptive or old.control != spec.control:
            if not self.control.adaptive:
                self.control = CapacityController(spec.control)
                return
            self.control.configure(spec.control)
            if old.control is None or old.control.initial != spec.control.initial:
                # the operator named a new starting point (max_inflight): start there
                self.control.limit = float(spec.control.initial)

    def set_lease(self, slots: int | None, tokens: int | None) -> None:
        """This process's part of the engine, in requests and reserved tokens (``None``:
        the engine is this process's alone), as granted by the shared state
        (:mod:`proxy.admission.lease_binding`). Lowering it lets the surplus finish; after raising
        it, the pool's scheduler must dispatch."""
        self.lease_slots, self.lease_tokens = slots, tokens

    @property
    def in_rotation(self) -> bool:
        """Healthy and not draining."""
        return self.health.state is Health.HEALTHY and not self.draining

    def fits(self, tokens: int, headroom: float = 0.0) -> bool:
        """Whether a request reserving ``tokens`` of a class with ``headroom`` (the
        fraction of the capacity it leaves to the classes above: :func:`qos.capacity.room_for`)
        may be placed here now (module docstring)."""
        if not self.in_rotation or self.occupied() >= room_for(self.capacity, headroom):
            return False
        if self.lease_tokens is not None and self.inflight_tokens + tokens > self.lease_tokens:
            return False
        cap = self.spec.max_inflight_tokens
        return cap is None or self.inflight_tokens + tokens <= cap

    def occupied(self) -> int:
        """Requests in flight here as the classes' headroom counts them: each class's up
        to its own room (:func:`qos.capacity.room_for` at its headroom), the top class's
        (headroom 0) and those placed outside admission in full (module docstring)."""
        return occupied(self.inflight, self.held, self.capacity)

    def can_hold(self, tokens: int) -> bool:
        """Whether its token capacity can ever hold a request reserving ``tokens``."""
        cap = self.spec.max_inflight_tokens
        return cap is None or tokens <= cap

    def headroom(self, tokens: int = 0, placed: int = 1) -> float:
        """``h(e, t)`` of the module docstring: the fraction left free once ``placed``
        requests reserving ``tokens`` in all are added (``placed=0``: free now). At most
        1; below 0 when over a limit."""
        h = 1.0 - (self.inflight + placed) / max(1, self.capacity)
        cap = self.spec.max_inflight_tokens
        if cap is not None:
            h = min(h, 1.0 - (self.inflight_tokens + tokens) / cap)
        if self.load is not None:
            h = min(h, 1.0 - self.load / self.spec.upstream.load_signal.saturated_at)
        return h

    def set_load(
        self,
        load: float | None,
        saturated: bool = False,
        capacity_limit: int | None = None,
        *,
        waiting: int | None = None,
        signal: str | None = None,
    ) -> None:
        """Record what the engine's load poller knows (``None`` / False / ``None`` when
        the reading is stale or absent): the KV fraction in use, whether the engine is
        saturated (:func:`proxy.runtime.load_signal.is_saturated`), the capacity limit
        :func:`proxy.runtime.load_signal.capacity_for` derives from it, the requests waiting
        inside it, and the poller's state (``signal``, kept when ``None``)."""
        self.load, self.saturated, self.capacity_limit, self.waiting = load, saturated, capacity_limit, waiting
        if signal is not None:
            self.load_signal = signal

    def status(self) -> dict:
        """A JSON-ready view for ``/admin/status`` and the dashboard: the keys of the
        dashboard's ``engines`` entries (:mod:`proxy.api.dashboard`: ``name``, ``url``,
        ``kind``, ``inflight``, ``capacity``, ``max_inflight``, ``inflight_tokens``,
        ``load``, ``waiting``, ``saturated``, ``load_signal``), and ``pool``, ``state``,
        ``max_inflight_tokens``, ``headroom``, ``weight``, ``routed``, ``ejections``,
        ``ejections_refused`` (passive ejections the pool's floor refused),
        ``ejection_held`` (one is being refused now), ``failures``, ``probe_in_s``,
        ``last_error``."""
        h = self.health
        c = self.control
        return {
            "name": self.name,
            "pool": self.spec.pool,
            "url": public_url(self.url),  # no user:password@
            "kind": self.spec.kind,
            "state": "draining" if self.draining else h.state.value,
            "inflight": self.inflight,
            "capacity": self.capacity,
            "max_inflight": self.spec.max_inflight,
            "capacity_mode": "adaptive" if c.adaptive else "fixed",
            "capacity_found": self.found_capacity,
            "capacity_reason": c.reason,
            "capacity_decreases": dict(c.decreases),
            "tpot_s": _ms(c.tpot_s),
            "baseline_tpot_s": _ms(c.baseline_tpot_s),
            "ttft_s": _ms(c.ttft_s),
            "baseline_ttft_s": _ms(c.baseline_ttft_s),
            "inflight_tokens": self.inflight_tokens,
            "max_inflight_tokens": self.spec.max_inflight_tokens,
            "load": self.load,
            "waiting": self.waiting,
            "saturated": self.saturated,
            "load_signal": self.load_signal,
            "headroom": round(self.headroom(placed=0), 4),
            "weight": self.spec.weight,
            "routed": self.routed,
            "ejections": h.ejections,
            "ejections_refused": h.ejections_refused,
            "ejection_held": h.ejection_held,
            "failures": dict(h.failures),
            "probe_in_s": None if h.ejected_until is None else round(h.retry_after_s() or 0.0, 3),
            "last_error": h.last_error,
        }


def _ms(v: float | None) -> float | None:
    """Seconds rounded to the millisecond's tenth, for status pages."""
    return None if v is None else round(v, 4)


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


def affinity_key(routing: RoutingConfig, session: str | None, prompt_text: str | None) -> str | None:
    """The affinity key of a request under ``routing.affinity``, or ``None``.

    Args:
        session: the value of the ``session_header`` the request carried, if any.
        prompt_text: the start of its prompt (at least ``prefix_chars`` characters when it
            has that many; see :func:`proxy.relay.request_kinds.prompt_prefix`), if any.

    The session wins over the prefix; an empty value counts as absent.
    """
    aff = routing.affinity
    if aff.session_header is not None and session:
        return "s\x00" + session
    if aff.prefix_chars > 0 and prompt_text:
        return "p\x00" + prompt_text[: aff.prefix_chars]
    return None


def _unit_hash(data: bytes) -> float:
    """A uniform float in (0, 1) from ``data`` (BLAKE2b, 64 bits)."""
    n = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")
    return (n + 0.5) / 2.0**64


def rendezvous_order(key: str, engines: Iterable[EngineState]) -> list[EngineState]:
    """``engines`` by weighted rendezvous score for ``key``, best first (module
    docstring). Deterministic for a key and a set of engine names and weights."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()

    def score(e: EngineState) -> float:
        u = _unit_hash(digest + e.name.encode("utf-8", "surrogatepass"))
        return -e.spec.weight / math.log(u)

    return sorted(engines, key=score, reverse=True)


def _within_lease(e: EngineState, tokens: int) -> bool:
    """Whether one more request of ``tokens`` stays within ``e``'s lease (if it has one)."""
    if e.lease_slots is not None and e.inflight >= e.lease_slots:
        return False
    return e.lease_tokens is None or e.inflight_tokens + tokens <= e.lease_tokens


class PoolRouter:
    """The engines of one pool and the choice among them (module docstring).

    Args:
        pool: the pool's resolved config.
        clock: monotonic seconds (passed to each engine's health).
        rng: float in [0, 1) (ejection jitter).
        affinity_of: returns the affinity key of a ticket given to :meth:`reserve`
            without one (see :func:`affinity_key`); default: none.
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
            key: affinity key (:func:`affinity_key`), or ``None``.
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
            rest = [e for e in self.engines.values() if e not in exclude and e.in_rotation and e.can_hold(tokens) and _within_lease(e, tokens)]
            return max(rest, key=lambda e: e.headroom(tokens), default=None)
        if not cands:
            return None
        if len(cands) == 1 and len(self.engines) == 1:
            return cands[0]  # the only engine (the single-upstream form): nothing to choose
        if self.routing.policy == "round_robin":
            pick = self._by_affinity(key, [e for e in cands if not e.saturated]) if key else None
            return pick or self._round_robin(cands, commit)
        scores = {e: e.headroom(tokens) for e in cands}
        best = max(scores.values())
        if key:
            floor = best - self.routing.affinity.tolerance - 1e-12
            pick = self._by_affinity(key, [e for e in cands if not e.saturated and scores[e] >= floor])
            if pick is not None:
                return pick
        tied = [e for e in cands if scores[e] >= best - 1e-12]
        return self._next_in_turn(tied, commit)

    @staticmethod
    def _by_affinity(key: str, eligible: list[EngineState]) -> EngineState | None:
        return rendezvous_order(key, eligible)[0] if eligible else None

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

    @staticmethod
    def _round_robin(cands: list[EngineState], commit: bool) -> EngineState:
        """Smooth weighted round robin (nginx ``ngx_http_upstream_get_peer``): every
        candidate gains its weight, the largest total is picked and pays the sum."""
        if not commit:
            return cands[0]
        total = 0.0
        for e in cands:
            e._wrr += e.spec.weight
            total += e.spec.weight
        pick = max(cands, key=lambda e: e._wrr)
        pick._wrr -= total
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
        engine.inflight_tokens += tokens
        engine.held[level] = engine.held.get(level, 0) + 1
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


class PoolCapacity:
    """A pool's engines as the scheduler's :class:`qos.capacity.Capacity`: the seam
    between one pool's :class:`qos.Scheduler` and its :class:`PoolRouter`.

    ``fits(tokens)``: some engine in rotation has room (:meth:`PoolRouter.choose`);
    ``reserve(ticket)``: place it on the chosen engine and set ``ticket.placement`` to
    that :class:`EngineState` (bind late); ``release(ticket)``: free its place.
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
        applied by :meth:`PoolRouter.reconfigure`."""
        self._headroom = {g.name: g.headroom for g in policy.groups if g.headroom > 0}

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
        signal sets each engine's own limit through :meth:`EngineState.set_load`.

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
        try:
            ticket.placement = self.router.reserve(ticket, headroom=self._headroom.get(ticket.group, 0.0))
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
