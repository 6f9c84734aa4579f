"""``llm-qos proxy --workers N`` with real processes: refused without shared_state; with
it, N workers serve one port (SO_REUSEPORT), register in a real Redis, reload together on
SIGHUP, a SIGKILLed worker is restarted, and SIGTERM stops them all."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.fake_upstream import make_app
from proxy.shared.keys import Keys
from tests.conftest import base_config
from tests.proc_util import free_port
from tests.proxy_process import REPO_ROOT, start_proxy, stop_proxy

ADMIN = {"Authorization": "Bearer admin-key"}


def _children(pid: int) -> set[int]:
    try:
        return {int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    except FileNotFoundError:
        return set()


def test_workers_refuse_to_start_without_shared_state(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(base_config("http://127.0.0.1:9")))
    out = subprocess.run(
        [sys.executable, "-m", "proxy", "proxy", "--config", str(cfg), "--port", str(free_port()), "--workers", "2"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2
    assert "shared_state" in out.stderr and "--workers 2" in out.stderr


async def _distinct_workers(url: str, tries: int = 60) -> dict[float, dict]:
    """Ask /admin/config over a new connection each time; the kernel spreads connections
    over the workers, each of which loaded its config at its own moment."""
    seen: dict[float, dict] = {}
    for _ in range(tries):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            async with s.get(f"{url}/admin/config", headers=ADMIN) as r:
                assert r.status == 200
                body = await r.json()
        seen[body["loaded_at"]] = body
    return seen


async def test_two_workers_share_one_port_reload_together_and_survive_a_kill(aiohttp_server, redis_server, tmp_path):
    up = await aiohttp_server(make_app(0.0, 0.0))
    cfg = base_config(str(up.make_url("")).rstrip("/"), max_inflight=5)
    cfg["admin"] = {"api_key": "admin-key"}
    cfg["shared_state"] = {"url": redis_server.url, "key_prefix": "workers", "lease_s": 1.0, "sync_interval_s": 0.1}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # started from this thread (not a worker thread): the kernel's die-with-parent signal
    # follows the thread that forked; the proxy's readiness does not need this loop
    proc = start_proxy(path, port, None, 60.0, ["--workers", "2", "--no-watch"])
    try:
        workers = _children(proc.pid)
        assert len(workers) == 2

        seen = await _distinct_workers(url)
        assert len(seen) == 2, "both workers answer on the one port"
        # each worker loads the whole config: the capacity is leased through Redis, not split
        assert [b["config"]["admission"]["max_inflight"] for b in seen.values()] == [5, 5]

        async with aiohttp.ClientSession() as s:
            for _ in range(6):
                async with s.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, headers={"X-User-Id": "alice"}) as r:
                    assert r.status == 200

        client = redis.Redis.from_url(redis_server.url, decode_responses=True)
        assert client.zcard(Keys("workers").replicas) == 2  # each worker is a replica
        statuses: dict[str, dict] = {}
        for _ in range(60):  # both workers' grants on the one engine add up to at most its capacity
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
                async with s.get(f"{url}/admin/status", headers=ADMIN) as r:
                    shared = (await r.json())["shared_state"]
            statuses[shared["replica_id"]] = shared
        assert len(statuses) == 2 and all(st["mode"] == "shared" for st in statuses.values())
        keys = {k for st in statuses.values() for k in st["grants"]}
        assert keys == {f"default/{str(up.make_url('')).rstrip('/')}:slots"}
        assert sum(g for st in statuses.values() for g in st["grants"].values()) <= 5

        # SIGHUP to the supervisor reloads every worker (no file watcher here)
        cfg["groups"][0]["users"][1]["weight"] = 7
        path.write_text(yaml.safe_dump(cfg))
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 15
        while True:
            bodies = list((await _distinct_workers(url)).values())
            if len(bodies) >= 2 and all(b["config"]["groups"][0]["users"][1]["weight"] == 7 for b in bodies):
                break
            assert time.monotonic() < deadline, "the workers did not all reload on SIGHUP"
            await asyncio.sleep(0.1)

        # a SIGKILLed worker is replaced; the port keeps serving
        victim = min(workers)
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not (len(_children(proc.pid)) == 2 and victim not in _children(proc.pid)):
            assert time.monotonic() < deadline, "the worker was not restarted"
            await asyncio.sleep(0.1)
        deadline = time.monotonic() + 30
        while len(await _distinct_workers(url)) < 2:  # the new one is listening too
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        assert proc.poll() is None
    finally:
        code = stop_proxy(proc)
    assert code == 0
    assert not _children(proc.pid)


def _series(text: str, name: str) -> dict[str, float]:
    """``{worker: value}`` of the samples named ``name``, summed per ``worker`` label."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                out[s.labels["worker"]] = out.get(s.labels["worker"], 0.0) + s.value
    return out


async def test_every_scrape_of_two_workers_shows_the_whole_server_and_logs_say_which_worker(aiohttp_server, redis_server, tmp_path):
    """Four scrapes in a row read requests_total 4, 2, 4, 4 when each came from one worker:
    every scrape now holds both workers' series, each labelled ``worker``, whose sum is
    every request served; every log line names its worker."""
    up = await aiohttp_server(make_app(0.0, 0.0))
    cfg = base_config(str(up.make_url("")).rstrip("/"), max_inflight=5)
    cfg["shared_state"] = {"url": redis_server.url, "key_prefix": "wmetrics", "lease_s": 1.0, "sync_interval_s": 0.1}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_proxy(path, port, None, 60.0, ["--workers", "2", "--no-watch", "--log-format", "json"])
    try:
        sent = 8
        for _ in range(sent):  # a new connection each: the kernel spreads them over the workers
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
                async with s.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}) as r:
                    assert r.status == 200
        for _ in range(8):
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
                async with s.get(f"{url}/metrics") as r:
                    assert r.status == 200
                    text = await r.text()
            ok = _series_labelled(text, "llm_qos_requests_total", group="bronze", outcome="ok")
            assert set(ok) == {"0", "1"} and sum(ok.values()) == sent, ok
            assert _series(text, "llm_qos_worker_up") == {"0": 1.0, "1": 1.0}
            assert set(_series(text, "llm_qos_inflight_requests")) == {"0", "1"}  # the live collectors too
            types = [line for line in text.splitlines() if line.startswith("# TYPE ")]
            assert len(types) == len(set(types)), "each family once"
    finally:
        code = stop_proxy(proc)
    assert code == 0
    lines = [line for line in proc.log_path.read_text().splitlines() if line.startswith("{")]
    access = [json.loads(line) for line in lines if '"request_id"' in line]
    assert len(access) == sent and {a["worker"] for a in access} <= {0, 1} and all("status" in a for a in access)
    diagnostic = [json.loads(line) for line in lines if '"logger"' in line]
    assert diagnostic and {d["worker"] for d in diagnostic} == {0, 1}


def _series_labelled(text: str, name: str, **labels: str) -> dict[str, float]:
    """``{worker: value}`` of the samples of ``name`` that have ``labels``."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                out[s.labels["worker"]] = out.get(s.labels["worker"], 0.0) + s.value
    return out
