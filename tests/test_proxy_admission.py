"""Admission through the real proxy: priority, weights, bounds, timeouts, identity."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from tests.conftest import base_config, wait_until


async def _post(http: aiohttp.ClientSession, url: str, body: dict, **headers: str) -> tuple[int, dict, dict]:
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        return r.status, dict(r.headers), await r.json()


async def test_platinum_queued_after_bronze_is_admitted_first(make_stack, http):
    # strict priority alone (preemption would take the busy bronze request's slot:
    # tests/test_preemption_process.py)
    st = await make_stack(max_inflight=1, preemption={"enabled": False})
    sched = st.state.admission.scheduler
    url = st.proxy_url
    busy = asyncio.create_task(_post(http, url, st.chat_body(3, itl_s=0.2, tag="busy")))
    await wait_until(lambda: st.stats.started == 1, what="slot busy")
    bronze = []
    for i in range(3):
        bronze.append(asyncio.create_task(_post(http, url, st.chat_body(1, tag=f"bronze{i}"), **{"X-User-Id": f"b{i}"})))
        await wait_until(lambda: sched.queued == i + 1, what="bronze queued")
    plat = asyncio.create_task(_post(http, url, st.chat_body(1, tag="platinum"), Authorization="Bearer sk-alice"))
    await wait_until(lambda: sched.queued == 4, what="platinum queued")
    results = await asyncio.gather(busy, *bronze, plat)
    assert all(status == 200 for status, _, _ in results)
    assert st.stats.tags[:2] == ["busy", "platinum"]
    assert sorted(st.stats.tags[2:]) == ["bronze0", "bronze1", "bronze2"]


async def test_users_share_by_weight_in_tokens(make_stack, http):
    """alice (3) and bob (1) in platinum, both backlogged with equal requests: alice is
    dispatched ~3x as often while both wait."""
    st = await make_stack(max_inflight=1)
    sched = st.state.admission.scheduler
    busy = asyncio.create_task(_post(http, st.proxy_url, st.chat_body(2, itl_s=0.2, tag="busy")))
    await wait_until(lambda: st.stats.started == 1, what="slot busy")
    tasks = []
    for i in range(12):
        tasks.append(asyncio.create_task(_post(http, st.proxy_url, st.chat_body(8, tag="alice"), Authorization="Bearer sk-alice")))
        tasks.append(asyncio.create_task(_post(http, st.proxy_url, st.chat_body(8, tag="bob"), **{"X-User-Id": "bob"})))
    await wait_until(lambda: sched.queued == 24, what="all queued")
    await asyncio.gather(busy, *tasks)
    first = st.stats.tags[1:13]  # the first 12 dispatched while both were backlogged
    assert first.count("alice") == 9 and first.count("bob") == 3


async def test_queue_full_is_429_with_retry_after(make_stack, http):
    st = await make_stack(max_inflight=1, max_queue=2)
    sched = st.state.admission.scheduler
    busy = asyncio.create_task(_post(http, st.proxy_url, st.chat_body(2, itl_s=0.3)))
    await wait_until(lambda: st.stats.started == 1, what="slot busy")
    queued = [asyncio.create_task(_post(http, st.proxy_url, st.chat_body(1))) for _ in range(2)]
    await wait_until(lambda: sched.queued == 2, what="queue full")
    status, headers, body = await _post(http, st.proxy_url, st.chat_body(1))
    assert status == 429
    assert int(headers["Retry-After"]) >= 1
    assert body["error"]["code"] == "queue_full"
    assert "scope" not in body["error"]  # only a rate limit names a bucket
    assert [s for s, _, _ in await asyncio.gather(busy, *queued)] == [200, 200, 200]


async def test_higher_priority_evicts_lowest_when_queue_full(make_stack, http):
    st = await make_stack(max_inflight=1, max_queue=1, preemption={"enabled": False})  # eviction alone
    sched = st.state.admission.scheduler
    busy = asyncio.create_task(_post(http, st.proxy_url, st.chat_body(2, itl_s=0.3)))
    await wait_until(lambda: st.stats.started == 1, what="slot busy")
    low = asyncio.create_task(_post(http, st.proxy_url, st.chat_body(1, tag="low")))
    await wait_until(lambda: sched.queued == 1, what="bronze queued")
    high = asyncio.create_task(_post(http, st.proxy_url, st.chat_body(1, tag="high"), Authorization="Bearer sk-alice"))
    status, headers, body = await low
    assert status == 503 and body["error"]["code"] == "evicted" and "Retry-After" in headers
    assert (await high)[0] == 200 and (await busy)[0] == 200
    assert st.stats.tags[1:] == ["high"]


async def test_queue_timeout_is_429(make_stack, http):
    st = await make_stack(max_inflight=1, queue_timeout_s=0.3)
    busy = asyncio.create_task(_post(http, st.proxy_url, st.chat_body(2, itl_s=1.0)))
    await wait_until(lambda: st.stats.started == 1, what="slot busy")
    status, headers, body = await _post(http, st.proxy_url, st.chat_body(1))
    assert status == 429 and body["error"]["code"] == "queue_timeout" and int(headers["Retry-After"]) >= 1
    assert st.state.admission.scheduler.queued == 0
    assert (await busy)[0] == 200


async def test_require_api_key_answers_401(make_stack, http, aiohttp_server):
    cfg = base_config("http://127.0.0.1:1")
    cfg["identity"] = {"require_api_key": True}
    st = await make_stack(config=cfg)
    status, _, body = await _post(http, st.proxy_url, st.chat_body(1), Authorization="Bearer sk-wrong")
    assert status == 401 and body["error"]["type"] == "authentication_error"
    status, _, _ = await _post(http, st.proxy_url, st.chat_body(1), Authorization="Bearer sk-carl")
    assert status == 200
    async with http.get(st.proxy_url + "/v1/models") as r:
        assert r.status == 401
    async with http.get(st.proxy_url + "/v1/models", headers={"Authorization": "Bearer sk-carl"}) as r:
        assert r.status == 200


async def test_an_unknown_key_is_401_not_a_silent_demotion(make_stack, http):
    """A presented key no configured user has (a typo, a revoked key) is 401
    invalid_api_key, without require_api_key; a request with no key still goes to the
    default group; a trusted header identity is not a presented key."""
    st = await make_stack()
    status, headers, body = await _post(http, st.proxy_url, st.chat_body(1), Authorization="Bearer sk-nobody")
    assert status == 401 and body["error"]["code"] == "invalid_api_key" and body["error"]["type"] == "authentication_error"
    assert "not valid" in body["error"]["message"] and "sk-nobody" not in body["error"]["message"]
    assert "x-request-id" in {k.lower() for k in headers}
    async with http.get(st.proxy_url + "/v1/models", headers={"Authorization": "Bearer sk-nobody"}) as r:
        assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
    assert st.stats.started == 0  # nothing reached the engine
    assert (await _post(http, st.proxy_url, st.chat_body(1)))[0] == 200  # no key: the default group
    assert (await _post(http, st.proxy_url, st.chat_body(1), Authorization="Bearer sk-carl"))[0] == 200
    # the gateway in front names the user and passes its own credential through
    status, _, _ = await _post(http, st.proxy_url, st.chat_body(1), Authorization="Bearer gateway-token", **{"X-User-Id": "u7"})
    assert status == 200
    assert st.state.admission.scheduler.user_state("u7") is not None


async def test_a_placeholder_key_is_ignored_when_the_config_lists_no_key(make_stack, http):
    """With no key configured at all the proxy authenticates nobody by key: the placeholder
    an OpenAI SDK must be given (``EMPTY``) is no presented key."""
    cfg = base_config("http://127.0.0.1:1")
    for g in cfg["groups"]:
        for u in g["users"]:
            u.pop("api_key", None)
    st = await make_stack(config=cfg)
    assert (await _post(http, st.proxy_url, st.chat_body(1), Authorization="Bearer EMPTY"))[0] == 200


async def test_idle_users_are_forgotten_on_time_without_new_traffic(make_stack, http):
    """A burst of identities, then silence: every one is forgotten once idle for
    forget_users_after_s (a timer), not only when a new user's request comes."""
    st = await make_stack(forget_users_after_s=1.0)

    async def tracked() -> float:
        async with http.get(st.proxy_url + "/metrics") as r:
            text = await r.text()
        return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("llm_qos_users_tracked "))

    results = await asyncio.gather(*(_post(http, st.proxy_url, st.chat_body(1), **{"X-User-Id": f"burst-{i}"}) for i in range(40)))
    assert all(status == 200 for status, _, _ in results)
    idle_since = time.monotonic()
    assert await tracked() == 40
    deadline = idle_since + 1.0 + 3.0  # the window, plus slack for a loaded machine
    while await tracked() > 0:
        assert time.monotonic() < deadline, "idle users still tracked long after forget_users_after_s"
        await asyncio.sleep(0.05)
    assert time.monotonic() - idle_since >= 0.9  # not before their window
    assert st.state.admission.scheduler.users_forgotten == 40


