"""Objective protection in the scheduling core (qos/objective_protection.py): the at-risk
rule, the steps and their times, whom a shed takes, the drain rate and on_miss's
estimate; the scheduler's hold on lower classes (qos.Scheduler.hold_back); the recent
attainment the rule reads (qos.objectives). Fake clocks, no I/O."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qos import GroupPolicy, TicketState
from qos.objective_protection import (
    ATTAINMENT, HOLD, NONE, PREEMPT, QUEUE_WAIT, SHED, GroupDrainRate, GroupReading, ProtectionSettings, ProtectionState,
    Risk, risk_of, shed_victims, unreachable_wait,
)  # fmt: skip
from qos.objectives import LatencyWindow, Objective, ObjectiveTracker
from qos.ticket import Ticket

from tests.test_qos_scheduler import Harness, pol

S = ProtectionSettings()


def reading(oldest=None, active=True, recent=(), target=1.0, name="gold") -> GroupReading:
    return GroupReading(name, target, oldest, active, tuple(recent))


# ---------------------------------------------------------------- at risk


def test_about_to_miss_when_the_oldest_wait_reaches_the_fraction_of_the_target():
    assert risk_of(0, reading(oldest=0.49), S) is None
    r = risk_of(0, reading(oldest=0.5), S)
    assert r == Risk("gold", 0, QUEUE_WAIT, "ttft", 0.5, 0.5)
    assert risk_of(0, reading(oldest=0.3), ProtectionSettings(wait_fraction=0.25)) is not None
    assert risk_of(0, reading(oldest=50.0, target=None), S) is None  # no ttft objective: no queue signal


def test_missing_when_recent_attainment_is_below_the_goal_with_enough_values_and_work_there():
    below = [("ttft", 10, 9, 0.95)]  # 90 % against 95 %
    assert risk_of(1, reading(recent=below), S) == Risk("gold", 1, ATTAINMENT, "ttft", 0.9, 0.95)
    assert risk_of(1, reading(recent=[("ttft", 9, 0, 0.95)]), S) is None  # fewer than min_requests
    assert risk_of(1, reading(recent=[("ttft", 20, 19, 0.95)]), S) is None  # 95 %: met
    assert risk_of(1, reading(recent=below, active=False), S) is None  # nothing to protect now
    assert risk_of(1, reading(recent=[("tpot", 10, 5, 0.9)], target=None), S).objective == "tpot"


def step_times(_g: str) -> float:
    return 1.0


def test_steps_escalate_one_at_a_time_each_after_its_step_time_and_end_after_a_calm_step():
    s = ProtectionState()
    risk = [Risk("gold", 0, QUEUE_WAIT, "ttft", 1, 0.5)]
    assert s.update(0.0, risk, step_times) == HOLD and s.protected == "gold"
    assert s.update(0.99, risk, step_times) is None and s.step == HOLD  # not yet: the hold has its time
    assert s.update(1.0, risk, step_times) == PREEMPT
    assert s.update(1.5, risk, step_times) is None
    assert s.update(2.0, risk, step_times) == SHED
    assert s.update(9.0, risk, step_times) is None and s.step == SHED  # the last step
    assert s.update(9.5, [], step_times) is None and s.step == SHED  # calm, kept for a step time
    assert s.update(10.0, risk, step_times) is None and s.calm_since is None  # at risk again: calm restarts
    assert s.update(10.1, [], step_times) is None
    assert s.update(11.1, [], step_times) == NONE and s.step == NONE and s.protected is None
    assert s.entered == [0, 1, 1, 1]


def test_the_highest_group_at_risk_is_protected():
    s = ProtectionState()
    s.update(0.0, [Risk("silver", 2, ATTAINMENT, "ttft", 0.5, 0.9), Risk("gold", 1, QUEUE_WAIT, "ttft", 1, 0.5)], step_times)
    assert (s.protected, s.protected_rank) == ("gold", 1)


def test_shed_only_at_the_last_step_while_at_risk_and_once_per_step_time():
    s = ProtectionState()
    risk = [Risk("gold", 0, QUEUE_WAIT, "ttft", 1, 0.5)]
    for t in (0.0, 1.0, 2.0):
        s.update(t, risk, step_times)
    assert s.step == SHED and s.shed_due(2.0, 1.0)
    s.shed_done(2.0)
    assert not s.shed_due(2.5, 1.0) and s.shed_due(3.0, 1.0)
    s.update(3.0, [], step_times)  # calm: no shedding though the step holds
    assert not s.shed_due(4.0, 1.0)


def test_automatic_step_time_is_half_the_ttft_target():
    assert S.step_time(0.5) == 0.25 and S.step_time(0.02) == 0.05 and S.step_time(None) == 1.0
    assert ProtectionSettings(step_s=2.0).step_time(0.5) == 2.0


# ------------------------------------------------------------------ shedding


def tickets(group: str, n: int, start: int = 0) -> list[Ticket]:
    return [Ticket(seq=start + i, user_id="u", group=group, prompt_tokens=1, max_output_tokens=1, enqueued_at=0, deadline=9) for i in range(n)]


def test_shed_takes_the_lowest_groups_newest_first_never_the_protected_or_above():
    gold, silver, bronze = tickets("gold", 3), tickets("silver", 4, 10), tickets("bronze", 2, 20)
    out = shed_victims([gold, silver, bronze], 0, lambda _i: False, 0.5)
    assert out == [bronze[1], bronze[0], silver[3]]  # ceil(6 / 2) = 3
    assert shed_victims([gold, silver, bronze], 1, lambda _i: False, 0.5) == [bronze[1]]
    assert shed_victims([gold, silver, []], 1, lambda _i: False, 0.5) == []
    # a group under its min_share floor keeps its requests
    assert shed_victims([gold, silver, bronze], 0, lambda i: i == 2, 0.5) == [silver[3], silver[2]]
    assert shed_victims([gold, silver, bronze], 0, lambda _i: False, 0.01) == [bronze[1]]  # at least one


def test_shed_never_takes_a_stream_waiting_to_be_resumed():
    """A stream preempted after its client was shown tokens waits to be resumed: shedding
    it cut the client's stream mid-answer (8 of 9 such streams on vLLM at 5x overload)."""
    gold, bronze = tickets("gold", 1), tickets("bronze", 3, 10)
    bronze[2].resuming = True
    assert shed_victims([gold, bronze], 0, lambda _i: False, 0.5) == [bronze[1]]  # ceil(2 / 2): the two others
    bronze[0].resuming = bronze[1].resuming = True
    assert shed_victims([gold, bronze], 0, lambda _i: False, 1.0) == []


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 6), min_size=1, max_size=5), protected=st.integers(0, 4), fraction=st.floats(0.01, 1.0), floors=st.sets(st.integers(0, 4)))
def test_shed_property(sizes, protected, fraction, floors):
    protected = min(protected, len(sizes) - 1)
    waiting, seq = [], 0
    for i, n in enumerate(sizes):
        waiting.append(tickets(f"g{i}", n, seq))
        seq += n
    out = shed_victims(waiting, protected, lambda i: i in floors, fraction)
    eligible = [i for i in range(protected + 1, len(sizes)) if i not in floors]
    total = sum(sizes[i] for i in eligible)
    assert len(out) == (max(1, math.ceil(fraction * total - 1e-9)) if total else 0)
    ranks = [int(t.group[1:]) for t in out]
    assert all(r in eligible for r in ranks)
    assert ranks == sorted(ranks, reverse=True)  # lowest group first
    for r in set(ranks):  # newest first, and a group is emptied before a higher one is touched
        mine = [t.seq for t in out if t.group == f"g{r}"]
        assert mine == sorted(mine, reverse=True) and mine[0] == waiting[r][-1].seq
    for r in set(ranks[:-1]) - set(ranks[-1:]):
        assert ranks.count(r) == sizes[r]


