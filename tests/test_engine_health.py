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

from proxy.config.loading import parse_config
from proxy.routing.engine_health import EngineHealth, Health, max_passive_ejections
from proxy.routing.health_checker import HealthChecker
from proxy.config.pools import HealthConfig
from proxy.routing.router import PoolRouter
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
    a, b = engines("a", "b")  # two: failed requests never eject a pool's last engine in rotation
    r = make_router([a, b], check_interval_s=0, eject_base_s=0.3, eject_max_s=0.3)
    ea, eb = r.engines.values()
    checker.sync(r.engines.values())
    await asyncio.sleep(0.3)
    assert (await a.script(http))["checks_seen"] == 0
    # the relay reports three failed requests (phase 2 wires this call)
    for _ in range(3):
        r.report(ea, False, "http_5xx", "500")
    assert not ea.in_rotation and eb.in_rotation
    await wait_until(lambda: ea.in_rotation, 10, "probe after the backoff")
    assert (await a.script(http))["checks_seen"] == 1  # one probe, nothing more
    assert (await b.script(http))["checks_seen"] == 0


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


# ------------------------------------------------------- the floor (no I/O)
#
# Failed requests are what a client can cause: they must never eject a pool's engines
# past health.max_ejection_percent, nor its last engine in rotation. Failed checks may.


def _pure_router(n: int, **health) -> PoolRouter:
    from tests.test_router import Clock, eng, router

    return router(*(eng(i + 1) for i in range(n)), clock=Clock(), health={"failures_to_eject": 2, "check_interval_s": 0, **health})


def _ejected(r: PoolRouter) -> list[str]:
    return [e.name for e in r.engines.values() if not e.health.healthy]


@pytest.mark.parametrize(
    "n, percent, most",
    [(1, 50, 0), (2, 50, 1), (3, 50, 1), (4, 50, 2), (5, 50, 2), (10, 50, 5), (3, 10, 1), (3, 100, 2), (2, 100, 1), (4, 0, 0), (1, 100, 0)],
)
def test_max_passive_ejections_leaves_at_least_one_engine(n, percent, most):
    assert max_passive_ejections(n, percent) == most
    assert max_passive_ejections(n, percent) <= n - 1


@pytest.mark.parametrize("n, most", [(1, 0), (2, 1), (3, 1)])
def test_failed_requests_never_eject_the_pool_below_its_floor(n, most, caplog):
    """One client's requests answered 500 by every engine, many times over: at most
    ``max_ejection_percent`` (50) of the engines go out, never the last one, and every
    refused ejection is counted."""
    r = _pure_router(n)
    with caplog.at_level("WARNING", logger="llm_qos.engine_health"):
        for _ in range(10):
            for e in r.engines.values():
                r.report(e, False, "http_5xx", "answered 500")
    assert len(_ejected(r)) == most
    assert r.available and sum(e.in_rotation for e in r.engines.values()) == n - most >= 1
    held = [e for e in r.engines.values() if e.health.healthy]
    for e in held:
        assert e.health.ejection_held and e.health.ejections == 0
        assert e.health.ejections_refused == 10 - 1  # the 2nd..10th failures in a row: each would have ejected it
        assert e.health.failures["http_5xx"] == 10  # the failures still count
        assert e.status()["ejections_refused"] == 9 and e.status()["ejection_held"] is True
    # logged once per engine for the whole episode, not once per refused failure
    warnings = [rec.getMessage() for rec in caplog.records if "kept in rotation" in rec.getMessage()]
    assert sorted(w.split()[1] for w in warnings) == sorted(e.name for e in held)
    assert r.fits(ticket_of(1))


def ticket_of(tokens: int):
    from tests.test_router import ticket

    return ticket(tokens)


def test_an_episode_ends_with_a_success_and_the_next_one_logs_again(caplog):
    r = _pure_router(1)
    (e,) = r.engines.values()
    with caplog.at_level("WARNING", logger="llm_qos.engine_health"):
        for _ in range(4):
            r.report(e, False, "timeout")
        r.report(e, True)  # it answered: the episode is over
        assert not e.health.ejection_held and e.health.request_failures == 0
        for _ in range(3):
            r.report(e, False, "reset")
    assert len([x for x in caplog.records if "kept in rotation" in x.getMessage()]) == 2
    assert e.health.ejections_refused == 3 + 2 and e.in_rotation


