"""Unit tests of the scheduling core (qos.Scheduler), driven by a fake clock."""

from __future__ import annotations

import math

import pytest

from qos import (
    CostModel,
    GroupPolicy,
    RateLimit,
    RefusalReason,
    Refused,
    Scheduler,
    SchedulerPolicy,
    TicketState,
    UserPolicy,
)

# cost = prompt + output: counters are then plain token counts
FLAT = CostModel(input_weight=1.0, output_weight=1.0, default_output_tokens=0)


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class Harness:
    """A scheduler with a fake clock that records every admission and late refusal."""

    def __init__(self, policy: SchedulerPolicy) -> None:
        self.clock = FakeClock()
        self.admitted: list = []
        self.refused: list = []
        self.s = Scheduler(policy, clock=self.clock, on_admit=self.admitted.append, on_refuse=self.refused.append)

    def submit(self, user, prompt, out=0, group=None):
        return self.s.submit(user, group, prompt, out)

    def release_exact(self, t) -> bool:
        """Release with exactly the estimated usage (no true-up)."""
        return self.s.release(t, output_tokens=t.max_output_tokens)

    def serve(self, n: int) -> list:
        """Release the oldest in-flight ticket n times (exact usage); return the tickets
        admitted meanwhile, in order."""
        start = len(self.admitted)
        for _ in range(n):
            oldest = min(self.s.inflight, key=lambda t: t.admitted_at or 0)
            assert self.release_exact(oldest)
        return self.admitted[start:]


def pol(groups=("g",), default=None, users=(), **kw) -> SchedulerPolicy:
    gs = tuple(g if isinstance(g, GroupPolicy) else GroupPolicy(g) for g in groups)
    kw.setdefault("cost", FLAT)
    return SchedulerPolicy(
        groups=gs,
        default_group=default or gs[-1].name,
        users={u.user_id: u for u in users},
        **kw,
    )


def cost_by_user(tickets) -> dict[str, float]:
    out: dict[str, float] = {}
    for t in tickets:
        out[t.user_id] = out.get(t.user_id, 0.0) + t.charged
    return out


# ------------------------------------------------------------------ priority


def test_strict_priority_platinum_jumps_queued_bronze():
    h = Harness(pol(("platinum", "gold", "bronze"), max_inflight=1))
    busy = h.submit("b0", 10, group="bronze")
    assert busy.state is TicketState.ADMITTED
    bronze = [h.submit(f"b{i}", 10, group="bronze") for i in range(1, 4)]
    plat = h.submit("p", 10, group="platinum")
    assert plat.state is TicketState.QUEUED
    assert h.s.queue_depths() == {"platinum": 1, "gold": 0, "bronze": 3}
    h.s.release(busy)
    assert h.admitted[-1] is plat
    assert all(t.state is TicketState.QUEUED for t in bronze)
    h.s.release(plat)
    assert h.admitted[-1] is bronze[0]


def test_lower_class_not_admitted_while_higher_head_waits_for_token_room():
    h = Harness(pol(("gold", "bronze"), max_inflight=4, max_inflight_tokens=1000))
    big = h.submit("x", 800, group="bronze")
    gold = h.submit("g", 500, group="gold")  # does not fit next to 800
    small = h.submit("y", 50, group="bronze")  # would fit, but must not overtake gold
    assert gold.state is TicketState.QUEUED and small.state is TicketState.QUEUED
    h.s.release(big)
    assert [t.state for t in (gold, small)] == [TicketState.ADMITTED, TicketState.ADMITTED]
    assert h.admitted[-2:] == [gold, small]


# ------------------------------------------------------------ token fairness


def test_equal_weights_share_tokens_not_requests():
    h = Harness(pol(max_inflight=1))
    first = h.submit("warm", 1)
    for _ in range(40):
        h.submit("A", 900, 100)  # 1000 tokens each
    for _ in range(400):
        h.submit("B", 90, 10)  # 100 tokens each
    h.s.release(first)
    got = h.serve(200)
    # both still backlogged: the window is fully contended
    assert {t.user_id for t in h.s.tickets_waiting()} == {"A", "B"}
    served = cost_by_user(got)
    assert abs(served["A"] - served["B"]) <= 2 * 1000
    n_a = sum(t.user_id == "A" for t in got)
    n_b = sum(t.user_id == "B" for t in got)
    assert n_b >= 8 * n_a  # ~10x as many short requests for the same tokens