# --------------------------------------------------------- drain and on_miss


def test_drain_rate_is_starts_per_second_of_waiting_over_the_window():
    d = GroupDrainRate(10.0)
    assert d.rate(0.0, 1.0) is None
    d.backlogged(0.5, 0.5)
    d.started(0.5)
    assert d.rate(0.5, 1.0) is None  # waited less than min_backlog_s: unknown
    d.backlogged(2.0, 1.5)
    d.started(2.0)
    assert d.rate(2.0, 1.0) == pytest.approx(2 / 2.0)
    assert d.rate(2.0 + 10.0, 1.0) is None  # the window has passed
    d.backlogged(30.0, 2.0)
    assert d.rate(30.0, 1.0) == 0.0  # waited, nothing started: a stall


def test_unreachable_wait_compares_the_queue_wait_at_the_drain_rate_with_the_target():
    assert unreachable_wait(0, 0.1, 0.5) is None  # nothing ahead: never refused
    assert unreachable_wait(3, None, 0.5) is None  # rate unknown
    assert unreachable_wait(3, 10.0, 0.5) is None  # (3 + 1) / 10 = 0.4 s
    assert unreachable_wait(4, 10.0, 0.5) is None  # 0.5 s: met
    assert unreachable_wait(5, 10.0, 0.5) == pytest.approx(0.6)
    assert unreachable_wait(1, 0.0, 0.5) == math.inf


# ------------------------------------------------------- the scheduler's hold


