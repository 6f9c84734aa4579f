"""The engine's load signal: the scheduler's capacity limit, the parsers of LightLLM's
``/token_load`` and vLLM's / SGLang's ``/metrics``, the polling task (in process, against
real servers), and the whole thing through the real proxy process in front of the LightLLM
stand-in."""

from __future__ import annotations

import asyncio
import math

import aiohttp
import pytest
import yaml
from aiohttp import web

from bench.fake_upstream import STATS, make_app
from proxy.api.app import create_app
from proxy.config.schema import LoadSignalConfig
from proxy.config.loading import ConfigError, parse_config
from proxy.api.handlers import STATE
from proxy.runtime.load_report import (
    NoSignal,
    Reading,
    capacity_for,
    is_repeat,
    is_saturated,
    parse_prometheus,
    parse_token_load,
)
from proxy.runtime.load_signal import LOAD_SIGNAL
from qos import GroupPolicy, Scheduler, SchedulerPolicy, TicketState
from tests.conftest import wait_until
from tests.engine_fixture import free_port
from tests.lightllm_wire import WireConfig, WireThread
from tests.proxy_process import start_proxy, stop_proxy

# ------------------------------------------------------- Scheduler.set_capacity_limit


def _scheduler(max_inflight: int = 4) -> tuple[Scheduler, list]:
    admitted: list = []
    policy = SchedulerPolicy(groups=(GroupPolicy("g"),), default_group="g", max_inflight=max_inflight, queue_timeout_s=60)
    t = [0.0]
    return Scheduler(policy, clock=lambda: t[0], on_admit=admitted.append), admitted


def test_capacity_limit_holds_new_dispatches_but_never_stalls():
    s, admitted = _scheduler(4)
    a = s.submit("u", None, 10, 10)
    s.set_capacity_limit(1)
    assert s.capacity == 1
    b, c = s.submit("u", None, 10, 10), s.submit("v", None, 10, 10)
    assert b.state is c.state is TicketState.QUEUED  # one in flight: hold
    s.release(a)
    # nothing in flight: one goes (which one is the fair queue's choice: v, not served yet)
    first, second = (b, c) if b.state is TicketState.ADMITTED else (c, b)
    assert first.state is TicketState.ADMITTED and second.state is TicketState.QUEUED
    s.set_capacity_limit(None)
    assert second.state is TicketState.ADMITTED and s.capacity == 4  # lifting dispatches at once
    assert admitted == [a, first, second]


def test_capacity_limit_with_requests_already_in_flight_lets_them_finish():
    s, _ = _scheduler(3)
    flying = [s.submit("u", None, 1, 1) for _ in range(3)]
    s.set_capacity_limit(1)
    queued = s.submit("u", None, 1, 1)
    for t in flying[:2]:
        s.release(t)
        assert queued.state is TicketState.QUEUED  # 1 still in flight >= limit 1
    s.release(flying[2])
    assert queued.state is TicketState.ADMITTED


def test_capacity_limit_never_raises_above_max_inflight_and_survives_policy_updates():
    s, _ = _scheduler(2)
    s.set_capacity_limit(10)
    assert s.capacity == 2
    s.set_capacity_limit(1)
    s.update_policy(SchedulerPolicy(groups=(GroupPolicy("g"),), default_group="g", max_inflight=6))
    assert s.capacity == 1
    assert s.snapshot()["capacity"] == 1
    with pytest.raises(ValueError):
        s.set_capacity_limit(0)


# ------------------------------------------------------------------------ parsers


def test_token_load_is_the_larger_of_current_and_dynamic():
    r = parse_token_load(b'{"current_load":0.25,"logical_max_load":0.9,"dynamic_max_load":0.9}')
    assert r == Reading(load=0.9, waiting=None, engine="lightllm")
    r = parse_token_load(b'{"current_load": 0.97, "logical_max_load": 0.5, "dynamic_max_load": 0.5}')
    assert r.load == 0.97


def test_token_load_with_data_parallel_ranks_is_saturated_only_when_all_are():
    r = parse_token_load(b'{"current_load":[0.1,0.99],"logical_max_load":[0.2,0.99],"dynamic_max_load":[0.2,0.99]}')
    assert r.load == 0.2


