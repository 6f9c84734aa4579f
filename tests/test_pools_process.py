"""Pools end to end: the real proxy process in front of several scripted engines, each a
process of its own on a real socket (``bench.scripted_engine``, killable with SIGKILL), or a
scripted upstream that records what it received (``tests.scripted_upstream``).

Every load loop is bounded in count and time; assertions are on outcomes and on which
engine served what (``X-Engine``), never on timings.
"""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import pytest
import yaml

from tests.proc_util import free_port
from tests.proxy_process import start_proxy, stop_proxy
from tests.scripted_upstream import ScriptedUpstream, response
from tests.test_engine_health import Engine

ADMIN = "adm-key"
FAST_HEALTH = {"check_interval_s": 0.3, "check_timeout_s": 0.5, "checks_to_eject": 2, "failures_to_eject": 2, "eject_base_s": 0.3, "eject_max_s": 1.0}


def pools_config(pools: list[dict], **admission) -> dict:
    return {
        "upstream": {"kind": "openai", "load_signal": {"enabled": False}},
        "admission": {"max_inflight": 4, "max_queue": 200, "queue_timeout_s": 30, **admission},
        "admin": {"api_key": ADMIN},
        "identity": {"header": "X-User-Id"},
        "default_group": "bronze",
        "groups": [
            {"name": "platinum", "users": [{"id": "alice", "api_key": "sk-alice"}]},
            {"name": "bronze", "users": [{"id": "carl", "api_key": "sk-carl"}]},
        ],
        "pools": pools,
    }


