"""Unit tests of qos.queue_wait (the drain rate and the Retry-After it gives) and of the
scheduler's use of it, driven by a fake clock."""

from __future__ import annotations

import math

import pytest

from qos import GroupPolicy, RefusalReason, Refused, Scheduler, SchedulerPolicy, TicketState
from qos.queue_wait import MAX_RETRY_AFTER_S, DrainRate, QueueWait, starts_needed
from tests.test_qos_scheduler import FLAT, FakeClock


def test_no_rate_before_starts_while_work_waits():
    d = DrainRate()
    assert d.rate(0.0) is None
    for i in range(5):  # each start at an empty queue: arrivals, not drain
        d.observe(float(i), 0)
        d.started(float(i), 0)
    assert d.rate(10.0) is None


def test_rate_is_starts_per_busy_second():
    d = DrainRate()
    d.observe(0.0, 5)
    d.started(0.5, 5)
    assert d.rate(0.5) is None  # one interval is not enough
    for i in range(2, 9):  # one start every 0.5 s, work waiting all along
        d.started(i * 0.5, 5)
    assert d.rate(4.0) == pytest.approx(2.0)
    assert d.rate(4.25) == pytest.approx(2.0)


def test_idle_time_changes_nothing_and_a_stall_lowers_the_rate():
    d = DrainRate()
    d.observe(0.0, 3)
    for i in range(1, 11):
        d.started(float(i), 3)  # 1/s
    d.observe(10.0, 0)
    learned = d.rate(10.0)
    assert learned == pytest.approx(1.0)
    assert d.rate(500.0) == learned  # idle: the rate learned stays
    d.observe(500.0, 3)  # work waits again, nothing starts for 10 s
    stalled = d.rate(510.0)
    assert stalled == pytest.approx(0.1)  # 10 s without a start


def test_starts_in_pairs_average_to_their_rate():
    d = DrainRate()
    d.observe(0.0, 9)
    for i in range(1, 3):  # two slots: two starts every 0.5 s (gaps 0.5 and 0)
        d.started(i * 0.5, 9)
        d.started(i * 0.5, 9)
    assert d.rate(1.0) == pytest.approx(4.0)


def test_the_average_follows_a_new_rate():
    d = DrainRate()
    d.observe(0.0, 3)
    t = 0.0
    for _ in range(20):
        t += 1.0
        d.started(t, 3)  # 1/s
    for _ in range(50):
        t += 0.1
        d.started(t, 3)  # 10/s for 20 s
    assert d.rate(t) == pytest.approx(10.0, rel=0.05)


def test_starts_needed_terms():
    # room: 10 waiting of max 10 -> one start gives a place
    assert starts_needed(10, 10, 0, 10, None, 100.0, 30.0) == 1
    # timely: 50 ahead at 1/s with a 10 s timeout: 41 must start first
    assert starts_needed(50, 100, 20, 30, None, 1.0, 10.0) == pytest.approx(41)
    # its class's own bound: 5 above, 3 of max 3 in its class -> 6
    assert starts_needed(8, 100, 5, 3, 3, 100.0, 30.0) == 6
    assert starts_needed(0, 100, 0, 0, None, 1.0, 30.0) == 0


def test_refused_clients_are_told_to_come_back_one_start_apart():
    w = QueueWait()
    waits = [w.retry_after_s(0.0, "g", 10.0, 2.0) for _ in range(4)]
    assert waits == pytest.approx([5.0, 5.5, 6.0, 6.5])
    assert w.retry_after_s(0.0, "other", 10.0, 2.0) == pytest.approx(5.0)  # per class
    assert w.retry_after_s(0.0, "g", 1.0, 2.0, promise=False) == pytest.approx(7.0)
    assert w.retry_after_s(100.0, "g", 0.0, 2.0) == 1.0  # the promises are past; at least 1 s
    assert w.retry_after_s(100.0, "x", 1e9, 2.0) == MAX_RETRY_AFTER_S


def _policy(**kw) -> SchedulerPolicy:
    kw.setdefault("max_inflight", 1)
    kw.setdefault("max_queue", 4)
    kw.setdefault("queue_timeout_s", 60.0)
    return SchedulerPolicy(groups=(GroupPolicy("hi"), GroupPolicy("lo")), default_group="lo", cost=FLAT, **kw)