@pytest.mark.parametrize("sizes", [(100, 100), (1000, 100), (100, 1000)])
def test_weights_3_to_1_give_3_to_1_token_service(sizes):
    sa, sb = sizes
    h = Harness(pol(users=(UserPolicy("A", "g", 3.0), UserPolicy("B", "g", 1.0)), max_inflight=1, max_queue=5000))
    first = h.submit("warm", 1)
    for _ in range(700):
        h.submit("A", sa)
        h.submit("B", sb)
    h.s.release(first)
    got = h.serve(600)
    assert {t.user_id for t in h.s.tickets_waiting()} == {"A", "B"}
    served = cost_by_user(got)
    ratio = served["A"] / served["B"]
    # bound: weighted service differs by at most 2*max(C_a/w_a, C_b/w_b)
    slack = 2 * max(sa / 3, sb / 1)
    assert abs(served["A"] / 3 - served["B"]) <= slack
    assert 2.5 <= ratio <= 3.5


@pytest.mark.parametrize("real_output, next_user", [(1000, "B"), (0, "A")])
def test_true_up_at_release_changes_order(real_output, next_user):
    h = Harness(pol(max_inflight=1))
    b0 = h.submit("B", 500)  # B counter 500
    a1 = h.submit("A", 10, 1000)
    b1 = h.submit("B", 10)
    a2 = h.submit("A", 10)  # (A still has a1 waiting: no lift)
    h.release_exact(b0)
    assert a1.state is TicketState.ADMITTED
    # A has no finished request yet: its request weighs what it claims (its estimate and
    # its max_tokens) while it runs; that orders A, it is not service
    assert h.s.order_keys()["A"] == 1010 and h.s.counters()["A"] == 0
    h.s.release(a1, output_tokens=real_output)
    assert h.s.counters()["A"] == 10 + real_output
    assert h.s.order_keys()["A"] == 10 + real_output + a2.charged  # a2.charged: 0 unless admitted
    assert h.admitted[-1] is (a2 if next_user == "A" else b1)


def test_release_with_real_prompt_tokens_trues_up_prompt_too():
    h = Harness(pol(max_inflight=1))
    t = h.submit("A", 100, 50)
    assert h.s.order_keys()["A"] == 150 and h.s.counters()["A"] == 0
    assert h.s.release(t, prompt_tokens=40, output_tokens=10)
    assert h.s.counters()["A"] == 50
    assert t.charged == 50


def test_record_output_charges_streaming_beyond_estimate():
    h = Harness(pol(max_inflight=1))
    a = h.submit("A", 10, 10)  # charged 20
    h.submit("A", 10)
    b = h.submit("B", 10)
    assert h.s.order_keys()["A"] == 20
    h.s.record_output(a, 500)
    # the output is confirmed as produced; the prompt stays an estimate until the end
    assert h.s.order_keys()["A"] == 510 and a.charged == 510 and h.s.counters()["A"] == 500
    h.s.record_output(a, 400)  # not cumulative-increasing: ignored, no refund
    assert h.s.order_keys()["A"] == 510
    h.s.release(a)  # output defaults to the last recorded count: no further change
    assert h.s.counters()["A"] == 510 and h.s.order_keys()["A"] == 510 and a.output_tokens == 500
    assert h.admitted[-1] is b  # A now far ahead: B first


def test_record_output_within_estimate_charges_nothing_and_ignores_queued():
    h = Harness(pol(max_inflight=1))
    h.s.release(h.submit("A", 10, 100), output_tokens=100)  # A's answers fill max_tokens
    a = h.submit("A", 10, 100)  # so 100 output tokens are expected of this one
    q = h.submit("A", 10, 100)
    assert h.s.order_keys()["A"] == 110 + 110
    h.s.record_output(a, 50)
    h.s.record_output(q, 999)  # queued: nothing to charge
    assert h.s.order_keys()["A"] == 220 and q.charged == 0  # within the expectation: the order is unchanged
    assert h.s.counters()["A"] == 110 + 50  # the service seen so far


