"""Fair-share counters across replicas: a transport of per-user service, not a scheduler.

Each replica adds up the service it renders to each user in each pool (cost units: the
cost model's ``prompt x input_weight + output x output_weight``, divided by nothing: the
weight is the scheduler's business) with :meth:`ServiceCounters.add`. At every sync the
sums go to Redis (``INCRBYFLOAT`` on ``{P}:svc:<pool>:<user>``, one batch applied at most
once, by sequence number) and, in the same script, the global totals of the users this
replica has waiting are read back. The difference between two readings, minus what this
replica pushed in between, is the service the *other* replicas rendered:
:meth:`ServiceCounters.take_remote` hands it out, and the scheduler adds it to its local
counters (``docs/scaling.md``, "What the scheduler does with it").

A counter that went backwards (Redis restarted, or the key expired after
``service_ttl_s`` idle) gives no delta: the reading becomes the new base.
"""

from __future__ import annotations

from typing import Iterable

from .lua import script

SERVICE_SCRIPT = script("service")  # proxy/shared/lua/service.lua

PoolUser = tuple[str, str]


class ServiceCounters:
    """This replica's side of the shared service counters.

    Args:
        keys: a :class:`proxy.shared.keys.Keys`.
        max_pending: bound on distinct (pool, user) pairs buffered between syncs (or
            through an outage); beyond, service is dropped and counted in ``dropped``.
        max_watched: at most this many waiting users are read back per sync.
    """

    def __init__(self, keys, max_pending: int = 100_000, max_watched: int = 2_000) -> None:
        self._keys = keys
        self.max_pending = max_pending
        self.max_watched = max_watched
        self.dropped = 0
        self.seq = 0
        self._open: dict[PoolUser, float] = {}
        self._frozen: dict[PoolUser, float] | None = None
        self._frozen_seq = 0
        self._global: dict[PoolUser, float] = {}
        self._remote: dict[PoolUser, float] = {}

    def add(self, pool: str, user_id: str, cost: float) -> None:
        """Buffer ``cost`` units of service rendered here to ``user_id`` in ``pool``."""
        if not cost:
            return
        k = (pool, user_id)
        if k in self._open:
            self._open[k] += cost
        elif len(self._open) < self.max_pending:
            self._open[k] = cost
        else:
            self.dropped += 1

    def request(self, watched: Iterable[PoolUser]) -> tuple[list[PoolUser], int, list[float]]:
        """The pairs, batch sequence number (0: none) and increments of one sync.

        The increments are the unconfirmed batch if there is one (resent unchanged),
        else everything buffered since; ``watched`` pairs (users waiting here) are read
        back too, up to ``max_watched`` of them.
        """
        if self._frozen is None and self._open:
            self.seq += 1
            self._frozen, self._frozen_seq, self._open = self._open, self.seq, {}
        incs = self._frozen or {}
        pairs = list(incs)
        seen = set(pairs)
        room = self.max_watched
        for k in watched:
            if room <= 0:
                break
            if k not in seen:
                seen.add(k)
                pairs.append(k)
                room -= 1
        return pairs, (self._frozen_seq if incs else 0), [incs.get(k, 0.0) for k in pairs]

    def apply_reply(self, pairs: list[PoolUser], incs: list[float], values: list) -> None:
        """Take in the values Redis returned for ``pairs``: the batch is confirmed, and
        each value minus the last reading minus our own increment is remote service."""
        self._frozen = None
        fresh: dict[PoolUser, float] = {}
        for k, inc, raw in zip(pairs, incs, values):
            v = float(raw)
            fresh[k] = v
            last = self._global.get(k)
            if last is not None:
                delta = v - last - inc
                if delta > 1e-9:
                    self._remote[k] = self._remote.get(k, 0.0) + delta
        # keep the readings of this sync only: a pair not read now gets a new base later
        self._global = fresh
        if len(self._remote) > self.max_pending:
            self._remote.clear()

    def global_service(self, pool: str, user_id: str) -> float | None:
        """The user's service in the pool over all replicas at the last sync (cost
        units), or None when it was not read then."""
        return self._global.get((pool, user_id))

    def take_remote(self) -> dict[PoolUser, float]:
        """Service the other replicas rendered since the last call, per (pool, user)
        (cost units, > 0); the buffer is emptied."""
        out, self._remote = self._remote, {}
        return out

    def redis_args(self, replica_key: str, pairs: list[PoolUser], seq: int, incs: list[float], ttl_ms: int, keep_ms: int) -> tuple[list[str], list]:
        """KEYS and ARGV of :data:`SERVICE_SCRIPT`."""
        return [replica_key] + [self._keys.service(p, u) for p, u in pairs], [seq, ttl_ms, keep_ms] + [repr(float(i)) for i in incs]

    def __len__(self) -> int:
        return len(self._open) + len(self._frozen or ())
