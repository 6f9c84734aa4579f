"""Admission across pools (:class:`proxy.admission.admission.Admission`), in process: the schedulers
of several pools, the rate limits they share, engines leaving and coming back, and pools
removed by a reload. The relay around it is covered through the real proxy process in
``tests/test_pools_process.py``."""

from __future__ import annotations

import asyncio

import pytest
import yaml

from proxy.admission.admission import Admission, NoEngine
from proxy.config.loading import parse_config
from qos import RefusalReason, Refused, TicketState
from tests.conftest import base_config, wait_until


def config(pools: list[dict], **user_limits):
    cfg = base_config("x", max_inflight=1, queue_timeout_s=30)
    del cfg["upstream"]["url"]
    if user_limits:
        cfg["groups"][1]["users"][0]["rate_limit"] = user_limits
    cfg["pools"] = pools
    return parse_config(yaml.safe_dump(cfg))


def pool(name: str, *engines: str, **extra) -> dict:
    return {"name": name, "models": [name], "engines": [{"url": f"http://127.0.0.1:9/{e}", "name": e} for e in engines], **extra}


def admission(cfg) -> Admission:
    return Admission(cfg.to_policy(), cfg.effective_pools())


async def test_rate_limits_are_one_set_of_buckets_across_pools():
    adm = admission(config([pool("a", "a1"), pool("b", "b1")], requests_per_minute=2))
    t1 = await adm.acquire("carl", None, 5, 5, pool="a")
    t2 = await adm.acquire("carl", None, 5, 5, pool="b")
    with pytest.raises(Refused) as e:
        await adm.acquire("carl", None, 5, 5, pool="b")
    assert e.value.reason is RefusalReason.RATE_LIMITED
    assert (t1.placement.name, t2.placement.name) == ("a1", "b1")
    adm.release(t1)
    adm.release(t2)


async def test_one_pool_full_does_not_hold_another():
    adm = admission(config([pool("a", "a1"), pool("b", "b1")]))
    held = await adm.acquire("carl", None, 5, 5, pool="a")
    waiting = asyncio.create_task(adm.acquire("carl", None, 5, 5, pool="a"))
    await wait_until(lambda: adm.pools["a"].scheduler.queued == 1, what="queued in a")
    other = await adm.acquire("carl", None, 5, 5, pool="b")  # at once
    assert other.placement.name == "b1" and adm.pools["b"].scheduler.queued == 0
    adm.release(held)
    adm.release(await waiting)
    adm.release(other)


async def test_no_engine_in_rotation_is_refused_at_once_and_queued_requests_wait_for_one_back():
    adm = admission(config([pool("a", "a1", health={"checks_to_eject": 1, "eject_base_s": 5, "eject_max_s": 10})]))
    engine = adm.pools["a"].router.engines["a1"]
    held = await adm.acquire("carl", None, 5, 5, pool="a")
    queued = asyncio.create_task(adm.acquire("carl", None, 5, 5, pool="a"))
    await wait_until(lambda: adm.pools["a"].scheduler.queued == 1, what="queued")
    engine.health.record_check(False, "refused")  # ejected by its check (failed requests never eject a pool's last engine)
    with pytest.raises(NoEngine) as e:
        await adm.acquire("carl", None, 5, 5, pool="a")
    assert e.value.reason is RefusalReason.NO_ENGINE and e.value.retry_after_s >= 1
    adm.release(held)
    await asyncio.sleep(0.05)
    assert not queued.done()  # nothing in rotation: it waits (bounded by queue_timeout_s)
    engine.health.record_check(True)  # a probe passed
    adm.engine_checked(engine)
    t = await asyncio.wait_for(queued, 5)
    assert t.placement is engine
    adm.release(t)