def test_weight_zero_user_served_only_when_no_positive_user_waits():
    users = (UserPolicy("Z", "g", 0.0), UserPolicy("P", "g", 1.0))
    h = Harness(pol(users=users, max_inflight=1))
    busy = h.submit("x", 1)
    z = [h.submit("Z", 1) for _ in range(3)]
    p = [h.submit("P", 1000) for _ in range(3)]
    h.s.release(busy)
    h.serve(5)
    assert h.admitted[1:] == p + z  # Z waited longer, yet goes last, in arrival order
    assert h.s.counters()["Z"] == 0
    assert all(t.state is not TicketState.QUEUED for t in p)


def test_newly_backlogged_user_is_lifted_and_cannot_bank_credit():
    h = Harness(pol(max_inflight=1))
    # B is served once, then goes idle while A is served a lot
    h.release_exact(h.submit("B", 100))
    first = h.submit("A", 100)
    for _ in range(30):
        h.submit("A", 100)
    h.s.release(first)
    h.serve(10)
    a_key = h.s.order_keys()["A"]  # A's key, with its request in flight (100)
    assert h.s.counters()["B"] == 100
    for _ in range(10):
        h.submit("B", 100)
    # lifted to the virtual time (A's key when its request in flight was picked), not
    # left at its old 100
    assert h.s.counters()["B"] == a_key - 100 == h.s.snapshot()["groups"][0]["virtual_time"]
    got = h.serve(10)
    n_b = sum(t.user_id == "B" for t in got)
    assert 4 <= n_b <= 6  # alternates, no burst of B


def test_new_user_is_lifted_to_virtual_time_when_class_idle_even_after_reload():
    h = Harness(pol(max_inflight=1))
    for _ in range(5):
        h.release_exact(h.submit("A", 100))
    vt = h.s.snapshot()["groups"][0]["virtual_time"]
    assert vt == 400  # A's counter when it was last picked
    h.s.update_policy(pol(max_inflight=1))  # hot reload with the class empty
    assert h.s.snapshot()["groups"][0]["virtual_time"] == vt
    n = h.submit("N", 100)
    assert n.state is TicketState.ADMITTED
    assert h.s.counters()["N"] == vt  # no banked credit for a newcomer
    assert h.s.order_keys()["N"] == vt + 100


def test_user_requests_with_different_trusted_groups_do_not_corrupt_queues():
    # an unlisted user's class can come per request from a trusted header; while it has a
    # request waiting, its later requests join that class (one account per user)
    h = Harness(pol(("gold", "bronze"), max_inflight=1))
    busy = h.submit("x", 1, group="bronze")
    b = h.submit("u", 1, group="gold")
    c = h.submit("u", 1, group="bronze")
    assert sum(h.s.queue_depths().values()) == h.s.queued == 2
    assert b.group == c.group
    h.s.release(busy)
    h.s.release(b)
    h.s.release(c)
    assert [t.state for t in (b, c)] == [TicketState.RELEASED] * 2
    assert h.s.queued == 0 and not h.s.inflight
    # with nothing waiting, the next request goes where it is sent
    assert h.submit("u", 1, group="bronze").group == "bronze"


def test_true_up_of_ticket_from_another_class_reorders_users_current_class():
    h = Harness(pol(("gold", "bronze"), max_inflight=1))
    h.release_exact(h.submit("v", 500, group="bronze"))  # v: 500
    h.s.release(h.submit("u", 10, 1000, group="gold"), output_tokens=1000)  # u's answers fill max_tokens
    g = h.submit("u", 10, 1000, group="gold")  # u: 1010 expected, in flight
    v = h.submit("v", 10, group="bronze")
    u = h.submit("u", 10, group="bronze")  # u now queues in bronze, key 1010 (in flight)
    assert h.s.order_keys() == {"v": 500, "u": 1010}
    h.s.release(g, output_tokens=0)  # refund: u back to 10, below v
    assert h.admitted[-1] is u and v.state is TicketState.QUEUED


# --------------------------------------------------------------- queue bounds


def test_group_max_queue_refuses_group_queue_full():
    h = Harness(pol((GroupPolicy("gold"), GroupPolicy("bronze", max_queue=2)), max_inflight=1))
    h.submit("a", 1, group="bronze")
    h.submit("a", 1, group="bronze")
    h.submit("b", 1, group="bronze")
    with pytest.raises(Refused) as e:
        h.submit("c", 1, group="bronze")
    assert e.value.reason is RefusalReason.GROUP_QUEUE_FULL
    assert e.value.retry_after_s >= 1
    assert h.s.queued == 2
    assert h.submit("d", 1, group="gold").state is TicketState.QUEUED  # other class unaffected


