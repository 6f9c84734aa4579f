"""Token fairness in front of a continuously-batching engine (issue 20).

Closed-loop clients against the engine model of :mod:`tests.batching_sim` (the real
scheduler on an injected clock; every request in the batch gains one token per engine
step, so requests started together end together). Before slot holds, the user whose
requests ended handed its slots to the other at every such moment (it had nothing
waiting yet), and weights decided nothing: alice (weight 3) got 51.8 % with 24 streams
each, where 75 % is her share and she asks for it.
"""

from __future__ import annotations

import pytest

from qos import GroupPolicy, Scheduler, SchedulerPolicy, TicketState, UserPolicy

from tests.batching_sim import run_closed_loop, run_two_loads

WEIGHTS = {"alice": 3.0, "bob": 1.0}


def _share(streams_alice: int, streams_bob: int, **kw) -> tuple[float, float]:
    r = run_closed_loop({"alice": streams_alice, "bob": streams_bob}, WEIGHTS, **kw)
    return r.share("alice"), r.tokens_per_s


def test_closed_loop_users_get_their_weight_share_of_a_batching_engine():
    """The issue's case: 24 closed-loop 128-token streams each, 32 slots. Alice asks for
    24 slots, her weight's share: she gets 75 % of the tokens (51.8 % before), and the
    engine's rate is what it is without holds (380 tokens/s at 32 in flight)."""
    share, rate = _share(24, 24)
    assert share == pytest.approx(0.75, abs=0.02)
    _, rate_without = _share(24, 24, hold_slot_s=0.0)
    assert rate >= 0.99 * rate_without


@pytest.mark.parametrize(
    "streams, expected",
    [
        ((4, 40), 4 / 32),  # alice asks for 4 slots of 32: she gets them (9.1 % before)
        ((20, 20), 20 / 32),  # 20 < her 24: all of them, bob the other 12 (49.0 % before)
        ((8, 24), 8 / 32),  # owed no more than she asks for
        ((40, 4), 28 / 32),  # bob asks for 4 < his 8: alice takes the rest
    ],
)
def test_a_user_with_nothing_waiting_gets_what_it_asks_for_up_to_its_share(streams, expected):
    """A user asking for fewer slots than its weight's share gets all it asks for, and
    the other user the rest (slots are tokens on a batching engine: every request in
    flight advances at the same rate)."""
    share, _rate = _share(*streams)
    assert share == pytest.approx(expected, abs=0.01)


def test_backlogged_users_get_their_weight_share_of_a_batching_engine():
    """Both users backlogged at the proxy (128 streams each): 75 %."""
    share, _rate = _share(128, 128)
    assert share == pytest.approx(0.75, abs=0.02)


# ------------------------------------------------------------ the hold itself


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _sched(hold_slot_s=0.5, max_inflight=2, groups=("gold",), users=(("a", "gold", 3.0), ("b", "gold", 1.0))):
    clock = Clock()
    policy = SchedulerPolicy(
        groups=tuple(GroupPolicy(g) for g in groups),
        default_group=groups[-1],
        users={u: UserPolicy(u, g, w) for u, g, w in users},
        max_inflight=max_inflight,
        queue_timeout_s=1000.0,
        hold_slot_s=hold_slot_s,
    )
    admitted = []
    return Scheduler(policy, clock=clock, on_admit=admitted.append), clock, admitted


def test_a_freed_slot_waits_for_its_owed_users_next_request():
    """a (weight 3, owed) ends a request with nothing waiting while b waits: the slot is
    kept for a, whose next request, arriving after b's, takes it."""
    s, clock, admitted = _sched()
    a1 = s.submit("a", None, 10, 100)
    s.submit("b", None, 10, 100)
    b2 = s.submit("b", None, 10, 100)
    assert b2.state is TicketState.QUEUED
    clock.t += 1.0
    assert s.release(a1, 10, 100)
    assert b2.state is TicketState.QUEUED and s.held_slots == 1
    assert s.next_hold_end() == pytest.approx(clock.t + 0.5)
    clock.t += 0.01
    a2 = s.submit("a", None, 10, 100)
    assert a2.state is TicketState.ADMITTED and b2.state is TicketState.QUEUED
    assert s.held_slots == 0 and s.snapshot()["holds_taken"] == 1


