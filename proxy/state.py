"""The live state of one proxy process and the atomic config swap."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .admission import Admission
from .config import Config, ConfigError, with_upstream_urls
from .identity import IdentityResolver
from .metrics import Metrics
from .pool_config import unserved
from .shared import create_shared_state
from .upstream import Upstream
from .workers import split_for_worker


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
        worker: (index, count) for one of ``--workers`` processes: every load is
            :func:`proxy.workers.split_for_worker`'s part of the file.

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
        self.admission = Admission(config.to_policy())
        self.metrics = Metrics(lambda: self.admission.scheduler, (g.name for g in config.groups))
        self.upstream: Upstream | None = None  # created on startup, inside the loop
        self.last_error: str | None = None
        self.draining = False
        self.open_requests = 0  # client requests being handled now
        self.max_body_bytes = config.limits.max_body_bytes  # fixed for the app's lifetime
        # shared with the other replicas through Redis, or standalone; fixed for the
        # process's lifetime (a changed shared_state section takes effect at restart)
        self.shared = create_shared_state(config.shared_state, worker[1] if worker else 1)

    def _prepare(self, config: Config) -> Config:
        config = _servable(with_upstream_urls(config, self.upstream_override))
        return split_for_worker(config, self.worker[1], self.worker[0]) if self.worker else config

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


def _servable(config: Config) -> Config:
    """``config``, or ConfigError when this build cannot serve it (pools, until the
    second phase of issue #12 wires them in)."""
    reason = unserved(config)
    if reason is not None:
        raise ConfigError(reason)
    return config