class Proxy:
    def __init__(self, tmp_path, cfg: dict) -> None:
        self.path = tmp_path / "pools.yaml"
        self.path.write_text(yaml.safe_dump(cfg))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = start_proxy(self.path, self.port, extra_args=["--no-watch"])

    def write(self, cfg: dict) -> None:
        self.path.write_text(yaml.safe_dump(cfg))

    async def reload(self, http: aiohttp.ClientSession) -> None:
        async with http.post(self.url + "/admin/reload", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
            assert r.status == 200, await r.text()

    async def status(self, http: aiohttp.ClientSession) -> dict:
        async with http.get(self.url + "/admin/status", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
            assert r.status == 200
            return await r.json()

    def stop(self) -> None:
        stop_proxy(self.proc)


@pytest.fixture
def proxies():
    started: list[Proxy] = []

    def make(tmp_path, cfg: dict) -> Proxy:
        p = Proxy(tmp_path, cfg)
        started.append(p)
        return p

    yield make
    for p in started:
        p.stop()


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


def chat(model: str, n: int = 4, stream_: bool = False, **fake) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": n, "stream": stream_}
    if fake:
        body["fake"] = fake
    return body


async def post(http, proxy: Proxy, body: dict, user: str = "carl") -> tuple[int, str | None, bytes]:
    async with http.post(proxy.url + "/v1/chat/completions", json=body, headers={"X-User-Id": user}) as r:
        return r.status, r.headers.get("X-Engine"), await r.read()


def engine_rows(status: dict) -> dict[str, dict]:
    return {e["name"]: e for e in status["engines"]}


# ---------------------------------------------------------------------- routing


async def test_requests_are_routed_by_model_aliases_rewritten_and_models_listed(engines, proxies, tmp_path, http):
    a, b = engines("a", "b")
    cfg = pools_config(
        [
            {"name": "small", "models": ["small", {"name": "tiny", "upstream_model": "small"}], "engines": [{"url": a.url, "name": "a"}]},
            {"name": "big", "models": ["big"], "engines": [{"url": b.url, "name": "b"}]},
        ]
    )
    px = proxies(tmp_path, cfg)
    for model, engine in (("small", "a"), ("tiny", "a"), ("big", "b"), ("big", "b")):
        status, served_by, _ = await post(http, px, chat(model))
        assert (status, served_by) == (200, engine), model
    async with http.post(px.url + "/v1/chat/completions", json=chat("nope")) as r:
        assert r.status == 404
        err = (await r.json())["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model"
    async with http.get(px.url + "/v1/models") as r:
        listed = await r.json()
    assert r.status == 200 and [(m["id"], m["owned_by"]) for m in listed["data"]] == [("small", "small"), ("tiny", "small"), ("big", "big")]
    async with http.get(px.url + "/v1/models/tiny") as r:
        assert r.status == 200 and (await r.json())["owned_by"] == "small"
    async with http.get(px.url + "/v1/models/nope") as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
    st = await px.status(http)
    rows = engine_rows(st)
    assert rows["a"]["routed"] == 2 and rows["b"]["routed"] == 2 and {p["name"] for p in st["pools"]} == {"small", "big"}
    async with http.get(px.url + "/metrics") as r:
        text = await r.text()
    assert 'llm_qos_engine_routed_requests_total{engine="a",pool="small"} 2.0' in text
    assert 'llm_qos_engine_ejections_total{engine="b",pool="big"} 0.0' in text


async def test_alias_and_two_level_priority_reach_only_configured_engines(proxies, tmp_path, http):
    with ScriptedUpstream() as prio, ScriptedUpstream() as plain:
        for up, key in ((prio, "engine-name"), (plain, "plain")):
            up.on(key, lambda sock, seen: sock.sendall(response(200, [("Content-Type", "application/json")], b'{"id":"x","object":"chat.completion","choices":[]}')))
        cfg = pools_config(
            [
                {
                    "name": "prio",
                    "models": [{"name": "alias", "upstream_model": "engine-name"}],
                    "engines": [{"url": prio.url, "name": "vllm", "priority_field": "priority", "priority_order": "lower_first"}],
                },
                {"name": "plain", "models": ["plain"], "engines": [{"url": plain.url, "name": "plain"}]},
            ]
        )
        px = proxies(tmp_path, cfg)
        for user, sent in (("alice", None), ("carl", -100)):
            body = chat("alias")
            if sent is not None:
                body["priority"] = sent  # a client cannot promote itself
            async with http.post(px.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer sk-{user}"}) as r:
                assert r.status == 200, await r.text()
        async with http.post(px.url + "/v1/chat/completions", json=chat("plain"), headers={"Authorization": "Bearer sk-alice"}) as r:
            assert r.status == 200
        seen = prio.seen_for("engine-name")
        assert [s.json["priority"] for s in seen] == [0, 1]  # platinum rank 0, bronze rank 1
        assert all(s.json["model"] == "engine-name" for s in seen)
        (p,) = plain.seen_for("plain")
        assert "priority" not in p.json


async def test_an_absurd_max_tokens_reserves_at_most_the_pools_context_length(proxies, tmp_path, http):
    """``max_tokens: 2**40`` on a pool whose engines have 8192 and 4096 tokens of context
    reserves at most 4096 (the smallest: the engine is chosen after admission), prompt
    included, not ``cost.max_tokens_ceiling``: with ``max_inflight_tokens: 10000`` it is
    admitted (without the ceiling it could never fit: 400 request_too_large), and
    ``/admin/status`` shows 4096 tokens in flight while it runs."""
    release = threading.Event()

    def slow(sock, seen) -> None:
        release.wait(20)
        sock.sendall(response(200, [("Content-Type", "application/json")], b'{"id":"x","object":"chat.completion","choices":[]}'))

    with ScriptedUpstream() as a, ScriptedUpstream() as b:
        for up in (a, b):
            up.on("ctx", slow)
        engines = [{"url": a.url, "name": "a", "max_model_len": 8192}, {"url": b.url, "name": "b", "max_model_len": 4096}]
        cfg = pools_config([{"name": "p", "models": ["ctx"], "engines": engines, "health": {"check_interval_s": 0}}], max_inflight_tokens=10000)
        px = proxies(tmp_path, cfg)
        body = {**chat("ctx"), "max_tokens": 2**40}
        req = asyncio.ensure_future(http.post(px.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-carl"}))
        try:
            for _ in range(100):
                status = await px.status(http)
                if status["inflight"] == 1:
                    break
                await asyncio.sleep(0.05)
            assert status["inflight"] == 1 and status["inflight_tokens"] == 4096
        finally:
            release.set()
        async with await req as r:
            assert r.status == 200, await r.text()


async def test_stream_usage_can_be_turned_off_for_one_engine(proxies, tmp_path, http):
    """``stream_usage: false`` on one engine (one that rejects ``stream_options``, say):
    its streams go as the client sent them; another pool's engine still gets
    ``include_usage`` asked for (the ``upstream`` section's default)."""
    sse = [("Content-Type", "text/event-stream")]
    done = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
    with ScriptedUpstream() as plain, ScriptedUpstream() as usage:
        for up, key in ((plain, "plain"), (usage, "usage")):
            up.on(key, lambda sock, seen: sock.sendall(response(200, sse, done)))
        cfg = pools_config(
            [
                {"name": "plain", "models": ["plain"], "engines": [{"url": plain.url, "stream_usage": False}]},
                {"name": "usage", "models": ["usage"], "engines": [{"url": usage.url}]},
            ]
        )
        px = proxies(tmp_path, cfg)
        for model in ("plain", "usage"):
            async with http.post(px.url + "/v1/chat/completions", json=chat(model, stream_=True), headers={"Authorization": "Bearer sk-carl"}) as r:
                assert r.status == 200 and await r.read() == done
        assert "stream_options" not in plain.seen_for("plain")[0].json
        assert usage.seen_for("usage")[0].json["stream_options"] == {"include_usage": True}


# ---------------------------------------------------------------------- dispatch


async def test_least_headroom_fills_by_capacity_and_a_full_engine_gets_nothing(engines, proxies, tmp_path, http):
    a, b = engines("a", "b")
    cfg = pools_config([{"name": "p", "models": ["m"], "engines": [{"url": a.url, "name": "a", "max_inflight": 3}, {"url": b.url, "name": "b", "max_inflight": 1}]}])
    px = proxies(tmp_path, cfg)
    slow = chat("m", n=400, itl_s=0.02)  # about 8 s each, unless cancelled
    tasks = [asyncio.create_task(post(http, px, slow)) for _ in range(5)]
    try:
        for _ in range(200):  # bounded: until 4 run and 1 waits
            st = await px.status(http)
            if st["inflight"] == 4 and st["queued"] == 1:
                break
            await asyncio.sleep(0.05)
        rows = engine_rows(st)
        assert (st["inflight"], st["queued"]) == (4, 1)
        assert (rows["a"]["inflight"], rows["b"]["inflight"]) == (3, 1)
        async with http.get(a.url + "/stats") as r:
            assert (await r.json())["active"] == 3
        async with http.get(b.url + "/stats") as r:
            assert (await r.json())["active"] == 1
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_one_pools_overload_does_not_block_another(engines, proxies, tmp_path, http):
    a, b = engines("a", "b")
    cfg = pools_config(
        [
            {"name": "slow", "models": ["slow"], "engines": [{"url": a.url, "name": "a", "max_inflight": 1}]},
            {"name": "fast", "models": ["fast"], "engines": [{"url": b.url, "name": "b", "max_inflight": 2}]},
        ]
    )
    px = proxies(tmp_path, cfg)
    stuck = [asyncio.create_task(post(http, px, chat("slow", n=400, itl_s=0.02))) for _ in range(6)]
    try:
        for _ in range(200):
            st = await px.status(http)
            if {p["name"]: p["queued"] for p in st["pools"]}["slow"] == 5:
                break
            await asyncio.sleep(0.05)
        assert {p["name"]: p["queued"] for p in st["pools"]} == {"slow": 5, "fast": 0}
        for _ in range(6):  # served at once while the other pool's queue is full
            status, served_by, _ = await post(http, px, chat("fast"))
            assert (status, served_by) == (200, "b")
    finally:
        for t in stuck:
            t.cancel()
        await asyncio.gather(*stuck, return_exceptions=True)


# ---------------------------------------------------------------------- health


async def _stream(http, px: Proxy, body: dict) -> tuple[int, str | None, bytes]:
    async with http.post(px.url + "/v1/chat/completions", json=body, headers={"X-User-Id": "carl"}) as r:
        return r.status, r.headers.get("X-Engine"), await r.read()


async def test_engine_killed_mid_run_is_invisible_to_requests_it_never_got(engines, proxies, tmp_path, http):
    a, b = engines("a", "b")
    cfg = pools_config(
        [
            {
                "name": "p",
                "models": ["m"],
                "engines": [{"url": a.url, "name": "a", "max_inflight": 4}, {"url": b.url, "name": "b", "max_inflight": 16}],
                "health": FAST_HEALTH,
            }
        ]
    )
    px = proxies(tmp_path, cfg)
    # two long streams on each engine
    streams = [asyncio.create_task(_stream(http, px, chat("m", n=300, stream_=True, itl_s=0.02))) for _ in range(4)]
    for _ in range(200):
        rows = engine_rows(await px.status(http))
        if rows["a"]["inflight"] >= 1 and rows["a"]["inflight"] + rows["b"]["inflight"] == 4:
            break
        await asyncio.sleep(0.05)
    cut_expected = rows["a"]["inflight"]
    assert cut_expected >= 1
    a.kill()
    # requests sent right after the kill: none reached a, so none may fail
    fresh = await asyncio.gather(*(post(http, px, chat("m")) for _ in range(8)))
    assert all(s == 200 and e == "b" for s, e, _ in fresh), fresh
    results = await asyncio.gather(*streams)
    cut = [body for _status, _engine, body in results if b"upstream_stream_broken" in body]
    assert len(cut) == cut_expected, [(s, e, b[-200:]) for s, e, b in results]
    for body in cut:  # cut streams end with the terminal error event
        assert not body.rstrip().endswith(b"[DONE]")
    assert all(body.rstrip().endswith(b"data: [DONE]") for body in (r[2] for r in results) if body not in cut)
    await _until(http, px, lambda rows: rows["a"]["state"] == "ejected", "a ejected")
    st = await px.status(http)
    assert engine_rows(st)["a"]["ejections"] == 1
    a.start()  # restarted on its port: a probe brings it back
    await _until(http, px, lambda rows: rows["a"]["state"] == "healthy", "a back")
    served = {e for _s, e, _b in await asyncio.gather(*(post(http, px, chat("m", n=100, itl_s=0.01)) for _ in range(8)))}
    assert "a" in served


async def _until(http, px: Proxy, pred, what: str, timeout: float = 20.0) -> dict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        rows = engine_rows(await px.status(http))
        if pred(rows):
            return rows
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {rows}")
        await asyncio.sleep(0.05)


async def test_zero_healthy_engines_answer_503_with_retry_after_at_once(engines, proxies, tmp_path, http):
    (a,) = engines("a")
    cfg = pools_config([{"name": "p", "models": ["m"], "engines": [{"url": a.url, "name": "a"}], "health": {**FAST_HEALTH, "eject_base_s": 5, "eject_max_s": 10}}])
    px = proxies(tmp_path, cfg)
    assert (await post(http, px, chat("m")))[0] == 200
    a.kill()
    await _until(http, px, lambda rows: rows["a"]["state"] == "ejected", "a ejected by its checks")
    loop = asyncio.get_running_loop()
    for _ in range(5):
        t0 = loop.time()
        async with http.post(px.url + "/v1/chat/completions", json=chat("m")) as r:
            assert r.status == 503
            assert (await r.json())["error"]["code"] == "no_healthy_engine"
            assert int(r.headers["Retry-After"]) >= 1
        assert loop.time() - t0 < 5  # answered, never queued until a timeout
    async with http.get(px.url + "/ready") as r:
        assert r.status == 503  # no pool can serve
    async with http.get(px.url + "/admin/dashboard.json", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        (row,) = (await r.json())["engines"]
    assert (row["pool"], row["name"], row["state"]) == ("p", "a", "ejected")
    async with http.get(px.url + "/metrics") as r:
        text = await r.text()
    assert 'llm_qos_engine_state{engine="a",pool="p",state="ejected"} 1.0' in text
    assert 'llm_qos_rejections_total{group="bronze",reason="no_healthy_engine"} 5.0' in text


async def test_every_engine_refusing_the_connection_is_503_with_retry_after(proxies, tmp_path, http):
    """Issue 21.8: both engines of the pool refuse connections (nothing listens on their
    ports), neither ejected yet: the request tried on each is answered as when none is in
    rotation, 503 no_healthy_engine with Retry-After (was 502 upstream_unreachable, no
    Retry-After), and it never reached an engine."""
    slow = {**FAST_HEALTH, "check_interval_s": 60, "failures_to_eject": 100}
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    cfg = pools_config([{"name": "p", "models": ["m"], "engines": [{"url": u, "name": f"e{i}"} for i, u in enumerate(dead)], "health": slow}])
    px = proxies(tmp_path, cfg)
    for _ in range(3):
        async with http.post(px.url + "/v1/chat/completions", json=chat("m"), headers={"X-User-Id": "carl"}) as r:
            body = await r.json()
            assert r.status == 503, body
            assert body["error"]["code"] == "no_healthy_engine"
            assert int(r.headers["Retry-After"]) >= 1
            assert "refused" in body["error"]["message"] or "connect" in body["error"]["message"]
    rows = engine_rows(await px.status(http))
    assert all(r["state"] == "healthy" and r["inflight"] == 0 for r in rows.values())  # not ejected; nothing held


async def test_one_users_failing_requests_cannot_eject_every_engine(engines, proxies, tmp_path, http):
    """The hostile-client trial: bob (bronze) sends bursts of requests that the engines
    answer 500. With two engines and ``failures_to_eject: 2``, failed requests may eject
    at most one (``max_ejection_percent`` 50, and never the last in rotation): alice
    (platinum) is served 200, not ``503 no_healthy_engine``. The refusal is counted per
    engine. Answers 501 (Not Implemented) are no failure at all."""
    a, b = engines("a", "b")
    health = {**FAST_HEALTH, "failures_to_eject": 2, "eject_base_s": 30, "eject_max_s": 60}  # no probe during the test
    px = proxies(tmp_path, pools_config([{"name": "p", "models": ["m"], "engines": [{"url": a.url, "name": "a"}, {"url": b.url, "name": "b"}], "health": health}]))
    unsupported = await asyncio.gather(*(post(http, px, chat("m", status=501), user="bob") for _ in range(6)))
    assert [s for s, _e, _b in unsupported] == [501] * 6
    rows = engine_rows(await px.status(http))
    assert all(rows[n]["state"] == "healthy" and rows[n]["failures"]["http_5xx"] == 0 for n in ("a", "b")), rows
    for _ in range(2):  # bursts of concurrent requests, then one at a time
        burst = await asyncio.gather(*(post(http, px, chat("m", status=500), user="bob") for _ in range(8)))
        assert all(s == 500 for s, _e, _b in burst), [(s, e, body[:200]) for s, e, body in burst]
    for _ in range(4):
        assert (await post(http, px, chat("m", status=500), user="bob"))[0] == 500
    rows = engine_rows(await px.status(http))
    states = sorted(rows[n]["state"] for n in ("a", "b"))
    assert states == ["ejected", "healthy"], rows
    (kept,) = [n for n in ("a", "b") if rows[n]["state"] == "healthy"]
    assert rows[kept]["ejections_refused"] >= 1 and rows[kept]["ejection_held"] is True
    async with http.post(px.url + "/v1/chat/completions", json=chat("m"), headers={"Authorization": "Bearer sk-alice"}) as r:
        assert r.status == 200, await r.text()
        assert r.headers.get("X-Engine") == kept
    rows = engine_rows(await px.status(http))
    assert sum(rows[n]["state"] == "ejected" for n in ("a", "b")) <= 1 and rows[kept]["ejection_held"] is False  # alice's 200 ended the episode
    async with http.get(px.url + "/metrics") as r:
        text = await r.text()
    refused = {
        line.split('engine="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("llm_qos_engine_ejections_refused_total{")
    }
    assert set(refused) == {"a", "b"} and refused[kept] >= 1 and refused[next(n for n in ("a", "b") if n != kept)] == 0
    no_engine = [line for line in text.splitlines() if line.startswith("llm_qos_rejections_total{") and 'reason="no_healthy_engine"' in line]
    assert no_engine and all(line.endswith(" 0.0") for line in no_engine), no_engine


# ---------------------------------------------------------------------- reload


async def test_reload_adds_and_removes_engines_under_load_without_failures(engines, proxies, tmp_path, http):
    a, b, c = engines("a", "b", "c")

    def cfg(*names_urls):
        return pools_config([{"name": "p", "models": ["m"], "engines": [{"url": u, "name": n, "max_inflight": 2} for n, u in names_urls], "health": FAST_HEALTH}])

    px = proxies(tmp_path, cfg(("a", a.url), ("b", b.url)))
    phase = {"n": 0}
    results: list[tuple[int, int, int, str | None, bool]] = []  # (phase at send, at answer, status, engine, complete)

    async def worker() -> None:
        for _ in range(200):  # bounded
            if phase["n"] >= 3:
                return
            sent_in = phase["n"]
            async with http.post(px.url + "/v1/chat/completions", json=chat("m", n=10, itl_s=0.01), headers={"X-User-Id": "carl"}) as r:
                body = await r.read()
                results.append((sent_in, phase["n"], r.status, r.headers.get("X-Engine"), r.status == 200 and b'"finish_reason"' in body))

    async def within(p: int, n: int = 4) -> None:  # until n requests were sent and answered in phase p
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while sum(1 for r in results if r[0] == r[1] == p) < n:
            assert loop.time() < deadline, f"no traffic in phase {p}: {results}"
            await asyncio.sleep(0.05)

    workers = [asyncio.create_task(worker()) for _ in range(4)]
    await within(0)
    px.write(cfg(("a", a.url), ("c", c.url)))  # b removed (drains), c added
    await px.reload(http)
    phase["n"] = 1
    await within(1)
    px.write(cfg(("c", c.url), ("b", b.url)))  # a removed, b back
    await px.reload(http)
    phase["n"] = 2
    await within(2)
    phase["n"] = 3
    await asyncio.wait_for(asyncio.gather(*workers), 60)
    assert results and all(status == 200 and complete for *_p, status, _e, complete in results), [r for r in results if r[2] != 200 or not r[4]]
    # sent after a reload and answered before the next: only the engines that reload kept or added
    by_phase = {p: {e for s, f, _st, e, _c in results if s == f == p} for p in (0, 1, 2)}
    assert by_phase[1] <= {"a", "c"} and "c" in by_phase[1]
    assert by_phase[2] <= {"c", "b"}
    rows = engine_rows(await px.status(http))
    assert set(rows) == {"c", "b"} and all(r["inflight"] == 0 for r in rows.values())


async def test_repeated_upstream_flags_serve_one_pool_over_those_engines(engines, tmp_path, http):
    a, b = engines("a", "b")
    cfg = pools_config([])
    del cfg["pools"]
    path = tmp_path / "single.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = free_port()
    proc = start_proxy(path, port, extra_args=["--no-watch", "--upstream", a.url, "--upstream", b.url])
    try:
        url = f"http://127.0.0.1:{port}"
        tasks = [http.post(url + "/v1/chat/completions", json=chat("any-model", n=20, itl_s=0.02)) for _ in range(6)]
        served = []
        for r in await asyncio.gather(*tasks):
            async with r:
                assert r.status == 200
                served.append(r.headers.get("X-Engine"))
        assert set(served) == {"a", "b"}  # both engines of the pool took requests
        async with http.get(url + "/v1/models") as r:
            assert r.status == 200 and [m["id"] for m in (await r.json())["data"]] == ["fake-model"]  # the catch-all engine's own list
    finally:
        stop_proxy(proc)


async def test_each_engines_load_signal_steers_dispatch_away_from_a_saturated_one(engines, proxies, tmp_path, http):
    a, b = engines("a", "b")
    cfg = pools_config(
        [
            {
                "name": "p",
                "models": ["m"],
                "engines": [{"url": a.url, "name": "a", "max_inflight": 8}, {"url": b.url, "name": "b", "max_inflight": 8}],
                "health": {"check_interval_s": 0},
            }
        ]
    )
    cfg["upstream"] = {"kind": "lightllm", "load_signal": {"enabled": True, "interval_s": 0.05, "stale_after_s": 2.0}}
    await a.script(http, load=0.99)  # a reports its KV cache full
    px = proxies(tmp_path, cfg)
    rows = await _until(http, px, lambda rows: rows["a"]["saturated"] and rows["b"]["load_signal"] == "ok", "both engines polled")
    assert rows["a"]["capacity"] == 1 and rows["b"]["capacity"] == 8
    results = await asyncio.gather(*(post(http, px, chat("m", n=20, itl_s=0.01)) for _ in range(6)))
    assert all(status == 200 and engine == "b" for status, engine, _ in results), results
    await a.script(http, load=0.0)
    await _until(http, px, lambda rows: not rows["a"]["saturated"], "a drained")
    results = await asyncio.gather(*(post(http, px, chat("m", n=50, itl_s=0.01)) for _ in range(8)))
    assert "a" in {engine for _s, engine, _b in results}


async def test_a_session_header_keeps_a_session_on_one_engine(engines, proxies, tmp_path, http):
    a, b = engines("a", "b")
    affinity = {"policy": "least_headroom", "affinity": {"session_header": "X-Session-Id", "tolerance": 1.0}}
    cfg = pools_config([{"name": "p", "models": ["m"], "engines": [{"url": a.url, "name": "a"}, {"url": b.url, "name": "b"}], "routing": affinity}])
    px = proxies(tmp_path, cfg)
    by_session: dict[str, set] = {}
    for i in range(24):
        session = f"s{i % 8}"
        async with http.post(px.url + "/v1/chat/completions", json=chat("m"), headers={"X-Session-Id": session}) as r:
            assert r.status == 200
            by_session.setdefault(session, set()).add(r.headers["X-Engine"])
    assert all(len(engines) == 1 for engines in by_session.values()), by_session  # each session sticks
    assert set().union(*by_session.values()) == {"a", "b"}  # and sessions spread over the engines
