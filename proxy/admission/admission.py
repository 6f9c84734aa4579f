"""The asyncio face of the schedulers: wait for a slot on an engine, give it back exactly once.

One concept over 400 lines: a request's wait for a slot across the pools, from
:meth:`Admission.acquire` to :meth:`Admission.release` (reroute, requeue and reload
included), with the timers that wake the queues on time (slot holds, idle users,
preemption); the pieces that stand alone live beside it: the pool and a ticket's context
(:mod:`.pool`), preemption (:mod:`.preemption`), the status (:mod:`.pool_snapshot`).

:class:`Admission` owns one :class:`Pool` per configured pool (the single ``upstream``
form is the pool ``default`` of one engine): its :class:`qos.Scheduler` (its own queue,
so one model's overload never blocks another's) whose capacity is the pool's
:class:`proxy.routing.router.PoolRouter` (through :class:`proxy.routing.pool_capacity.PoolCapacity`). Groups,
users and weights are the same policy in every pool; fair-share counters are kept per
pool (each pool's queue orders its own users); rate limits are one
:class:`qos.RateLimiter` shared by every pool, so a user's limit holds across models.

A request calls :meth:`Admission.acquire` with its pool, which either returns at once, or
parks the request on a future that the scheduler's ``on_admit`` / ``on_refuse`` callbacks
resolve. No polling, no threads: waking is driven by the events that free capacity (a
release, a cancel, a policy change, an engine back in rotation, a load reading). A queued
request whose client disconnects is cancelled by aiohttp, and the ``except`` path takes it
out of the queue at once.

Idle users are forgotten on time (``admission.forget_users_after_s``), not only when a new
user arrives: one timer (``loop.call_at``) is armed for the earliest
:meth:`qos.Scheduler.next_forget_at` of the pools whenever a request ends and none is
armed, and re-armed for the next one when it fires (:meth:`qos.Scheduler.forget_idle`).

Bind late: the returned ticket's ``placement`` is the :class:`proxy.routing.engine_state.EngineState`
chosen when it was dispatched; the handler opens the request on that engine's ``client``
(:class:`proxy.relay.upstream.Upstream`). A request whose connection failed before it reached the
engine is moved with :meth:`Admission.reroute`.

Preemption (``admission.preemption``): a lower class's request taken out of flight for a
higher class's head that waited too long (:mod:`proxy.admission.preemption`: when, and
what happens to the taken request's task). The pool as admission holds it, a ticket's
context and the refusals are :mod:`proxy.admission.pool`; the status it reports,
:mod:`proxy.admission.pool_snapshot`.

Zero engines in rotation: :meth:`acquire` raises :class:`NoEngine` (503 with Retry-After)
at once instead of queueing. Requests already queued when a pool loses its last engine
keep waiting, bounded by ``admission.queue_timeout_s``, and are dispatched the moment a
probe brings an engine back (:meth:`Admission.engine_checked`).

Reload (:meth:`Admission.reconfigure`): pools and engines are matched by name. A kept
pool keeps its scheduler (queue, fairness counters, requests in flight); its router adds
engines, updates kept ones and drains removed ones (no new work; they leave when their
last request ends). A removed pool is *retired*: it takes no new request, but finishes
what it holds, requests in flight and queued ones alike, on its engines, then closes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from qos import RefusalReason, Refused, Scheduler, SchedulerPolicy, Ticket, TicketState
from qos.rate_limit import RateLimiter

from ..config.pools import PoolSpec
from ..routing.engine_state import EngineState
from ..routing.pool_capacity import PoolCapacity
from ..routing.router import PoolRouter
from .pool import TIMER_SLACK_S, NoEngine, Pool, Waiting, fresh_refusal, refuse, wake
from .pool_snapshot import pools_snapshot
from .objective_protection import ObjectiveProtection
from .preemption import OnPreempt, Preemption, arm_preempt_timer, preempt_after_s, preempt_now, take_back_cancel
from .rate_reservation import SharedRateLimiter, reserve_and_submit

FORGET_SLACK_S = TIMER_SLACK_S  # the forget timer fires this much after an idle user's deadline


def _nothing() -> None:
    return None


def _moved_meter(ticket: Ticket, old: EngineState | None, new: EngineState | None) -> None:
    """``ticket`` left ``old`` (it never reached it: an end without a first token there)
    for ``new``, where a stream's first token is awaited again
    (:class:`proxy.routing.engine_meter.EngineMeter`: the capacity controller's growth is
    clocked by first tokens while streams await them)."""
    if old is not None and old is not new:
        old.meter.finished(ticket)
        if new is not None:
            new.meter.moved(ticket)  # its time since dispatch includes the failure on old: not judged
    if new is not None and new is not old and ticket.stream:
        new.meter.awaiting(ticket)




class Admission:
    """Admission control for one proxy process, across its pools.

    Args:
        policy: the initial scheduler policy (groups, users, weights, limits).
        pools: the resolved pools (:meth:`proxy.config.schema.Config.effective_pools`), at least one.
        clock: monotonic clock in seconds (the schedulers').
        rate_limiter: the rate limits every pool reserves from (default: one private
            :class:`qos.RateLimiter` of ``2 * policy.max_users + 64`` buckets, resized with
            the policy); a :class:`proxy.admission.rate_reservation.SharedRateLimiter` reserves them in
            the shared state (Redis) before each submit.
        leased: the engines' capacity is leased through a shared state
            (:mod:`proxy.admission.lease_binding`): a new engine takes nothing before its lease.

    Attributes:
        clock: the schedulers' clock.
        pools: name -> :class:`Pool`, config order.
        retired: removed pools still finishing their requests.
        rate_limiter: the shared rate limits.
        on_engine_removed: called with an engine that left its pool (drained after a
            reload, or with its retired pool); the proxy closes its connections there.
        on_capacity: called with a pool after its engines' room grew outside the
            scheduler (an engine back, a load limit lifted); default: dispatch.
        on_wait: called (no arguments) when a request starts waiting in a queue (a
            replica asks the shared state for a sync then: its lease may not cover it).
        preemption: the :class:`Preemption` settings (set by the proxy from its config).
        on_preempt: called with ``(pool, engine, ticket)`` for each request preempted
            (``engine``: the one it was taken off); the proxy counts it there.
        protection: objective protection and ``on_miss: reject``
            (:class:`proxy.admission.objective_protection.ObjectiveProtection`; the proxy
            configures it and gives it the objectives' tracker).
    """

    def __init__(
        self,
        policy: SchedulerPolicy,
        pools: Sequence[PoolSpec],
        clock=time.monotonic,
        rate_limiter: RateLimiter | None = None,
        leased: bool = False,
    ) -> None:
        self._clock = self.clock = clock
        self.leased = leased
        self._owns_limiter = rate_limiter is None
        self.rate_limiter = rate_limiter if rate_limiter is not None else RateLimiter(max_buckets=2 * policy.max_users + 64)
        self.policy = policy
        self.pools: dict[str, Pool] = {}
        self.retired: list[Pool] = []
        self._placing_key: str | None = None
        self._forget_timer: asyncio.TimerHandle | None = None
        self.on_engine_removed: Callable[[EngineState], None] | None = None
        self.on_wait: Callable[[], None] = _nothing
        self.preemption = Preemption()
        self.on_preempt: OnPreempt | None = None
        self.protection = ObjectiveProtection(lambda: list(self.all_pools()), self._clock, self.rearm)
        self.reconfigure(policy, pools)

    # ------------------------------------------------------------------ pools

    def _new_pool(self, spec: PoolSpec, policy: SchedulerPolicy) -> Pool:
        router = PoolRouter(spec, clock=self._clock, leased=self.leased)
        capacity = PoolCapacity(router, self._affinity_of)
        scheduler = Scheduler(
            policy, clock=self._clock, on_admit=self._admitted, on_refuse=self._refuse, rate_limiter=self.rate_limiter, capacity=capacity
        )
        pool = Pool(spec, router, scheduler)
        router.on_engine_removed = self._engine_removed
        return pool

    def reconfigure(self, policy: SchedulerPolicy, pools: Sequence[PoolSpec]) -> None:
        """Take a new policy and pools (hot reload; see the module docstring). Kept pools
        keep their queues, counters and requests in flight; every scheduler takes
        ``policy`` (:meth:`qos.Scheduler.update_policy`).

        Raises:
            ValueError: ``policy`` is inconsistent, or ``pools`` is empty (nothing changes).
        """
        if not pools:
            raise ValueError("at least one pool is needed")
        self.policy = policy
        if self._owns_limiter:
            self.rate_limiter.max_buckets = 2 * policy.max_users + 64
        old = self.pools
        new: dict[str, Pool] = {}
        for spec in pools:
            pool = old.get(spec.name)
            if pool is None:
                pool = next((p for p in self.retired if p.name == spec.name), None)
                if pool is not None:
                    self.retired.remove(pool)
                    pool.retired = False
            if pool is None:
                pool = self._new_pool(spec, policy)
            else:
                pool.spec = spec
                pool.router.reconfigure(spec)
                pool.scheduler.update_policy(policy)
            new[spec.name] = pool
        self.pools = new
        for name, pool in old.items():
            if name not in new:
                pool.retired = True
                pool.scheduler.update_policy(policy)
                self.retired.append(pool)
        self._sweep()
        self._rearm_forget()  # forget_users_after_s may have changed

    def _sweep(self) -> None:
        """Close retired pools that hold nothing any more."""
        for pool in [p for p in self.retired if p.idle]:
            self.retired.remove(pool)
            pool.router.reconfigure(PoolSpec(pool.name, pool.spec.models, (), pool.spec.routing, pool.spec.health))

    def _engine_removed(self, engine: EngineState) -> None:
        if self.on_engine_removed is not None:
            self.on_engine_removed(engine)

    @property
    def default(self) -> Pool:
        """The first pool (the only one in the single-``upstream`` form)."""
        return next(iter(self.pools.values()))

    @property
    def scheduler(self) -> Scheduler:
        """The first pool's scheduler (the only one in the single-``upstream`` form)."""
        return self.default.scheduler

    @scheduler.setter
    def scheduler(self, scheduler: Scheduler) -> None:  # bench/live.py swaps in another policy
        self.default.scheduler = scheduler

    def all_pools(self) -> Iterator[Pool]:
        """Every pool, the retired ones last."""
        yield from self.pools.values()
        yield from self.retired

    def routers(self) -> list[PoolRouter]:
        """Every pool's router (retired pools' included)."""
        return [p.router for p in self.all_pools()]

    def engines(self) -> Iterator[tuple[Pool, EngineState]]:
        """Every engine of every pool (draining ones included)."""
        for pool in self.all_pools():
            for e in list(pool.router.engines.values()):
                yield pool, e

    def pool_of(self, engine: EngineState) -> Pool | None:
        """The pool ``engine`` belongs to, or ``None`` once it left."""
        pool = self.pools.get(engine.spec.pool)
        if pool is not None and pool.router.engines.get(engine.name) is engine:
            return pool
        for pool in self.retired:
            if pool.router.engines.get(engine.name) is engine:
                return pool
        return None

    # -------------------------------------------------------------- callbacks

    _wake = staticmethod(wake)  # the schedulers' on_admit (bench/live.py passes them on)
    _refuse = staticmethod(refuse)  # their on_refuse

    def _admitted(self, ticket: Ticket) -> None:
        """The schedulers' ``on_admit``: wake the waiting task; a start for the drain rate."""
        wake(ticket)
        self.protection.started(ticket)

    def _affinity_of(self, ticket: Ticket) -> str | None:
        w = ticket.context
        return w.key if isinstance(w, Waiting) else self._placing_key

    # ---------------------------------------------------------------- acquire

    async def acquire(
        self,
        user_id: str,
        group: str | None,
        prompt_tokens: int,
        max_tokens: int | None,
        choices: int = 1,
        output_ceiling: int | None = None,
        *,
        pool: str | None = None,
        key: str | None = None,
    ) -> Ticket:
        """Wait until the request may go to an engine of ``pool``.

        Args:
            user_id: the caller.
            group: a class chosen for this request by a trusted source, or ``None``
                (the policy's: a listed user's own class, else the default one). Never
                pass the user's *configured* class here: after a reload removes the
                user, its queued requests must follow the new policy, not the old file.
            prompt_tokens: estimated prompt length (tokens).
            max_tokens: the request's output cap per choice (tokens) or ``None``.
            choices: the output multiplier (``max(n, best_of)`` x prompts).
            output_ceiling: the serving engine's output ceiling when known (tokens).
            pool: the pool's name (:class:`proxy.routing.model_routing.Route`); ``None``: the first.
            key: the request's affinity key (:func:`proxy.routing.placement.affinity_key`), or ``None``.

        Returns:
            An ADMITTED ticket whose ``placement`` is its engine
            (:class:`proxy.routing.engine_state.EngineState`); the caller must :meth:`release` it in a
            ``finally``.

        Raises:
            NoEngine: no engine of the pool is in rotation (nothing was reserved).
            Refused: too large to ever fit (``TOO_LARGE``), rate limited, queue full,
                evicted, waited past ``queue_timeout_s``, or shutting down.
            asyncio.CancelledError: the client went away while queued; the ticket has
                been removed from the queue (or released, if admission raced the cancel).
            KeyError: no pool of that name.
        """
        p = self.pools[pool] if pool is not None else self.default
        if not p.router.available:
            raise NoEngine(p.name, p.router.retry_after_s())
        self.protection.arrive(p, user_id, group)  # on_miss: reject refuses here
        sched = p.scheduler

        def submit() -> Ticket:
            self._placing_key = key
            try:
                return sched.submit(user_id, group, prompt_tokens, max_tokens, choices=choices, output_ceiling=output_ceiling)
            finally:
                self._placing_key = None

        if isinstance(self.rate_limiter, SharedRateLimiter):
            request = {"user_id": user_id, "group": group, "prompt_tokens": prompt_tokens, "max_output_tokens": max_tokens, "choices": choices, "output_ceiling": output_ceiling}
            ticket = await reserve_and_submit(sched, self.rate_limiter, request, submit)
        else:
            ticket = submit()
        if ticket.state is TicketState.ADMITTED:
            ticket.context = Waiting(None, key, p, asyncio.current_task())
            return ticket
        ticket.context = Waiting(asyncio.get_running_loop().create_future(), key, p, asyncio.current_task())
        if p.watchers and (watch := p.watchers.get(ticket.context.task)) is not None:
            watch.ticket = ticket  # its client asked for its queue status (:mod:`.queue_status`)
            watch.moved.set()
        await self._wait(ticket)
        return ticket

    async def _wait(self, ticket: Ticket) -> None:
        """Wait until the QUEUED ``ticket`` (its context's future set) is dispatched.
        A preemption of it between its dispatch and this task's waking is taken here:
        it waits again. Raises as :meth:`acquire` (the ticket out of the queue)."""
        w = ticket.context
        pool = w.pool
        sched = pool.scheduler
        self.on_wait()
        self._arm_preempt(pool)
        try:
            while True:
                try:
                    async with asyncio.timeout_at(self._loop_deadline(ticket)):
                        await w.fut
                    return
                except TimeoutError:
                    if sched.cancel(ticket, RefusalReason.TIMEOUT) or ticket.state is TicketState.REFUSED:
                        ticket.context = None
                        raise fresh_refusal(ticket.refusal) from None
                    if ticket.state is TicketState.ADMITTED:
                        return
                except asyncio.CancelledError:
                    if w.preempted and self.preempted(ticket):
                        continue  # dispatched, then preempted before this task woke: wait again
                    raise
        except BaseException:
            ticket.context = None
            if not sched.cancel(ticket) and ticket.state is TicketState.ADMITTED:
                self._release_engine(ticket)
                sched.release(ticket)
                self._arm_hold(pool)
            self._sweep()
            raise
        finally:
            # no reference cycle (future -> exception -> traceback -> this frame -> future)
            # left for the garbage collector: refused requests are freed at once
            w.fut = None
            self._arm_forget()  # a refused user may be idle now
            self._arm_preempt(pool)

    async def wait_requeued(self, ticket: Ticket) -> EngineState:
        """After :meth:`preempted` said so: wait until the preempted ``ticket`` is
        dispatched again (it waits at the head of its user's queue), and return its new
        engine (``ticket.placement``; bind late: any engine of its pool).

        Raises:
            Refused: it waited past ``queue_timeout_s`` (counted again from its
                preemption), was evicted, or the proxy is shutting down.
            asyncio.CancelledError: the client went away; it is out of the queue.
        """
        if ticket.state is TicketState.QUEUED:
            await self._wait(ticket)
        _moved_meter(ticket, None, ticket.placement)  # the preemption told its old engine's meter
        return ticket.placement

    def preempted(self, ticket: Ticket) -> bool:
        """Called by the task handling ``ticket`` when it catches ``CancelledError``:
        whether that cancel was a preemption (then it is taken back: the task goes on,
        to :meth:`wait_requeued`). False when the task was not preempted, or when it was
        also cancelled for another reason (its client left): then it must end as
        cancelled (and :meth:`release` takes the ticket out of the queue);
        :func:`proxy.admission.preemption.take_back_cancel`."""
        return take_back_cancel(ticket)

    def _loop_deadline(self, ticket: Ticket) -> float:
        loop = asyncio.get_running_loop()
        return loop.time() + max(0.0, ticket.deadline - self._clock())

    def release(self, ticket: Ticket, prompt_tokens: int | None = None, output_tokens: int | None = None) -> bool:
        """Give the slot back and true up the cost; see :meth:`qos.Scheduler.release`.
        A ticket preempted and waiting again (its client left meanwhile) is taken out of
        the queue instead (and False returned)."""
        w = ticket.context
        if not isinstance(w, Waiting) or w.pool is None:
            return False
        pool = w.pool
        if ticket.state is TicketState.QUEUED:
            pool.scheduler.cancel(ticket)
            done = False
        else:
            self._release_engine(ticket)
            done = pool.scheduler.release(ticket, prompt_tokens, output_tokens)
            self._arm_hold(pool)
        if pool.retired:
            self._sweep()
        self._arm_forget()
        self._arm_preempt(pool)
        return done

    @staticmethod
    def _release_engine(ticket: Ticket) -> None:
        engine = ticket.placement
        if engine is not None:
            engine.meter.finished(ticket)

    def record_output(self, ticket: Ticket, output_tokens: int) -> None:
        """See :meth:`qos.Scheduler.record_output`; also the engine's latency meter
        (:class:`proxy.routing.engine_meter.EngineMeter`)."""
        w = ticket.context
        if isinstance(w, Waiting) and w.pool is not None:
            pool = w.pool
            engine = ticket.placement
            if engine is not None:
                engine.meter.progress(ticket, output_tokens, self._clock())
            pool.scheduler.record_output(ticket, output_tokens)

    def reroute(self, ticket: Ticket, tried: Iterable[EngineState]) -> EngineState | None:
        """Move an admitted ticket whose request never reached its engine to another one
        of its pool, not in ``tried`` (:meth:`proxy.routing.router.PoolRouter.reroute`): the
        engine with room and the most headroom, else the healthy one with the most
        headroom even if full (the request was admitted; the engine it was given failed).
        Returns the new engine (``ticket.placement``), or ``None`` when no other engine is
        in rotation (the ticket then holds no engine; :meth:`release` it as usual)."""
        w = ticket.context
        if not isinstance(w, Waiting) or w.pool is None:
            return None
        old = ticket.placement
        engine = w.pool.router.reroute(ticket, exclude=tuple(tried), over=True)
        ticket.placement = engine
        _moved_meter(ticket, old, engine)
        return engine

    def report(self, engine: EngineState, ok: bool, reason: str | None = None, detail: str = "", *, status: int | None = None) -> None:
        """Record the result of a request sent to ``engine`` (see
        :meth:`proxy.routing.engine_health.EngineHealth.record_request`; ``status``: the 5xx of
        an ``http_5xx`` failure); nothing for the single-``upstream`` form
        (:attr:`Pool.tracks_health`)."""
        pool = self.pool_of(engine)
        if pool is not None and pool.tracks_health:
            pool.router.report(engine, ok, reason, detail, status=status)

    def engine_checked(self, engine: EngineState) -> None:
        """An engine's health check or probe ended: dispatch its pool if it is in rotation
        (it may be back)."""
        pool = self.pool_of(engine)
        if pool is not None and engine.in_rotation:
            pool.scheduler.dispatch()
            self._arm_preempt(pool)

    def dispatch(self, engine: EngineState | None = None) -> None:
        """Dispatch what fits now in ``engine``'s pool (every pool for ``None``): its room
        grew outside the schedulers' own calls (a load limit lifted)."""
        pools = list(self.all_pools()) if engine is None else [p for p in [self.pool_of(engine)] if p is not None]
        for p in pools:
            p.scheduler.dispatch()
            self._arm_preempt(p)

    def update_policy(self, policy: SchedulerPolicy) -> None:
        """Swap the policy in every pool, pools unchanged; see :meth:`qos.Scheduler.update_policy`."""
        self.reconfigure(policy, [p.spec for p in self.pools.values()])

    def rearm(self, pool: Pool) -> None:
        """``pool``'s preemption bound changed (objective protection): dispatch what
        fits and re-arm its preemption timer."""
        pool.scheduler.dispatch()
        self._arm_preempt(pool)  # an earlier moment re-arms it

    def close(self) -> None:
        """Refuse everything queued (503) and every later request, in every pool."""
        self.protection.close()
        for p in self.all_pools():
            p.scheduler.close()
            if p.hold_timer is not None:
                p.hold_timer.cancel()
                p.hold_timer = None
        if self._forget_timer is not None:
            self._forget_timer.cancel()
            self._forget_timer = None

    # ------------------------------------------------------------ slot holds

    def _arm_hold(self, pool: Pool) -> None:
        """Arm ``pool``'s hold timer for its scheduler's earliest slot hold's end
        (``admission.hold_slot_s`` after the release that made it), unless one is armed:
        holds are made only at a release, each lasting the same time, so a later one never
        ends first (a reload that shortens ``hold_slot_s`` wakes it late by at most the old
        time). When it fires the scheduler dispatches (an unused hold's slot goes to the
        queue) and it re-arms for the next hold."""
        if pool.hold_timer is not None:
            return
        due = pool.scheduler.next_hold_end()
        if due is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # outside the loop: armed at the next release
            return
        delay = max(0.0, due - self._clock()) + FORGET_SLACK_S
        pool.hold_timer = loop.call_at(loop.time() + delay, self._hold_due, pool)

    def _hold_due(self, pool: Pool) -> None:
        pool.hold_timer = None
        pool.scheduler.dispatch()
        self._arm_hold(pool)
        self._arm_preempt(pool)

    # ------------------------------------------------------------ preemption

    def preempt_after_s(self, pool: Pool) -> float:
        """Seconds ``pool``'s waiting head waits before preemption
        (:func:`proxy.admission.preemption.preempt_after_s`)."""
        return preempt_after_s(self.preemption, pool)

    def _arm_preempt(self, pool: Pool) -> None:
        arm_preempt_timer(pool, self.preemption, self._clock, self._preempt_due)

    def _preempt_due(self, pool: Pool) -> None:
        if preempt_now(pool, self.preemption, self._clock, self.on_preempt):
            self._arm_preempt(pool)

    # ------------------------------------------------------------ idle users

    def _arm_forget(self) -> None:
        """Arm the forget timer for the earliest idle user's deadline, unless one is
        armed (an early firing forgets nothing and re-arms) or no user is idle."""
        if self._forget_timer is not None:
            return
        due = [at for p in self.all_pools() if (at := p.scheduler.next_forget_at()) is not None]
        if not due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # outside the loop (a policy set at construction): armed on the first release
            return
        # a little late rather than early: the loop's clock may round its timers down
        delay = max(0.0, min(due) - self._clock()) + FORGET_SLACK_S
        self._forget_timer = loop.call_at(loop.time() + delay, self._forget_due)

    def _rearm_forget(self) -> None:
        if self._forget_timer is not None:
            self._forget_timer.cancel()
            self._forget_timer = None
        self._arm_forget()

    def _forget_due(self) -> None:
        self._forget_timer = None
        for p in self.all_pools():
            p.scheduler.forget_idle()
        self._arm_forget()

    # ------------------------------------------------------------- inspection

    def snapshot(self, top_users: int = 20) -> dict:
        """Every pool's scheduler snapshot summed, with a row per pool and per engine
        (:func:`proxy.admission.pool_snapshot.pools_snapshot`); each pool's row has its
        ``objective_protection`` (:meth:`ObjectiveProtection.status`)."""
        pools = list(self.all_pools())
        snap = pools_snapshot(pools, top_users)
        for row, p in zip(snap["pools"], pools):
            row["objective_protection"] = self.protection.status(p)
        return snap


__all__ = ["Admission", "NoEngine", "Pool", "Preemption", "Refused", "RefusalReason"]
