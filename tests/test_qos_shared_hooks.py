"""The scheduling core's hooks for several processes sharing one deployment: a lease on
the capacity (``LocalCapacity.set_lease``), service reported (``on_service``) and service
rendered elsewhere charged (``charge_remote``), the demand per class (``class_loads``)
and the rate-limit charge of a request (``rate_request``)."""

from __future__ import annotations

from qos import CostModel, GroupPolicy, RateLimit, Scheduler, SchedulerPolicy, UserPolicy

FLAT = CostModel(input_weight=1.0, output_weight=1.0, default_output_tokens=0)


def _policy(max_inflight: int = 4, max_inflight_tokens: int | None = None) -> SchedulerPolicy:
    return SchedulerPolicy(
        groups=(GroupPolicy("gold"), GroupPolicy("bronze", limits=RateLimit(requests_per_minute=60))),
        users={"a": UserPolicy("a", "gold", 1.0), "b": UserPolicy("b", "gold", 1.0), "h": UserPolicy("h", "gold", 3.0)},
        default_group="bronze",
        max_inflight=max_inflight,
        max_inflight_tokens=max_inflight_tokens,
        cost=FLAT,
    )


class Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_lease_of_zero_dispatches_nothing_and_a_larger_one_dispatches_up_to_it():
    admitted: list = []
    s = Scheduler(_policy(), clock=Clock(), on_admit=admitted.append)
    s.capacity_model.set_lease(0)
    tickets = [s.submit("a", None, 10, 0) for _ in range(4)]
    assert admitted == [] and s.capacity == 0
    s.capacity_model.set_lease(2)
    s.dispatch()
    assert admitted == tickets[:2]
    s.capacity_model.set_lease(1)  # lowered below in flight: the surplus finishes
    s.release(tickets[0], 10, 0)
    assert admitted == tickets[:2]
    s.release(tickets[1], 10, 0)
    assert admitted == tickets[:3]
    s.capacity_model.set_lease(None)  # no lease: max_inflight again
    s.dispatch()
    assert admitted == tickets


def test_a_token_lease_has_no_exception_for_an_idle_engine():
    admitted: list = []
    s = Scheduler(_policy(max_inflight_tokens=1000), clock=Clock(), on_admit=admitted.append)
    s.capacity_model.set_lease(4, 50)
    t = s.submit("a", None, 100, 0)
    assert admitted == []  # 100 tokens do not fit a 50-token lease, even with nothing in flight
    s.capacity_model.set_lease(4, 100)
    s.dispatch()
    assert admitted == [t]


def test_service_reported_adds_up_to_the_counter_and_remote_service_moves_the_order():
    seen: list = []
    admitted: list = []
    s = Scheduler(_policy(max_inflight=1), clock=Clock(), on_admit=admitted.append, on_service=lambda u, c: seen.append((u, c)))
    first = s.submit("a", None, 10, 5)
    s.record_output(first, 3)
    s.release(first, 10, 5)
    assert sum(c for u, c in seen if u == "a") == 15
    # a and b both wait; a has had 15 units here. b got 100 elsewhere: a goes first
    blocker = s.submit("h", None, 1, 0)
    ta, tb = s.submit("a", None, 1, 0), s.submit("b", None, 1, 0)
    assert s.charge_remote("b", 100.0)
    assert not s.charge_remote("nobody", 5.0) and not s.charge_remote("a", float("nan")) and not s.charge_remote("a", -1.0)
    s.release(blocker, 1, 0)
    assert admitted[-1] is ta
    s.release(ta, 1, 0)
    assert admitted[-1] is tb


def test_remote_service_is_divided_by_the_weight():
    s = Scheduler(_policy(), clock=Clock())
    s.capacity_model.set_lease(0)
    s.submit("h", None, 1, 0)
    s.submit("a", None, 1, 0)
    before = s.counters()
    s.charge_remote("h", 30.0)
    s.charge_remote("a", 30.0)
    after = s.counters()
    assert after["h"] - before["h"] == 10.0 and after["a"] - before["a"] == 30.0


def test_class_loads_and_waiting_users():
    s = Scheduler(_policy(), clock=Clock())
    s.capacity_model.set_lease(0)
    s.submit("a", None, 10, 5)
    s.submit("h", None, 20, 0)
    s.submit("h", None, 1, 0)
    s.submit("zed", None, 7, 0)  # bronze, the default class
    assert s.class_loads() == [("gold", 3, 36, 4.0), ("bronze", 1, 7, 1.0)]
    assert s.waiting_users() == {"a", "h", "zed"}


def test_rate_request_is_what_submit_would_charge():
    s = Scheduler(_policy(), clock=Clock())
    up, gpol, tokens = s.rate_request("zed", None, 12, 30, choices=2)
    assert (up.group, gpol.name, gpol.limits.requests_per_minute, tokens) == ("bronze", "bronze", 60, 12 + 60)
    t = s.submit("zed", None, 12, 30, choices=2)
    assert t.reserved_tokens == tokens