@pytest.mark.parametrize("body", [b"oops", b"[1,2]", b'{"x": 1}', b'{"current_load": "high"}'])
def test_token_load_garbage_is_no_signal(body):
    with pytest.raises(NoSignal):
        parse_token_load(body)


VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B"} 12.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B"} 3.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B"} 0.97
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B"} 0.42
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B"} 0.0
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B"} 1234.0
"""

SGLANG = """\
# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="Qwen/Qwen2.5-7B"} 0.0
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="Qwen/Qwen2.5-7B"} 0.96
sglang:num_running_reqs{model_name="Qwen/Qwen2.5-7B"} 40.0
"""


def test_vllm_metrics():
    assert parse_prometheus(VLLM) == Reading(load=0.42, waiting=5, engine="vllm", running=12, work=1234.0)
    old = 'vllm:gpu_cache_usage_perc{model_name="x y}z"} 0.5\nvllm:num_requests_waiting{model_name="x"} 0.0 1700000000000\n'
    assert parse_prometheus(old) == Reading(load=0.5, waiting=0, engine="vllm")


def test_a_report_of_the_same_engine_step_is_a_repeat():
    """vLLM sets its gauges and token counters once per engine step; one step can outlast
    several polls (a full CPU batch, a host short of CPU): the readings it gives meanwhile
    are one observation, not a queue seen twice."""
    first = parse_prometheus(VLLM)
    assert is_repeat(first, parse_prometheus(VLLM))
    stepped = parse_prometheus(VLLM + 'vllm:generation_tokens_total{engine="0",model_name="m"} 12.0\n')
    assert stepped.work == 1246.0 and not is_repeat(first, stepped)
    idle = parse_prometheus(VLLM.replace("} 12.0", "} 0.0").replace("} 3.0", "} 0.0").replace("} 2.0", "} 0.0"))
    assert not is_repeat(idle, idle)  # an idle engine's repeats say nothing either way
    assert not is_repeat(None, first)
    no_counter = Reading(load=0.4, waiting=5, engine="vllm", running=12)
    assert not is_repeat(no_counter, no_counter)  # an engine without counters: every report counts, as before


def test_sglang_metrics():
    assert parse_prometheus(SGLANG) == Reading(load=0.96, waiting=0, engine="sglang", running=40)


@pytest.mark.parametrize(
    "text",
    ["", "# nothing\n", "lightllm_request_count_total 3.0\n", "vllm:num_requests_running 3\n", "vllm:kv_cache_usage_perc NaN\n"],
)
def test_metrics_without_a_load_are_no_signal(text):
    with pytest.raises(NoSignal):
        parse_prometheus(text)


def test_saturation_rules():
    cfg = LoadSignalConfig()
    assert is_saturated(Reading(0.95, None, "lightllm"), cfg)
    assert not is_saturated(Reading(0.94, None, "lightllm"), cfg)
    assert is_saturated(Reading(0.1, 1, "vllm"), cfg)
    assert not is_saturated(Reading(0.1, 0, "vllm"), cfg)
    assert not is_saturated(Reading(0.1, 7, "vllm"), LoadSignalConfig(queue_at=0))
    assert not is_saturated(Reading(None, None, "vllm"), cfg)


def test_capacity_follows_the_room_left_in_the_engine():
    cfg = LoadSignalConfig(saturated_at=0.9)
    assert capacity_for(Reading(0.95, None, "lightllm"), cfg, 7) == 1  # saturated: hold
    assert capacity_for(Reading(0.45, None, "lightllm"), cfg, 9) == 9 + 9  # 0.05 each, 0.45 left up to 0.9
    assert capacity_for(Reading(0.85, None, "lightllm"), cfg, 1) == 2  # someone else's load: one more
    assert capacity_for(Reading(0.3, None, "lightllm"), cfg, 0) is None  # nothing of ours to measure by
    assert capacity_for(Reading(None, 0, "vllm"), cfg, 3) is None
    assert capacity_for(Reading(0.0, 0, "vllm"), cfg, 3) is None


def _with_signal(signal: dict | None) -> str:
    up: dict = {"url": "http://127.0.0.1:9", "kind": "lightllm"}
    if signal is not None:
        up["load_signal"] = signal
    return yaml.safe_dump({"upstream": up, "default_group": "g", "groups": [{"name": "g"}]})


def test_config_defaults_and_validation():
    cfg = parse_config(_with_signal(None)).upstream.load_signal
    assert (cfg.enabled, cfg.interval_s, cfg.saturated_at, cfg.queue_at, cfg.stale_after_s) == ("auto", 0.5, 0.95, 1, 3.0)
    assert parse_config(_with_signal({"enabled": True})).upstream.load_signal.enabled is True
    assert parse_config(_with_signal({"enabled": False})).upstream.load_signal.enabled is False
    for bad in ({"enabled": "sometimes"}, {"saturated_at": 1.5}, {"interval_s": 2, "stale_after_s": 1}, {"poll": 1}):
        with pytest.raises(ConfigError):
            parse_config(_with_signal(bad))


# ------------------------------------------- the polling task, in process, real sockets


class MetricsUpstream:
    """The fake OpenAI upstream plus a ``/metrics`` whose text and status the test sets."""

    def __init__(self, text: str = "", status: int = 200) -> None:
        self.text, self.status, self.hits = text, status, 0
        self.stepping = False  # True: every answer adds a generated token (the engine stepped)
        self.app = make_app()
        self.app.router.add_get("/metrics", self._metrics)

    async def _metrics(self, request: web.Request) -> web.Response:
        self.hits += 1
        if self.status != 200:
            return web.Response(status=self.status, text="no")
        text = self.text
        if self.stepping:
            text += f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {self.hits}.0\n'
        return web.Response(text=text, content_type="text/plain")


async def _proxy_in_process(aiohttp_server, upstream_url: str, signal: dict, max_inflight: int = 4):
    cfg = {
        "upstream": {"url": upstream_url, "kind": "openai", "load_signal": signal},
        # the load signal's hold of a fixed capacity (an adaptive one: tests/test_capacity_control.py)
        "admission": {"max_inflight": max_inflight, "queue_timeout_s": 20, "capacity": {"mode": "fixed"}},
        "default_group": "g",
        "groups": [{"name": "g"}],
    }
    app = create_app(parse_config(yaml.safe_dump(cfg)))
    server = await aiohttp_server(app)
    return app, str(server.make_url("")).rstrip("/")


FAST = {"interval_s": 0.05, "stale_after_s": 0.5}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "fake": {"itl_s": 0.04}}


async def test_vllm_queue_holds_admissions_until_it_drains(aiohttp_server):
    up = MetricsUpstream(VLLM)
    upstream = await aiohttp_server(up.app)
    app, url = await _proxy_in_process(aiohttp_server, str(upstream.make_url("")).rstrip("/"), FAST)
    sig, sched, stats = app[LOAD_SIGNAL], app[STATE].admission.scheduler, up.app[STATS]
    await wait_until(lambda: sig.saturated, what="saturation seen")
    assert sched.capacity == 1
    async with aiohttp.ClientSession() as s:
        tasks = [asyncio.create_task(s.post(url + "/v1/chat/completions", json=CHAT)) for _ in range(3)]
        await wait_until(lambda: stats.started == 1 and sched.queued == 2, what="one sent, two held")
        for _ in range(30):  # 0.3 s: one at a time, never none
            assert stats.active <= 1 and sched.queued + len(sched.inflight) + stats.completed >= 3
            await asyncio.sleep(0.01)
        up.text = VLLM.replace("} 3.0", "} 0.0").replace("} 2.0", "} 0.0")
        await wait_until(lambda: not sig.saturated, what="saturation over")
        for t in tasks:
            r = await t
            assert r.status == 200
            await r.read()
    assert stats.completed == 3
    await wait_until(lambda: sched.capacity == 4, what="no limit once nothing of ours is in flight")


async def test_one_engine_step_read_again_is_not_a_queue_seen_twice(aiohttp_server):
    """An engine step longer than the poll interval gives the same report to several
    polls (its token counters unmoved): the capacity controller takes it once, so requests
    waiting in that one step are no queue; the same figures over steps that did work are."""
    up = MetricsUpstream(VLLM)  # 12 running, 5 waiting: past any batch seen
    upstream = await aiohttp_server(up.app)
    cfg = {
        "upstream": {"url": str(upstream.make_url("")).rstrip("/"), "kind": "openai", "load_signal": FAST},
        "admission": {"queue_timeout_s": 20},
        "default_group": "g",
        "groups": [{"name": "g"}],
    }
    app = create_app(parse_config(yaml.safe_dump(cfg)))
    await aiohttp_server(app)
    pool = next(iter(app[STATE].admission.pools.values()))
    control = next(iter(pool.router.engines.values())).control
    polls = up.hits
    await wait_until(lambda: up.hits >= polls + 10, what="ten polls of one engine step")
    assert not control.decreases
    up.stepping = True  # each poll now reports a step that did work
    await wait_until(lambda: control.decreases.get("engine_queue", 0) >= 1, what="the queue seen over two steps")


async def test_sglang_token_usage_saturates(aiohttp_server):
    up = MetricsUpstream(SGLANG)
    upstream = await aiohttp_server(up.app)
    app, _ = await _proxy_in_process(aiohttp_server, str(upstream.make_url("")).rstrip("/"), FAST)
    await wait_until(lambda: app[LOAD_SIGNAL].saturated, what="saturation seen")
    assert app[LOAD_SIGNAL].reading == Reading(0.96, 0, "sglang", running=40)
    up.text = SGLANG.replace("0.96", "0.5")
    await wait_until(lambda: not app[LOAD_SIGNAL].saturated, what="saturation over")


async def test_failed_polls_fall_back_to_max_inflight_once_stale(aiohttp_server):
    up = MetricsUpstream(VLLM)
    upstream = await aiohttp_server(up.app)
    app, _ = await _proxy_in_process(aiohttp_server, str(upstream.make_url("")).rstrip("/"), FAST)
    sig, sched = app[LOAD_SIGNAL], app[STATE].admission.scheduler
    await wait_until(lambda: sig.saturated, what="saturation seen")
    up.status = 503
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await wait_until(lambda: not sig.saturated, timeout=3, what="hold lifted")
    assert loop.time() - t0 >= 0.3  # the last good reading counted until it went stale
    assert sched.capacity == 4 and sig.polls["error"] >= 1


async def test_auto_stops_polling_an_upstream_without_load_metrics(aiohttp_server):
    up = MetricsUpstream(status=404)  # a hosted API, transformers serve
    upstream = await aiohttp_server(up.app)
    app, _ = await _proxy_in_process(aiohttp_server, str(upstream.make_url("")).rstrip("/"), FAST)
    await wait_until(lambda: app[LOAD_SIGNAL].no_signal, what="no signal noticed")
    await asyncio.sleep(0.4)  # eight intervals
    assert up.hits == 1 and not app[LOAD_SIGNAL].saturated


async def test_disabled_never_polls_and_a_reload_can_turn_it_on(aiohttp_server):
    up = MetricsUpstream(VLLM)
    upstream = await aiohttp_server(up.app)
    app, url = await _proxy_in_process(aiohttp_server, str(upstream.make_url("")).rstrip("/"), {**FAST, "enabled": False})
    await asyncio.sleep(0.3)
    assert up.hits == 0 and not app[LOAD_SIGNAL].saturated
    state = app[STATE]
    cfg = state.active.config
    on = cfg.model_copy(update={"upstream": cfg.upstream.model_copy(update={"load_signal": LoadSignalConfig(**FAST, enabled=True)})})
    state.apply(on)
    await wait_until(lambda: app[LOAD_SIGNAL].saturated, what="saturation seen after the reload")
    state.apply(cfg)
    await wait_until(lambda: not app[LOAD_SIGNAL].saturated, what="hold lifted when switched off")
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    assert "llm_qos_upstream_saturated 0.0" in text and 'llm_qos_load_signal_polls_total{result="ok"}' in text


# ------------------------------------ through the real proxy process, LightLLM stand-in


@pytest.fixture(scope="module")
def lightllm():
    # budget 200 tokens: a request of prompt 2 + 40 new reserves 21% of it
    with WireThread(WireConfig(max_total_token_num=200, max_req_total_len=200, disconnect_poll_s=0.1)) as w:
        yield w


@pytest.fixture(scope="module")
def proxied(lightllm, tmp_path_factory):
    cfg = {
        "upstream": {"url": lightllm.url, "kind": "lightllm", "load_signal": {"interval_s": 0.1, "stale_after_s": 1.0, "saturated_at": 0.8}},
        "admission": {"max_inflight": 8, "max_queue": 50, "queue_timeout_s": 30},
        "default_group": "g",
        "groups": [{"name": "g"}],
    }
    path = tmp_path_factory.mktemp("load") / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = free_port()
    proc = start_proxy(path, port)
    yield f"http://127.0.0.1:{port}"
    assert stop_proxy(proc) == 0


@pytest.fixture(autouse=True)
def _fresh(request):
    if "lightllm" in request.fixturenames:
        w = request.getfixturevalue("lightllm")
        w.set_token_load(None)
        w.reset()


async def gauge(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return math.nan


async def until_gauge(url: str, name: str, value: float, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (v := await gauge(url, name)) != value:
        assert loop.time() < deadline, f"{name} is {v}, never became {value}"
        await asyncio.sleep(0.05)


def gen(n: int, itl_s: float = 0.02) -> dict:
    return {"inputs": "hi", "parameters": {"max_new_tokens": n}, "wire": {"itl_s": itl_s}}


async def test_reported_saturation_holds_new_requests_in_the_proxy(proxied, lightllm):
    lightllm.set_token_load({"current_load": 0.5, "logical_max_load": 0.97, "dynamic_max_load": 0.97})
    await until_gauge(proxied, "llm_qos_upstream_saturated", 1.0)
    async with aiohttp.ClientSession() as s:
        tasks = [asyncio.create_task(s.post(proxied + "/generate_stream", json=gen(10))) for _ in range(4)]
        await wait_until(lambda: lightllm.stats.started == 1, what="one request through")
        await asyncio.sleep(0.5)
        assert lightllm.stats.max_running == 1  # one at a time while saturated, never none
        lightllm.set_token_load(None)  # back to the real (small) load
        await until_gauge(proxied, "llm_qos_upstream_saturated", 0.0)
        for t in tasks:
            r = await t
            assert r.status == 200
            assert (await r.read()).count(b'"finished":true') == 1
    assert lightllm.stats.completed == 4


@pytest.mark.parametrize("failure", [{"status": 500}, {"hang_s": 5}])
async def test_a_failing_token_load_falls_back_to_latency_and_capacity_grows_again(proxied, lightllm, failure):
    """The capacity controller (adaptive, the default) held the engine at what it ran while
    saturated; once the readings fail and go stale it is steered by latency alone, and the
    demand of waiting requests grows it again: it never stays collapsed."""
    lightllm.set_token_load({"current_load": 0.99, "dynamic_max_load": 0.99})
    await until_gauge(proxied, "llm_qos_upstream_saturated", 1.0)
    lightllm.set_token_load({"current_load": 0.99, "dynamic_max_load": 0.99, **failure})
    await until_gauge(proxied, "llm_qos_upstream_saturated", 0.0, timeout=4.0)  # stale after 1 s
    async with aiohttp.ClientSession() as s:
        tasks = [asyncio.create_task(s.post(proxied + "/generate", json=gen(20, itl_s=0.25))) for _ in range(3)]
        await wait_until(lambda: lightllm.stats.running == 3, what="all three at once again")
        for t in tasks:
            r = await t
            assert r.status == 200
            await r.read()
    lightllm.set_token_load(None)


async def test_real_token_load_keeps_lightllm_own_queue_empty(proxied, lightllm):
    """Four requests fill 84% of the KV budget; the proxy sees it and keeps the next three
    in its own queue instead of LightLLM's FIFO."""
    await until_gauge(proxied, "llm_qos_upstream_load", 0.0)  # fresh readings again
    async with aiohttp.ClientSession() as s:
        first = [asyncio.create_task(s.post(proxied + "/generate", json=gen(40))) for _ in range(4)]
        await wait_until(lambda: lightllm.stats.running == 4, what="four running")
        await until_gauge(proxied, "llm_qos_upstream_saturated", 1.0)
        later = [asyncio.create_task(s.post(proxied + "/generate", json=gen(40))) for _ in range(3)]
        await asyncio.sleep(0.2)
        assert lightllm.stats.started == 4  # held in the proxy
        for t in first + later:
            r = await t
            assert r.status == 200
            await r.read()
    assert lightllm.stats.completed == 7
    assert lightllm.stats.had_to_wait == 0  # nothing ever queued inside LightLLM