def test_an_unused_hold_ends_and_its_slot_goes_to_the_queue():
    """The owed user does not come back: when the hold ends, the caller's timer
    (``dispatch`` at ``next_hold_end``) gives the slot to the user waiting; with holds
    off it goes at once."""
    s, clock, admitted = _sched()
    a1 = s.submit("a", None, 10, 100)
    s.submit("b", None, 10, 100)
    b2 = s.submit("b", None, 10, 100)
    s.release(a1, 10, 100)
    clock.t += 0.4
    s.dispatch()
    assert b2.state is TicketState.QUEUED
    clock.t = s.next_hold_end()
    s.dispatch()
    assert b2.state is TicketState.ADMITTED
    assert s.held_slots == 0 and s.next_hold_end() is None and s.snapshot()["holds_expired"] == 1

    s, clock, admitted = _sched(hold_slot_s=0.0)
    a1 = s.submit("a", None, 10, 100)
    s.submit("b", None, 10, 100)
    b2 = s.submit("b", None, 10, 100)
    s.release(a1, 10, 100)
    assert b2.state is TicketState.ADMITTED


def test_no_hold_for_a_user_that_ranks_after_the_user_waiting():
    """The freed slot is kept only for a user owed it: when the user waiting has the
    smaller key, it gets the slot at once."""
    s, clock, admitted = _sched(users=(("a", "gold", 1.0), ("b", "gold", 1.0)))
    a1 = s.submit("a", None, 10, 100)
    a2 = s.submit("a", None, 10, 100)
    b1 = s.submit("b", None, 10, 100)  # b has nothing in flight: its key is the smaller
    assert b1.state is TicketState.QUEUED
    s.release(a1, 10, 100)
    assert b1.state is TicketState.ADMITTED and s.held_slots == 0
    assert a2.state is TicketState.ADMITTED


def test_a_hold_of_a_higher_class_keeps_the_slot_from_a_lower_class_only():
    """A platinum user's freed slot is kept from bronze's waiting head (strict priority
    for a closed-loop platinum client); a bronze user's hold never delays platinum."""
    users = (("p", "platinum", 1.0), ("z", "bronze", 1.0), ("y", "bronze", 1.0))
    s, clock, admitted = _sched(max_inflight=1, groups=("platinum", "bronze"), users=users)
    p1 = s.submit("p", None, 10, 100)
    z1 = s.submit("z", None, 10, 100)
    s.release(p1, 10, 100)
    assert z1.state is TicketState.QUEUED and s.held_slots == 1
    p2 = s.submit("p", None, 10, 100)
    assert p2.state is TicketState.ADMITTED
    # a bronze user's freed slot, kept for it, never delays a platinum request
    s, clock, admitted = _sched(max_inflight=1, groups=("platinum", "bronze"), users=users)
    z1 = s.submit("z", None, 10, 100)
    s.release(z1, 10, 100)
    assert s.held_slots == 1  # kept for z: nobody else waits yet
    p1 = s.submit("p", None, 10, 100)
    assert p1.state is TicketState.ADMITTED and s.held_slots == 1


@pytest.mark.parametrize("first", ["alice", "bob"])
def test_a_second_load_right_after_the_first_gets_its_weight_share(first):
    """A load that starts on an idle engine whose capacity was found earlier (a second
    benchmark run right after the first, measured on vLLM: alice 74.6 % then 55.2 %):
    dispatching the whole capacity at once gave every place to the user whose client
    started first, for a whole generation. The controller's restart after idle paces the
    start, the queue forms in the proxy, and weights decide: 75 % in both loads. The
    restart window (the initial limit, 16) still goes in arrival order: when bob's client
    starts first, his 16 extra places cost alice a few points until their requests end."""
    order = {first: 128, ("bob" if first == "alice" else "alice"): 128}
    for load in run_two_loads(order, WEIGHTS):
        if first == "alice":
            assert load.share("alice") == pytest.approx(0.75, abs=0.05)
        else:
            assert 0.75 - 16 / 128 / 2 - 0.02 <= load.share("alice") <= 0.80
    if first == "bob":  # without the pace the first client takes the batch, whatever its weight
        assert run_two_loads(order, WEIGHTS, restart=False)[1].share("alice") < 0.5
