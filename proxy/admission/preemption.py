"""Preemption (``admission.preemption``), as admission drives it on an asyncio loop.

When the head strict priority serves next has waited ``after_s`` and does not fit, a
request of a lower class that has shown its client nothing is taken out of flight
(:meth:`qos.Scheduler.preempt`: the lowest class's newest, at most ``max_per_request``
times each) and the head takes its room. The preempted request's handler task is
cancelled with the ticket marked (:func:`take_back_cancel` tells it so): it closes its
upstream request (which aborts the generation), answers nothing, and waits at the head of
its queue (:meth:`proxy.admission.admission.Admission.wait_requeued`) to be dispatched
again, possibly on another engine. One timer per pool (``loop.call_at``,
:func:`arm_preempt_timer`) is armed for the moment the waiting head will have waited
``after_s``, whenever a request starts waiting or one ends; no polling.

Which request is taken is the scheduler's rule (:mod:`qos.preemption`); this module is
when, and what happens to the taken request's task.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from qos import Ticket

from ..routing.engine_state import EngineState
from .pool import TIMER_SLACK_S, Pool, Waiting

AUTO_PREEMPT_FLOOR_S = 0.25  # ``auto``: never sooner than this
AUTO_PREEMPT_TTFTS = 2.0  # ``auto``: this many times the engine's baseline TTFT
AUTO_PREEMPT_DEFAULT_S = 0.5  # ``auto`` while no engine's baseline TTFT is known

#: called with ``(pool, engine, ticket)`` for each request preempted
OnPreempt = Callable[[Pool, EngineState | None, Ticket], None]


@dataclass(frozen=True, slots=True)
class Preemption:
    """``admission.preemption`` as the admission applies it.

    Attributes:
        enabled: preempt at all.
        after_s: seconds a higher class's head waits before a lower class's request is
            preempted for it; ``None``: ``auto`` (:func:`preempt_after_s`).
        max_per_request: the most times one request is preempted.
    """

    enabled: bool = True
    after_s: float | None = None
    max_per_request: int = 2


def preempt_after_s(settings: Preemption, pool: Pool) -> float:
    """Seconds ``pool``'s waiting head waits before preemption: ``after_s`` when set;
    ``auto``: ``max(0.25, 2 x`` the largest baseline TTFT its engines in rotation
    have measured ``)`` (``EngineState.baseline_ttft_s``), 0.5 while none is known; 0
    while objective protection's second step is in force in the pool
    (:attr:`proxy.admission.pool.Pool.preempt_now`)."""
    if pool.preempt_now:
        return 0.0
    if settings.after_s is not None:
        return settings.after_s
    known = [b for e in pool.router.engines.values() if e.in_rotation and (b := getattr(e, "baseline_ttft_s", None))]
    if not known:
        return AUTO_PREEMPT_DEFAULT_S
    return max(AUTO_PREEMPT_FLOOR_S, AUTO_PREEMPT_TTFTS * max(known))


def arm_preempt_timer(pool: Pool, settings: Preemption, clock: Callable[[], float], fire: Callable[[Pool], None]) -> None:
    """Arm ``pool``'s preemption timer (``fire(pool)`` on the running loop) for when its
    blocked head will have waited long enough (:meth:`qos.Scheduler.preempt_at`), unless
    one is armed as early; disarm it when nothing can be preempted for. Every state change
    that can make a preemption possible (a request waits, one ends, room changes) calls
    this, and a timer that preempted re-arms; one that found nothing waits for the next
    change, so no timer spins. ``clock``: the scheduler's, in seconds."""
    sched = pool.scheduler
    # nothing waits: nothing to preempt for (preempt_at would say None, after the wait's cost)
    due = sched.preempt_at(preempt_after_s(settings, pool)) if settings.enabled and sched.queued and not pool.retired else None
    if due is None:
        if pool.preempt_timer is not None:
            pool.preempt_timer.cancel()
            pool.preempt_timer = pool.preempt_due = None
        return
    if pool.preempt_timer is not None:
        if pool.preempt_due is not None and pool.preempt_due <= due:
            return
        pool.preempt_timer.cancel()
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # outside the loop: armed on the next change
        return
    delay = max(0.0, due - clock()) + TIMER_SLACK_S
    pool.preempt_due = due
    pool.preempt_timer = loop.call_at(loop.time() + delay, fire, pool)


def preempt_now(pool: Pool, settings: Preemption, clock: Callable[[], float], on_preempt: OnPreempt | None) -> bool:
    """``pool``'s preemption timer fired: preempt what :meth:`qos.Scheduler.preempt`
    gives (each victim's engine meter told, its task cancelled with the ticket marked, a
    new wake-up future set, ``on_preempt`` called). Returns whether the timer must be
    armed again: after a preemption, or when it fired early (the head changed, or clock
    rounding); not when nothing can be taken now (the next change re-arms)."""
    pool.preempt_timer = pool.preempt_due = None
    if not settings.enabled or pool.retired:
        return False  # a retired pool only finishes what it holds
    engines = {}
    for t in pool.scheduler.inflight:
        engines[t] = t.placement
    after = preempt_after_s(settings, pool)
    victims = pool.scheduler.preempt(after, settings.max_per_request, abortable)
    if not victims:
        due = pool.scheduler.preempt_at(after)
        return due is not None and due > clock()
    loop = asyncio.get_running_loop()
    for t in victims:
        engine = engines.get(t)
        if engine is not None and getattr(engine, "meter", None) is not None:
            engine.meter.finished(t)
        pool.preemptions += 1
        w = t.context
        if isinstance(w, Waiting):
            if w.fut is None or w.fut.done():
                w.fut = loop.create_future()
            w.preempted += 1
            if w.task is not None:
                w.task.cancel()
        if on_preempt is not None:
            on_preempt(pool, engine, t)
    return True


def abortable(ticket: Ticket) -> bool:
    """Whether a task handles ``ticket`` that a preemption can reach (cancel)."""
    w = ticket.context
    return isinstance(w, Waiting) and w.task is not None and not w.task.done()


def take_back_cancel(ticket: Ticket) -> bool:
    """Called by the task handling ``ticket`` when it catches ``CancelledError``:
    whether that cancel was a preemption (then it is taken back, ``Task.uncancel``: the
    task goes on, to :meth:`proxy.admission.admission.Admission.wait_requeued`). False
    when the task was not preempted, or when it was also cancelled for another reason
    (its client left): then it must end as cancelled."""
    w = ticket.context
    if not isinstance(w, Waiting) or not w.preempted:
        return False
    task = asyncio.current_task()
    n, w.preempted = w.preempted, 0
    if task is not w.task:
        return False
    left = task.cancelling()
    for _ in range(min(n, left)):
        left = task.uncancel()
    return left == 0


__all__ = ["AUTO_PREEMPT_DEFAULT_S", "AUTO_PREEMPT_FLOOR_S", "AUTO_PREEMPT_TTFTS", "OnPreempt", "Preemption", "abortable", "arm_preempt_timer", "preempt_after_s", "preempt_now", "take_back_cancel"]
