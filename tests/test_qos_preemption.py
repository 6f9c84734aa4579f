"""Preemption in the scheduling core: a higher class's head that has waited past the
bound takes the room of a lower class's request that has shown its client nothing
(qos.Scheduler.preempt / requeue / preempt_at), driven by a fake clock."""

from __future__ import annotations

import math

import pytest

from qos import GroupPolicy, LocalCapacity, RateLimit, RefusalReason, TicketState, UserPolicy

from tests.test_qos_scheduler import Harness, pol

AFTER = 0.5  # preempt_after_s in these tests


def three(max_inflight: int = 3, **kw) -> Harness:
    return Harness(pol(("gold", "silver", "bronze"), max_inflight=max_inflight, **kw))


def fill(h: Harness):
    """silver s1, bronze b1 then bronze b2 (newest) in flight; gold g1 waiting."""
    s1 = h.submit("s", 10, 10, group="silver")
    h.clock.advance(0.1)
    b1 = h.submit("b", 10, 10, group="bronze")
    h.clock.advance(0.1)
    b2 = h.submit("c", 10, 10, group="bronze")
    g1 = h.submit("g", 10, 10, group="gold")
    assert [t.state for t in (s1, b1, b2, g1)] == [TicketState.ADMITTED] * 3 + [TicketState.QUEUED]
    return s1, b1, b2, g1


def test_no_preemption_before_the_bound_then_lowest_class_newest_is_taken():
    h = three()
    s1, b1, b2, g1 = fill(h)
    assert h.s.preempt_at(AFTER) == pytest.approx(g1.enqueued_at + AFTER)
    h.clock.advance(AFTER - 0.01)
    assert h.s.preempt(AFTER, 2) == []
    h.clock.advance(0.01)
    assert h.s.preempt(AFTER, 2) == [b2]
    assert g1.state is TicketState.ADMITTED and h.admitted[-1] is g1
    assert b2.state is TicketState.QUEUED and b2.preemptions == 1 and b2.placement is None
    assert b1.state is s1.state is TicketState.ADMITTED
    assert h.s.preempt_at(AFTER) is None  # nothing waits above bronze


def test_shown_requests_and_the_bound_protect_a_request():
    h = three()
    s1, b1, b2, g1 = fill(h)
    b2.shown = True  # a stream that has sent its client something
    h.clock.advance(AFTER)
    assert h.s.preempt(AFTER, 1) == [b1]
    # b1 goes back in as soon as there is room, and cannot be preempted again (bound 1)
    assert h.s.release(g1, output_tokens=10)
    assert b1.state is TicketState.ADMITTED
    g2 = h.submit("g", 10, 10, group="gold")
    h.clock.advance(AFTER)
    assert h.s.preempt(AFTER, 1) == [s1]  # silver is the only class left to take from
    assert g2.state is TicketState.ADMITTED
    g3 = h.submit("g", 10, 10, group="gold")
    h.clock.advance(AFTER)
    assert h.s.preempt(AFTER, 1) == []  # b1 at its bound, b2 shown: nothing to take
    assert g3.state is TicketState.QUEUED


def test_same_or_higher_class_work_is_never_preempted():
    h = Harness(pol(("gold", "silver"), max_inflight=2))
    h.submit("a", 10, 10, group="gold")
    h.submit("b", 10, 10, group="gold")
    s = h.submit("s", 10, 10, group="silver")
    g = h.submit("g", 10, 10, group="gold")
    h.clock.advance(10)
    assert h.s.preempt_at(AFTER) is None  # the gold head waits behind gold work only
    assert h.s.preempt(AFTER, 5) == []
    assert s.state is g.state is TicketState.QUEUED


def test_requeue_refunds_every_charge_exactly_and_frees_the_room():
    users = (UserPolicy("b", "bronze", limits=RateLimit(tokens_per_minute=1000)),)
    h = Harness(pol(("gold", "bronze"), users=users, max_inflight=2, max_inflight_tokens=1000))
    h.submit("x", 100, 100, group="bronze")
    before_key = h.s.order_keys().get("b", 0.0)
    shares = h.s._shares
    shares.share("bronze")  # decayed to now
    before_served = shares._served["bronze"]
    victim = h.submit("b", 200, 300)
    assert victim.state is TicketState.ADMITTED
    assert h.s.order_keys()["b"] > before_key  # charged its expected cost at dispatch
    tokens_before = h.s.inflight_tokens
    g = h.submit("g", 100, 100, group="gold")
    h.clock.advance(AFTER)
    assert h.s.preempt(AFTER, 2) == [victim]
    assert h.s.order_keys()["b"] == pytest.approx(before_key)
    assert h.s.counters()["b"] == pytest.approx(before_key)
    assert h.s.user_state("b")["pending"] == 0 and h.s.user_state("b")["inflight"] == 0
    assert victim.charged == 0 and victim.share_charged == 0
    shares.share("bronze")
    decay = math.exp(-AFTER / h.s.policy.share_window_s)
    assert shares._served["bronze"] == pytest.approx(before_served * decay)  # its class's share: as before it
    assert h.s.inflight_tokens == tokens_before - victim.reserved_tokens + g.reserved_tokens
    # served later: the rate limit is settled to that attempt alone (500 of 1000), so a
    # second request of 500 passes at once
    h.s.release(g, output_tokens=100)
    assert victim.state is TicketState.ADMITTED
    h.s.release(victim, prompt_tokens=200, output_tokens=300)
    again = h.submit("b", 200, 300)
    assert again.state is not TicketState.REFUSED