def test_group_max_queue_zero_still_admits_when_a_slot_is_free():
    h = Harness(pol((GroupPolicy("g", max_queue=0),), max_inflight=1))
    t = h.submit("a", 1)
    assert t.state is TicketState.ADMITTED
    with pytest.raises(Refused) as e:
        h.submit("a", 1)
    assert e.value.reason is RefusalReason.GROUP_QUEUE_FULL


def test_global_max_queue_refuses_queue_full():
    h = Harness(pol(max_inflight=1, max_queue=3, queue_timeout_s=100))
    h.submit("a", 1)
    for i in range(3):
        h.submit(f"u{i}", 1)
    with pytest.raises(Refused) as e:
        h.submit("z", 1)
    assert e.value.reason is RefusalReason.QUEUE_FULL
    assert e.value.retry_after_s >= 1
    assert h.s.queued == 3 and not h.refused


def test_eviction_by_higher_priority_takes_newest_of_lowest_class():
    h = Harness(pol(("gold", "silver", "bronze"), max_inflight=1, max_queue=3))
    h.submit("x", 1, group="bronze")
    b1 = h.submit("b1", 1, group="bronze")
    s1 = h.submit("s1", 1, group="silver")
    b2 = h.submit("b2", 1, group="bronze")
    g1 = h.submit("g1", 1, group="gold")
    assert h.refused == [b2]
    assert b2.state is TicketState.REFUSED and b2.refusal.reason is RefusalReason.EVICTED
    assert b2.refusal.retry_after_s >= 1
    assert h.s.queued == 3 and g1.state is TicketState.QUEUED
    h.submit("s2", 1, group="silver")  # silver evicts the remaining bronze
    assert h.refused == [b2, b1]
    h.submit("g2", 1, group="gold")  # no bronze left: the newest silver goes
    assert h.refused[-1].user_id == "s2"
    assert s1.state is TicketState.QUEUED
    # lowest class, and equal priority with nothing below: refused, nobody evicted
    for user, group in (("b3", "bronze"), ("s3", "silver")):
        with pytest.raises(Refused) as e:
            h.submit(user, 1, group=group)
        assert e.value.reason is RefusalReason.QUEUE_FULL
    h.submit("g3", 1, group="gold")  # evicts s1
    with pytest.raises(Refused) as e:
        h.submit("g4", 1, group="gold")
    assert e.value.reason is RefusalReason.QUEUE_FULL
    assert len(h.refused) == 4 and h.s.queued == 3
    assert h.s.queue_depths() == {"gold": 3, "silver": 0, "bronze": 0}


def test_eviction_never_takes_a_stream_waiting_to_be_resumed():
    """A stream preempted after showing tokens waits to be resumed; evicting it would cut
    its client's stream mid-answer (the shed step had the same fault on vLLM)."""
    h = Harness(pol(("gold", "bronze"), max_inflight=1, max_queue=2))
    h.submit("x", 1, group="bronze")
    b1 = h.submit("b1", 1, group="bronze")
    b2 = h.submit("b2", 1, group="bronze")
    b2.resuming = True
    h.submit("g1", 1, group="gold")
    assert h.refused == [b1] and b2.state is TicketState.QUEUED
    b2_only = h.s.queue_depths()
    assert b2_only == {"gold": 1, "bronze": 1}
    with pytest.raises(Refused) as e:  # nothing evictable below: the newcomer is refused
        h.submit("g2", 1, group="gold")
    assert e.value.reason is RefusalReason.QUEUE_FULL and b2.state is TicketState.QUEUED


def test_evicted_request_gets_its_rate_limit_tokens_back():
    users = (UserPolicy("b", "bronze", limits=RateLimit(tokens_per_minute=1000)),)
    h = Harness(pol(("gold", "bronze"), users=users, max_inflight=1, max_queue=1))
    h.submit("x", 1, group="bronze")
    victim = h.submit("b", 600)
    h.submit("g", 1, group="gold")
    assert victim.refusal.reason is RefusalReason.EVICTED
    assert h.s.cancel(next(iter(h.s.tickets_waiting())))  # free the queue slot
    assert h.submit("b", 600).state is TicketState.QUEUED  # 600 <= 1000 after refund


