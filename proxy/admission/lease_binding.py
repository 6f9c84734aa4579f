"""Capacity leases bound to the engines: what ties the shared state's leases
(:mod:`proxy.shared.leases`) to the schedulers and the engines' capacity.

Every engine of every pool is one capacity key for its request slots
(``<pool>/<engine>:slots``, capacity ``max_inflight``) and, when it has a
``max_inflight_tokens``, a second key for its reserved tokens (``<pool>/<engine>:tokens``).
Engines are identified by pool and name (a name defaults to the engine's URL): every
replica of a deployment must name an engine alike, or each will lease it separately.

At every sync the shared state calls :meth:`LeaseBinding.report`, which reads, for each
key, from the pool's scheduler and the engine: the units in flight on that engine (exact:
the lease invariant rests on it), and per priority class the units of that class in
flight there, the units waiting in the pool's queue (a request waits for the pool, not an
engine, so every engine of the pool reports the pool's waiting units: the plan caps each
engine's target at its capacity anyway), the summed weight of the class's users with
requests waiting (0 when none wait: then the class only keeps what weighted demand
leaves, as :mod:`proxy.shared.leases` plans it), and the class's ``min_share`` (its floor
in the plan). An engine this replica cannot dispatch to (``in_rotation`` false: ejected
by its own health checks, or draining after a reload) is reported closed, with its
units in flight and no demand: the plan gives this replica nothing there, so its share
goes to the replicas that can use the engine, and the claim it keeps is what it still
runs there. It opens again at the first sync after the engine is back in rotation.

When grants change (:meth:`LeaseBinding.apply`) each engine's lease is set to its grant
(:meth:`LeasedEngine.set_lease`: the engine's capacity becomes ``min(max_inflight, load
signal's limit, lease)``, its tokens ``min(max_inflight_tokens, token lease)``), and every
pool's scheduler is asked to dispatch what now fits. A lease of 0 is real: another
replica holds the whole engine. Before the first grant every lease is 0, so a replica
dispatches nothing Redis has not granted (or, when Redis is unreachable, until its
fallback share is taken: :mod:`proxy.shared.sync`).

Fair shares across replicas: each scheduler reports the service it renders
(:attr:`qos.Scheduler.on_service` → ``report_service``), and after each sync the
service the *other* replicas rendered to the users waiting here is charged to those
users' counters (:meth:`LeaseBinding.fold_remote` → :meth:`qos.Scheduler.charge_remote`),
so every replica orders its queue by service rendered everywhere, one sync interval late.

The binding needs one narrow hook of the capacity model: something per engine that has
``max_inflight``, ``max_inflight_tokens``, ``in_rotation``, ``inflight``, ``inflight_tokens``
and ``set_lease(slots, tokens)`` (:class:`LeasedEngine`: the router's
:class:`proxy.routing.engine_state.EngineState`), and a way to tell which engine a ticket in flight is on
(``ticket.placement``). A new engine must start with a lease of 0 when leases are in force
(:class:`proxy.routing.router.PoolRouter` ``leased=True``), so nothing is placed there before the
binding's next :meth:`LeaseBinding.rebind`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, Sequence

from qos import Scheduler, Ticket

from ..shared import CapacityReport, ClassDemand, SyncReport


class LeasedEngine(Protocol):
    """One engine's capacity, as the binding sees it."""

    @property
    def name(self) -> str:
        """Unique within its pool; the same on every replica."""

    @property
    def max_inflight(self) -> int:
        """Requests it may run at once (its configured capacity)."""

    @property
    def max_inflight_tokens(self) -> int | None:
        """Reserved tokens it may hold at once, or ``None``."""

    @property
    def in_rotation(self) -> bool:
        """Whether this process may place requests there now (not ejected by its health
        checks, not draining); one that is not claims only what it has in flight."""

    @property
    def inflight(self) -> int:
        """Requests of this process on it now (exact)."""

    @property
    def inflight_tokens(self) -> int:
        """Their reserved tokens."""

    def set_lease(self, slots: int | None, tokens: int | None) -> None:
        """Cap this process's use of the engine (``None``: no cap); 0 is allowed."""


@dataclass(frozen=True, slots=True)
class BoundPool:
    """One pool as the binding sees it.

    Attributes:
        name: the pool's name (the service counters' pool).
        scheduler: its scheduler.
        engines: returns its engines now (a reload may change them); engines draining
            with requests in flight must be included until those finish.
        engine_of: the engine a ticket in flight is on (``None``: unknown; then the
            pool's only engine, if it has one).
    """

    name: str
    scheduler: Scheduler
    engines: Callable[[], Iterable[LeasedEngine]]
    engine_of: Callable[[Ticket], LeasedEngine | None] = lambda _t: None


def slots_key(pool: str, engine: str) -> str:
    """The capacity key of an engine's request slots."""
    return f"{pool}/{engine}:slots"