def test_the_floor_counts_engines_ejected_by_checks_and_frees_when_one_is_back():
    r = _pure_router(3, checks_to_eject=1)
    a, b, c = r.engines.values()
    a.health.record_check(False, "GET /v1/models answered 503")  # out by its check: 1 of 3, the most at 50 %
    for _ in range(3):
        assert not r.report(b, False, "http_5xx", "answered 500")
    assert b.in_rotation and b.health.ejection_held and _ejected(r) == ["e1"]
    a.health.record_check(True)  # its probe passed: back in
    assert a.in_rotation and r.report(b, False, "http_5xx", "answered 500")  # the count was kept: ejected at once
    assert _ejected(r) == ["e2"] and not b.health.ejection_held and b.health.ejections == 1
    assert not r.report(c, False, "connect") and not r.report(c, False, "connect")  # the floor again
    assert c.in_rotation


def test_max_ejection_percent_zero_turns_passive_ejection_off_and_draining_engines_are_not_counted():
    r = _pure_router(4, max_ejection_percent=0)
    for e in r.engines.values():
        for _ in range(3):
            r.report(e, False, "connect")
    assert _ejected(r) == []
    from tests.test_router import eng, pool

    r = _pure_router(3)
    held = r.reserve(ticket_of(1))  # keeps its engine draining after the reload below
    r.reconfigure(pool(*(eng(i + 1) for i in range(3) if r.engines[f"e{i + 1}"] is not held), health={"failures_to_eject": 2}))
    assert held.draining
    assert r.report(held, False, "reset") is False and r.report(held, False, "reset")  # out of rotation anyway: no floor
    x, y = (e for e in r.engines.values() if not e.draining)
    assert r.report(x, False, "reset") is False and r.report(x, False, "reset")  # 1 of the 2 left
    assert not r.report(y, False, "reset") and not r.report(y, False, "reset") and y.in_rotation


@pytest.mark.parametrize("n", [1, 2])
def test_failed_checks_may_still_eject_every_engine(n):
    """A failing check path is the engine's own state, not a client's doing: the floor
    does not hold against it, so a pool whose engines are all down is answered 503."""
    r = _pure_router(n, checks_to_eject=2)
    first = next(iter(r.engines.values()))
    if n > 1:
        r.report(first, False, "http_5xx", "answered 500")
        assert r.report(first, False, "http_5xx", "answered 500")  # one out by requests
    for e in r.engines.values():
        for _ in range(2):
            e.health.record_check(False, "GET /v1/models: ClientConnectorError")
    assert len(_ejected(r)) == n and not r.available and r.capacity == 0
    assert all(e.health.ejections_refused == 0 for e in r.engines.values())


@pytest.mark.parametrize(
    "detail, status",
    [("answered 501", 501), ("answered 505", 505), ("reported a 501 error in its answer", 501), ("", 501)],
)
def test_a_501_or_505_is_not_an_engine_failure(detail, status):
    """Not Implemented / HTTP Version Not Supported: the engine answered that it does not
    serve the request's route or version. A success: it resets the failure count and
    never ejects, even with failures_to_eject 1 in a pool of two."""
    r = _pure_router(2, failures_to_eject=1)
    a, _ = r.engines.values()
    for _ in range(5):
        assert not r.report(a, False, "http_5xx", detail, status=status)
    assert a.in_rotation and a.health.failures["http_5xx"] == 0 and a.health.request_failures == 0
    h = EngineHealth(HealthConfig(failures_to_eject=2), "e")
    h.record_request(False, "http_5xx", "answered 500", status=500)
    h.record_request(False, "http_5xx", detail, status=status)  # resets the count, like any answer
    assert h.request_failures == 0 and not h.record_request(False, "http_5xx", "answered 502", status=502) and h.healthy


@pytest.mark.parametrize("detail, status", [("answered 500", 500), ("answered 502", 502), ("reported a 503 error in its answer", 503), ("", 504), ("answered 501", None)])
def test_other_5xx_still_fail(detail, status):
    r = _pure_router(2, failures_to_eject=1)
    a, _ = r.engines.values()
    assert r.report(a, False, "http_5xx", detail, status=status) and a.health.failures["http_5xx"] == 1


def test_a_status_is_the_callers_never_read_from_the_detail():
    h = EngineHealth(HealthConfig(failures_to_eject=1), "e")
    assert h.record_request(False, "connect", "Cannot connect to host 10.0.0.1:501")  # a port, not an answer
    h = EngineHealth(HealthConfig(failures_to_eject=1), "e")
    assert h.record_request(False, "http_5xx", "answered 501")  # no status given: "501" in the text is not read
    h = EngineHealth(HealthConfig(failures_to_eject=1), "e")
    assert not h.record_request(False, "http_5xx", "answered 501", status=501) and h.healthy