async def test_rate_limit_429_says_whether_the_user_or_the_group_limit_tripped(make_stack, http):
    cfg = base_config("http://127.0.0.1:1")
    alice = cfg["groups"][0]["users"][0]
    alice["rate_limit"] = {"requests_per_minute": 1}  # alice: one request a minute
    cfg["groups"][1]["rate_limit"] = {"tokens_per_minute": 100}  # bronze: 100 tokens a minute, all users together
    st = await make_stack(config=cfg)
    assert (await _post(http, st.proxy_url, st.chat_body(4), Authorization="Bearer sk-alice"))[0] == 200
    status, headers, body = await _post(http, st.proxy_url, st.chat_body(4), Authorization="Bearer sk-alice")
    assert status == 429 and int(headers["Retry-After"]) >= 1
    err = body["error"]
    assert (err["code"], err["scope"], err["limit"]) == ("rate_limited", "user", "requests_per_minute")
    assert "user 'alice'" in err["message"] and "requests_per_minute" in err["message"]
    # two bronze users share the group's bucket: the second is refused by the group's limit
    assert (await _post(http, st.proxy_url, st.chat_body(80), **{"X-User-Id": "u1"}))[0] == 200
    status, _, body = await _post(http, st.proxy_url, st.chat_body(80), **{"X-User-Id": "u2"})
    err = body["error"]
    assert status == 429 and (err["code"], err["scope"], err["limit"]) == ("rate_limited", "group", "tokens_per_minute")
    assert "group 'bronze'" in err["message"]
    assert set(err) == {"message", "type", "param", "code", "scope", "limit"}