def tokens_key(pool: str, engine: str) -> str:
    """The capacity key of an engine's reserved tokens."""
    return f"{pool}/{engine}:tokens"


class LeaseBinding:
    """Binds a shared state (:class:`proxy.shared.SharedState`) to the pools' schedulers
    and engines (module docstring). Installs itself as the shared state's reporter,
    change and sync callbacks, and as every scheduler's ``on_service``.

    Args:
        shared: the shared state (not started yet, or started: it is applied at once).
        pools: returns the pools now (called at every sync and grant change).
    """

    def __init__(self, shared, pools: Callable[[], Sequence[BoundPool]]) -> None:
        self.shared = shared
        self.pools = pools
        shared.set_reporter(self.report)
        shared.set_on_change(self.apply)
        shared.set_on_sync(self.fold_remote)
        self.rebind()

    def rebind(self) -> None:
        """After the pools or engines changed (a reload): hook every scheduler's service
        reports and set every engine's lease to its grant (0 for a new engine until
        Redis grants it; a sync is asked for at once)."""
        for pool in self.pools():
            pool.scheduler.on_service = _reporter(self.shared, pool.name)
        self.apply()
        self.shared.request_sync()

    def apply(self) -> None:
        """Set every engine's lease to its grant, then let every scheduler dispatch what
        now fits (called when grants change)."""
        grant = self.shared.grant
        pools = self.pools()
        for pool in pools:
            for e in pool.engines():
                tokens = grant(tokens_key(pool.name, e.name)) if e.max_inflight_tokens is not None else None
                e.set_lease(grant(slots_key(pool.name, e.name)), tokens)
        for pool in pools:
            pool.scheduler.dispatch()

    def report(self) -> SyncReport:
        """This replica's capacity use and demand, per capacity key (module docstring)."""
        reports: list[CapacityReport] = []
        waiting: dict[str, set[str]] = {}
        for pool in self.pools():
            sched = pool.scheduler
            loads = sched.class_loads()
            n = len(loads)
            index = {name: i for i, (name, *_rest) in enumerate(loads)}
            engines = list(pool.engines())
            only = engines[0] if len(engines) == 1 else None
            per = {id(e): ([0] * n, [0] * n) for e in engines}
            for t in sched.inflight:
                e = pool.engine_of(t) or only
                counts = per.get(id(e)) if e is not None else None
                if counts is None:
                    continue
                c = index.get(t.group, n - 1)  # a class a reload removed: count it lowest
                counts[0][c] += 1
                counts[1][c] += t.reserved_tokens
            floors = {g.name: g.min_share for g in sched.policy.groups}
            for e in engines:
                reqs, toks = per[id(e)]
                # an engine this replica cannot dispatch to (ejected by its health checks,
                # draining after a reload) claims only what it has in flight there: no
                # demand, and closed, so the plan gives it nothing that would sit idle
                usable = getattr(e, "in_rotation", True)
                slots = _demand(loads, floors, reqs, 1) if usable else ()
                reports.append(CapacityReport(slots_key(pool.name, e.name), e.max_inflight, e.inflight, slots, usable))
                if e.max_inflight_tokens is not None:
                    tokens = _demand(loads, floors, toks, 2) if usable else ()
                    reports.append(CapacityReport(tokens_key(pool.name, e.name), e.max_inflight_tokens, e.inflight_tokens, tokens, usable))
            users = sched.waiting_users()
            if users:
                waiting[pool.name] = users
        return SyncReport(tuple(reports), waiting)

    def fold_remote(self) -> None:
        """Charge the service other replicas rendered to the users waiting here (called
        after each sync)."""
        remote = self.shared.take_remote_service()
        if not remote:
            return
        by_name = {p.name: p.scheduler for p in self.pools()}
        for (pool, user), cost in remote.items():
            sched = by_name.get(pool)
            if sched is not None:
                sched.charge_remote(user, cost)


def _demand(loads: list, floors: dict[str, float], units: list[int], waiting_col: int) -> tuple[ClassDemand, ...]:
    """Per class (``loads``: :meth:`qos.Scheduler.class_loads`): its units in flight on
    the engine (``units``), waiting in the pool (column ``waiting_col`` of ``loads``: 1
    requests, 2 tokens), the summed weight of its waiting users, and its floor."""
    return tuple(
        ClassDemand(units[c], row[waiting_col], row[3] if row[1] else 0.0, floors.get(row[0], 0.0))
        for c, row in enumerate(loads)
    )  # fmt: skip


def _reporter(shared, pool: str) -> Callable[[str, float], None]:
    report = shared.report_service

    def on_service(user_id: str, cost: float) -> None:
        report(pool, user_id, cost)

    return on_service


__all__ = ["BoundPool", "LeaseBinding", "LeasedEngine", "slots_key", "tokens_key"]
