"""Objective protection per pool with ``pools`` (:class:`proxy.admission.admission.Admission`
in process, its timers on the running loop): a group at risk in one pool holds and sheds
the lower groups there only; the other pool's lower work flows as before."""

from __future__ import annotations

import asyncio

import pytest

from proxy.admission.admission import Admission, Preemption
from proxy.admission.objective_protection import GroupObjectives
from qos import RefusalReason, Refused, TicketState
from qos.objective_protection import ProtectionSettings
from qos.objectives import Objective
from tests.conftest import wait_until
from tests.test_pool_admission import config, pool


def admission() -> Admission:
    cfg = config([pool("a", "a1"), pool("b", "b1")])
    adm = Admission(cfg.to_policy(), cfg.effective_pools())
    adm.preemption = Preemption(False, None, 2)  # the lower request in flight stays
    groups = {"platinum": GroupObjectives({"ttft": Objective("ttft", 0.2, 95)})}
    adm.protection.configure(ProtectionSettings(step_s=0.05), 0.02, groups)
    return adm


async def test_a_group_at_risk_in_one_pool_holds_and_sheds_lower_work_there_only():
    adm = admission()
    a, b = adm.pools["a"], adm.pools["b"]
    carl = await adm.acquire("carl", None, 5, 5, pool="a")  # bronze takes pool a's one slot
    alice = asyncio.create_task(adm.acquire("alice", None, 5, 5, pool="a"))  # platinum waits there
    await wait_until(lambda: a.scheduler.hold_below == 0, timeout=2, what="pool a held below platinum")
    assert b.scheduler.hold_below is None
    erin = await asyncio.wait_for(adm.acquire("erin", None, 5, 5, pool="b"), 1)  # bronze in pool b: at once
    assert erin.state is TicketState.ADMITTED
    frank = asyncio.create_task(adm.acquire("frank", None, 5, 5, pool="a"))  # bronze in pool a: shed
    with pytest.raises(Refused) as e:
        await asyncio.wait_for(frank, 2)
    assert e.value.reason is RefusalReason.OBJECTIVE_PROTECTION
    snap = adm.snapshot()
    prot = {p["name"]: p["objective_protection"] for p in snap["pools"]}
    assert prot["a"]["step"] == "shed" and prot["a"]["protected"] == "platinum" and prot["a"]["shed"] == 1
    assert prot["b"]["step"] == "none" and prot["b"]["shed"] == 0
    adm.release(carl)
    t = await asyncio.wait_for(alice, 1)
    assert t.state is TicketState.ADMITTED and t.placement.name == "a1"
    adm.release(t)
    adm.release(erin)
    await wait_until(lambda: a.scheduler.hold_below is None, timeout=2, what="protection over in pool a")
    adm.close()


class Handler:
    """A request's task as the handler runs it: hold the ticket until ``done``; when
    preempted, wait to be dispatched again (``log``: each engine it ran on)."""

    def __init__(self, adm: Admission, user: str, pool: str) -> None:
        self.adm, self.user, self.pool = adm, user, pool
        self.done = asyncio.Event()
        self.log: list[str] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        t = await self.adm.acquire(self.user, None, 5, 5, pool=self.pool)
        try:
            while True:
                self.log.append(t.placement.name)
                try:
                    await self.done.wait()
                    return
                except asyncio.CancelledError:
                    if not self.adm.preempted(t):
                        raise
                    self.log.append("preempted")
                    await self.adm.wait_requeued(t)
        finally:
            self.adm.release(t)


async def test_the_second_step_preempts_at_once_where_the_preemption_bound_alone_would_wait():
    adm = admission()
    adm.preemption = Preemption(True, 30.0, 2)  # by itself, no preemption within the test
    a = adm.pools["a"]
    carl = Handler(adm, "carl", "a")  # bronze, shown nothing: preemptible
    await wait_until(lambda: carl.log, what="carl on a1")
    t0 = asyncio.get_running_loop().time()
    alice = Handler(adm, "alice", "a")
    await wait_until(lambda: a.scheduler.hold_below == 0, timeout=2, what="the hold")
    assert not alice.log and carl.log == ["a1"]  # the hold alone frees nothing
    await wait_until(lambda: alice.log, timeout=2, what="alice dispatched by the preempt step")
    assert asyncio.get_running_loop().time() - t0 < 2.0
    assert carl.log == ["a1", "preempted"] and a.preemptions == 1
    assert adm.snapshot()["pools"][0]["objective_protection"]["entered"]["preempt"] == 1
    alice.done.set()
    await alice.task
    await wait_until(lambda: len(carl.log) == 3, timeout=3, what="carl dispatched again once protection ends")
    carl.done.set()
    await carl.task
    adm.close()


async def test_a_reload_keeps_the_step_in_force_and_disabling_ends_it():
    adm = admission()
    a = adm.pools["a"]
    carl = await adm.acquire("carl", None, 5, 5, pool="a")
    alice = asyncio.create_task(adm.acquire("alice", None, 5, 5, pool="a"))
    await wait_until(lambda: a.scheduler.hold_below == 0, timeout=2, what="the hold")
    groups = dict(adm.protection.groups)
    adm.update_policy(adm.policy)  # a reload: the pool and its scheduler are kept
    adm.protection.configure(ProtectionSettings(step_s=0.05), 0.02, groups)
    assert a.scheduler.hold_below == 0 and adm.protection.status(a)["step"] != "none"
    adm.protection.configure(ProtectionSettings(enabled=False), 0.02, groups)
    assert a.scheduler.hold_below is None and adm.protection.status(a)["step"] == "none"
    adm.release(carl)
    adm.release(await asyncio.wait_for(alice, 1))
    adm.close()


def test_config_keys_defaults_and_validation():
    from proxy.config.loading import ConfigError, parse_config

    base = "default_group: b\ngroups:\n  - {name: p, ttft_target_s: 0.5, on_miss: reject}\n  - {name: b}\n"
    cfg = parse_config(base)
    assert cfg.group("p").on_miss == "reject" and cfg.group("b").on_miss == "serve"
    s = cfg.objectives.protection.settings()
    assert (s.enabled, s.wait_fraction, s.recent_s, s.min_requests, s.step_s, s.shed_fraction) == (True, 0.5, 10.0, 10, None, 0.5)
    assert (s.drain_window_s, s.min_backlog_s, cfg.objectives.protection.interval_s) == (10.0, 1.0, 0.1)
    assert parse_config(base + "objectives: {protection: {step_s: 0.3}}").objectives.protection.settings().step_s == 0.3
    for bad in (
        "default_group: b\ngroups:\n  - {name: b, on_miss: reject}\n",  # reject without a ttft target
        "default_group: b\ngroups:\n  - {name: b, on_miss: drop}\n",
        base + "objectives: {protection: {wait_fraction: 0}}",
        base + "objectives: {protection: {shed_fraction: 1.5}}",
        base + "objectives: {protection: {step_s: never}}",
    ):
        with pytest.raises(ConfigError):
            parse_config(bad)
