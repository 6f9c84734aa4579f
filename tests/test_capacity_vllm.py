"""The capacity controller and priority in front of a real continuously-batching engine:
vLLM's CPU build with a small batch limit (``--max-num-seqs 8``), the proxy as a real process
with no capacity number in its config.

* the capacity the proxy finds converges to what the engine runs, from below and from
  above, and the queue stays in the proxy: vLLM's own waiting count stays near 0;
* priority under overload: platinum is served while bronze streams keep the engine full,
  and waits far less than bronze.

Every load loop is bounded in count and time; the engine is this module's own (its batch
limit must be known), stopped at the end.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import aiohttp
import pytest
import yaml

from tests.proc_util import free_port
from tests.proxy_process import start_proxy, stop_proxy
from tests.vllm_engine import FIXTURE_ENGINE_ARGS, require_vllm, start_vllm_engine, stop_vllm_engine

BATCH = 8  # the engine's --max-num-seqs
ADMIN = "admin-key-capacity"


@pytest.fixture(scope="module")
def small_vllm():
    require_vllm()
    engine = start_vllm_engine(free_port(), extra_args=[*FIXTURE_ENGINE_ARGS, "--max-num-seqs", str(BATCH)])
    try:
        yield engine
    finally:
        stop_vllm_engine(engine)


def _config(engine_url: str, **capacity) -> dict:
    return {
        "upstream": {"url": engine_url, "kind": "openai", "load_signal": {"interval_s": 0.25, "stale_after_s": 2.0}},
        "admission": {"max_queue": 500, "queue_timeout_s": 120, **({"capacity": capacity} if capacity else {})},
        "admin": {"api_key": ADMIN},
        "default_group": "bronze",
        "groups": [
            {"name": "platinum", "users": [{"id": "alice", "api_key": "sk-alice"}]},
            {"name": "bronze", "users": []},
        ],
    }


class _Proxy:
    def __init__(self, tmp_path, cfg: dict) -> None:
        path = tmp_path / f"config-{id(cfg)}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = start_proxy(path, self.port)

    async def engine(self, http: aiohttp.ClientSession) -> dict:
        async with http.get(self.url + "/admin/status", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
            assert r.status == 200
            st = await r.json()
        (e,) = st["engines"]
        return {**e, "queued": st["queued"]}

    def stop(self) -> None:
        assert stop_proxy(self.proc) == 0


def _body(model: str, tokens: int) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Count."}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }


async def _stream(http: aiohttp.ClientSession, url: str, body: dict, key: str | None = None) -> float:
    """One streamed chat request; returns its time to first content token (seconds)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    t0 = time.monotonic()
    ttft = None
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if ttft is None and line.startswith(b"data: {") and b'"content"' in line:
                ttft = time.monotonic() - t0
    assert ttft is not None
    return ttft


async def _closed_loop(http, url: str, model: str, clients: int, tokens: int, until: float) -> list[float]:
    """``clients`` bronze streams back to back until the clock passes ``until``."""
    ttfts: list[float] = []

    async def client() -> None:
        for _ in range(1000):  # bounded; ends by time
            if time.monotonic() >= until:
                return
            ttfts.append(await _stream(http, url, _body(model, tokens)))

    await asyncio.gather(*(client() for _ in range(clients)))
    return ttfts


