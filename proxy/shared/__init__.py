"""QoS state shared by several proxy processes through Redis (``docs/scaling.md``).

One module per job: :mod:`.leases` (capacity leases), :mod:`.rate_limits` (rate-limit
buckets in Redis: what a request is charged to, the scripts' calls) with
:mod:`.rate_mirror` (their levels last seen, the local pre-check), :mod:`.local_buckets`
(buckets kept in the process: fallback and standalone), :mod:`.reserve_batcher`
(concurrent reserves in one pipeline), :mod:`.reserve_log` (reserves whose outcome is not
known yet) and :mod:`.rate_corrections` (settles and refunds waiting for the next sync),
all used by :mod:`.replica_rate_limits` (this replica's takes and corrections);
:mod:`.counters` (fair-share service counters), :mod:`.sync` (the sync loop and the
fallback: :class:`SharedState`), :mod:`.redis_link` (its connections and script calls),
:mod:`.standalone` (the same surface without Redis),
:mod:`.keys` (the Redis key layout); the scripts Redis runs are :mod:`.lua`. What binds
this state to the schedulers and engines is :mod:`proxy.admission` (``lease_binding``,
``rate_reservation``).

May import: config.
"""

from __future__ import annotations

from ..config.schema import SharedStateConfig
from .leases import CapacityReport, ClassDemand, fallback_share
from .rate_limits import RateLimited, Reservation
from .standalone import StandaloneState
from .sync import SharedState, SyncReport


def create_shared_state(config: SharedStateConfig | None, expected_replicas: int = 1) -> SharedState | StandaloneState:
    """A :class:`SharedState` for a ``shared_state`` section, else a :class:`StandaloneState`.

    Args:
        config: the section, or None (absent: standalone).
        expected_replicas: replicas assumed before Redis says (``--workers N``).
    """
    if config is None:
        return StandaloneState()
    return SharedState(config, expected_replicas=expected_replicas)


__all__ = [
    "CapacityReport",
    "ClassDemand",
    "RateLimited",
    "Reservation",
    "SharedState",
    "StandaloneState",
    "SyncReport",
    "create_shared_state",
    "fallback_share",
]