def test_requeued_request_is_first_in_its_users_queue_and_its_class():
    h = Harness(pol(("gold", "bronze"), max_inflight=1))
    b1 = h.submit("b", 10, 10)
    b2 = h.submit("b", 10, 10)
    c1 = h.submit("c", 10, 10)
    g = h.submit("g", 10, 10, group="gold")
    h.clock.advance(AFTER)
    assert h.s.preempt(AFTER, 2) == [b1]
    waiting = [t for t in h.s.tickets_waiting()]
    assert waiting[0] is b1  # arrival order in its class: its own seq
    assert h.s.release(g, output_tokens=10)
    assert h.admitted[-1] is b1  # before b's later request and before user c
    assert b2.state is c1.state is TicketState.QUEUED


def test_a_victim_whose_room_is_too_small_is_skipped_for_one_that_frees_enough():
    h = Harness(pol(("gold", "bronze"), max_inflight=4, max_inflight_tokens=1000))
    big = h.submit("b", 400, 200)  # 600 tokens, older
    small = h.submit("c", 50, 50)  # 100 tokens, newest
    g = h.submit("g", 300, 300, group="gold")  # 600: needs big's room
    assert g.state is TicketState.QUEUED
    h.clock.advance(AFTER)
    assert h.s.preempt(AFTER, 2) == [big]
    assert g.state is TicketState.ADMITTED and small.state is TicketState.ADMITTED


def test_client_leaving_while_requeued_frees_everything():
    users = (UserPolicy("b", "bronze", limits=RateLimit(tokens_per_minute=1000)),)
    h = Harness(pol(("gold", "bronze"), users=users, max_inflight=1))
    victim = h.submit("b", 300, 300)
    g = h.submit("g", 10, 10, group="gold")
    h.clock.advance(AFTER)
    assert h.s.preempt(AFTER, 2) == [victim]
    assert h.s.cancel(victim)
    assert victim.state is TicketState.REFUSED and victim.refusal.reason is RefusalReason.CANCELLED
    assert h.s.queued == 0 and h.s.user_state("b")["queued"] == 0 and h.s.user_state("b")["inflight"] == 0
    assert h.s.inflight == {g}
    h.s.release(g, output_tokens=10)
    # its whole reservation came back: 600 more tokens fit the 1000 a minute
    assert h.submit("b", 300, 300).state is TicketState.ADMITTED


def test_requeued_request_waits_a_fresh_queue_timeout():
    h = Harness(pol(("gold", "bronze"), max_inflight=1, queue_timeout_s=5.0))
    victim = h.submit("b", 10, 10)
    h.clock.advance(4.0)
    g = h.submit("g", 10, 10, group="gold")
    h.clock.advance(4.0)  # 8 s after the victim's submit
    assert h.s.preempt(AFTER, 2) == [victim]
    h.clock.advance(4.0)
    assert h.s.expire() == []
    assert victim.state is TicketState.QUEUED
    h.s.release(g, output_tokens=10)
    assert victim.state is TicketState.ADMITTED


def test_no_loop_each_request_is_preempted_at_most_the_bound():
    """Gold requests keep coming; each bronze request is taken at most twice and is
    answered in between (no unbounded preempt/requeue loop)."""
    h = Harness(pol(("gold", "bronze"), max_inflight=1))
    b = h.submit("b", 10, 10)
    for _ in range(5):
        g = h.submit("g", 10, 10, group="gold")
        h.clock.advance(AFTER)
        h.s.preempt(AFTER, 2)
        if g.state is TicketState.ADMITTED:
            h.s.release(g, output_tokens=10)
    assert b.preemptions == 2 and b.state is TicketState.ADMITTED


def test_min_share_class_under_its_floor_is_not_preempted():
    groups = (GroupPolicy("gold"), GroupPolicy("bronze", min_share=0.5))
    h = Harness(pol(groups, max_inflight=2))
    b = h.submit("b", 10, 10)  # (its first request credits bronze its share)
    g0 = h.submit("g", 10, 5000, group="gold")
    h.s.release(g0, output_tokens=5000)  # then gold has most of the service
    assert h.s._under_floor(1)
    h.submit("g", 10, 10, group="gold")
    g = h.submit("g", 10, 10, group="gold")
    h.clock.advance(AFTER)
    assert h.s.preempt(AFTER, 2) == []  # bronze is under its floor: it keeps its request
    assert b.state is TicketState.ADMITTED and g.state is TicketState.QUEUED


def test_capacity_without_fits_without_is_never_preempted_on():
    class Plain(LocalCapacity):
        fits_without = None

    h = Harness(pol(("gold", "bronze"), max_inflight=1))
    h.s.capacity_model = Plain(1)
    b = h.submit("b", 10, 10)
    h.submit("g", 10, 10, group="gold")
    h.clock.advance(AFTER)
    assert h.s.preempt(AFTER, 2) == []
    assert b.state is TicketState.ADMITTED
