"""The dashboard's JSON through real sockets, and its pieces: quantiles of a cumulative
histogram, the scheduler's per-group service and active weight."""

from __future__ import annotations

import asyncio
import math

import pytest
import yaml

from proxy.api import dashboard_data
from proxy.runtime.config_watch import reload_config
from proxy.api.dashboard_samples import bucket_quantile
from qos import GroupPolicy, Scheduler, SchedulerPolicy, UserPolicy
from tests.conftest import base_config, wait_until

ADMIN = {"Authorization": "Bearer adm-1"}


def test_bucket_quantile_interpolates_like_histogram_quantile():
    # 10 observations: 4 in (0, 0.1], 4 in (0.1, 1], 2 above 1
    buckets = [(0.1, 4.0), (1.0, 8.0), (math.inf, 10.0)]
    assert bucket_quantile(0.2, buckets) == pytest.approx(0.05)  # rank 2 of 4 in the first bucket
    assert bucket_quantile(0.5, buckets) == pytest.approx(0.1 + 0.9 * 1 / 4)  # rank 5: 1 of 4 into (0.1, 1]
    assert bucket_quantile(0.95, buckets) == 1.0  # in the +Inf bucket: the highest finite bound
    assert bucket_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_the_snapshot_gives_each_groups_service_and_active_weight():
    """What the dashboard's user shares are read against: per group the decayed service
    of every user, and the weight of the users active (served lately, or waiting)."""
    clock = Clock()
    policy = SchedulerPolicy(
        groups=(GroupPolicy("g"),),
        default_group="g",
        users={"a": UserPolicy("a", "g", 3.0), "b": UserPolicy("b", "g", 1.0)},
        max_inflight=4,
        share_window_s=10.0,
    )
    s = Scheduler(policy, clock=clock)
    for user, out in (("a", 30), ("b", 10)):
        t = s.submit(user, None, 10, out)
        s.release(t, 10, out)
    g = s.snapshot()["groups"][0]
    cost = policy.cost
    assert g["recent_service"] == pytest.approx(cost.cost(10, 30) + cost.cost(10, 10), rel=1e-3)
    assert g["active_weight"] == 4.0
    top = s.snapshot(top_users=1)["users"]
    assert [u["user"] for u in top] == ["a"] and top[0]["recent_service"] == pytest.approx(cost.cost(10, 30), rel=1e-3)
    clock.t += 10.0  # one time constant later: decayed by e
    assert s.snapshot()["groups"][0]["recent_service"] == pytest.approx(g["recent_service"] / math.e, rel=1e-3)
    clock.t += 200.0  # long idle: nobody is active any more
    assert s.snapshot()["groups"][0]["active_weight"] == 0.0


async def test_dashboard_json_needs_the_admin_key_and_lists_groups_and_engines(make_stack, http, monkeypatch):
    monkeypatch.delenv("LLM_QOS_ADMIN_KEY", raising=False)
    st = await make_stack()
    async with http.get(st.proxy_url + "/admin/dashboard.json") as r:
        assert r.status == 403 and (await r.json())["error"]["code"] == "admin_disabled"
    async with http.get(st.proxy_url + "/admin/dashboard") as r:  # the page still loads, and says so
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/html")
    monkeypatch.setenv("LLM_QOS_ADMIN_KEY", "adm-1")
    async with http.get(st.proxy_url + "/admin/dashboard.json", headers=ADMIN) as r:
        assert r.status == 200 and r.headers["Cache-Control"] == "no-store"
        d = await r.json()
    assert [g["name"] for g in d["groups"]] == ["platinum", "bronze"]
    assert [e["name"] for e in d["engines"]] == ["upstream"] and d["engines"][0]["url"] == st.upstream_url
    for path in ("/admin/dashboard.js", "/admin/dashboard.css"):
        async with http.get(st.proxy_url + path) as r:
            assert r.status == 200 and "Content-Security-Policy" in r.headers


