"""Objective protection and ``on_miss: reject``, as admission applies them on an asyncio
loop (the rule, the steps and the drain rate: :mod:`qos.objective_protection`).

Per pool, a timer checks every ``objectives.protection.interval_s`` (0.1 s) while the
pool has requests waiting or in flight, or a step in force, and only when some group has
objectives (a config without objectives arms nothing). A check reads, for each group with
objectives in priority order, how long its oldest request without a first token has
waited, in the pool's queue (:meth:`qos.Scheduler.tickets_waiting`) or in flight (a
:attr:`qos.Ticket.stream` with no output yet: dispatched at once, it can wait inside the
engine, in its FIFO or behind a batch whose steps outlast the target), and its recent
attainment over the
pool's engines (:meth:`qos.objectives.ObjectiveTracker.recent`), finds the groups at risk
(:func:`qos.objective_protection.risk_of`), moves the pool's
:class:`qos.objective_protection.ProtectionState`, and applies its step:

1. ``hold``: :meth:`qos.Scheduler.hold_back` below the protected group;
2. ``preempt``: the pool's preemption wait bound is 0 (:attr:`Pool.preempt_now`, read by
   :func:`proxy.admission.preemption.preempt_after_s`); the preemption timer is re-armed;
3. ``shed``: the requests :func:`qos.objective_protection.shed_victims` names are taken
   out of the queue and their waiting tasks answered ``429 objective_protection``.

A check also adds the time since the last one to the drain rate's waiting time of every
group with ``on_miss: reject`` that has requests waiting (so the waiting time is sampled
at the checks, to ``interval_s``); each dispatch of such a group's request from the queue
counts a start (:meth:`ObjectiveProtection.started`, the schedulers' ``on_admit``).
:meth:`ObjectiveProtection.arrive` refuses a request of such a group at once when
:func:`qos.objective_protection.unreachable_wait` says its queue wait passes its target.

Hot reload (:meth:`ObjectiveProtection.configure`) swaps the settings and groups and
keeps every pool's state (its step, its drain rates); a group no longer configured loses
its drain rate.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from qos import RefusalReason, Ticket
from qos.objective_protection import (
    HOLD, NONE, PREEMPT, STEP_NAMES, GroupDrainRate, GroupReading, ProtectionSettings, ProtectionState, risk_of,
    shed_refusal, shed_victims, unreachable_refusal, unreachable_wait,
)  # fmt: skip
from qos.objectives import TTFT, Objective, ObjectiveTracker

from .pool import TIMER_SLACK_S, Pool, Waiting, refuse

#: called with ``(pool name, protected group, step name)`` when a pool enters a step
OnStep = Callable[[str, str, str], None]
#: called with ``(pool name, group, reason code)`` for each request shed or refused
OnRefused = Callable[[str, str, str], None]


@dataclass(frozen=True, slots=True)
class GroupObjectives:
    """One group's objectives as protection reads them.

    Attributes:
        objectives: its objectives (:class:`qos.objectives.Objective`), by name.
        on_miss: ``serve`` or ``reject``.
    """

    objectives: Mapping[str, Objective]
    on_miss: str = "serve"

    @property
    def ttft_target_s(self) -> float | None:
        o = self.objectives.get(TTFT)
        return None if o is None else o.target_s


@dataclass(eq=False, slots=True)
class PoolProtection:
    """One pool's protection, live: its state, its groups' drain rates, its timer.

    Attributes:
        state: the step in force (:class:`qos.objective_protection.ProtectionState`).
        drains: group -> its drain rate (groups with ``on_miss: reject``).
        timer: the next check, while armed.
        checked_at: when the last check ran (clock seconds), ``None`` before the first.
        shed: requests shed here since start.
        unreachable: requests refused here by ``on_miss: reject`` since start.
    """

    state: ProtectionState = field(default_factory=ProtectionState)
    drains: dict[str, GroupDrainRate] = field(default_factory=dict)
    timer: asyncio.TimerHandle | None = None
    checked_at: float | None = None
    shed: int = 0
    unreachable: int = 0


class ObjectiveProtection:
    """Objective protection for every pool of one :class:`proxy.admission.admission.Admission`.

    Args:
        pools: returns the live pools (the admission's, retired ones included).
        clock: the schedulers' clock (monotonic seconds).
        rearm: called with a pool whose preemption bound changed (re-arms its
            preemption timer and dispatches).
        tracker: returns the process's :class:`qos.objectives.ObjectiveTracker` (also
            the attribute ``tracker``; default: an empty one).

    Attributes:
        settings: ``objectives.protection`` (:class:`qos.objective_protection.ProtectionSettings`).
        interval_s: seconds between a pool's checks.
        groups: group -> :class:`GroupObjectives`, the groups with objectives.
        on_step, on_refused: metrics hooks (see :data:`OnStep`, :data:`OnRefused`).
    """

    def __init__(self, pools: Callable[[], list[Pool]], clock: Callable[[], float], rearm: Callable[[Pool], None], tracker: Callable[[], ObjectiveTracker] | None = None) -> None:
        self._pools = pools
        empty = ObjectiveTracker()
        self.tracker: Callable[[], ObjectiveTracker] = tracker if tracker is not None else (lambda: empty)
        self._clock = clock
        self._rearm = rearm
        self.settings = ProtectionSettings()
        self.interval_s = 0.1
        self.groups: dict[str, GroupObjectives] = {}
        self._live: dict[str, PoolProtection] = {}
        self.on_step: OnStep | None = None
        self.on_refused: OnRefused | None = None

    def configure(self, settings: ProtectionSettings, interval_s: float, groups: Mapping[str, GroupObjectives]) -> None:
        """Take new settings and groups (start-up, reload); every pool keeps its state.
        With protection disabled, or without objectives, every step in force ends now."""
        self.settings, self.interval_s, self.groups = settings, interval_s, dict(groups)
        pools = self._pools()
        for name in set(self._live) - {p.name for p in pools}:  # pools gone for good
            live = self._live.pop(name)
            if live.timer is not None:
                live.timer.cancel()
        for live in self._live.values():
            for g in [g for g in live.drains if self.groups.get(g, GroupObjectives({})).on_miss != "reject"]:
                del live.drains[g]
            if drain_window_changed(live, settings):
                live.drains = {g: GroupDrainRate(settings.drain_window_s) for g in live.drains}
        for pool in pools:
            if not self.settings.enabled or not self.groups:
                self._end(pool)
            self.touch(pool)

    def _of(self, pool: Pool) -> PoolProtection:
        live = self._live.get(pool.name)
        if live is None:
            live = self._live[pool.name] = PoolProtection()
        return live

    # ------------------------------------------------------------------ arrival

    def arrive(self, pool: Pool, user_id: str, group: str | None) -> None:
        """A request for ``pool`` arrives (before it is submitted): arm the pool's
        checks, and refuse it at once when its group asks ``on_miss: reject`` and it
        cannot meet its TTFT objective (the module docstring).

        Raises:
            qos.Refused: ``OBJECTIVE_UNREACHABLE``, with ``Retry-After`` the time, at the
                drain rate, until the wait of a request arriving then would be within
                the target (at least 1 s, at most ``drain_window_s``).
        """
        if not self.groups:
            return
        self.touch(pool)
        name = pool.scheduler.policy.user(user_id, group).group
        g = self.groups.get(name)
        if g is None or g.on_miss != "reject" or g.ttft_target_s is None:
            return
        live = self._of(pool)
        drain = live.drains.get(name)
        if drain is None:
            live.drains[name] = GroupDrainRate(self.settings.drain_window_s)
            return
        ahead = pool.scheduler.queue_depths().get(name, 0)
        rate = drain.rate(self._clock(), self.settings.min_backlog_s)
        wait = unreachable_wait(ahead, rate, g.ttft_target_s)
        if wait is None:
            return
        retry = self.settings.drain_window_s if math.isinf(wait) else min(self.settings.drain_window_s, max(1.0, wait - g.ttft_target_s))
        live.unreachable += 1
        if self.on_refused is not None:
            self.on_refused(pool.name, name, RefusalReason.OBJECTIVE_UNREACHABLE.value)
        raise unreachable_refusal(name, wait, g.ttft_target_s, retry)

    def started(self, ticket: Ticket) -> None:
        """The schedulers' ``on_admit`` hook: a request dispatched from the queue (its
        context a :class:`Waiting`, set once it waits) counts a start of its group."""
        w = ticket.context
        if not isinstance(w, Waiting) or w.pool is None:
            return
        live = self._live.get(w.pool.name)
        drain = live.drains.get(ticket.group) if live is not None else None
        if drain is not None:
            drain.started(self._clock())

    # ------------------------------------------------------------------- checks

    def touch(self, pool: Pool) -> None:
        """Arm ``pool``'s checks unless armed, or nothing needs them (no objectives)."""
        live = self._of(pool)
        if live.timer is not None or not self.groups:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # outside the loop: armed by the first request
            return
        live.timer = loop.call_at(loop.time() + self.interval_s + TIMER_SLACK_S, self._check, pool)

    def _check(self, pool: Pool) -> None:
        live = self._of(pool)
        live.timer = None
        now = self._clock()
        dt = 0.0 if live.checked_at is None else min(now - live.checked_at, 2 * self.interval_s)
        live.checked_at = now
        sched = pool.scheduler
        depths = sched.queue_depths()
        for name, drain in live.drains.items():
            if depths.get(name):
                drain.backlogged(now, dt)
        if self.settings.enabled and not pool.retired:
            self._step(pool, live, now, depths)
        elif live.state.step != NONE:
            self._end(pool)  # a retired pool only finishes what it holds, unheld
        if sched.queued or sched.inflight or live.state.step != NONE:
            self.touch(pool)
        else:
            live.checked_at = None  # idle: the next arrival starts the checks afresh

    def _readings(self, pool: Pool, now: float, depths: dict[str, int]) -> list[tuple[int, GroupReading]]:
        """``(rank, reading)`` of every group with objectives, highest first."""
        sched, s, tracker = pool.scheduler, self.settings, self.tracker()
        oldest: dict[str, float] = {}
        want = {n for n in self.groups if depths.get(n)}
        if want:
            for t in sched.tickets_waiting():  # highest class first, arrival order within
                if t.group in want and t.group not in oldest:
                    oldest[t.group] = now - t.enqueued_at
                    if len(oldest) == len(want):
                        break
        # a request dispatched at once can wait inside the engine (its FIFO, or a batch
        # whose steps outlast the target): its time to first token runs there too
        timed = {n for n, g in self.groups.items() if g.ttft_target_s is not None}
        for t in sched.inflight:
            if t.stream and t.output_tokens == 0 and t.group in timed:
                waited = now - t.enqueued_at
                if waited > oldest.get(t.group, -1.0):
                    oldest[t.group] = waited
        inflight: dict[str, int] | None = None
        out = []
        for rank, gpol in enumerate(sched.policy.groups):
            g = self.groups.get(gpol.name)
            if g is None:
                continue
            recent = tuple((o.name, *tracker.recent(now, gpol.name, o.name, pool.name, s.recent_s), o.percentile / 100) for o in g.objectives.values())
            active = bool(depths.get(gpol.name))
            if not active and any(n >= s.min_requests for _o, n, _m, _g in recent):
                if inflight is None:
                    inflight = {}
                    for t in sched.inflight:
                        inflight[t.group] = inflight.get(t.group, 0) + 1
                active = bool(inflight.get(gpol.name))
            out.append((rank, GroupReading(gpol.name, g.ttft_target_s, oldest.get(gpol.name), active, recent)))
        return out

    def _step_time(self, group: str) -> float:
        g = self.groups.get(group)
        return self.settings.step_time(g.ttft_target_s if g is not None else None)

    def _step(self, pool: Pool, live: PoolProtection, now: float, depths: dict[str, int]) -> None:
        st = live.state
        risks = [r for rank, g in self._readings(pool, now, depths) if (r := risk_of(rank, g, self.settings)) is not None]
        entered = st.update(now, risks, self._step_time)
        if entered is not None and entered != NONE and self.on_step is not None and st.protected is not None:
            self.on_step(pool.name, st.protected, STEP_NAMES[entered])
        self._apply(pool, st)
        if st.protected is not None and st.shed_due(now, self._step_time(st.protected)):
            self._shed(pool, live, st.protected_rank)
            st.shed_done(now)

    def _apply(self, pool: Pool, st: ProtectionState) -> None:
        """Put ``st``'s step in force on ``pool``: the hold and the preemption bound."""
        pool.scheduler.hold_back(st.protected_rank if st.step >= HOLD and st.protected_rank >= 0 else None)
        now_bound = st.step >= PREEMPT
        if pool.preempt_now != now_bound:
            pool.preempt_now = now_bound
            self._rearm(pool)

    def _shed(self, pool: Pool, live: PoolProtection, protected_rank: int) -> None:
        sched = pool.scheduler
        ranks = {g.name: i for i, g in enumerate(sched.policy.groups)}
        waiting: list[list[Ticket]] = [[] for _ in ranks]
        for t in sched.tickets_waiting():
            i = ranks.get(t.group)
            if i is not None and i > protected_rank:
                waiting[i].append(t)
        protected = sched.policy.groups[protected_rank].name
        retry = max(1.0, self.settings.recent_s)
        for t in shed_victims(waiting, protected_rank, lambda i: sched.under_floor(sched.policy.groups[i].name), self.settings.shed_fraction):
            if not sched.cancel(t, RefusalReason.OBJECTIVE_PROTECTION):
                continue
            t.refusal = shed_refusal(t.group, protected, retry)
            refuse(t)  # its waiting task answers 429 objective_protection
            live.shed += 1
            if self.on_refused is not None:
                self.on_refused(pool.name, t.group, RefusalReason.OBJECTIVE_PROTECTION.value)

    def _end(self, pool: Pool) -> None:
        """End every step in force on ``pool`` (protection turned off)."""
        live = self._of(pool)
        st = live.state
        if st.step != NONE:
            st.end(self._clock())
        self._apply(pool, st)

    # ------------------------------------------------------------------- status

    def status(self, pool: Pool) -> dict:
        """``pool``'s protection as JSON (``/admin/status``'s ``pools[].objective_protection``):
        :meth:`qos.objective_protection.ProtectionState.status` plus ``held_below``
        (the protected group while lower groups are held, else null), ``preempt_now``,
        ``shed`` and ``unreachable`` (requests since start), and ``drain_rates``
        (group -> requests started per second of waiting, null while unknown)."""
        live = self._live.get(pool.name) or PoolProtection()
        now = self._clock()
        out = live.state.status(now)
        out["enabled"] = self.settings.enabled and bool(self.groups)
        out["held_below"] = live.state.protected if pool.scheduler.hold_below is not None else None
        out["preempt_now"] = pool.preempt_now
        out["shed"] = live.shed
        out["unreachable"] = live.unreachable
        out["drain_rates"] = {g: _round(d.rate(now, self.settings.min_backlog_s)) for g, d in live.drains.items()}
        return out

    def steps(self) -> dict[str, int]:
        """Pool name -> the step in force (0 none, 1 hold, 2 preempt, 3 shed)."""
        return {p.name: self._live[p.name].state.step if p.name in self._live else NONE for p in self._pools()}

    def close(self) -> None:
        """Cancel every pool's check timer (shutdown)."""
        for live in self._live.values():
            if live.timer is not None:
                live.timer.cancel()
                live.timer = None


def drain_window_changed(live: PoolProtection, settings: ProtectionSettings) -> bool:
    """Whether ``live``'s drain rates were measured over another window than ``settings``'."""
    return any(d.window_s != settings.drain_window_s for d in live.drains.values())


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


__all__ = ["GroupObjectives", "ObjectiveProtection", "OnRefused", "OnStep", "PoolProtection"]
