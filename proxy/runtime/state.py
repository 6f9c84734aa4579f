"""The live state of one proxy process and the atomic config swap."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from qos.objectives import ObjectiveTracker

from ..routing import engine_metrics
from ..admission.admission import Admission, Pool, Preemption
from ..admission.lease_binding import BoundPool, LeaseBinding
from ..config.schema import Config
from ..config.loading import with_upstream_urls
from ..routing.health_checker import HealthChecker
from ..admission.identity import IdentityResolver
from ..telemetry.metrics import Metrics, SharedStateCollector
from ..telemetry.objectives import ObjectivesCollector
from ..telemetry.protection import ProtectionMetrics
from ..admission.objective_protection import GroupObjectives
from ..routing.model_routing import ModelTable
from ..config.pools import public_url
from ..routing.engine_state import EngineState
from ..shared import StandaloneState, create_shared_state
from ..admission.rate_reservation import SharedRateLimiter
from ..relay.upstream import Upstream

log = logging.getLogger("llm_qos.proxy")


@dataclass(slots=True)
class ActiveConfig:
    """One whole config as requests see it: read once per request, so a request never
    mixes two configs.

    Attributes:
        config: the validated config.
        identity: resolver built from it.
        digest: short SHA-256 of the file's bytes ("" when not from a file).
        loaded_at: wall-clock time (Unix seconds) it became active.
        models: its model table (which pool serves which ``model``).
    """

    config: Config
    identity: IdentityResolver
    digest: str = ""
    models: ModelTable = None  # type: ignore[assignment]
    loaded_at: float = field(default_factory=time.time)


class ProxyState:
    """Everything a request handler needs, held on the aiohttp app.

    Args:
        config: the initial config.
        digest: its file's hash, if loaded from a file.
        config_path: the file it came from (for reloads), or ``None``.
        upstream_override: upstream URL(s) applied on every load (the CLI's
            ``--upstream``; several make a pool: :func:`proxy.config.loading.with_upstream_urls`).
        worker: (index, count) for one of ``--workers`` processes (each is a replica of
            the deployment: it assumes at least ``count`` replicas before Redis says).

    With ``shared_state``, the scheduler's capacity is leased per engine
    (:mod:`proxy.admission.lease_binding`) and its rate limits are reserved in Redis
    (:mod:`proxy.admission.rate_reservation`); without it, the process is standalone, as before.

    Raises:
        ConfigError: the override does not fit the config.
    """

    def __init__(
        self,
        config: Config,
        digest: str = "",
        config_path: str | None = None,
        upstream_override: str | list[str] | None = None,
        worker: tuple[int, int] | None = None,
    ) -> None:
        self.upstream_override = upstream_override
        self.worker = worker
        config = self._prepare(config)
        pools = config.effective_pools()
        self.active = ActiveConfig(config, IdentityResolver(config), digest, models=ModelTable(pools))
        self.config_path = config_path
        # shared with the other replicas through Redis, or standalone; fixed for the
        # process's lifetime (a changed shared_state section takes effect at restart)
        self.shared = create_shared_state(config.shared_state, worker[1] if worker else 1)
        standalone = isinstance(self.shared, StandaloneState)
        self.admission = Admission(config.to_policy(), pools, rate_limiter=None if standalone else SharedRateLimiter(self.shared), leased=not standalone)
        self.admission.on_engine_removed = self._engine_removed
        self.admission.preemption = _preemption(config)
        self.leases: LeaseBinding | None = None
        if not standalone:
            self.admission.on_wait = self.shared.request_sync
            self.leases = LeaseBinding(self.shared, self._bound_pools)
        self.metrics = Metrics(lambda: [p.scheduler for p in self.admission.all_pools()], (g.name for g in config.groups), worker=worker[0] if worker else None)
        engine_metrics.register(self.metrics.registry, self.admission.routers)
        self.admission.on_preempt = self._preempted
        self.metrics.registry.register(SharedStateCollector(self.shared, self._lease_keys))
        # the groups' latency objectives, measured per (group, engine) on time.monotonic
        self.objectives = ObjectiveTracker(config.group_objectives(), config.objectives.window_s)
        self.metrics.registry.register(ObjectivesCollector(lambda: self.objectives, time.monotonic))
        # keeping them: objective protection and on_miss: reject (admission/objective_protection.py)
        protection = self.admission.protection
        protection.tracker = lambda: self.objectives
        self.protection_metrics = ProtectionMetrics(self.metrics.registry, protection.steps)
        protection.on_step, protection.on_refused = self.protection_metrics.step, self.protection_metrics.refused
        _protect(self.admission, config)
        self.health: HealthChecker | None = None  # created on startup, inside the loop
        self.started = False
        self.on_engines_synced: list = []  # called (no arguments) after every sync_engines
        self._closing: set[asyncio.Task] = set()
        self.last_error: str | None = None
        self.draining = False
        self.open_requests = 0  # client requests being handled now
        self.max_body_bytes = config.limits.max_body_bytes  # fixed for the app's lifetime

    def _prepare(self, config: Config) -> Config:
        return with_upstream_urls(config, self.upstream_override)

    def _bound_pools(self) -> list[BoundPool]:
        """The pools the capacity leases bind: every pool's scheduler and engines
        (retired pools and draining engines too, while they have requests in flight)."""
        return [BoundPool(p.name, p.scheduler, p.router.engines.values, _placement) for p in self.admission.all_pools()]

    def _lease_keys(self) -> list[str]:
        """The capacity keys this process leases (for the metrics: their series exist
        from start-up, at 0 until granted)."""
        return [r.key for r in self.leases.report().capacity] if self.leases is not None else []

    def apply(self, config: Config, digest: str = "") -> None:
        """Make ``config`` the active one, atomically (one reference swap, no await).

        The scheduler keeps its fairness counters, rate-limit buckets, queue and
        requests in flight (:meth:`qos.Scheduler.update_policy`).

        Raises:
            ValueError: the config is inconsistent as a scheduler policy (nothing changes).
            ConfigError: as for the constructor (nothing changes).
        """
        config = self._prepare(config)
        policy = config.to_policy()
        identity = IdentityResolver(config)
        pools = config.effective_pools()
        models = ModelTable(pools)
        self.admission.reconfigure(policy, pools)
        self.admission.preemption = _preemption(config)
        self.metrics.add_groups(g.name for g in config.groups)  # new groups' series at 0
        self.objectives.configure(config.group_objectives(), config.objectives.window_s)
        _protect(self.admission, config)
        self.sync_engines()
        self.active = ActiveConfig(config, identity, digest, models=models)
        self.last_error = None
        if self.leases is not None:
            self.leases.rebind()  # an engine renamed or re-sized: its lease follows

    # ---------------------------------------------------------------- engines

    @property
    def upstream(self) -> Upstream | None:
        """The first engine's connections (the only engine of the single-``upstream``
        form), or ``None`` before startup."""
        for e in self.admission.default.router.engines.values():
            return e.client
        return None

    def start(self) -> None:
        """Open every engine's connections and start the health checks (inside the
        running loop, at startup)."""
        self.health = HealthChecker(on_checked=self.admission.engine_checked)
        self.started = True
        self.sync_engines()

    def sync_engines(self) -> None:
        """Give every engine its :class:`proxy.relay.upstream.Upstream` (new ones a fresh pool
        of connections, kept ones their new settings) and watch the health of the
        engines of pools that track it (:attr:`proxy.admission.admission.Pool.tracks_health`)."""
        if not self.started:
            return
        watched = []
        for pool, e in self.admission.engines():
            if e.client is None:
                e.client = Upstream(e.spec.upstream)
            elif e.client.config is not e.spec.upstream:
                e.client.reconfigure(e.spec.upstream)
            if pool.tracks_health and not e.draining:
                watched.append(e)
        if self.health is not None:
            self.health.sync(watched)
        for hook in self.on_engines_synced:
            hook()

    def _preempted(self, pool: Pool, engine: EngineState | None, ticket) -> None:
        """A request was preempted off ``engine``: count it (``llm_qos_preemptions_total``)."""
        self.metrics.preemptions.labels(pool.name, engine.name if engine is not None else "", ticket.group).inc()

    def _engine_removed(self, engine: EngineState) -> None:
        """An engine left its pool (drained): stop checking it, close its connections."""
        if self.health is not None:
            self.health.unwatch(engine)
        client, engine.client = engine.client, None
        if client is not None:
            task = asyncio.get_running_loop().create_task(client.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        log.info("engine %s (%s) left pool %s", engine.name, public_url(engine.url), engine.spec.pool)

    async def close(self) -> None:
        """Stop the health checks and close every engine's connections (at cleanup)."""
        if self.health is not None:
            await self.health.close()
        for _pool, e in list(self.admission.engines()):
            if e.client is not None:
                await e.client.close()
                e.client = None
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


def _protect(admission: Admission, config: Config) -> None:
    """``objectives.protection`` and the groups' objectives and ``on_miss`` to
    ``admission.protection`` (its pools' states are kept)."""
    groups = {g.name: GroupObjectives({o.name: o for o in objs}, g.on_miss) for g in config.groups if (objs := g.objectives())}
    p = config.objectives.protection
    admission.protection.configure(p.settings(), p.interval_s, groups)


def _preemption(config: Config) -> Preemption:
    """``admission.preemption`` as :class:`proxy.admission.admission.Preemption`."""
    p = config.admission.preemption
    return Preemption(p.enabled, None if p.after_s == "auto" else float(p.after_s), p.max_per_request)


def _placement(ticket) -> EngineState | None:
    """The engine a ticket in flight is on (bound at dispatch)."""
    return ticket.placement
