"""One engine of a pool as the router sees it (:class:`EngineState`): its capacity now,
whether it is in rotation, whether a request fits it and what headroom it would leave,
its load readings, and its row on status pages. The choice among the engines that fit is
:mod:`proxy.routing.placement`'s and :class:`proxy.routing.router.PoolRouter`'s.

Definitions (one engine ``e``, a request reserving ``t`` tokens, prompt + max output):

* **capacity** ``cap(e) = min(found, max_inflight, limit, lease)``, where ``found`` is
  what its capacity controller found (:mod:`qos.capacity_control`, stepped by the load
  poller; ``max_inflight`` itself with ``admission.capacity.mode: fixed``), ``limit`` is
  the capacity limit a fixed engine's load signal sets
  (:func:`proxy.runtime.load_report.capacity_for`: 1 while it reports itself saturated; absent when
  there is none; an adaptive engine's controller reacts to the same reading), and ``lease`` is this
  process's part of the engine when several replicas share it (granted through Redis:
  :mod:`proxy.admission.lease_binding`; absent standalone). A lease may be 0, and a token lease
  caps ``inflight_tokens + t`` (another replica's requests may be running there).
* **in rotation**: healthy (not ejected) and not draining (removed by a reload).
* **headroom of a class**: a request of a class with ``headroom`` h (the fraction of each
  engine it leaves to the classes above it) fits only while
  ``occupied(e) < room_for(cap(e), h, vacant)`` (:func:`qos.capacity.room_for`), so lower
  classes never fill the last part of an engine and a higher class's request is dispatched
  at once; ``vacant`` is how many more requests the classes above ran here at once over
  the last 10 s than they run now (:class:`qos.capacity.RecentPeaks`, rolled by the load
  poller), so their recent load finds its places free when it comes back.
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
  :meth:`proxy.routing.pool_capacity.PoolCapacity.admissible`), so with engines of different
  token capacities a request too large for a small one waits for a large one instead of
  filling the small one while it is idle.
* **headroom** ``h(e, t)``: the fraction of the engine still free once the request is
  placed, the smallest of ``1 - (inflight + 1) / cap``, ``1 - (inflight_tokens + t) /
  max_inflight_tokens`` (when set) and ``1 - load / saturated_at`` (when a fresh load
  reading exists). Fractions, so engines of different sizes compare; after placing, so a
  big engine is preferred to a small one equally loaded, and a large request to the
  engine it dents least.
* **saturated**: its load signal says so (it then fits only while nothing of ours runs
  there, so the queue cannot stall behind an engine kept busy by someone else).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection

from qos.capacity import RecentPeaks, excess, occupied, room_for
from qos.capacity_control import CapacityController
from qos.capacity_control import fixed as fixed_capacity

from .engine_health import EngineHealth, Health
from .engine_meter import EngineMeter
from ..config.pools import EngineSpec, public_url


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
    peak_inflight: int = 0  # the most in flight since the capacity controller's last step
    inflight_tokens: int = 0
    held: dict[float, int] = field(default_factory=dict, repr=False)  # in flight by the headroom of its class
    peaks: RecentPeaks = field(default_factory=RecentPeaks, repr=False)  # each class's recent most in flight, rolled by the load poller
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
        :func:`proxy.runtime.load_report.capacity_for`): what several replicas' leases share out
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
        # min(found_capacity, usable, lease) in one pass: it is asked several times per
        # request (usable <= the controller's value, so found's min with it is implied)
        cap = self.control.usable
        if self.spec.max_inflight < cap:
            cap = self.spec.max_inflight
        limit = self.capacity_limit
        if limit is not None and limit < cap:
            cap = max(1, limit)
        lease = self.lease_slots
        return cap if lease is None or lease >= cap else lease

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
        if self.health.state is not Health.HEALTHY or self.draining:
            return False  # not in rotation
        cap = self.capacity
        if occupied(self.inflight, self.held, cap, self.peaks) >= self._room(cap, headroom):
            return False
        if self.lease_tokens is not None and self.inflight_tokens + tokens > self.lease_tokens:
            return False
        cap = self.spec.max_inflight_tokens
        return cap is None or self.inflight_tokens + tokens <= cap

    def room_for(self, headroom: float) -> int:
        """The most requests a class with ``headroom`` may run here now
        (:func:`qos.capacity.room_for`): the capacity less the fixed fraction and the room
        the classes above it ran here at once over the last few seconds and do not run
        now (:attr:`peaks`)."""
        return self._room(self.capacity, headroom)

    def _room(self, capacity: int, headroom: float) -> int:
        return room_for(capacity, headroom, self.peaks.vacant(headroom, self.held) if headroom > 0.0 else 0)

    def note_late(self, now: float, levels: Collection[float]) -> None:
        """One control step's late first tokens here (:meth:`qos.capacity.RecentPeaks.late`):
        ``levels``, the headrooms of the classes with a late first token (empty: none).
        Called before :meth:`qos.capacity.RecentPeaks.roll`."""
        cap = self.capacity
        peaks = self.peaks
        held = self.held

        def draining(level: float) -> bool:
            return any(excess(lv, k, cap, peaks) for lv, k in held.items() if lv > level)

        peaks.late(now, levels, cap, draining)

    def occupied(self) -> int:
        """Requests in flight here as the classes' headroom counts them: each class's up
        to its own room (:meth:`room_for` at its headroom), the top class's
        (headroom 0) and those placed outside admission in full (module docstring)."""
        return occupied(self.inflight, self.held, self.capacity, self.peaks)

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
        saturated (:func:`proxy.runtime.load_report.is_saturated`), the capacity limit
        :func:`proxy.runtime.load_report.capacity_for` derives from it, the requests waiting
        inside it, and the poller's state (``signal``, kept when ``None``)."""
        self.load, self.saturated, self.capacity_limit, self.waiting = load, saturated, capacity_limit, waiting
        if signal is not None:
            self.load_signal = signal

    def status(self) -> dict:
        """A JSON-ready view for ``/admin/status`` and the dashboard: the keys of the
        dashboard's ``engines`` entries (:mod:`proxy.api.dashboard_data`: ``name``, ``url``,
        ``kind``, ``inflight``, ``capacity``, ``max_inflight``, ``inflight_tokens``,
        ``load``, ``waiting``, ``saturated``, ``load_signal``), and ``pool``, ``state``,
        ``max_inflight_tokens``, ``headroom``, ``weight``, ``routed``, ``ejections``,
        ``ejections_refused`` (passive ejections the pool's floor refused),
        ``ejection_held`` (one is being refused now), ``failures``, ``probe_in_s``,
        ``last_error``, and ``late_kept`` (per class whose first tokens came late here, by
        its headroom as a string, the places the classes below it keep for it:
        :meth:`qos.capacity.RecentPeaks.late`)."""
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
            "late_kept": {str(level): n for level, n in self.peaks.late_kept().items()},
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
