"""One pool as admission holds it, and what a ticket carries while admission holds it.

* :class:`Pool`: a pool, live: its config, its router (the engines) and its scheduler
  (the queue), and the timers :class:`proxy.admission.admission.Admission` arms for it.
* :class:`Waiting`: a ticket's ``context`` from submit to release (its pool, affinity
  key, task, wake-up future, preemptions not yet taken); :func:`wake` and :func:`refuse`
  are the scheduler's ``on_admit`` / ``on_refuse`` callbacks that resolve that future.
* :class:`NoEngine`: the refusal when no engine of a pool is in rotation, and
  :func:`fresh_refusal`, the exception a waiting request is refused with.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from qos import RefusalReason, Refused, Scheduler, Ticket

from ..config.pools import PoolSpec
from ..routing.router import PoolRouter
from ..wire.errors import retry_after_seconds
from .queue_status import moved

TIMER_SLACK_S = 0.01  # admission's timers fire this much after their deadline (the loop may round down)


class NoEngine(Refused):
    """No engine of the pool is in rotation (all ejected or draining): answer 503 at once
    (reason :attr:`qos.RefusalReason.NO_ENGINE`, ``no_healthy_engine``).

    Attributes:
        pool: the pool's name.
        retry_after_s: seconds until the first ejected engine is probed (>= 1).
    """

    def __init__(self, pool: str, retry_after_s: float) -> None:
        super().__init__(RefusalReason.NO_ENGINE, retry_after_s, f"no engine of pool {pool!r} is healthy now; retry after {retry_after_seconds(retry_after_s)} s")
        self.pool = pool


@dataclass(eq=False, slots=True)
class Waiting:
    """A ticket's ``context`` from submit to release: its pool, its affinity key, the
    task that handles it (cancelled to preempt it), its wake-up future while it waits
    (``None`` otherwise), and the preemptions whose cancel its task has not taken yet."""

    fut: asyncio.Future | None
    key: str | None
    pool: "Pool | None" = None
    task: asyncio.Task | None = None
    preempted: int = 0


@dataclass(eq=False)
class Pool:
    """One pool, live: its config, router and scheduler.

    Attributes:
        spec: its resolved config.
        router: its engines and the choice among them.
        scheduler: its queue and admission.
        retired: removed by a reload; finishing what it holds.
        preemptions: requests preempted here since start.
        preempt_timer, preempt_due: the preemption timer and the moment it is armed for
            (:mod:`proxy.admission.preemption`).
        hold_timer: fires when its scheduler's earliest slot hold ends
            (:meth:`qos.Scheduler.next_hold_end`), so an unused held slot goes to the queue.
        watchers: the waiting requests whose clients asked for their queue status, by
            task (:class:`proxy.admission.queue_status.QueueWatch`); signalled at each
            dispatch and refusal of a waiting request.
        preempt_now: objective protection's second step is in force: the preemption wait
            bound is 0 (:mod:`proxy.admission.objective_protection`).
    """

    spec: PoolSpec
    router: PoolRouter
    scheduler: Scheduler
    retired: bool = False
    preemptions: int = 0
    preempt_timer: asyncio.TimerHandle | None = None
    preempt_due: float | None = None
    hold_timer: asyncio.TimerHandle | None = None
    watchers: dict = field(default_factory=dict)
    preempt_now: bool = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def tracks_health(self) -> bool:
        """Whether its engines are ejected on failures and checked actively. Not for the
        single-``upstream`` form: one engine, whose failures the client sees as before
        (there is no other engine to send the request to)."""
        return not self.spec.single_upstream

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing in flight."""
        return not self.scheduler.queued and not self.scheduler.inflight


def wake(ticket: Ticket) -> None:
    """The scheduler's ``on_admit``: wake the task waiting for ``ticket``, if any."""
    w = ticket.context
    if isinstance(w, Waiting) and w.fut is not None and not w.fut.done():
        w.fut.set_result(None)
        if w.pool is not None and w.pool.watchers:
            moved(w.pool.watchers)


def refuse(ticket: Ticket) -> None:
    """The scheduler's ``on_refuse``: raise the ticket's refusal in the task waiting for it."""
    w = ticket.context
    if isinstance(w, Waiting) and w.fut is not None and not w.fut.done():
        w.fut.set_exception(fresh_refusal(ticket.refusal))
        if w.pool is not None and w.pool.watchers:
            moved(w.pool.watchers)


def fresh_refusal(refusal: Refused) -> Refused:
    """A new exception carrying ``refusal``'s reason: the ticket's own stays free of
    tracebacks (which would tie the ticket to the frames that raised it)."""
    return Refused(refusal.reason, refusal.retry_after_s, refusal.detail, refusal.scope, refusal.limit)


__all__ = ["NoEngine", "Pool", "TIMER_SLACK_S", "Waiting", "fresh_refusal", "refuse", "wake"]
