"""Latency objectives end to end: a real proxy process in front of the fake upstream
(bench/fake_upstream.py, its own process), one group whose requests meet their TTFT
target and one whose first token the upstream delays past it; /metrics and
/admin/status report each, per engine and overall; a reload changes a target."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from pathlib import Path

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import free_port, start_fake_upstream, stop
from tests.proxy_process import start_proxy, stop_proxy

ADMIN = {"Authorization": "Bearer sk-admin"}
ITL_S = 0.01  # the fake upstream's gap between a stream's tokens


def _config(upstream_url: str, slow_target_s: float = 0.3) -> dict:
    return {
        "upstream": {"url": upstream_url, "kind": "openai", "load_signal": {"enabled": False}},
        "admission": {"max_inflight": 32, "capacity": {"mode": "fixed"}},
        "identity": {"header": "X-User-Id"},
        "admin": {"api_key": "sk-admin"},
        "default_group": "plain",
        "objectives": {"window_s": 60},
        "groups": [
            {"name": "fast", "users": [{"id": "f"}], "ttft_target_s": 0.3, "tpot_target_s": 0.05, "tpot_percentile": 90},
            {"name": "slow", "users": [{"id": "s"}], "ttft_target_s": slow_target_s},
            {"name": "plain", "users": [{"id": "p"}]},
        ],
    }


@contextlib.contextmanager
def _stack():
    with tempfile.TemporaryDirectory(prefix="llm-qos-objectives-") as d:
        tmp = Path(d)
        up_port, px_port = free_port(), free_port()
        upstream = start_fake_upstream(up_port, tmp, itl_s=ITL_S)
        url = f"http://127.0.0.1:{up_port}"
        path = tmp / "config.yaml"
        path.write_text(yaml.safe_dump(_config(url)))
        try:
            proxy = start_proxy(path, px_port, extra_args=["--no-watch"])
        except BaseException:
            stop(upstream)
            raise
        try:
            yield f"http://127.0.0.1:{px_port}", path, url
        finally:
            stop_proxy(proxy)
            stop(upstream)


async def _chat(http: aiohttp.ClientSession, url: str, user: str, stream: bool = True, **fake) -> None:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "stream": stream}
    if fake:
        body["fake"] = fake
    async with http.post(url + "/v1/chat/completions", json=body, headers={"X-User-Id": user}) as r:
        assert r.status == 200
        await r.read()


async def _series(http: aiohttp.ClientSession, url: str) -> dict[tuple[str, tuple], float]:
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith("llm_qos_objective_"):
            for s in fam.samples:
                out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k in ("group", "objective"))))] = s.value
    return out


async def _status(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(url + "/admin/status", headers=ADMIN) as r:
        assert r.status == 200
        return (await r.json())["objectives"]


def _key(name: str, group: str, objective: str) -> tuple[str, tuple]:
    return (name, (("group", group), ("objective", objective)))


async def test_one_group_meets_its_ttft_target_and_the_other_misses_it():
    with _stack() as (url, path, upstream_url):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            await asyncio.gather(
                *(_chat(http, url, "f") for _ in range(8)),
                *(_chat(http, url, "s", ttft_s=0.6) for _ in range(6)),
                *(_chat(http, url, "p") for _ in range(3)),
                _chat(http, url, "s", stream=False, ttft_s=0.6),  # not a stream: not measured
            )
            m = await _series(http, url)
            assert m[_key("llm_qos_objective_target_seconds", "fast", "ttft")] == 0.3
            assert m[_key("llm_qos_objective_goal_ratio", "fast", "tpot")] == 0.9
            assert m[_key("llm_qos_objective_attainment_ratio", "fast", "ttft")] == 1.0
            assert m[_key("llm_qos_objective_requests", "fast", "ttft")] == 8
            assert m[_key("llm_qos_objective_attainment_ratio", "slow", "ttft")] == 0.0
            assert m[_key("llm_qos_objective_requests", "slow", "ttft")] == 6
            assert 0.55 <= m[_key("llm_qos_objective_measured_seconds", "slow", "ttft")] <= 0.6 * 1.05 + 0.5
            # 12 tokens ITL_S apart: the time per output token is measured, within target
            assert m[_key("llm_qos_objective_attainment_ratio", "fast", "tpot")] == 1.0
            assert ITL_S * 0.5 <= m[_key("llm_qos_objective_measured_seconds", "fast", "tpot")] <= 0.05
            assert not any(labels[0] == ("group", "plain") for _name, labels in m)  # no objectives, no series
            assert _key("llm_qos_objective_target_seconds", "slow", "tpot") not in m

            st = await _status(http, url)
            assert set(st) == {"fast", "slow"} and set(st["slow"]) == {"ttft"}
            fast, slow = st["fast"]["ttft"], st["slow"]["ttft"]
            assert (fast["target_s"], fast["percentile"], fast["met"]) == (0.3, 95.0, True)
            assert fast["overall"]["requests"] == 8 and fast["overall"]["attainment"] == 1.0
            assert slow["met"] is False and slow["overall"] == {**slow["overall"], "requests": 6, "attainment": 0.0}
            (engine,) = slow["engines"]  # the one engine, as POOL/NAME
            assert slow["engines"][engine]["requests"] == 6
            assert st["fast"]["tpot"]["met"] is True

            # a reload that moves the slow group's target starts its window afresh
            path.write_text(yaml.safe_dump(_config(upstream_url, slow_target_s=2.0)))
            async with http.post(url + "/admin/reload", headers=ADMIN) as r:
                assert r.status == 200, await r.text()
            st = await _status(http, url)
            assert st["slow"]["ttft"]["target_s"] == 2.0 and st["slow"]["ttft"]["overall"]["requests"] == 0
            assert st["fast"]["ttft"]["overall"]["requests"] == 8  # unchanged: kept
            await asyncio.gather(*(_chat(http, url, "s", ttft_s=0.6) for _ in range(3)))
            m = await _series(http, url)
            assert m[_key("llm_qos_objective_attainment_ratio", "slow", "ttft")] == 1.0
            assert m[_key("llm_qos_objective_target_seconds", "slow", "ttft")] == 2.0