# -------------------------------------------------------- timeout and cancel


def test_expire_refuses_after_queue_timeout_and_next_deadline():
    h = Harness(pol(max_inflight=1, queue_timeout_s=5.0))
    t0 = h.clock.t
    busy = h.submit("a", 1)
    assert h.s.next_deadline() is None
    h.clock.advance(1)
    q1 = h.submit("b", 1)
    h.clock.advance(1)
    q2 = h.submit("c", 1)
    assert h.s.next_deadline() == pytest.approx(t0 + 6)
    h.clock.t = t0 + 5.999
    assert h.s.expire() == [] and q1.state is TicketState.QUEUED
    h.clock.t = t0 + 6
    assert h.s.expire() == [q1]
    assert h.refused == [q1] and q1.refusal.reason is RefusalReason.TIMEOUT
    assert h.s.queued == 1 and h.s.next_deadline() == pytest.approx(t0 + 7)
    h.s.release(busy)
    assert q2.state is TicketState.ADMITTED
    assert h.s.next_deadline() is None
    h.clock.advance(100)
    assert h.s.expire() == []  # admitted tickets never time out
    assert q2.state is TicketState.ADMITTED and q1 not in h.admitted


def test_expire_frees_token_room_for_the_next_head():
    h = Harness(pol(max_inflight=4, max_inflight_tokens=100, queue_timeout_s=5))
    h.submit("a", 60)
    h.clock.advance(1)
    big = h.submit("b", 60)
    h.clock.advance(3)
    small = h.submit("c", 30)  # fits, but waits behind big (arrival order)
    assert small.state is TicketState.QUEUED
    h.clock.advance(2)  # big timed out, small not
    assert h.s.expire() == [big]
    assert small.state is TicketState.ADMITTED


def test_cancel_queued_removes_it_at_once():
    h = Harness(pol(max_inflight=1))
    busy = h.submit("a", 1)
    q1 = h.submit("b", 1)
    q2 = h.submit("c", 1)
    assert h.s.queued == 2
    assert h.s.cancel(q1) is True
    assert h.s.queued == 1 and sum(h.s.queue_depths().values()) == 1
    assert q1.state is TicketState.REFUSED and q1.refusal.reason is RefusalReason.CANCELLED
    assert h.refused == []  # the caller cancelled: no callback
    assert h.s.cancel(q1) is False
    h.s.release(busy)
    assert h.admitted == [busy, q2]
    assert h.s.cancel(q2) is False  # admitted: must be released instead
    assert q2.state is TicketState.ADMITTED
    h.s.release(q2)
    assert q1 not in h.admitted and h.s.queued == 0


def test_cancel_of_head_blocked_by_token_room_admits_next_at_once():
    h = Harness(pol(max_inflight=4, max_inflight_tokens=100))
    h.submit("a", 60)
    big = h.submit("b", 60)  # head of the class, does not fit
    small = h.submit("c", 30)  # fits, but waits behind big
    assert small.state is TicketState.QUEUED
    assert h.s.cancel(big)
    assert small.state is TicketState.ADMITTED


def test_release_exactly_once():
    h = Harness(pol(max_inflight=2))
    a = h.submit("a", 10)
    b = h.submit("b", 10)
    assert h.s.release(a) is True
    assert len(h.s.inflight) == 1 and h.s.inflight_tokens == 10
    assert h.s.release(a) is False
    assert len(h.s.inflight) == 1 and h.s.inflight_tokens == 10 and b in h.s.inflight
    q = h.submit("c", 1)
    h.submit("d", 1)
    assert q.state is TicketState.ADMITTED
    assert h.s.queued == 1
    assert h.s.release(a) is False and h.s.queued == 1  # no phantom slot freed


def test_release_of_queued_ticket_is_refused():
    h = Harness(pol(max_inflight=1))
    h.submit("a", 1)
    q = h.submit("b", 1)
    assert h.s.release(q) is False
    assert q.state is TicketState.QUEUED and h.s.queued == 1


# ------------------------------------------------------------------ capacity