@pytest.fixture(scope="module")
def lightllm_dp():
    """LightLLM v1.2.0 with ``--dp 2``: ``/token_load`` answers a list per rank."""
    with WireThread(WireConfig(dp=2, max_total_token_num=400, max_req_total_len=200, disconnect_poll_s=0.1)) as w:
        yield w


@pytest.fixture(scope="module")
def proxied_dp(lightllm_dp, tmp_path_factory):
    cfg = {
        "upstream": {"url": lightllm_dp.url, "kind": "lightllm", "load_signal": {"interval_s": 0.1, "stale_after_s": 1.0, "saturated_at": 0.8}},
        "admission": {"max_inflight": 16, "max_queue": 50, "queue_timeout_s": 30},
        "default_group": "g",
        "groups": [{"name": "g"}],
    }
    path = tmp_path_factory.mktemp("load-dp") / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = free_port()
    proc = start_proxy(path, port)
    yield f"http://127.0.0.1:{port}"
    assert stop_proxy(proc) == 0


async def test_data_parallel_real_load_keeps_lightllm_own_queue_empty(proxied_dp, lightllm_dp):
    """Eight requests fill 82% of both ranks' KV budgets; the next three wait in the proxy.
    (Before the saturation test of the same proxy: a report of a full cache leaves the
    capacity growing one request per step for a while, TCP's congestion avoidance.)"""
    lightllm_dp.set_token_load(None)
    lightllm_dp.reset()
    await until_gauge(proxied_dp, "llm_qos_upstream_load", 0.0)
    async with aiohttp.ClientSession() as s:
        first = [asyncio.create_task(s.post(proxied_dp + "/generate", json=gen(40))) for _ in range(8)]
        await wait_until(lambda: lightllm_dp.stats.running == 8, what="eight running")
        await until_gauge(proxied_dp, "llm_qos_upstream_saturated", 1.0)
        later = [asyncio.create_task(s.post(proxied_dp + "/generate", json=gen(40))) for _ in range(3)]
        await asyncio.sleep(0.2)
        assert lightllm_dp.stats.started == 8  # held in the proxy
        for t in first + later:
            r = await t
            assert r.status == 200
            await r.read()
    assert lightllm_dp.stats.completed == 11 and lightllm_dp.stats.had_to_wait == 0


async def test_data_parallel_token_load_saturates_only_when_every_rank_is_full(proxied_dp, lightllm_dp):
    lightllm_dp.set_token_load({"current_load": [0.99, 0.1], "logical_max_load": [0.99, 0.1], "dynamic_max_load": [0.99, 0.1]})
    await until_gauge(proxied_dp, "llm_qos_upstream_load", 0.1)  # one rank has room: the engine takes work
    assert await gauge(proxied_dp, "llm_qos_upstream_saturated") == 0.0
    lightllm_dp.set_token_load({"current_load": [0.99, 0.9], "logical_max_load": [0.99, 0.95], "dynamic_max_load": [0.99, 0.95]})
    await until_gauge(proxied_dp, "llm_qos_upstream_saturated", 1.0)
    assert await gauge(proxied_dp, "llm_qos_upstream_load") == 0.95
    lightllm_dp.set_token_load(None)
