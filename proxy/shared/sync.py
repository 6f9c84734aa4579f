"""The shared state of one proxy process: the sync loop, and the fallback when Redis cannot
be reached. Its connections and script calls are :mod:`proxy.shared.redis_link`; its
rate-limit takes and corrections, :mod:`proxy.shared.replica_rate_limits`.

One concept over 400 lines: one replica's session with the shared state (the sync round,
the modes it moves through, the surface the proxy holds), a few methods of
:class:`SharedState` each; some 120 of the lines are docstrings, 50 of them this account
of the modes and of what a full outage can cost.

:class:`SharedState` is what the rest of the proxy holds. The hot path reads
:meth:`~SharedState.grant` (a dict lookup) and awaits :meth:`~SharedState.reserve_rate`
(one Redis round trip when a rate limit applies, none otherwise); everything else is
buffered and travels with the sync, one pipelined round trip every ``sync_interval_s``:

1. the lease script (:mod:`proxy.shared.leases`): renew this replica, report capacity use
   and demand, get the new grants;
2. the service counters (:mod:`proxy.shared.counters`): push service, read back the
   global service of the users waiting here;
3. the rate-limit corrections (:mod:`proxy.shared.rate_limits`): settles and refunds.

**Modes** (:attr:`SharedState.mode`):

- ``shared``: the last sync succeeded.
- ``degraded``: a sync or a reserve failed (error, or no answer within ``timeout_s``),
  less than ``lease_s`` after the last successful sync. Each grant drops to
  min(grant, capacity ÷ N) at once (only lowering: always safe); rate limits are
  enforced locally at limit ÷ N; nothing waits for Redis any more. N is
  :attr:`SharedState.share_replicas`: the live count Redis last reported, at least
  ``expected_replicas``.
- ``fallback``: no successful sync for ``lease_s``. Each grant becomes the share
  capacity ÷ N (remainders to the lowest ranks: the shares of replicas that last saw the
  same live set add up to at most the capacity). A replica dispatches only while its own in
  flight is below its grant, so one that still runs more than its share from before the
  outage starts nothing new until its in flight is below its share.

  **The bound of a full outage.** Let old_i(t) be replica i's units in flight at time t
  that it dispatched before its first failed call, and share_i its share. After that
  call its grant is at most share_i, so its in flight is at most max(share_i, old_i(t)),
  and the engines' total in flight is at most
  ``C + Σ_i max(0, old_i(t) − share_i)``. While no replica has reached ``fallback`` it
  is at most C (``degraded`` only lowers grants under the claims Redis held). The excess
  exists only when a replica held more than its share when Redis went away and its
  requests outlive about ``lease_s`` − ``sync_interval_s``; it shrinks as those requests finish and is gone when
  they all have (it is at most C − min_i share_i). It is not zero because the other
  replicas cannot see, without Redis, when those requests finish; holding their shares
  back until then would leave them unable to serve for the whole outage.
  The first successful sync after this opens a rebuild window (see
  :mod:`proxy.shared.leases`).

Requests are never moved between replicas: queued requests stay in their replica's queue
whatever Redis does, so nothing is dispatched twice and nothing is lost.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from qos import RateLimit

from ..config.schema import SharedStateConfig
from .counters import SERVICE_SCRIPT, ServiceCounters
from .keys import Keys
from .leases import LEASE_SCRIPT, CapacityReport, LeaseTable
from .rate_corrections import PendingAdjustments
from .rate_limits import ADJUST_SCRIPT, RESERVE_SCRIPT, Reservation
from .redis_link import UNREACHABLE, RedisLink, describe, still_cancelled
from .replica_rate_limits import ReplicaRateLimits

log = logging.getLogger("llm_qos.shared")


@dataclass(frozen=True, slots=True)
class SyncReport:
    """What the scheduler tells the shared state at each sync (see :meth:`SharedState.set_reporter`).

    Attributes:
        capacity: one report per capacity key this replica uses or has units in flight on.
        waiting_users: per pool, the users with requests waiting here (their global
            service is read back).
    """

    capacity: tuple[CapacityReport, ...] = ()
    waiting_users: Mapping[str, Iterable[str]] = field(default_factory=dict)


def new_replica_id() -> str:
    """``host:pid:random``: unique per process, readable in ``redis-cli``."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class SharedState:
    """QoS state shared with the other replicas of a deployment through Redis.

    Args:
        config: the ``shared_state`` section.
        replica_id: this process's id (default :func:`new_replica_id`).
        expected_replicas: replicas assumed before Redis has said how many are live
            (default ``config.expected_replicas``; ``--workers N`` passes at least N).
        clock: monotonic seconds (for the lease's local side and the pre-check).

    Call :meth:`start` inside the event loop before use and :meth:`stop` at shutdown.
    """

    def __init__(
        self,
        config: SharedStateConfig,
        replica_id: str | None = None,
        expected_replicas: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.replica_id = replica_id or new_replica_id()
        self.keys = Keys(config.key_prefix)
        self._clock = clock
        self._interval = config.sync_interval_s
        self._timeout = config.timeout_s
        self._lease_ms = int(config.lease_s * 1000)
        self._keep_ms = max(60_000, 10 * self._lease_ms)
        self._ttl_ms = int(config.service_ttl_s * 1000)
        self.expected_replicas = max(config.expected_replicas, expected_replicas or 1)
        self.live_replicas = self.expected_replicas
        self.rank: int | None = None
        self.mode = "degraded"  # until the first sync succeeds
        self.rebuilding = False
        self.leases = LeaseTable()
        self.counters = ServiceCounters(self.keys)
        self.syncs = 0  # successful
        self.sync_failures = 0
        self.last_sync_rtt_s = 0.0
        self._last_ok_send: float | None = None
        self._reporter: Callable[[], SyncReport] = SyncReport
        self._on_change: Callable[[], None] = lambda: None
        self._on_sync: Callable[[], None] = lambda: None
        self._link = RedisLink(
            config,
            self.replica_id,
            {"lease": LEASE_SCRIPT, "reserve": RESERVE_SCRIPT, "adjust": ADJUST_SCRIPT, "service": SERVICE_SCRIPT},
        )
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.rate_limits = ReplicaRateLimits(
            self.keys,
            self._link.reserves,
            self.keys.reserve_log(self.replica_id),
            self._keep_ms,
            self._timeout,
            self._interval,
            clock,
            shared=lambda: self.mode == "shared",
            share=lambda: self.share_replicas,
            on_unreachable=self._unreachable,
        )
        self._stopping = False
        self._sync_lock = asyncio.Lock()  # one sync at a time (the loop, stop(), tests)
        self._started_at = clock()

    # ------------------------------------------------------------------ wiring

    def set_reporter(self, reporter: Callable[[], SyncReport]) -> None:
        """Install the function called (synchronously, no await) at each sync for this
        replica's capacity use, demand and waiting users."""
        self._reporter = reporter

    def set_on_change(self, callback: Callable[[], None]) -> None:
        """Install the function called (synchronously) whenever grants change, so the
        scheduler can dispatch what a larger grant now allows."""
        self._on_change = callback

    def set_on_sync(self, callback: Callable[[], None]) -> None:
        """Install the function called (synchronously) after every successful sync, once
        its replies are applied: the moment new remote service is available
        (:meth:`take_remote_service`)."""
        self._on_sync = callback

    def request_sync(self) -> None:
        """Sync soon (at most four times per interval), e.g. when work starts waiting
        that the grant does not cover."""
        self._wake.set()

    # --------------------------------------------------------------- lifecycle

    async def start(self, background: bool = True) -> None:
        """Connect, try a first sync (bounded by ``timeout_s``: an unreachable Redis does
        not delay start-up; the process starts in ``degraded`` mode and keeps trying), and
        start the sync loop (``background=False``: no loop, the caller calls
        :meth:`sync_once` itself, as the benchmark does)."""
        self._link.connect()  # two connections: the syncs', the reserves'
        await self.sync_once()
        if background:
            self._task = asyncio.create_task(self._run(), name="llm-qos shared-state sync")

    async def stop(self, give_back: bool = True) -> None:
        """Stop syncing, push what is buffered, give this replica's grants back (so the
        others can use them at once, not after a lease), and close the connections.
        Bounded by a few ``timeout_s``; errors are logged, not raised. ``give_back=False``
        only closes: Redis sees what a crash looks like (the grants lapse after a lease)."""
        if self._task is not None:
            # the loop ends after its current sync (itself bounded by timeout_s); it is
            # told, not cancelled, so no cancellation can be lost inside the client
            self._stopping = True
            self._wake.set()
            done, _ = await asyncio.wait({self._task}, timeout=self._timeout * 3 + 1.0)
            if not done:
                self._task.cancel()
                await asyncio.wait({self._task})
            self._task = None
        if not self._link.connected:
            return
        if self.mode == "shared" and give_back:
            await self.sync_once()
            try:
                keys = self.leases.reported_keys()
                async with asyncio.timeout(self._timeout * 2):
                    await self._link.call(
                        "lease",
                        [self.keys.replicas, self.keys.epoch] + [self.keys.lease(k) for k in keys],
                        [self.replica_id, self._lease_ms, self._keep_ms, json.dumps([0] * len(keys)), "leave"],
                    )
            except UNREACHABLE as e:
                still_cancelled()
                log.warning("shared state: could not give the grants back at shutdown (%s); they expire in %g s", describe(e), self.config.lease_s)
        await self._link.close()

    async def _run(self) -> None:
        min_gap = self._interval / 4
        last = self._clock()
        while not self._stopping:
            remaining = self._interval - (self._clock() - last)
            if remaining > 0:
                try:
                    async with asyncio.timeout(remaining):
                        await self._wake.wait()
                except TimeoutError:
                    pass
                gap = min_gap - (self._clock() - last)
                if gap > 0 and not self._stopping:  # woken early: no more than four syncs per interval
                    await asyncio.sleep(gap)
            if self._stopping:
                return
            self._wake.clear()
            last = self._clock()
            try:
                await self.sync_once()
            except Exception:  # a bug must not end the loop: the lease would lapse
                log.exception("shared state: sync failed unexpectedly")

    # -------------------------------------------------------------------- sync

    async def sync_once(self) -> bool:
        """One sync: renew, report, push, read back. Returns whether Redis answered."""
        assert self._link.connected, "start() first"
        async with self._sync_lock:
            return await self._sync()

    async def _sync(self) -> bool:
        report = self._reporter()
        mode = "rejoin" if self.mode == "fallback" else "sync"
        lease_keys, lease_body = self.leases.request(report.capacity)
        pairs, svc_seq, incs = self.counters.request((pool, u) for pool, users in report.waiting_users.items() for u in users)
        adj = self.rate_limits.batch()
        sent = self._clock()
        try:
            replies = await self._call_sync(mode, lease_keys, lease_body, pairs, svc_seq, incs, adj)
        except UNREACHABLE as e:
            still_cancelled()
            self.sync_failures += 1
            self._unreachable(e)
            return False
        self.last_sync_rtt_s = self._clock() - sent
        lease = json.loads(replies[0])
        changed, lowered = self.leases.apply_reply(lease_keys, _as_list(lease.get("g")))
        if pairs:
            self.counters.apply_reply(pairs, incs, replies[1])
        if adj is not None:
            self.rate_limits.batch_applied()
        self.live_replicas = max(1, int(lease["n"]))
        self.rank = int(lease["rank"])
        self.rebuilding = bool(lease["rebuild"])
        self._last_ok_send = sent
        self.syncs += 1
        if self.mode != "shared":
            log.info("shared state: Redis reached (%d live replicas%s)", self.live_replicas, ", rebuilding" if self.rebuilding else "")
            self.mode = "shared"
            self.rate_limits.redis_is_back()
        if lowered:
            self.request_sync()  # confirm the lower grant now: Redis frees the rest at once
        if changed:
            self._on_change()
        self._on_sync()
        return True

    async def _call_sync(self, mode, lease_keys, lease_body, pairs, svc_seq, incs, adj) -> list:
        """The sync's script calls in one pipeline: the lease script, then the service
        counters' (when users wait here) and the corrections' (when there are any); the
        lease's and the counters' replies (``[]`` for none)."""
        lease_args = (
            [self.keys.replicas, self.keys.epoch] + [self.keys.lease(k) for k in lease_keys],
            [self.replica_id, self._lease_ms, self._keep_ms, lease_body, mode],
        )
        calls = [("lease", *lease_args)]
        if pairs:
            calls.append(("service", *self.counters.redis_args(self.keys.replica(self.replica_id), pairs, svc_seq, incs, self._ttl_ms, self._keep_ms)))
        if adj is not None:
            calls.append(self.rate_limits.adjust_call(self.keys.replica(self.replica_id), adj))
        out = await self._link.pipeline(calls)
        if pairs:
            return out
        return [out[0], []]

    def _unreachable(self, error: BaseException) -> None:
        """Redis did not answer: shrink to the local shares now, take them after a lease."""
        was = self.mode
        since = None if self._last_ok_send is None else self._clock() - self._last_ok_send
        if since is None:
            since = self._clock() - self._started_at
        if since >= self.config.lease_s:
            self.mode = "fallback"
            changed = self.leases.take_shares(self.share_replicas, self.rank)
        else:
            self.mode = "degraded"
            changed = self.leases.shrink_to_shares(self.share_replicas, self.rank)
        if self.mode != was:
            log.warning(
                "shared state: Redis unreachable (%s); %s: local share of capacity and limits = 1/%d",
                describe(error), self.mode, self.share_replicas,
            )
        if changed:
            self._on_change()

    @property
    def adjustments(self) -> PendingAdjustments:
        """The rate-limit corrections waiting for the next sync (:attr:`rate_limits`')."""
        return self.rate_limits.adjustments

    @property
    def share_replicas(self) -> int:
        """N, the divisor of the local shares (capacity and limits ÷ N) while Redis cannot
        be reached: the live replicas Redis last reported, at least ``expected_replicas``
        (a deployment that runs 2 replicas but saw 1 live at its last sync still assumes
        the other may be serving)."""
        return max(self.expected_replicas, self.live_replicas)

    # --------------------------------------------------------------- hot path

    def grant(self, key: str) -> int:
        """Units of capacity ``key`` this replica may have in flight now. A dict lookup."""
        return self.leases.grant(key)

    async def reserve_rate(self, user_id: str, group: str, user_limit: RateLimit, group_limit: RateLimit, tokens: int) -> Reservation:
        """Take one request and ``tokens`` from the user's and the group's buckets, across
        all replicas, before dispatch.

        Args:
            user_id, group: whose buckets.
            user_limit, group_limit: their limits (from the policy; ``None`` fields mean
                unlimited; no limit at all costs no Redis call).
            tokens: the estimate to take (prompt + ``max_tokens``), >= 0.

        Returns:
            The reservation, for :meth:`settle_rate` or :meth:`refund_rate`.

        Raises:
            proxy.shared.rate_limits.RateLimited: it does not fit now (``retry_after_s``
                says when it would).
        """
        return await self.rate_limits.reserve(user_id, group, user_limit, group_limit, tokens)

    def settle_rate(self, reservation: Reservation, actual_tokens: int) -> None:
        """Correct the token buckets to the real usage (``actual_tokens``: prompt + output
        as the engine counted them). Sent with the next sync; no await."""
        self.rate_limits.settle(reservation, actual_tokens)

    def refund_rate(self, reservation: Reservation) -> None:
        """Give the whole take back: the request never reached an engine (refused, timed
        out or cancelled while queued). Sent with the next sync; no await."""
        self.rate_limits.refund(reservation)

    def report_service(self, pool: str, user_id: str, cost: float) -> None:
        """Buffer service rendered here (cost units); pushed at the next sync."""
        self.counters.add(pool, user_id, cost)

    def global_service(self, pool: str, user_id: str) -> float | None:
        """The user's service in ``pool`` over all replicas as of the last sync, or None
        when the user was not waiting here then (see :class:`ServiceCounters`)."""
        return self.counters.global_service(pool, user_id)

    def take_remote_service(self) -> dict[tuple[str, str], float]:
        """Service other replicas rendered since the last call, per (pool, user)."""
        return self.counters.take_remote()

    def last_sync_age_s(self) -> float | None:
        """Seconds since the last successful sync was sent (None: never synced)."""
        return None if self._last_ok_send is None else round(self._clock() - self._last_ok_send, 3)

    def status(self) -> dict:
        """A summary for ``/admin/status`` and logs."""
        return {
            "mode": self.mode,
            "replica_id": self.replica_id,
            "live_replicas": self.live_replicas,
            "share_replicas": self.share_replicas,
            "rebuilding": self.rebuilding,
            "grants": self.leases.grants(),
            "syncs": self.syncs,
            "sync_failures": self.sync_failures,
            "last_sync_rtt_ms": round(self.last_sync_rtt_s * 1000, 3),
            "last_sync_age_s": self.last_sync_age_s(),
            "pending_rate_corrections": len(self.adjustments),
            "pending_service": len(self.counters),
        }


def _as_list(v) -> list:
    """cjson encodes an empty Lua table as ``{}``."""
    return v if isinstance(v, list) else []