def test_max_inflight_tokens_caps_sum_and_refuses_what_can_never_fit():
    # (issue 10 changed this: an oversize request used to be admitted when nothing was
    # in flight, and then held every other class back while slots were free)
    h = Harness(pol(max_inflight=10, max_inflight_tokens=1000))
    a = h.submit("a", 500, 100)
    b = h.submit("b", 300)
    c = h.submit("c", 200)  # 600 + 300 + 200 > 1000
    assert [t.state for t in (a, b, c)] == [TicketState.ADMITTED, TicketState.ADMITTED, TicketState.QUEUED]
    assert h.s.inflight_tokens == 900
    h.s.release(b)
    assert c.state is TicketState.ADMITTED and h.s.inflight_tokens == 800
    h.s.release(a)
    h.s.release(c)
    assert h.s.inflight_tokens == 0
    with pytest.raises(Refused) as e:
        h.submit("h", 5000, 1000)
    assert e.value.reason is RefusalReason.TOO_LARGE and "1000" in e.value.detail
    assert h.s.queued == 0 and not h.s.inflight and "h" not in h.s.counters()
    exact = h.submit("i", 1000)  # exactly the cap fits
    assert exact.state is TicketState.ADMITTED and h.s.inflight_tokens == 1000


def test_max_inflight_is_respected():
    h = Harness(pol(max_inflight=3))
    ts = [h.submit(f"u{i}", 1) for i in range(5)]
    assert len(h.s.inflight) == 3 and h.s.queued == 2
    assert [t.state for t in ts].count(TicketState.ADMITTED) == 3


# ---------------------------------------------------------------- rate limits


def test_user_rpm_limit_retry_after_and_refill():
    users = (UserPolicy("a", "g", limits=RateLimit(requests_per_minute=2)),)
    h = Harness(pol(users=users, max_inflight=10))
    h.submit("a", 1)
    h.submit("a", 1)
    with pytest.raises(Refused) as e:
        h.submit("a", 1)
    assert e.value.reason is RefusalReason.RATE_LIMITED
    assert e.value.retry_after_s == pytest.approx(30.0)  # one request at 2/min
    assert h.submit("other", 1).state is TicketState.ADMITTED  # per user
    h.clock.advance(20)
    with pytest.raises(Refused) as e:
        h.submit("a", 1)
    assert e.value.retry_after_s == pytest.approx(10.0)
    h.clock.advance(10)
    assert h.submit("a", 1).state is TicketState.ADMITTED
    with pytest.raises(Refused):
        h.submit("a", 1)


def test_user_tpm_limit_retry_after_and_refill():
    users = (UserPolicy("a", "g", limits=RateLimit(tokens_per_minute=1200)),)
    h = Harness(pol(users=users, max_inflight=10))
    h.submit("a", 500, 100)  # 600 tokens reserved
    h.submit("a", 400, 100)  # 500: level 100
    with pytest.raises(Refused) as e:
        h.submit("a", 200, 100)
    assert e.value.reason is RefusalReason.RATE_LIMITED
    assert e.value.retry_after_s == pytest.approx((300 - 100) / 20.0)  # 20 tokens/s
    h.clock.advance(10)
    assert h.submit("a", 200, 100).state is TicketState.ADMITTED


def test_tpm_true_up_at_release_refunds_unused_tokens():
    users = (UserPolicy("a", "g", limits=RateLimit(tokens_per_minute=1000)),)
    h = Harness(pol(users=users, max_inflight=10))
    t = h.submit("a", 100, 900)
    with pytest.raises(Refused):
        h.submit("a", 100, 100)
    h.s.release(t, output_tokens=0)  # only 100 tokens used
    assert h.submit("a", 100, 700).state is TicketState.ADMITTED


def test_request_larger_than_bucket_is_served_when_bucket_full():
    users = (UserPolicy("a", "g", limits=RateLimit(tokens_per_minute=600)),)
    h = Harness(pol(users=users, max_inflight=10))
    big = h.submit("a", 5000)
    assert big.state is TicketState.ADMITTED
    with pytest.raises(Refused) as e:
        h.submit("a", 1)
    # debt of 4400 + need 1, at 10 tokens/s
    assert e.value.retry_after_s == pytest.approx(4401 / 10.0)


