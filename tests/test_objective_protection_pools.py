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
