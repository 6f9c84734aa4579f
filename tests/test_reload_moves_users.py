"""Through the proxy: a reload that removes a user moves its waiting requests to the
default group at once (issue 10), and /admin/status lists the top users only."""

from __future__ import annotations

import asyncio

import yaml

from proxy.runtime.config_watch import reload_config
from tests.conftest import wait_until

ADMIN = {"Authorization": "Bearer sk-admin"}


async def test_a_removed_user_takes_the_default_group_at_once_waiting_requests_included(make_stack, http):
    st = await make_stack(max_inflight=1, preemption={"enabled": False})  # the order of dispatch alone
    sched = st.state.admission.scheduler
    url = st.proxy_url + "/v1/chat/completions"
    busy = asyncio.create_task(http.post(url, json=st.chat_body(3, itl_s=0.3, tag="busy"), headers={"X-User-Id": "carl"}))
    await wait_until(lambda: st.stats.started == 1, what="slot busy")
    # alice (platinum, by her API key) queues three requests, carl (bronze) one
    alice = [asyncio.create_task(http.post(url, json=st.chat_body(1, tag="alice"), headers={"Authorization": "Bearer sk-alice"})) for _ in range(3)]
    await wait_until(lambda: sched.queue_depths()["platinum"] == 3, what="alice queued")
    carl = asyncio.create_task(http.post(url, json=st.chat_body(1, tag="carl"), headers={"X-User-Id": "carl"}))
    await wait_until(lambda: sched.queued == 4, what="carl queued")
    cfg = yaml.safe_load(st.config_path.read_text())
    cfg["groups"][0]["users"] = [u for u in cfg["groups"][0]["users"] if u["id"] != "alice"]
    st.config_path.write_text(yaml.safe_dump(cfg))
    assert reload_config(st.state)
    # alice is now an unknown user of the default group, bronze, her waiting requests too
    assert sched.queue_depths() == {"platinum": 0, "bronze": 4}
    bob = asyncio.create_task(http.post(url, json=st.chat_body(1, tag="bob"), headers={"X-User-Id": "bob"}))
    await wait_until(lambda: sched.queue_depths()["platinum"] == 1, what="bob queued")
    results = await asyncio.gather(busy, *alice, carl, bob)
    for r in results:
        r.release()
    # bob (platinum) goes before all of alice's (with the old rule her requests kept
    # platinum for as long as any waited, and went first)
    assert st.stats.tags[:2] == ["busy", "bob"]
    assert sorted(st.stats.tags[2:]) == ["alice", "alice", "alice", "carl"]


async def test_admin_status_lists_the_top_users_and_counts_all(make_stack, http):
    cfg = None
    st = await make_stack(max_inflight=4)
    cfg = yaml.safe_load(st.config_path.read_text())
    cfg["admin"] = {"api_key": "sk-admin"}
    st.config_path.write_text(yaml.safe_dump(cfg))
    assert reload_config(st.state)
    for i in range(30):
        async with http.post(st.proxy_url + "/v1/chat/completions", json=st.chat_body(1 + i), headers={"X-User-Id": f"u{i}"}) as r:
            assert r.status == 200
    async with http.get(st.proxy_url + "/admin/status", headers=ADMIN) as r:
        body = await r.json()
    assert body["users_total"] == 30 and len(body["users"]) == 20
    assert body["users"][0]["user"] == "u29"  # the most recent service first
    async with http.get(st.proxy_url + "/admin/status?top=3", headers=ADMIN) as r:
        assert [u["user"] for u in (await r.json())["users"]] == ["u29", "u28", "u27"]
    async with http.get(st.proxy_url + "/admin/status?top=many", headers=ADMIN) as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "top"