def test_group_rate_limits_apply_to_all_users_together():
    g = GroupPolicy("g", limits=RateLimit(requests_per_minute=3, tokens_per_minute=6000))
    h = Harness(pol((g,), max_inflight=10))
    for u in ("a", "b", "c"):
        h.submit(u, 10)
    with pytest.raises(Refused) as e:
        h.submit("d", 10)
    assert e.value.reason is RefusalReason.RATE_LIMITED
    assert e.value.retry_after_s == pytest.approx(20.0)
    h.clock.advance(20)
    h.submit("d", 10)
    h.clock.advance(60)  # requests refilled; now exhaust the tokens
    h.submit("a", 5900)
    with pytest.raises(Refused) as e:
        h.submit("b", 1000)
    assert e.value.retry_after_s == pytest.approx((1000 - 100) / 100.0)  # 100 tokens/s


def test_rate_limited_submit_consumes_nothing():
    users = (UserPolicy("a", "g", limits=RateLimit(requests_per_minute=1)),)
    h = Harness(pol(users=users, max_inflight=1))
    h.submit("x", 1)
    h.submit("a", 1)
    for _ in range(3):
        with pytest.raises(Refused):
            h.submit("a", 1)
    assert h.s.queued == 1
    h.clock.advance(60)
    assert h.submit("a", 1).state is TicketState.QUEUED


def test_cancel_and_timeout_refund_tokens():
    users = (UserPolicy("a", "g", limits=RateLimit(tokens_per_minute=1000)),)
    h = Harness(pol(users=users, max_inflight=1, queue_timeout_s=5))
    h.submit("x", 1)
    q = h.submit("a", 800)
    h.s.cancel(q)
    q = h.submit("a", 800)  # tokens back after the cancel
    h.clock.advance(5)
    assert h.s.expire() == [q]
    assert h.submit("a", 800).state is TicketState.QUEUED


# ------------------------------------------------------------------ min_share


def _share_run(min_share: float) -> float:
    groups = (GroupPolicy("hi"), GroupPolicy("lo", min_share=min_share))
    h = Harness(pol(groups, max_inflight=1, share_window_s=30.0))
    busy = h.submit("warm", 1, group="hi")
    for i in range(300):
        h.submit(f"h{i % 3}", 100, group="hi")
        h.submit(f"l{i % 3}", 100, group="lo")
    h.s.release(busy)
    got = []
    for _ in range(200):
        h.clock.advance(0.1)
        got += h.serve(1)
    assert h.s.queue_depths()["hi"] > 0  # the higher class stayed backlogged
    served = {"hi": 0.0, "lo": 0.0}
    for t in got:
        served[t.group] += t.charged
    return served["lo"] / (served["hi"] + served["lo"])


def test_min_share_guarantees_lower_class_its_fraction():
    frac = _share_run(0.2)
    assert 0.18 <= frac <= 0.3


def test_without_min_share_priority_is_strict():
    assert _share_run(0.0) == 0.0


# ------------------------------------------------------------- policy updates


def test_update_policy_keeps_counters():
    h = Harness(pol(max_inflight=1))
    for u, n in (("a", 100), ("b", 300)):
        h.release_exact(h.submit(u, n))
    before = h.s.counters()
    h.s.update_policy(pol(max_inflight=2, max_queue=50))
    assert h.s.counters() == before


def test_update_policy_raised_max_inflight_dispatches_at_once():
    h = Harness(pol(max_inflight=1))
    h.submit("a", 1)
    qs = [h.submit(f"u{i}", 1) for i in range(4)]
    h.s.update_policy(pol(max_inflight=3))
    assert [t.state for t in qs] == [TicketState.ADMITTED] * 2 + [TicketState.QUEUED] * 2
    assert len(h.s.inflight) == 3 and h.s.queued == 2


def test_update_policy_lowered_max_inflight_lets_surplus_finish():
    h = Harness(pol(max_inflight=3))
    ts = [h.submit(f"u{i}", 1) for i in range(3)]
    q = h.submit("q", 1)
    h.s.update_policy(pol(max_inflight=1))
    assert all(t.state is TicketState.ADMITTED for t in ts)
    h.s.release(ts[0])
    h.s.release(ts[1])
    assert q.state is TicketState.QUEUED
    h.s.release(ts[2])
    assert q.state is TicketState.ADMITTED


