"""The lease hook of the router and the binding's report, without Redis: an engine's
capacity under a lease, a leased router's new engines, and what a replica reports."""

from __future__ import annotations

import dataclasses

import yaml

from proxy.admission.lease_binding import BoundPool, LeaseBinding
from proxy.config.loading import parse_config
from proxy.routing.router import PoolRouter
from proxy.shared import StandaloneState
from qos import Scheduler
from tests.conftest import base_config


class Grants(StandaloneState):
    """A shared state whose grants the test sets."""

    def __init__(self) -> None:
        super().__init__()
        self.granted: dict[str, int] = {}
        self.syncs_asked = 0

    def grant(self, key: str) -> int:
        return self.granted.get(key, 0)

    def request_sync(self) -> None:
        self.syncs_asked += 1


def _pool(**engine_b):
    cfg = base_config("x")
    del cfg["upstream"]["url"]
    cfg["pools"] = [
        {"name": "p", "models": ["*"], "engines": [{"url": "http://127.0.0.1:9/", "name": "a", "max_inflight": 2}, {"url": "http://127.0.0.1:10/", "name": "b", "max_inflight": 3, **engine_b}]}
    ]
    config = parse_config(yaml.safe_dump(cfg))
    return config, config.effective_pools()[0]


class T:
    def __init__(self, tokens: int, group: str = "bronze") -> None:
        self.reserved_tokens = tokens
        self.group = group


def test_a_leased_router_places_nothing_before_a_grant_and_never_past_one():
    _, spec = _pool(max_inflight_tokens=100)
    router = PoolRouter(spec, leased=True)
    a, b = router.engines["a"], router.engines["b"]
    assert (a.lease_slots, a.lease_tokens, b.lease_slots, b.lease_tokens) == (0, None, 0, 0)
    assert router.choose(10) is None and a.capacity == 0
    b.set_lease(1, 50)
    assert router.choose(60) is None  # past the token lease, though b is idle
    placed = router.reserve(T(40))
    assert placed is b and router.choose(10) is None  # b's one slot is taken
    a.set_lease(2, None)
    assert router.choose(10) is a
    # a re-placed request never goes past a lease, even when it may go over capacity
    t = T(10)
    router.reserve(t)  # on a
    a.set_lease(1, None)
    assert router.reroute(t, over=True) is None  # b is at its lease


def test_the_binding_reports_per_engine_and_class_and_applies_grants():
    config, spec = _pool()
    router = PoolRouter(spec, leased=True)
    from proxy.routing.pool_capacity import PoolCapacity

    sched = Scheduler(config.to_policy(), capacity=PoolCapacity(router))
    shared = Grants()
    binding = LeaseBinding(shared, lambda: [BoundPool("p", sched, router.engines.values, lambda t: t.placement)])
    assert shared.syncs_asked == 1
    t1 = sched.submit("alice", None, 10, 5)  # platinum (weight 3)
    t2 = sched.submit("carl", None, 20, 0)  # bronze
    assert sched.queued == 2
    rep = binding.report()
    keys = [c.key for c in rep.capacity]
    assert keys == ["p/a:slots", "p/b:slots"]
    a = rep.capacity[0]
    assert (a.capacity, a.inflight) == (2, 0)
    assert [(d.inflight, d.waiting, d.weight) for d in a.demand] == [(0, 1, 3.0), (0, 1, 1.0)]
    assert set(rep.waiting_users["p"]) == {"alice", "carl"}
    shared.granted = {"p/a:slots": 1, "p/b:slots": 0}
    binding.apply()
    assert t1.state.value == "admitted" and t2.state.value == "queued"  # priority first
    rep = binding.report()
    assert [(d.inflight, d.waiting) for d in rep.capacity[0].demand] == [(1, 0), (0, 1)]
    assert rep.capacity[0].inflight == 1 and rep.capacity[1].inflight == 0


def test_an_engine_this_replica_cannot_use_is_reported_closed_with_only_its_in_flight():
    """Issue 21.2: an engine ejected by this replica's own health checks, or draining after
    a reload, claims only what runs there: reported closed, no demand (the pool's queue
    is not demand on it), its in flight still exact; back in rotation, it is open again."""
    config, spec = _pool()
    router = PoolRouter(spec, leased=True)
    from proxy.routing.pool_capacity import PoolCapacity

    sched = Scheduler(config.to_policy(), capacity=PoolCapacity(router))
    shared = Grants()
    binding = LeaseBinding(shared, lambda: [BoundPool("p", sched, router.engines.values, lambda t: t.placement)])
    shared.granted = {"p/a:slots": 1, "p/b:slots": 0}
    binding.apply()
    sched.submit("carl", None, 10, 0)  # runs on a
    for _ in range(3):
        sched.submit("carl", None, 10, 0)  # wait: the pool is full
    a = router.engines["a"]
    assert a.inflight == 1 and sched.queued == 3
    for _ in range(a.health.config.checks_to_eject):
        a.health.record_check(False, "503")
    assert not a.in_rotation
    by_key = {c.key: c for c in binding.report().capacity}
    assert (by_key["p/a:slots"].open, by_key["p/a:slots"].inflight, by_key["p/a:slots"].demand) == (False, 1, ())
    b = by_key["p/b:slots"]
    assert b.open and sum(d.waiting for d in b.demand) == 3  # the queue is demand on b only
    # back in rotation (a probe passed): open again, with the pool's waiting units
    a.health.ejected_until = 0.0
    a.health.record_check(True)
    assert a.in_rotation
    by_key = {c.key: c for c in binding.report().capacity}
    assert by_key["p/a:slots"].open and sum(d.waiting for d in by_key["p/a:slots"].demand) == 3
    # removed by a reload while a request still runs there: draining, closed
    router.reconfigure(dataclasses.replace(spec, engines=tuple(e for e in spec.engines if e.name == "b")))
    assert a.draining
    by_key = {c.key: c for c in binding.report().capacity}
    assert (by_key["p/a:slots"].open, by_key["p/a:slots"].inflight, by_key["p/a:slots"].demand) == (False, 1, ())


def test_the_binding_reports_each_class_min_share():
    """Issue 21.1: the floor travels with the demand, per class, for the shared plan."""
    cfg = base_config("http://127.0.0.1:9")
    cfg["groups"][-1]["min_share"] = 0.3
    config = parse_config(yaml.safe_dump(cfg))
    spec = config.effective_pools()[0]
    router = PoolRouter(spec, leased=True)
    from proxy.routing.pool_capacity import PoolCapacity

    sched = Scheduler(config.to_policy(), capacity=PoolCapacity(router))
    binding = LeaseBinding(Grants(), lambda: [BoundPool(spec.name, sched, router.engines.values, lambda t: t.placement)])
    demand = binding.report().capacity[0].demand
    assert [d.min_share for d in demand] == [g.min_share for g in config.groups] and demand[-1].min_share == 0.3