def test_hold_back_stops_lower_classes_new_dispatch_and_lifting_it_dispatches():
    h = Harness(pol(("gold", "silver", "bronze"), max_inflight=2))
    g1 = h.submit("g", 1, 1, group="gold")
    h.s.hold_back(0)
    b1 = h.submit("b", 1, 1, group="bronze")
    s1 = h.submit("s", 1, 1, group="silver")
    assert g1.state is TicketState.ADMITTED and b1.state is s1.state is TicketState.QUEUED  # a slot free, yet held
    g2 = h.submit("g2", 1, 1, group="gold")
    assert g2.state is TicketState.ADMITTED  # the protected class itself goes
    h.s.release(g1)
    assert s1.state is TicketState.QUEUED  # room freed: still held
    h.s.hold_back(1)  # now only bronze is held: silver goes
    assert s1.state is TicketState.ADMITTED and b1.state is TicketState.QUEUED
    h.s.release(g2)
    assert b1.state is TicketState.QUEUED
    h.s.hold_back(None)
    assert b1.state is TicketState.ADMITTED


def test_a_held_class_neither_preempts_nor_is_dispatched_by_preemption():
    h = Harness(pol(("gold", "silver", "bronze"), max_inflight=1))
    b = h.submit("b", 1, 1, group="bronze")
    s = h.submit("s", 1, 1, group="silver")
    h.s.hold_back(0)
    h.clock.advance(5)
    assert h.s.preempt_at(0.5) is None and h.s.preempt(0.5, 2) == []
    assert b.state is TicketState.ADMITTED and s.state is TicketState.QUEUED
    h.s.hold_back(None)
    assert h.s.preempt(0.5, 2) == [b] and s.state is TicketState.ADMITTED


def test_a_class_under_its_min_share_floor_is_not_held():
    h = Harness(pol(("gold", GroupPolicy("bronze", min_share=0.3)), max_inflight=2))
    h.s.hold_back(0)
    assert h.s.under_floor("bronze")  # nothing served yet: owed its floor
    b = h.submit("b", 1, 1, group="bronze")
    assert b.state is TicketState.ADMITTED
    assert not h.s.under_floor("bronze")  # served: above its floor now, held
    b2 = h.submit("b2", 1, 1, group="bronze")
    assert b2.state is TicketState.QUEUED


def test_without_hold_nothing_changes():
    h = Harness(pol(("gold", "bronze"), max_inflight=1))
    assert h.s.hold_below is None
    b = h.submit("b", 1, 1, group="bronze")
    assert b.state is TicketState.ADMITTED


# ------------------------------------------------------- recent attainment


def test_recent_attainment_covers_the_last_slices_only():
    w = LatencyWindow(0.5, window_s=60)
    w.observe(0.2, 0.1)  # slice 0
    w.observe(5.5, 0.9)  # slice 5
    w.observe(9.5, 0.1)  # slice 9
    assert w.recent(9.9, 1.0) == (1, 1)
    assert w.recent(9.9, 5.0) == (2, 1)  # slices 5..9
    assert w.recent(9.9, 10.0) == (3, 2)
    assert w.recent(70.0, 10.0) == (0, 0)
    t = ObjectiveTracker({"gold": [Objective("ttft", 0.5, 95)]})
    t.observe(1.0, "gold", ("p", "a"), "ttft", 0.1)
    t.observe(1.0, "gold", ("p", "b"), "ttft", 0.9)
    t.observe(1.0, "gold", ("q", "a"), "ttft", 0.9)
    assert t.recent(1.5, "gold", "ttft", "p", 10) == (2, 1)  # the pool's engines only
    assert t.recent(1.5, "silver", "ttft", "p", 10) == (0, 0)


@settings(max_examples=200, deadline=None)
@given(events=st.lists(st.tuples(st.floats(0.0, 0.7), st.booleans()), min_size=1, max_size=60))
def test_steps_property_one_at_a_time_never_before_the_step_time_and_end_only_after_a_calm_one(events):
    s, now, step_time = ProtectionState(), 0.0, 0.5
    risk = [Risk("gold", 0, QUEUE_WAIT, "ttft", 1, 0.5)]
    last_entry, calm_from = None, None
    for dt, at_risk in events:
        now += dt
        before, since = s.step, s.since
        entered = s.update(now, risk if at_risk else [], lambda _g: step_time)
        if at_risk:
            calm_from = None
            assert s.step in (before, min(before + 1, SHED))  # one step at a time, none skipped
            if s.step > before and before != NONE:
                assert now - since >= step_time  # the previous step had its time
            assert entered == (s.step if s.step != before else None)
        else:
            if before != NONE and calm_from is None:
                calm_from = now
            assert s.step in (before, NONE)
            if s.step == NONE and before != NONE:
                assert now - calm_from >= step_time and entered == NONE
                calm_from = None
        if s.step != before and s.step != NONE:
            last_entry = now
        assert s.shed_due(now, step_time) == (s.step == SHED and at_risk and (s.last_shed is None or now - s.last_shed >= step_time))
    assert last_entry is None or last_entry <= now