@pytest.mark.parametrize("start", ["below", "above"])
async def test_capacity_converges_to_what_the_engine_runs_and_the_queue_stays_in_the_proxy(small_vllm, tmp_path, start):
    capacity = {"initial": 2} if start == "below" else {"initial": 64, "max": 64}
    px = _Proxy(tmp_path, _config(small_vllm.url, **capacity))
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=100)) as http:
            first = await px.engine(http)
            assert first["capacity_mode"] == "adaptive" and first["capacity_found"] == (2 if start == "below" else 64)
            end = time.monotonic() + 40
            load = asyncio.create_task(_closed_loop(http, px.url, small_vllm.model, 3 * BATCH, 24, end))
            found, waiting, queued = [], [], []
            await asyncio.sleep(15)  # converge first
            for _ in range(60):  # bounded: ~15 s of readings
                if time.monotonic() > end - 2:
                    break
                e = await px.engine(http)
                found.append(e["capacity_found"])
                queued.append(e["queued"])
                waiting.append((await asyncio.to_thread(small_vllm.metrics))["num_requests_waiting"])
                await asyncio.sleep(0.25)
            await load
        assert len(found) >= 10
        # the queue is in the proxy, not in vLLM's FIFO
        assert statistics.mean(queued) >= BATCH, queued
        assert statistics.mean(waiting) <= 1.0, waiting
        # the capacity found is the engine's batch: never far below it, and above it only
        # by the growth steps between two readings of the engine's queue
        assert BATCH - 2 <= statistics.median(found) <= BATCH + 2, found
        assert max(found) <= BATCH + 6, found
    finally:
        px.stop()


async def test_platinum_is_served_first_while_bronze_keeps_the_engine_full(small_vllm, tmp_path):
    px = _Proxy(tmp_path, _config(small_vllm.url))
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=100)) as http:
            end = time.monotonic() + 35
            load = asyncio.create_task(_closed_loop(http, px.url, small_vllm.model, 4 * BATCH, 48, end))
            await asyncio.sleep(10)  # the engine full, bronze queued in the proxy
            assert (await px.engine(http))["queued"] >= BATCH
            platinum = []
            for _ in range(8):  # bounded: one probe every 0.5 s
                platinum.append(await _stream(http, px.url, _body(small_vllm.model, 8), key="sk-alice"))
                await asyncio.sleep(0.5)
            bronze = await load
        p50 = statistics.median(platinum)
        b50 = statistics.median(bronze[len(bronze) // 3 :])  # once the queue had formed
        assert p50 * 3 < b50, (platinum, b50)
    finally:
        px.stop()


async def test_clients_that_leave_mid_stream_or_send_huge_prompts_do_not_push_the_capacity_down(small_vllm, tmp_path):
    """Hostile and careless clients beside an honest load: streams cut after their first
    token and prompts of ~1500 tokens. The capacity found stays at the engine's batch (the
    stated bound is half of it through latency; the engine's own queue is what decides)."""
    px = _Proxy(tmp_path, _config(small_vllm.url))
    huge = "word " * 1500
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=100)) as http:
            end = time.monotonic() + 35
            honest = asyncio.create_task(_closed_loop(http, px.url, small_vllm.model, 2 * BATCH, 24, end))

            async def leaver() -> None:
                for _ in range(200):  # bounded; ends by time
                    if time.monotonic() >= end:
                        return
                    async with http.post(px.url + "/v1/chat/completions", json=_body(small_vllm.model, 200)) as r:
                        async for line in r.content:
                            if b'"content"' in line:
                                break  # leave after the first token

            async def stuffer() -> None:
                for _ in range(200):
                    if time.monotonic() >= end:
                        return
                    body = {**_body(small_vllm.model, 4), "messages": [{"role": "user", "content": huge}]}
                    async with http.post(px.url + "/v1/chat/completions", json=body) as r:
                        await r.read()

            hostile = [asyncio.create_task(leaver()) for _ in range(3)] + [asyncio.create_task(stuffer()) for _ in range(2)]
            await asyncio.sleep(12)
            found = []
            for _ in range(40):  # bounded: ~20 s of readings
                if time.monotonic() > end - 2:
                    break
                found.append((await px.engine(http))["capacity_found"])
                await asyncio.sleep(0.5)
            await honest
            await asyncio.gather(*hostile)
        assert len(found) >= 10
        assert min(found) >= BATCH // 2, found  # the bound: never below half through latency
        assert statistics.median(found) >= BATCH - 2, found
    finally:
        px.stop()