def _drive(service_s: float, rounds: int = 30) -> tuple[Scheduler, FakeClock]:
    """A scheduler whose one slot serves a request every ``service_s`` while 3 wait."""
    clock = FakeClock(0.0)
    s = Scheduler(_policy(), clock=clock)
    for i in range(4):
        s.submit(f"u{i}", None, 10, 10)
    for i in range(rounds):
        clock.advance(service_s)
        s.release(next(iter(s.inflight)))
        s.submit(f"v{i}", None, 10, 10)  # the queue stays at 3
    return s, clock


def _refusal(s: Scheduler) -> Refused:
    s.submit("x1", None, 10, 10)  # fills the queue (4)
    with pytest.raises(Refused) as e:
        s.submit("x2", None, 10, 10)
    assert e.value.reason is RefusalReason.QUEUE_FULL
    return e.value


def test_scheduler_measures_its_drain_rate():
    slow, _ = _drive(2.0)
    fast, _ = _drive(0.25)
    assert slow.drain_rate() == pytest.approx(0.5, rel=0.02)
    assert fast.drain_rate() == pytest.approx(4.0, rel=0.02)


def test_retry_after_follows_the_drain_rate():
    slow, _ = _drive(2.0)
    fast, _ = _drive(0.25)
    # a full queue (4) gets a place after one start: 1/rate
    assert _refusal(slow).retry_after_s == pytest.approx(2.0, rel=0.02)
    assert _refusal(fast).retry_after_s == 1.0  # 0.25 s, bounded to 1 s
    # a long queue timeout is not what bounds it: 20 waiting at 0.5/s with T = 10 s
    clock = FakeClock(0.0)
    s = Scheduler(_policy(max_queue=20, queue_timeout_s=10.0), clock=clock)
    s.submit("a", None, 1, 1)
    s.submit("b", None, 1, 1)
    for i in range(20):
        clock.advance(2.0)
        s.release(next(iter(s.inflight)))
        s.submit(f"c{i}", None, 1, 1)
    while s.queued < 20:
        s.submit(f"d{s.queued}", None, 1, 1)
    with pytest.raises(Refused) as e:
        s.submit("late", None, 1, 1)
    # 21 ahead (20 + itself) of which 0.5 * 10 start within its timeout: 16 starts, 32 s
    assert e.value.retry_after_s == pytest.approx(32.0, rel=0.02)


def test_a_higher_class_is_told_a_shorter_wait():
    s, _ = _drive(1.0)
    s.submit("x1", None, 10, 10)
    with pytest.raises(Refused) as lo:
        s.submit("x2", None, 10, 10)
    assert lo.value.reason is RefusalReason.QUEUE_FULL
    # a 'hi' newcomer evicts the newest 'lo' request: that one is told when 'lo' has room
    hi = s.submit("h", "hi", 10, 10)
    assert hi.state is TicketState.QUEUED


def test_position_and_wait_of_waiting_requests():
    s, clock = _drive(0.5)  # 2/s
    waiting = list(s.tickets_waiting())
    assert [s.queue_position(t)[0] for t in waiting] == [1, 2, 3]
    assert s.queue_position(waiting[2])[1] == pytest.approx(1.5, rel=0.05)
    h = s.submit("h", "hi", 10, 10)  # a higher class goes before them all
    assert s.queue_position(h)[0] == 1 and s.queue_position(waiting[0])[0] == 2
    assert s.would_wait("lo")[0] == 5 and s.would_wait("hi")[0] == 2
    s.release(next(iter(s.inflight)))
    assert s.queue_position(h) is None  # started
    assert s.queue_position(waiting[0])[0] == 1
    assert math.isfinite(s.would_wait(None)[1])


def test_a_timed_out_request_is_told_when_it_would_be_started_in_time():
    clock = FakeClock(0.0)
    s = Scheduler(_policy(max_queue=100, queue_timeout_s=5.0), clock=clock)
    for i in range(12):
        s.submit(f"u{i}", None, 1, 1)
    for _ in range(4):  # 1/s
        clock.advance(1.0)
        s.release(next(iter(s.inflight)))
    clock.advance(1.5)  # the oldest waiting pass their 5 s
    out = s.expire()
    assert out and all(t.refusal.reason is RefusalReason.TIMEOUT for t in out)
    first = out[0].refusal.retry_after_s
    assert first > 1.0  # the queue ahead (7 at 1/s) is more than its 5 s timeout


def test_the_one_second_floor_does_not_push_the_promises():
    w = QueueWait()
    # 10 starts/s: clients refused together are expected 0.1 s apart; all told 1 s
    assert [w.retry_after_s(0.0, "g", 1.0, 10.0) for _ in range(10)] == [1.0] * 10
    assert w.retry_after_s(0.0, "g", 1.0, 10.0) == pytest.approx(1.1)  # the eleventh
