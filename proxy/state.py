"""The live state of one proxy process and the atomic config swap."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .admission import Admission
from .capacity_leases import BoundPool, LeaseBinding, LocalEngine
from .config import Config, ConfigError, with_upstream_urls
from .identity import IdentityResolver
from .metrics import Metrics, SharedStateCollector
from .pool_config import resolve_pools, unserved
from .shared import StandaloneState, create_shared_state
from .shared_limits import SharedRateLimiter
from .upstream import Upstream


@dataclass(slots=True)
class ActiveConfig:
    """One whole config as requests see it: read once per request, so a request never
    mixes two configs.

    Attributes:
        config: the validated config.
        identity: resolver built from it.
        digest: short SHA-256 of the file's bytes ("" when not from a file).
        loaded_at: wall-clock time (Unix seconds) it became active.
    """

    config: Config
    identity: IdentityResolver
    digest: str = ""
    loaded_at: float = field(default_factory=time.time)


class ProxyState:
    """Everything a request handler needs, held on the aiohttp app.

    Args:
        config: the initial config.
        digest: its file's hash, if loaded from a file.
        config_path: the file it came from (for reloads), or ``None``.
        upstream_override: upstream URL(s) applied on every load (the CLI's
            ``--upstream``; several make a pool: :func:`proxy.config.with_upstream_urls`).
        worker: (index, count) for one of ``--workers`` processes (each is a replica of
            the deployment: it assumes at least ``count`` replicas before Redis says).

    With ``shared_state``, the scheduler's capacity is leased per engine
    (:mod:`proxy.capacity_leases`) and its rate limits are reserved in Redis
    (:mod:`proxy.shared_limits`); without it, the process is standalone, as before.

    Raises:
        ConfigError: the override does not fit the config, or this build cannot serve it
            (:func:`proxy.pool_config.unserved`).
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
        self.active = ActiveConfig(config, IdentityResolver(config), digest)
        self.config_path = config_path
        # shared with the other replicas through Redis, or standalone; fixed for the
        # process's lifetime (a changed shared_state section takes effect at restart)
        self.shared = create_shared_state(config.shared_state, worker[1] if worker else 1)
        standalone = isinstance(self.shared, StandaloneState)
        self.admission = Admission(config.to_policy(), shared_limits=None if standalone else SharedRateLimiter(self.shared))
        self.leases: LeaseBinding | None = None
        if not standalone:
            self.admission.on_wait = self.shared.request_sync
            self.leases = LeaseBinding(self.shared, self._bound_pools)
        self.metrics = Metrics(lambda: self.admission.scheduler, (g.name for g in config.groups))
        self.metrics.registry.register(SharedStateCollector(self.shared, self._lease_keys))
        self.upstream: Upstream | None = None  # created on startup, inside the loop
        self.last_error: str | None = None
        self.draining = False
        self.open_requests = 0  # client requests being handled now
        self.max_body_bytes = config.limits.max_body_bytes  # fixed for the app's lifetime

    def _prepare(self, config: Config) -> Config:
        return _servable(with_upstream_urls(config, self.upstream_override))

    def _bound_pools(self) -> list[BoundPool]:
        """The pools the capacity leases bind (the single-upstream form: one pool, one
        engine, named as :func:`proxy.pool_config.resolve_pools` names them)."""
        pool = resolve_pools(self.active.config)[0]
        engine = LocalEngine(pool.engines[0].name, self.admission.scheduler.capacity_model)
        return [BoundPool(pool.name, self.admission.scheduler, lambda: (engine,))]

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
        self.admission.update_policy(policy)
        self.metrics.add_groups(g.name for g in config.groups)  # new groups' series at 0
        if self.upstream is not None:
            self.upstream.reconfigure(config.upstream)
        self.active = ActiveConfig(config, identity, digest)
        self.last_error = None
        if self.leases is not None:
            self.leases.rebind()  # an engine renamed or re-sized: its lease follows


def _servable(config: Config) -> Config:
    """``config``, or ConfigError when this build cannot serve it (pools, until the
    second phase of issue #12 wires them in)."""
    reason = unserved(config)
    if reason is not None:
        raise ConfigError(reason)
    return config
