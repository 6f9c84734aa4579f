"""Objective protection and ``on_miss: reject`` through the proxy on real sockets, in front
of the scripted fake engine (bench/fake_upstream.py, its per-request ``fake`` timings), as
tests/test_preemption_process.py builds its stack:

* a group missing its TTFT objective, with a request in flight, holds the lower groups'
  new work first (free slots stay free), then sheds the lowest group's newest waiting
  requests with ``429 objective_protection`` (and a ``Retry-After``), then the next group
  up; the steps are counted and shown in ``/admin/status``;
* a group without objectives above it is neither held nor shed;
* the same through the real proxy process (``python -m proxy proxy``) and the fake
  engine's own process, the group *about to miss* from its live queue (its head waiting
  past half its target behind a lower stream that cannot be preempted);
* ``on_miss: reject`` refuses at once a request whose queue ahead cannot drain within its
  group's TTFT target at the measured drain rate, while a group that serves late queues it.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import yaml

from bench.harness import free_port, start_fake_upstream, stop
from tests.conftest import wait_until
from tests.proxy_process import start_proxy, stop_proxy

STEP_S = 0.4
TARGET_S = 0.3


def _config(groups: list[dict], max_inflight: int = 4, **protection) -> dict:
    return {
        "upstream": {"kind": "openai", "load_signal": {"enabled": False}},
        "admission": {"max_inflight": max_inflight, "capacity": {"mode": "fixed"}, "max_queue": 100, "queue_timeout_s": 20},
        "identity": {"header": "X-User-Id"},
        "admin": {"api_key": "adm"},
        "default_group": groups[-1]["name"],
        "objectives": {"protection": {"step_s": STEP_S, "min_requests": 3, "interval_s": 0.05, "shed_fraction": 0.5, **protection}},
        "groups": groups,
    }


def _body(n: int, stream: bool = False, **fake) -> dict:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": n, "stream": stream, "fake": fake}


async def _post(http: aiohttp.ClientSession, url: str, user: str, body: dict) -> tuple[int, dict, dict, float]:
    """``(status, json body, headers, monotonic time the answer came)``."""
    async with http.post(url + "/v1/chat/completions", json=body, headers={"X-User-Id": user}) as r:
        if body.get("stream"):
            await r.read()
            return r.status, {}, dict(r.headers), time.monotonic()
        return r.status, await r.json(), dict(r.headers), time.monotonic()


async def _status(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(url + "/admin/status", headers={"Authorization": "Bearer adm"}) as r:
        assert r.status == 200
        return (await r.json())["pools"][0]["objective_protection"]


async def _metric(http: aiohttp.ClientSession, url: str, name: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            key, _, value = line.rpartition(" ")
            out[key[len(name) :]] = float(value)
    return out


async def _miss(http, url: str, user: str, n: int = 3) -> None:
    """``n`` streams of ``user`` whose first token comes after 0.5 s: misses of a 0.3 s
    target (the group's recent attainment 0 over ``min_requests``)."""
    res = await asyncio.gather(*(_post(http, url, user, _body(2, stream=True, ttft_s=0.5)) for _ in range(n)))
    assert all(r[0] == 200 for r in res)


async def test_a_missing_group_holds_lower_work_first_then_sheds_the_lowest_groups_newest(make_stack, http):
    groups = [
        {"name": "platinum", "users": [{"id": "alice"}], "ttft_target_s": TARGET_S},
        {"name": "silver", "users": [{"id": "sam"}]},
        {"name": "bronze", "users": [{"id": "carl"}]},
    ]
    st = await make_stack(config=_config(groups))
    sched = st.state.admission.scheduler
    url = st.proxy_url
    await _miss(http, url, "alice")  # their first tokens were late inside the engine: held meanwhile
    await wait_until(lambda: sched.hold_below is None, what="calm once platinum's streams are gone")
    assert (await _status(http, url))["step"] == "none"  # missing, but nothing of platinum there
    # platinum in flight again: 60 tokens 0.05 s apart, 3 s of work on one of 4 slots
    long = asyncio.create_task(_post(http, url, "alice", _body(60, stream=True, itl_s=0.05, tag="p-long")))
    await wait_until(lambda: st.stats.started == 4, what="platinum's long stream at the engine")
    await wait_until(lambda: sched.hold_below == 0, what="the hold below platinum")
    started = st.stats.started
    lower: dict[str, asyncio.Task] = {}
    for name, user in (("s1", "sam"), ("b1", "carl"), ("b2", "carl"), ("b3", "carl")):
        lower[name] = asyncio.create_task(_post(http, url, user, _body(2, tag=name)))
        await wait_until(lambda n=len(lower): sched.queued == n, what=f"{name} queued")
    # step 1: three slots are free, yet the lower groups' new work waits
    assert st.stats.started == started and len(sched.inflight) == 1
    snap = await _status(http, url)
    assert snap["protected"] == "platinum" and snap["held_below"] == "platinum"
    assert snap["risks"][0]["reason"] == "attainment" and snap["risks"][0]["group"] == "platinum"
    # step 3: shed the lowest group's newest first: half of the four (b3, b2), then b1, then s1
    done = {k: await asyncio.wait_for(t, 10) for k, t in lower.items()}
    for name, (status, body, headers, _at) in done.items():
        assert status == 429, name
        assert body["error"]["code"] == "objective_protection" and "platinum" in body["error"]["message"]
        assert int(headers["Retry-After"]) >= 1
    at = {k: v[3] for k, v in done.items()}
    assert max(at["b3"], at["b2"]) < at["b1"] < at["s1"]
    assert at["b1"] - max(at["b3"], at["b2"]) >= STEP_S * 0.8  # one shed per step time
    assert st.stats.started == started  # none of them ever reached the engine
    assert (await asyncio.wait_for(long, 10))[0] == 200
    steps = await _metric(http, url, "llm_qos_protection_steps_total")
    # the hold twice: once while _miss's streams waited inside the engine, once now
    assert {k: v for k, v in steps.items() if v} == {f'{{group="platinum",pool="default",step="{s}"}}': n for s, n in (("hold", 2.0), ("preempt", 1.0), ("shed", 1.0))}
    refused = await _metric(http, url, "llm_qos_protection_refusals_total")
    assert refused['{group="bronze",pool="default",reason="objective_protection"}'] == 3.0
    assert refused['{group="silver",pool="default",reason="objective_protection"}'] == 1.0
    rejections = await _metric(http, url, "llm_qos_rejections_total")
    assert rejections['{group="bronze",reason="objective_protection"}'] == 3.0
    # platinum gone from the pool: protection ends one step time later, lower work flows again
    await wait_until(lambda: sched.hold_below is None, what="protection over")
    assert (await _post(http, url, "carl", _body(2)))[0] == 200
    assert (await _status(http, url))["step"] == "none"


async def test_a_stream_dispatched_at_once_but_waiting_inside_the_engine_is_about_to_miss(make_stack, http):
    """Platinum's stream found a free slot and went at once, but its first token does not
    come (the engine's FIFO, or a batch whose steps outlast the target): its wait runs
    there too, so the lower groups' new work is held though platinum waits in no queue."""
    groups = [
        {"name": "platinum", "users": [{"id": "alice"}], "ttft_target_s": TARGET_S},
        {"name": "bronze", "users": [{"id": "carl"}]},
    ]
    st = await make_stack(config=_config(groups))
    sched = st.state.admission.scheduler
    url = st.proxy_url
    slow = asyncio.create_task(_post(http, url, "alice", _body(2, stream=True, ttft_s=2.0, tag="p-slow")))
    await wait_until(lambda: st.stats.started == 1, what="platinum's stream at the engine")
    assert sched.queued == 0
    await wait_until(lambda: sched.hold_below == 0, what="the hold below platinum")
    snap = await _status(http, url)
    assert snap["protected"] == "platinum" and snap["risks"][0]["reason"] == "queue_wait"
    bronze = asyncio.create_task(_post(http, url, "carl", _body(2, tag="b")))
    await wait_until(lambda: sched.queued == 1, what="bronze held though three slots are free")
    assert st.stats.started == 1
    assert (await asyncio.wait_for(slow, 10))[0] == 200
    assert (await asyncio.wait_for(bronze, 10))[0] in (200, 429)  # served after, or shed meanwhile


async def test_a_group_without_objectives_above_the_protected_one_is_neither_held_nor_shed(make_stack, http):
    groups = [
        {"name": "gold", "users": [{"id": "gina"}]},
        {"name": "silver", "users": [{"id": "sam"}], "ttft_target_s": TARGET_S},
        {"name": "bronze", "users": [{"id": "carl"}]},
    ]
    # 8 slots: gold's burst of 3 below keeps its 3 places from silver for 10 s (the
    # headroom follows the groups above), and silver's own 3 must still go at once
    st = await make_stack(config=_config(groups, max_inflight=8))
    sched = st.state.admission.scheduler
    url = st.proxy_url
    await _miss(http, url, "gina")  # gold is as slow, but has no objective: nothing happens
    await _miss(http, url, "carl")
    assert sched.hold_below is None and (await _status(http, url))["step"] == "none"
    await _miss(http, url, "sam")
    long = asyncio.create_task(_post(http, url, "sam", _body(40, stream=True, itl_s=0.05)))
    await wait_until(lambda: sched.hold_below == 1, what="the hold below silver")
    bronze = asyncio.create_task(_post(http, url, "carl", _body(2)))
    await wait_until(lambda: sched.queued == 1, what="bronze held in the queue")
    # gold, above the protected group, goes at once, every time, while bronze waits
    for _ in range(3):
        status, _b, _h, _at = await asyncio.wait_for(_post(http, url, "gina", _body(2)), 5)
        assert status == 200
    assert sched.queued == 1
    status, body, _h, _at = await asyncio.wait_for(bronze, 10)
    assert status == 429 and body["error"]["code"] == "objective_protection"
    assert (await asyncio.wait_for(long, 10))[0] == 200
    refused = await _metric(http, url, "llm_qos_protection_refusals_total")
    assert not any('group="gold"' in k for k in refused)


async def test_on_miss_reject_refuses_at_once_when_the_queue_ahead_cannot_drain_in_time(make_stack, http):
    groups = [
        {"name": "platinum", "users": [{"id": "alice"}], "ttft_target_s": 0.5, "on_miss": "reject"},
        {"name": "gold", "users": [{"id": "gina"}], "ttft_target_s": 0.5},  # serves late (default)
    ]
    # protection off: only on_miss acts; one slot, each request 0.5 s of work
    st = await make_stack(config=_config(groups, max_inflight=1, enabled=False, min_backlog_s=0.5, drain_window_s=10))
    sched = st.state.admission.scheduler
    url = st.proxy_url
    work = _body(10, itl_s=0.05)
    first = [asyncio.create_task(_post(http, url, "alice", work)) for _ in range(4)]
    await wait_until(lambda: st.stats.started >= 3, timeout=10, what="two requests started from the queue")
    await wait_until(lambda: sched.queue_depths()["platinum"] >= 1, what="one still waiting")
    rate = (await _status(http, url))["drain_rates"]["platinum"]
    assert rate is not None and 1.0 <= rate <= 3.0  # about 2 starts per second of waiting
    t0 = time.monotonic()
    status, body, headers, at = await asyncio.wait_for(_post(http, url, "alice", _body(2)), 5)
    assert status == 429 and at - t0 < 0.3  # at once, not after waiting
    assert body["error"]["code"] == "objective_unreachable" and "platinum" in body["error"]["message"]
    assert 1 <= int(headers["Retry-After"]) <= 10
    # gold asks to be served late: the same queue ahead, it waits and is answered
    gold = asyncio.create_task(_post(http, url, "gina", _body(2)))
    assert all(r[0] == 200 for r in await asyncio.wait_for(asyncio.gather(*first), 15))
    assert (await asyncio.wait_for(gold, 10))[0] == 200
    # nothing ahead: served, whatever the rate
    assert (await _post(http, url, "alice", _body(2)))[0] == 200
    refused = await _metric(http, url, "llm_qos_protection_refusals_total")
    assert refused == {'{group="platinum",pool="default",reason="objective_unreachable"}': 1.0}
    assert (await _status(http, url))["unreachable"] == 1


async def test_in_the_real_proxy_process_a_waiting_head_past_half_its_target_sheds_the_lowest_newest(tmp_path: Path):
    groups = [
        {"name": "platinum", "users": [{"id": "alice"}], "ttft_target_s": 0.4},
        {"name": "silver", "users": [{"id": "sam"}]},
        {"name": "bronze", "users": [{"id": "carl"}]},
    ]
    cfg = _config(groups, max_inflight=1, step_s=0.3)
    up_port, px_port = free_port(), free_port()
    upstream = start_fake_upstream(up_port, tmp_path)
    cfg["upstream"]["url"] = f"http://127.0.0.1:{up_port}"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    try:
        proxy = start_proxy(path, px_port, extra_args=["--no-watch"])
    except BaseException:
        stop(upstream)
        raise
    url = f"http://127.0.0.1:{px_port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:

            async def queued() -> int:
                async with http.get(url + "/admin/status", headers={"Authorization": "Bearer adm"}) as r:
                    return (await r.json())["queued"]

            async def until_queued(n: int) -> None:
                for _ in range(500):
                    if await queued() >= n:
                        return
                    await asyncio.sleep(0.01)
                raise AssertionError(f"{n} never queued")

            # bronze's stream holds the one slot and has shown tokens: it cannot be preempted
            b0 = asyncio.create_task(_post(http, url, "carl", _body(30, stream=True, itl_s=0.1)))
            await asyncio.sleep(0.3)
            lower: dict[str, asyncio.Task] = {}
            for name, user in (("s1", "sam"), ("b1", "carl"), ("b2", "carl")):
                lower[name] = asyncio.create_task(_post(http, url, user, _body(2)))
                await until_queued(len(lower))
            p1 = asyncio.create_task(_post(http, url, "alice", _body(2)))
            done = {k: await asyncio.wait_for(t, 10) for k, t in lower.items()}
            snap = await _status(http, url)
            assert snap["protected"] == "platinum" and snap["risks"][0]["reason"] == "queue_wait"
            for name, (status, body, headers, _at) in done.items():
                assert status == 429 and body["error"]["code"] == "objective_protection", name
                assert int(headers["Retry-After"]) >= 1
            at = {k: v[3] for k, v in done.items()}
            assert max(at["b1"], at["b2"]) < at["s1"]  # half of three (b2, b1) first, silver a step later
            assert (await asyncio.wait_for(p1, 10))[0] == 200 and (await asyncio.wait_for(b0, 10))[0] == 200
            steps = await _metric(http, url, "llm_qos_protection_steps_total")
            assert [steps[f'{{group="platinum",pool="default",step="{s}"}}'] for s in ("hold", "preempt", "shed")] == [1.0, 1.0, 1.0]
    finally:
        stop_proxy(proxy)
        stop(upstream)