async def test_dashboard_json_counts_service_and_follows_a_reload(make_stack, http, monkeypatch):
    monkeypatch.setenv("LLM_QOS_ADMIN_KEY", "adm-1")
    st = await make_stack()

    async def data() -> dict:
        async with http.get(st.proxy_url + "/admin/dashboard.json", headers=ADMIN) as r:
            return await r.json()

    await data()  # the first sample: rates count from here
    for key, n in (("sk-alice", 10), ("sk-carl", 10), ("sk-carl", 10)):
        async with http.post(st.proxy_url + "/v1/chat/completions", json=st.chat_body(n), headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status == 200
            await r.read()
    d = await data()
    share = {g["name"]: g["service_share"] for g in d["groups"]}
    assert share["bronze"] == pytest.approx(2 / 3, abs=0.05) and share["platinum"] == pytest.approx(1 / 3, abs=0.05)
    users = {u["id"]: u for u in d["users"]["top"]}
    assert users["carl"]["service_share"] == 1.0 and users["carl"]["weight_share"] == 1.0
    assert users["alice"]["group"] == "platinum" and users["alice"]["weight_share"] == 1.0  # bob was not active
    cfg = yaml.safe_load(st.config_path.read_text())
    cfg["groups"].insert(1, {"name": "gold", "min_share": 0.3})
    st.config_path.write_text(yaml.safe_dump(cfg))
    assert reload_config(st.state)
    await wait_until(lambda: st.state.active.config.groups[1].name == "gold", what="reload")
    d = await data()
    assert [(g["name"], g["min_share"]) for g in d["groups"]] == [("platinum", 0.0), ("gold", 0.3), ("bronze", 0.0)]


async def test_history_is_sampled_without_a_page_and_a_new_tab_gets_it_at_once(make_stack, http, monkeypatch):
    """No page open while traffic passes; the first request for the data then holds full
    rates (not 'filling') and every chart point sampled meanwhile, at most HISTORY_POINTS
    of them; later requests get only newer points; engines carry their routed and failed
    counts and latency fields; the last reload's result is there."""
    monkeypatch.setenv("LLM_QOS_ADMIN_KEY", "adm-1")
    monkeypatch.setattr(dashboard_data, "SAMPLE_INTERVAL_S", 0.05)
    monkeypatch.setattr(dashboard_data, "WINDOW_S", 0.5)
    monkeypatch.setattr(dashboard_data, "POINT_RATE_S", 0.2)
    monkeypatch.setattr(dashboard_data, "HISTORY_POINTS", 12)
    st = await make_stack()

    async def data(query: str = "") -> dict:
        async with http.get(st.proxy_url + "/admin/dashboard.json" + query, headers=ADMIN) as r:
            assert r.status == 200
            return await r.json()

    for _ in range(6):
        async with http.post(st.proxy_url + "/v1/chat/completions", json=st.chat_body(20, itl_s=0.01), headers={"Authorization": "Bearer sk-carl"}) as r:
            assert r.status == 200
            await r.read()
    await asyncio.sleep(0.8)  # the sampler's own time passes: at least 16 samples, over the window
    d = await data()
    assert d["covered_s"] >= d["window_s"] == 0.5  # full rates at once, not "filling"
    h = d["history"]
    assert h["full"] and h["max_points"] == 12 and h["interval_s"] == 0.05
    seqs = [p["seq"] for p in h["points"]]
    assert len(seqs) == 12 and seqs == list(range(seqs[0], seqs[0] + 12)) and seqs[0] > 1  # bounded: the oldest dropped
    assert all(set(p["engines"]) == {"default/" + st.upstream_url} for p in h["points"])
    assert all(set(p["engines"]["default/" + st.upstream_url]) == {"inflight", "ttft_s", "tpot_s"} for p in h["points"])
    assert [e["routed"] for e in d["engines"]] == [6] and [e["failed"] for e in d["engines"]] == [0]
    assert {"ttft_s", "tpot_s", "routed_per_s", "failed_per_s", "id"} <= set(d["engines"][0])
    assert d["reload"]["result"] == "start-up" and d["reload"]["error"] is None

    later = (await data(f"?since={seqs[-1]}&history={h['id']}"))["history"]
    assert not later["full"] and all(p["seq"] > seqs[-1] for p in later["points"])
    assert (await data(f"?since={seqs[-1]}&history=another-process"))["history"]["full"]

    st.config_path.write_text("groups: [")
    assert not reload_config(st.state)
    r = (await data())["reload"]
    assert r["result"] == "error" and r["error"] and r["errors"] == 1
    cfg = base_config(st.upstream_url, max_queue=50)
    st.config_path.write_text(yaml.safe_dump(cfg))
    assert reload_config(st.state)
    r = (await data())["reload"]
    assert (r["result"], r["error"], r["ok"], r["errors"]) == ("ok", None, 1, 1)


async def test_chart_points_carry_the_traffic_as_it_passed(make_stack, http, monkeypatch):
    """Tokens per second of a group show in the points sampled while its requests ran."""
    monkeypatch.setenv("LLM_QOS_ADMIN_KEY", "adm-1")
    monkeypatch.setattr(dashboard_data, "SAMPLE_INTERVAL_S", 0.05)
    monkeypatch.setattr(dashboard_data, "POINT_RATE_S", 0.2)
    st = await make_stack()
    for _ in range(5):
        async with http.post(st.proxy_url + "/v1/chat/completions", json=st.chat_body(20, itl_s=0.01), headers={"Authorization": "Bearer sk-carl"}) as r:
            await r.read()
    await asyncio.sleep(0.3)
    async with http.get(st.proxy_url + "/admin/dashboard.json", headers=ADMIN) as r:
        points = (await r.json())["history"]["points"]
    assert max(p["tokens_per_s"].get("bronze") or 0.0 for p in points) > 0
    assert all((p["tokens_per_s"].get("platinum") or 0.0) == 0.0 for p in points)


async def test_objectives_show_with_their_attainment_and_in_the_chart_points(make_stack, http, monkeypatch):
    """A group with a TTFT objective its streams miss and a TPOT objective they meet: the
    dashboard's data gives both as /admin/status does, and its chart points follow the
    attainment; a group without objectives is not listed."""
    monkeypatch.setenv("LLM_QOS_ADMIN_KEY", "adm-1")
    monkeypatch.setattr(dashboard_data, "SAMPLE_INTERVAL_S", 0.05)
    cfg = base_config("http://unused")
    cfg["groups"][1].update(ttft_target_s=0.05, tpot_target_s=0.5, tpot_percentile=90)
    st = await make_stack(config=cfg)
    for _ in range(4):
        async with http.post(st.proxy_url + "/v1/chat/completions", json=st.chat_body(6, stream=True, ttft_s=0.1, itl_s=0.01), headers={"Authorization": "Bearer sk-carl"}) as r:
            assert r.status == 200
            await r.read()
    await asyncio.sleep(0.2)
    async with http.get(st.proxy_url + "/admin/dashboard.json", headers=ADMIN) as r:
        d = await r.json()
    async with http.get(st.proxy_url + "/admin/status", headers=ADMIN) as r:
        status = (await r.json())["objectives"]
    obj = d["objectives"]
    assert set(obj) == {"bronze"} and set(obj["bronze"]) == {"ttft", "tpot"}
    ttft, tpot = obj["bronze"]["ttft"], obj["bronze"]["tpot"]
    assert (ttft["overall"]["requests"], ttft["overall"]["attainment"], ttft["met"]) == (4, 0.0, False)
    assert (tpot["overall"]["requests"], tpot["overall"]["attainment"], tpot["met"], tpot["percentile"]) == (4, 1.0, True, 90)
    assert status == obj
    assert d["history"]["points"][-1]["objectives"] == {"bronze": {"ttft": 0.0, "tpot": 1.0}}