def test_update_policy_removed_class_moves_queued_to_default():
    users = (UserPolicy("s", "silver"),)
    h = Harness(pol(("gold", "silver", "bronze"), users=users, max_inflight=1))
    busy = h.submit("x", 1, group="gold")
    listed = h.submit("s", 1)
    unlisted = h.submit("u", 1, group="silver")
    assert h.s.queue_depths()["silver"] == 2
    h.s.update_policy(pol(("gold", "bronze"), max_inflight=1))
    assert h.s.queue_depths() == {"gold": 0, "bronze": 2}
    assert listed.group == unlisted.group == "bronze"
    assert h.s.queued == 2 and not h.refused
    h.s.release(busy)
    h.s.release(listed)
    h.s.release(unlisted)
    assert [t.state for t in (listed, unlisted)] == [TicketState.RELEASED] * 2


def test_update_policy_in_flight_ticket_of_removed_class_releases_cleanly():
    h = Harness(pol(("gold", "silver", "bronze"), max_inflight=1))
    t = h.submit("u", 10, 10, group="silver")
    q = h.submit("v", 1)
    h.s.update_policy(pol(("gold", "bronze"), max_inflight=1))
    assert h.s.release(t, output_tokens=100)
    assert h.s.counters()["u"] == 110
    assert q.state is TicketState.ADMITTED


def test_update_policy_changed_weight_takes_effect():
    users = (UserPolicy("A", "g", 1.0), UserPolicy("B", "g", 1.0))
    h = Harness(pol(users=users, max_inflight=1))
    busy = h.submit("x", 1)
    for _ in range(200):
        h.submit("A", 100)
        h.submit("B", 100)
    h.s.release(busy)
    got = h.serve(40)
    assert abs(sum(t.user_id == "A" for t in got) - 20) <= 1
    h.s.update_policy(pol(users=(UserPolicy("A", "g", 3.0), UserPolicy("B", "g", 1.0)), max_inflight=1))
    got = h.serve(80)
    n_a = sum(t.user_id == "A" for t in got)
    assert 56 <= n_a <= 64  # 3:1


def test_update_policy_moves_listed_user_to_new_class():
    h = Harness(pol(("gold", "bronze"), users=(UserPolicy("u", "bronze"),), max_inflight=1))
    busy = h.submit("x", 1, group="bronze")
    other = h.submit("y", 1, group="bronze")
    mine = h.submit("u", 1)
    h.s.update_policy(pol(("gold", "bronze"), users=(UserPolicy("u", "gold"),), max_inflight=1))
    assert mine.group == "gold"
    h.s.release(busy)
    assert h.admitted[-1] is mine and other.state is TicketState.QUEUED


def test_update_policy_rate_limit_change_applies():
    users = (UserPolicy("a", "g", limits=RateLimit(requests_per_minute=1)),)
    h = Harness(pol(users=users, max_inflight=10))
    h.submit("a", 1)
    with pytest.raises(Refused):
        h.submit("a", 1)
    h.s.update_policy(pol(max_inflight=10))  # limit removed
    for _ in range(5):
        h.submit("a", 1)


# --------------------------------------------------------------------- close


def test_close_refuses_queued_and_later_submits():
    h = Harness(pol(max_inflight=1))
    busy = h.submit("a", 1)
    qs = [h.submit("b", 1), h.submit("c", 1)]
    out = h.s.close()
    assert out == qs and h.refused == qs
    assert all(t.refusal.reason is RefusalReason.SHUTDOWN for t in qs)
    assert h.s.queued == 0 and sum(h.s.queue_depths().values()) == 0
    with pytest.raises(Refused) as e:
        h.submit("d", 1)
    assert e.value.reason is RefusalReason.SHUTDOWN and e.value.retry_after_s >= 1
    assert busy.state is TicketState.ADMITTED
    assert h.s.release(busy) is True
    assert len(h.s.inflight) == 0 and h.admitted == [busy]


def test_policy_validation():
    with pytest.raises(ValueError):
        pol(("a", "a"))
    with pytest.raises(ValueError):
        pol(max_inflight=0)
    with pytest.raises(ValueError):
        pol((GroupPolicy("a", min_share=0.6), GroupPolicy("b", min_share=0.6)))
    with pytest.raises(ValueError):
        pol(users=(UserPolicy("u", "nope"),))
    with pytest.raises(ValueError):
        pol(users=(UserPolicy("u", "g", -1.0),))
    assert math.isclose(CostModel().cost(10, 10), 30)
