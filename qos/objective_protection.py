"""Objective protection: while a group with latency objectives is missing, or about to
miss, its objective in a pool, the groups below it give way in stated steps; and a
request that cannot meet its own group's TTFT objective may be refused at once (pure: no
I/O, time is an argument; the proxy measures and applies:
:mod:`proxy.admission.objective_protection`).

**At risk.** A group ``G`` with objectives (``ttft_target_s`` and/or ``tpot_target_s``)
is *at risk* in a pool at a check (:func:`risk_of`) when either

* *about to miss* (source: the pool's live requests): ``G``'s oldest request still
  without its first token, waiting in the pool's queue or dispatched and waiting inside
  the engine (its FIFO, or a batch whose steps outlast the target), has waited at least
  ``wait_fraction`` (0.5) x ``G``'s ``ttft_target_s`` since it arrived; or
* *missing* (source: the measured objectives, :class:`qos.objectives.ObjectiveTracker`):
  over the last ``recent_s`` (10 s) of the objectives window, summed over the pool's
  engines, ``G`` recorded at least ``min_requests`` (10) values of an objective and the
  fraction within target is below the objective's goal (its percentile / 100), and
  ``G`` has requests waiting or in flight in the pool (with nothing there, there is
  nothing to protect now).

**The steps** (:class:`ProtectionState`), per pool, for the highest group at risk (the
*protected* group); each step is kept while the next ones are taken:

1. ``hold``: the groups ranked below the protected one get no new dispatch in the pool
   (their waiting requests stay queued; what runs finishes), except a group under its
   ``min_share`` floor (a promise too: it is never evicted or preempted either);
2. ``preempt``: the pool's preemption wait bound drops to 0 (the existing preemption,
   :mod:`qos.preemption`: a head that does not fit takes the room of a lower group's
   request that has shown its client nothing, at once instead of after ``after_s``);
3. ``shed``: every step time while still at risk, the newest waiting requests of the
   lowest groups below the protected one are refused (``429 objective_protection``):
   ``shed_fraction`` (half) of those groups' waiting requests, at least one, lowest group
   first, newest first in it (:func:`shed_victims`).

A step is taken when the previous one has been in force for the *step time* and the pool
is still at risk: ``step_s`` when set, else half the protected group's
``ttft_target_s`` (at least :data:`MIN_STEP_S`), or :data:`DEFAULT_STEP_S` for a group
with only a ``tpot`` objective. Protection ends (every step at once) when no group has
been at risk for one step time. A group without objectives is never protected; it is
held back or shed only while a group above it is at risk.

**``on_miss: reject``** (:func:`unreachable_wait`): a request of a group that asks for it,
arriving with ``ahead`` requests of its group already waiting in the pool, is refused
(``429 objective_unreachable``) when ``(ahead + 1) / drain_rate > ttft_target_s``: at
the group's measured drain rate its queue wait alone would pass the target. The *drain
rate* (:class:`GroupDrainRate`) is the group's requests started from the pool's queue per
second of time the group had requests waiting there, over the last ``drain_window_s``
(10 s); unknown (nothing refused) until the group has waited ``min_backlog_s`` (1 s) in
that window. A request with nothing of its group ahead is never refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .ticket import RefusalReason, Refused, Ticket

NONE, HOLD, PREEMPT, SHED = 0, 1, 2, 3
STEP_NAMES = ("none", "hold", "preempt", "shed")
MIN_STEP_S = 0.05  # the shortest automatic step time (seconds)
DEFAULT_STEP_S = 1.0  # the automatic step time of a group without a ttft objective
DRAIN_SLICES = 10  # the drain rate's window is cut into this many slices

QUEUE_WAIT = "queue_wait"  # risk reasons: the oldest wait passed its bound
ATTAINMENT = "attainment"  # the recent attainment fell below the goal


@dataclass(frozen=True, slots=True)
class ProtectionSettings:
    """``objectives.protection`` (docs/configuration.md).

    Attributes:
        enabled: protect at all (``on_miss: reject`` is a group's own and works without).
        wait_fraction: a group is about to miss when its longest wait reaches this
            fraction of its ``ttft_target_s`` (0..1].
        recent_s: the attainment's recent span (seconds), whole slices of the window.
        min_requests: the fewest values in ``recent_s`` that say a group is missing.
        step_s: seconds each step is given before the next; ``None``: automatic.
        shed_fraction: the part of the lower groups' waiting requests shed per step (0..1].
        drain_window_s: the drain rate's window (seconds).
        min_backlog_s: seconds of waiting in that window before a drain rate is known.
    """

    enabled: bool = True
    wait_fraction: float = 0.5
    recent_s: float = 10.0
    min_requests: int = 10
    step_s: float | None = None
    shed_fraction: float = 0.5
    drain_window_s: float = 10.0
    min_backlog_s: float = 1.0

    def step_time(self, ttft_target_s: float | None) -> float:
        """Seconds a step is given for a protected group of ``ttft_target_s`` (module
        docstring)."""
        if self.step_s is not None:
            return self.step_s
        if ttft_target_s is None:
            return DEFAULT_STEP_S
        return max(MIN_STEP_S, 0.5 * ttft_target_s)


@dataclass(frozen=True, slots=True)
class GroupReading:
    """One group with objectives in one pool, as measured at a check.

    Attributes:
        name: the group.
        ttft_target_s: its TTFT target (seconds), ``None`` without one.
        oldest_wait_s: how long its oldest request without a first token has waited
            since it arrived (seconds), in the pool's queue or in flight on an engine
            (the caller measures both), ``None`` when there is none.
        active: it has requests waiting or in flight in the pool.
        recent: per objective, ``(name, values, within target, goal)`` over the recent
            span (``goal``: percentile / 100).
    """

    name: str
    ttft_target_s: float | None
    oldest_wait_s: float | None
    active: bool
    recent: tuple[tuple[str, int, int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Risk:
    """Why a group is at risk.

    Attributes:
        group: the group; rank: its priority index (0 highest).
        reason: :data:`QUEUE_WAIT` or :data:`ATTAINMENT`.
        objective: ``ttft`` or ``tpot``.
        value: the longest wait (seconds) or the recent attainment (0..1).
        bound: what ``value`` was compared with (seconds, or the goal).
    """

    group: str
    rank: int
    reason: str
    objective: str
    value: float
    bound: float


def risk_of(rank: int, g: GroupReading, settings: ProtectionSettings) -> Risk | None:
    """Whether group ``g`` (priority index ``rank``) is at risk (the module docstring's
    rule), and why; ``None`` when not. The queue signal is tried first."""
    if g.ttft_target_s is not None and g.oldest_wait_s is not None:
        bound = settings.wait_fraction * g.ttft_target_s
        if g.oldest_wait_s >= bound:
            return Risk(g.name, rank, QUEUE_WAIT, "ttft", g.oldest_wait_s, bound)
    if g.active:
        for name, values, met, goal in g.recent:
            if values >= settings.min_requests and met / values < goal:
                return Risk(g.name, rank, ATTAINMENT, name, met / values, goal)
    return None


@dataclass(slots=True)
class ProtectionState:
    """One pool's protection: the step in force and since when.

    Attributes:
        step: :data:`NONE`, :data:`HOLD`, :data:`PREEMPT` or :data:`SHED`.
        protected, protected_rank: the highest group at risk at the last check that
            found one (``None`` / -1 without protection).
        since: when the step in force was entered (clock seconds).
        calm_since: when the pool was last found not at risk while a step was in force.
        last_shed: when the last shed was done.
        risks: the risks found at the last check.
        entered: times each step was entered (index: the step).
    """

    step: int = NONE
    protected: str | None = None
    protected_rank: int = -1
    since: float = 0.0
    calm_since: float | None = None
    last_shed: float | None = None
    risks: tuple[Risk, ...] = ()
    entered: list[int] = field(default_factory=lambda: [0, 0, 0, 0])

    def update(self, now: float, risks: Sequence[Risk], step_time: Callable[[str], float]) -> int | None:
        """Take one check's ``risks`` at ``now``; returns the step entered, if any
        (:data:`NONE` when protection ended). ``step_time(group)``: the step time of a
        protected group (:meth:`ProtectionSettings.step_time`). At most one step up per
        check."""
        self.risks = tuple(risks)
        if risks:
            top = min(risks, key=lambda r: r.rank)
            self.protected, self.protected_rank = top.group, top.rank
            self.calm_since = None
            if self.step == NONE:
                return self._enter(HOLD, now)
            if self.step < SHED and now - self.since >= step_time(top.group):
                return self._enter(self.step + 1, now)
            return None
        if self.step == NONE:
            return None
        if self.calm_since is None:
            self.calm_since = now
            return None
        if now - self.calm_since >= step_time(self.protected or ""):
            self.protected, self.protected_rank, self.calm_since, self.last_shed = None, -1, None, None
            self.step, self.since = NONE, now
            return NONE
        return None

    def end(self, now: float) -> None:
        """End every step at once (protection turned off by a reload)."""
        self.protected, self.protected_rank, self.calm_since, self.last_shed = None, -1, None, None
        self.step, self.since, self.risks = NONE, now, ()

    def _enter(self, step: int, now: float) -> int:
        self.step, self.since = step, now
        self.entered[step] += 1
        return step

    def shed_due(self, now: float, step_time: float) -> bool:
        """Whether to shed now: at :data:`SHED`, at risk at the last check, and one step
        time since the last shed (the first at once). The caller sheds and then calls
        :meth:`shed_done`."""
        if self.step != SHED or not self.risks:
            return False
        return self.last_shed is None or now - self.last_shed >= step_time

    def shed_done(self, now: float) -> None:
        """A shed was done at ``now``."""
        self.last_shed = now

    def status(self, now: float) -> dict:
        """JSON: ``step`` (its name), ``protected`` (group or null), ``for_s`` (seconds
        in this step), ``risks`` (``[{group, reason, objective, value, bound}]``),
        ``entered`` (``{step name: times}``)."""
        return {
            "step": STEP_NAMES[self.step],
            "protected": self.protected,
            "for_s": round(now - self.since, 3) if self.step != NONE else 0.0,
            "risks": [{"group": r.group, "reason": r.reason, "objective": r.objective, "value": round(r.value, 4), "bound": round(r.bound, 4)} for r in self.risks],
            "entered": {STEP_NAMES[i]: n for i, n in enumerate(self.entered) if i != NONE},
        }


def shed_victims(waiting: Sequence[Sequence[Ticket]], protected_rank: int, under_floor: Callable[[int], bool], fraction: float) -> list[Ticket]:
    """The waiting requests a shed refuses: of the groups ranked below
    ``protected_rank`` and not under their ``min_share`` floor (``under_floor(rank)``),
    ``ceil(fraction x`` their waiting requests ``)`` (at least one when any wait), the
    lowest group first, newest first inside it. A request waiting to be resumed
    (:attr:`Ticket.resuming`: its client is reading part of the answer) is neither shed
    nor counted (measured on vLLM: 8 of 9 streams preempted to be resumed were shed
    while they waited, their clients left with part of an answer and an error event).

    Args:
        waiting: per priority index (0 highest), that group's waiting requests in
            arrival order.
        protected_rank: the protected group's index.
        under_floor: whether the group of an index is at or under its floor.
        fraction: ``shed_fraction`` (0..1].
    """
    sheddable = [[t for t in w if not t.resuming] for w in waiting]
    groups = [i for i in range(len(sheddable) - 1, protected_rank, -1) if sheddable[i] and not under_floor(i)]
    total = sum(len(sheddable[i]) for i in groups)
    if not total:
        return []
    want = max(1, math.ceil(fraction * total - 1e-9))
    out: list[Ticket] = []
    for i in groups:
        for t in reversed(sheddable[i]):
            if len(out) >= want:
                return out
            out.append(t)
    return out


class GroupDrainRate:
    """A group's drain rate in one pool: requests started from the queue per second of
    time the group had requests waiting, over a sliding window.

    Args:
        window_s: the window (seconds, > 0), cut into :data:`DRAIN_SLICES` slices.

    ``now`` is any monotonic clock in seconds. Memory: 3 x :data:`DRAIN_SLICES` numbers.
    """

    __slots__ = ("window_s", "_slice_s", "_no", "_starts", "_backlog")

    def __init__(self, window_s: float = 10.0) -> None:
        if not window_s > 0:
            raise ValueError("window_s must be > 0")
        self.window_s = window_s
        self._slice_s = window_s / DRAIN_SLICES
        self._no = [-1] * DRAIN_SLICES
        self._starts = [0] * DRAIN_SLICES
        self._backlog = [0.0] * DRAIN_SLICES

    def _slot(self, now: float) -> int:
        no = math.floor(now / self._slice_s)
        j = no % DRAIN_SLICES
        if self._no[j] != no:
            self._no[j], self._starts[j], self._backlog[j] = no, 0, 0.0
        return j

    def started(self, now: float) -> None:
        """One of the group's waiting requests was started (dispatched) at ``now``."""
        self._starts[self._slot(now)] += 1

    def backlogged(self, now: float, seconds: float) -> None:
        """The group had requests waiting for ``seconds`` up to ``now``."""
        if seconds > 0:
            self._backlog[self._slot(now)] += seconds

    def totals(self, now: float) -> tuple[int, float]:
        """``(starts, seconds waiting)`` over the window at ``now``."""
        oldest = math.floor(now / self._slice_s) - DRAIN_SLICES + 1
        starts, backlog = 0, 0.0
        for j, no in enumerate(self._no):
            if no >= oldest:
                starts += self._starts[j]
                backlog += self._backlog[j]
        return starts, backlog

    def rate(self, now: float, min_backlog_s: float) -> float | None:
        """Requests started per second of waiting (>= 0), or ``None`` while the group
        waited less than ``min_backlog_s`` in the window."""
        starts, backlog = self.totals(now)
        if backlog < min_backlog_s or backlog <= 0:
            return None
        return starts / backlog


def unreachable_wait(ahead: int, rate: float | None, ttft_target_s: float) -> float | None:
    """The estimated queue wait (seconds) of a request with ``ahead`` requests of its
    group waiting before it, at a drain ``rate`` (requests per second), when it is past
    ``ttft_target_s``; ``None`` when it is not, when nothing is ahead, or when the rate is
    unknown. A rate of 0 (the group waited and nothing started) is an infinite wait."""
    if ahead <= 0 or rate is None:
        return None
    wait = math.inf if rate <= 0 else (ahead + 1) / rate
    return wait if wait > ttft_target_s else None


def shed_refusal(group: str, protected: str, retry_after_s: float) -> Refused:
    """OBJECTIVE_PROTECTION: a waiting request of ``group`` shed for ``protected``."""
    return Refused(
        RefusalReason.OBJECTIVE_PROTECTION,
        retry_after_s,
        f"shed from the queue: group {protected!r} is missing its latency objective and group {group!r} ranks below it",
    )


def unreachable_refusal(group: str, wait_s: float, ttft_target_s: float, retry_after_s: float) -> Refused:
    """OBJECTIVE_UNREACHABLE: a request of ``group`` (``on_miss: reject``) whose
    estimated queue wait ``wait_s`` passes its ``ttft_target_s``."""
    est = "no request of the group started" if math.isinf(wait_s) else f"about {wait_s:.2f} s in the queue"
    return Refused(
        RefusalReason.OBJECTIVE_UNREACHABLE,
        retry_after_s,
        f"the request cannot meet group {group!r}'s time-to-first-token objective of {ttft_target_s:g} s ({est} at the measured drain rate); on_miss: reject",
    )


__all__ = [
    "ATTAINMENT", "DEFAULT_STEP_S", "DRAIN_SLICES", "GroupDrainRate", "GroupReading", "HOLD", "MIN_STEP_S", "NONE", "PREEMPT",
    "ProtectionSettings", "ProtectionState", "QUEUE_WAIT", "Risk", "SHED", "STEP_NAMES", "risk_of", "shed_refusal",
    "shed_victims", "unreachable_refusal", "unreachable_wait",
]  # fmt: skip