async def test_a_request_that_never_reached_its_engine_moves_even_to_a_full_one():
    adm = admission(config([pool("a", "a1", "a2")]))
    t1 = await adm.acquire("carl", None, 5, 5, pool="a")
    t2 = await adm.acquire("alice", None, 5, 5, pool="a")
    assert {t1.placement.name, t2.placement.name} == {"a1", "a2"}
    first = t1.placement
    moved = adm.reroute(t1, [first])
    assert moved is t2.placement and moved.inflight == 2 and first.inflight == 0
    assert adm.reroute(t1, [first, moved]) is None  # no other engine: it holds none
    adm.release(t1)
    adm.release(t2)
    assert all(e.inflight == 0 for e in adm.pools["a"].router.engines.values())


async def test_a_moved_stream_is_awaited_by_its_new_engine_only():
    """The capacity controller's growth is clocked by first tokens while streams await
    them (:class:`proxy.routing.engine_meter.EngineMeter`): a stream moved to another
    engine before it reached its first is awaited there, and no longer by the engine it
    never reached (which would clock that engine's growth for as long as it ran)."""
    adm = admission(config([pool("a", "a1", "a2")]))
    t = await adm.acquire("carl", None, 5, 5, pool="a")
    t.stream = True
    first = t.placement
    first.meter.awaiting(t)
    moved = adm.reroute(t, [first])
    assert moved is not None and moved is not first
    assert first.meter.sample(1.0).awaiting == 0
    assert moved.meter.sample(1.0).awaiting == 1
    adm.release(t)
    assert moved.meter.sample(2.0).awaiting == 0


async def test_a_removed_pool_finishes_its_queue_then_closes():
    cfg = config([pool("a", "a1"), pool("b", "b1")])
    adm = admission(cfg)
    gone = []
    adm.on_engine_removed = gone.append
    held = await adm.acquire("carl", None, 5, 5, pool="b")
    queued = asyncio.create_task(adm.acquire("alice", None, 5, 5, pool="b"))
    await wait_until(lambda: adm.pools["b"].scheduler.queued == 1, what="queued in b")
    new = config([pool("a", "a1")])
    adm.reconfigure(new.to_policy(), new.effective_pools())
    assert list(adm.pools) == ["a"] and [p.name for p in adm.retired] == ["b"]
    with pytest.raises(KeyError):
        await adm.acquire("carl", None, 5, 5, pool="b")  # takes nothing new
    adm.release(held)
    t = await asyncio.wait_for(queued, 5)  # served by its old pool
    assert t.state is TicketState.ADMITTED and t.placement.name == "b1"
    assert not gone
    adm.release(t)
    assert adm.retired == [] and [e.name for e in gone] == ["b1"]


async def test_a_removed_engine_drains_and_leaves():
    adm = admission(config([pool("a", "a1", "a2")]))
    gone = []
    adm.on_engine_removed = gone.append
    t1 = await adm.acquire("carl", None, 5, 5, pool="a")
    t2 = await adm.acquire("alice", None, 5, 5, pool="a")
    on_a2 = t1 if t1.placement.name == "a2" else t2
    new = config([pool("a", "a1", "a3")])
    adm.reconfigure(new.to_policy(), new.effective_pools())
    router = adm.pools["a"].router
    assert router.engines["a2"].draining and not gone
    t3 = await adm.acquire("bob", None, 5, 5, pool="a")
    assert t3.placement.name == "a3"  # never the draining engine
    adm.release(on_a2)
    assert [e.name for e in gone] == ["a2"] and "a2" not in router.engines
    for t in (t1, t2, t3):
        adm.release(t)


async def test_the_status_counts_a_user_of_several_pools_once():
    adm = admission(config([pool("a", "a1"), pool("b", "b1")]))
    for u, p in (("carl", "a"), ("carl", "b"), ("dana", "a")):  # (one slot per pool)
        adm.release(await adm.acquire(u, None, 5, 5, pool=p))
    held = await adm.acquire("erin", None, 5, 5, pool="b")
    assert [p.scheduler.users_tracked for p in adm.pools.values()] == [2, 2]
    snap = adm.snapshot()
    assert snap["users_total"] == 3  # carl, tracked by both pools, once
    assert sorted(u["user"] for u in snap["users"]) == ["carl", "dana", "erin"]
    assert snap["inflight"] == 1
    adm.release(held)