def test_no_engine_message_states_the_seconds_retry_after_says():
    """``retry after N s`` in the 503's message is the ``Retry-After`` header's N: both
    round up (a wait of 1.3 s said "1 s" beside ``Retry-After: 2``)."""
    import re

    from proxy.admission.admission import NoEngine
    from proxy.wire.errors import error_response

    for wait in (0.2, 1.0, 1.3, 1.5, 1.99, 2.01, 29.4):
        r = NoEngine("p", wait)
        header = error_response(503, r.detail, retry_after_s=r.retry_after_s).headers["Retry-After"]
        assert re.search(r"retry after (\d+) s", r.detail).group(1) == header, (wait, r.detail, header)


async def test_no_healthy_engine_503_agrees_with_its_retry_after(make_stack, http):
    import re

    st = await make_stack()
    (pool,) = st.state.admission.all_pools()
    (engine,) = pool.router.engines.values()
    for _ in range(engine.health.config.checks_to_eject):
        engine.health.record_check(False, "refused")
    assert not engine.in_rotation
    # probed in 1.3 s (not a whole number: the message said 1 s beside Retry-After: 2)
    engine.health.ejected_until += 1.3 - engine.health.retry_after_s()
    status, headers, body = await _post(http, st.proxy_url, st.chat_body(1))
    assert status == 503 and body["error"]["code"] == "no_healthy_engine"
    assert re.search(r"retry after (\d+) s", body["error"]["message"]).group(1) == headers["Retry-After"], (body, headers)
