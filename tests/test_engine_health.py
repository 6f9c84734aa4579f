"""Engine health through real sockets: scripted engines as their own processes, whose
checks fail, hang, or that are killed with SIGKILL and restarted; the checker ejects them,
probes them back in, and sends nothing while nothing is due."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp
import pytest
import yaml

from proxy.config import parse_config
from proxy.engine_health import Health, HealthChecker
from proxy.router import PoolRouter
from tests.conftest import base_config, wait_until
from tests.proc_util import die_with_parent, free_port, wait_for_line
from tests.proxy_process import REPO_ROOT

FAST = {"check_interval_s": 0.2, "check_timeout_s": 0.5, "checks_to_eject": 2, "failures_to_eject": 3, "eject_base_s": 0.2, "eject_max_s": 0.8}


class Engine:
    """``python -m bench.scripted_engine`` on a port of its own, restartable."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        cmd = [sys.executable, "-m", "bench.scripted_engine", "--port", str(self.port), "--name", self.name]
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, preexec_fn=die_with_parent)
        wait_for_line(self.proc, f"scripted engine {self.name} ready", 30, f"engine {self.name}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.proc.stdout.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()

    async def script(self, http: aiohttp.ClientSession, **changes) -> dict:
        if changes:
            async with http.post(self.url + "/script", json=changes) as r:
                assert r.status == 200
                return await r.json()
        async with http.get(self.url + "/script") as r:
            return await r.json()


@pytest.fixture
def engines():
    started: list[Engine] = []

    def make(*names: str) -> list[Engine]:
        out = [Engine(n) for n in names]
        for e in out:
            e.start()
            started.append(e)
        return out

    yield make
    for e in started:
        e.stop()


def make_router(engines: list[Engine], **health) -> PoolRouter:
    cfg = base_config("x")
    del cfg["upstream"]["url"]
    cfg["pools"] = [
        {
            "name": "p",
            "models": ["m"],
            "engines": [{"url": e.url, "name": e.name, **({"api_key": "sk-engine"} if e.name == "keyed" else {})} for e in engines],
            "health": {**FAST, **health},
        }
    ]
    (pool,) = parse_config(yaml.safe_dump(cfg)).effective_pools()
    return PoolRouter(pool)


@pytest.fixture
async def checker():
    c = HealthChecker()
    yield c
    await c.close()


async def test_failing_checks_eject_an_engine_and_a_passing_probe_brings_it_back(engines, checker, http):
    a, b = engines("a", "b")
    r = make_router([a, b])
    ea, eb = r.engines.values()
    checker.sync(r.engines.values())
    await a.script(http, checks="fail")
    await wait_until(lambda: ea.health.state is Health.EJECTED, 10, "a ejected")
    assert eb.in_rotation and "503" in ea.health.last_error
    assert all(r.choose(1) is eb for _ in range(5))
    await a.script(http, checks="ok")
    await wait_until(lambda: ea.in_rotation, 10, "a back in rotation")
    assert ea.health.ejections == 1


async def test_an_engine_killed_with_sigkill_is_ejected_and_returns_when_restarted(engines, checker):
    a, b = engines("a", "b")
    r = make_router([a, b])
    ea, eb = r.engines.values()
    checker.sync(r.engines.values())
    await wait_until(lambda: ea.health.checks["ok"] >= 1, 10, "a first check")
    a.kill()
    await wait_until(lambda: not ea.in_rotation, 10, "a ejected after SIGKILL")
    assert "Connect" in ea.health.last_error or "refused" in ea.health.last_error.lower()
    assert r.available and eb.in_rotation
    b.kill()
    await wait_until(lambda: not r.available, 10, "no engine left")
    assert 1.0 <= r.retry_after_s() <= FAST["eject_max_s"] + 1
    a.start()  # same port
    await wait_until(lambda: ea.in_rotation, 15, "a back after restart")
    assert r.available and r.choose(1) is ea


async def test_a_check_that_hangs_fails_after_its_timeout(engines, checker, http):
    (a,) = engines("a")
    r = make_router([a], check_timeout_s=0.3)
    (ea,) = r.engines.values()
    await a.script(http, checks="hang")
    t0 = time.monotonic()
    checker.sync(r.engines.values())
    await wait_until(lambda: not ea.in_rotation, 10, "a ejected by hanging checks")
    assert "no answer within 0.3 s" in ea.health.last_error
    assert time.monotonic() - t0 >= 2 * 0.3  # two checks, each waited out


async def test_checks_run_at_their_interval_and_not_at_all_when_off(engines, checker, http):
    a, b = engines("a", "b")
    r_on = make_router([a], check_interval_s=0.3)
    r_off = make_router([b], check_interval_s=0)
    checker.sync([*r_on.engines.values(), *r_off.engines.values()])
    t0 = time.monotonic()
    await asyncio.sleep(1.5)
    took = time.monotonic() - t0
    seen_on = (await a.script(http))["checks_seen"]
    assert 2 <= seen_on <= took / 0.3 + 1, seen_on  # ~5: the interval, not a busy loop
    assert (await b.script(http))["checks_seen"] == 0


async def test_a_passive_ejection_wakes_the_checker_for_one_probe(engines, checker, http):
    (a,) = engines("a")
    r = make_router([a], check_interval_s=0, eject_base_s=0.3, eject_max_s=0.3)
    (ea,) = r.engines.values()
    checker.sync(r.engines.values())
    await asyncio.sleep(0.3)
    assert (await a.script(http))["checks_seen"] == 0
    # the relay reports three failed requests (phase 2 wires this call)
    for _ in range(3):
        r.report(ea, False, "http_5xx", "500")
    assert not ea.in_rotation
    await wait_until(lambda: ea.in_rotation, 10, "probe after the backoff")
    assert (await a.script(http))["checks_seen"] == 1  # one probe, nothing more


async def test_unwatched_engines_are_left_alone_and_credentials_are_sent(engines, checker, http):
    (a,) = engines("keyed")
    r = make_router([a], check_interval_s=0.1)
    checker.sync(r.engines.values())
    await wait_until(lambda: next(iter(r.engines.values())).health.checks["ok"] >= 2, 10, "two checks")
    assert (await a.script(http))["check_authorization"] == "Bearer sk-engine"
    checker.sync([])
    assert checker.watched == []
    await asyncio.sleep(0.2)  # a check in flight when unwatched may still land
    seen = (await a.script(http))["checks_seen"]
    await asyncio.sleep(0.6)
    assert (await a.script(http))["checks_seen"] == seen
