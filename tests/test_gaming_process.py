"""One test per attack of issue 10, through the real proxy process (``python -m proxy``)
in front of the fake upstream (its own process, refusing max_tokens beyond its context
length with a 400 the way vLLM does): the honest users' outcome holds.

Dispatch order is read from the upstream's record of the requests it started (each body
carries a ``fake.tag``), so what is asserted is what the engine really saw.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Callable

import aiohttp
import pytest
import yaml

from bench.harness import free_port, start_fake_upstream, stop
from tests.proxy_process import start_proxy, stop_proxy

ADMIN = {"Authorization": "Bearer sk-admin"}
CONTEXT = 32768


def _config(upstream_url: str, **admission) -> dict:
    return {
        "upstream": {"url": upstream_url, "kind": "openai", "load_signal": {"enabled": False}},
        "admission": {"max_inflight": 2, "max_queue": 5000, "queue_timeout_s": 60, **admission},
        "identity": {"header": "X-User-Id"},
        "admin": {"api_key": "sk-admin"},
        "default_group": "g",
        "groups": [
            {
                "name": "g",
                "users": [
                    {"id": "short", "weight": 1},
                    {"id": "long", "weight": 1},
                    {"id": "gamer", "weight": 1},
                    {"id": "stuffer", "weight": 1, "rate_limit": {"tokens_per_minute": 3000}},
                ],
            }
        ],
    }


class Stack:
    """The fake upstream and the proxy, each its own process, on free loopback ports.
    ``config`` builds the proxy's config from the upstream's URL (default: ``_config``
    with ``admission``)."""

    def __init__(self, tmp: Path, config: Callable[[str], dict] | None = None, **admission) -> None:
        self.tmp = tmp
        up_port, px_port = free_port(), free_port()
        self.upstream = start_fake_upstream(up_port, tmp, max_model_len=CONTEXT)
        self.upstream_url = f"http://127.0.0.1:{up_port}"
        self.config_path = tmp / "config.yaml"
        cfg = config(self.upstream_url) if config is not None else _config(self.upstream_url, **admission)
        self.config_path.write_text(yaml.safe_dump(cfg))
        try:
            self.proxy = start_proxy(self.config_path, px_port, extra_args=["--no-watch"])
        except BaseException:
            stop(self.upstream)
            raise
        self.url = f"http://127.0.0.1:{px_port}"

    async def reload(self, http: aiohttp.ClientSession, cfg: dict) -> None:
        """Write ``cfg`` as the config file and have the proxy reload it."""
        self.config_path.write_text(yaml.safe_dump(cfg))
        async with http.post(self.url + "/admin/reload", headers=ADMIN) as r:
            assert r.status == 200, await r.text()

    def close(self) -> None:
        stop_proxy(self.proxy)
        stop(self.upstream)


@contextlib.contextmanager
def open_stack(config: Callable[[str], dict] | None = None, **admission):
    with tempfile.TemporaryDirectory(prefix="llm-qos-gaming-") as d:
        s = Stack(Path(d), config, **admission)
        try:
            yield s
        finally:
            s.close()


@pytest.fixture
def stack(request):
    with open_stack(**getattr(request, "param", {})) as s:
        yield s


def body(tag: str, max_tokens: int | None, stream: bool = False, **fake) -> dict:
    b: dict = {"model": "fake-model", "messages": [{"role": "user", "content": "hello there"}], "stream": stream, "fake": {"tag": tag, **fake}}
    if max_tokens is not None:
        b["max_tokens"] = max_tokens
    return b


async def post(http: aiohttp.ClientSession, url: str, user: str, b: dict) -> tuple[int, dict]:
    async with http.post(url + "/v1/chat/completions", json=b, headers={"X-User-Id": user}) as r:
        return r.status, await r.json(content_type=None)


async def upstream_tags(http: aiohttp.ClientSession, st: Stack) -> list[str]:
    async with http.get(st.upstream_url + "/stats") as r:
        return (await r.json())["tags"]


async def admin_status(http: aiohttp.ClientSession, st: Stack) -> dict:
    async with http.get(st.url + "/admin/status", headers=ADMIN) as r:
        return await r.json()


async def queued(http: aiohttp.ClientSession, st: Stack) -> int:
    return (await admin_status(http, st))["queued"]


async def group_depths(http: aiohttp.ClientSession, st: Stack) -> dict[str, int]:
    return {g["name"]: g["queued"] for g in (await admin_status(http, st))["groups"]}


async def until(what: str, check, timeout_s: float = 20.0) -> None:
    """Poll the coroutine function ``check`` until it returns true."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not await check():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def hold_slots(http: aiohttp.ClientSession, st: Stack, n: int = 2, user: str = "warm") -> list[asyncio.Task]:
    """``n`` slow requests that keep ``n`` slots busy while a backlog is built."""
    tasks = [asyncio.create_task(post(http, st.url, user, body("warm", 3, itl_s=0.4))) for _ in range(n)]
    for _ in range(200):
        if (await upstream_tags(http, st)).count("warm") == n:
            break
        await asyncio.sleep(0.02)
    return tasks


def token_shares(tags: list[str], cost: dict[str, float], users: tuple[str, ...], first: int) -> dict[str, float]:
    """Weighted tokens of the first ``first`` dispatches of ``users`` (real costs), as
    shares."""
    seen = [t for t in tags if t in users][:first]
    total = {u: seen.count(u) * cost[u] for u in users}
    s = sum(total.values())
    return {u: total[u] / s for u in users}


# prompt 10 (the fake's usage) x1 + output x2
COST = {"short": 10 + 2 * 4, "long": 10 + 2 * 40}


async def test_absurd_max_tokens_refused_upstream_leaves_honest_shares_intact(stack):
    """The gamer's max_tokens 2**62 requests reach the engine, which refuses them (400).
    Afterwards a short-answer user and a long-answer user still split tokens 50/50 (with
    the old accounting the group's virtual time sat near 1e19, costs vanished in
    rounding, and the order fell back to arrival: the long user took ~83 %)."""
    st = stack
    async with aiohttp.ClientSession() as http:
        for _ in range(3):
            results = await asyncio.gather(*[post(http, st.url, "gamer", body("gamer", 2**62)) for _ in range(6)])
            assert all(status == 400 for status, _ in results)
            assert "maximum context length" in results[0][1]["message"]  # the engine's own answer, relayed
        warm = await hold_slots(http, st)
        honest = []
        for i in range(40):  # arrival order alternates: FCFS would give "long" 83 % of the tokens
            honest.append(asyncio.create_task(post(http, st.url, "short", body("short", 4))))
            honest.append(asyncio.create_task(post(http, st.url, "long", body("long", 40, itl_s=0.002))))
        for _ in range(500):
            if await queued(http, st) == 80:
                break
            await asyncio.sleep(0.02)
        results = await asyncio.gather(*warm, *honest)
        assert all(status == 200 for status, _ in results)
        shares = token_shares(await upstream_tags(http, st), COST, ("short", "long"), 30)
    assert 0.35 <= shares["short"] <= 0.65, shares


async def test_huge_max_tokens_then_disconnect_does_not_starve_a_newcomer(stack):
    """The gamer keeps four streams with max_tokens 30 000 going and drops each after its
    first chunk (the reservation is refunded). A newcomer arriving meanwhile is served at
    once; with the old accounting it was lifted to the gamer's inflated counter and
    waited behind thousands of the gamer's refunded requests."""
    st = stack
    stop_gamer = asyncio.Event()

    async def gamer(http: aiohttp.ClientSession) -> None:
        while not stop_gamer.is_set():
            async with http.post(st.url + "/v1/chat/completions", json=body("gamer", 30_000, stream=True, itl_s=0.01), headers={"X-User-Id": "gamer"}) as r:
                await r.content.readany()  # the first chunk, then away
                r.close()

    async with aiohttp.ClientSession() as http:
        gamers = [asyncio.create_task(gamer(http)) for _ in range(4)]
        try:
            await asyncio.sleep(1.5)  # the gamer alone for a while
            mark = len(await upstream_tags(http, st))
            newbie = [post(http, st.url, "newbie", body("newbie", 8)) for _ in range(6)]
            results = await asyncio.wait_for(asyncio.gather(*newbie), 20)
            assert all(status == 200 for status, _ in results)
            after = (await upstream_tags(http, st))[mark:]
        finally:
            stop_gamer.set()
            await asyncio.wait_for(asyncio.gather(*gamers, return_exceptions=True), 30)
    # the newcomer's six went within the next few dispatches
    last = max(i for i, t in enumerate(after) if t == "newbie")
    assert after.count("newbie") == 6 and last < 30, after[:40]


async def test_prompt_stuffed_in_tools_is_counted_against_the_rate_limit(stack):
    """A user limited to 3 000 tokens a minute streams requests with a 5 000-token prompt
    in ``tools`` and an engine that reports no usage: one such request goes (a request
    larger than the bucket is served once when the bucket is full), the next ones get
    429 (with the old estimate, tools were free and, with no usage to true up, every one
    passed); the honest user is served throughout."""
    st = stack
    tools = [{"type": "function", "function": {"name": "f", "description": "d" * 20_000, "parameters": {"type": "object"}}}]

    async def stream(user: str, b: dict) -> int:
        async with http.post(st.url + "/v1/chat/completions", json=b, headers={"X-User-Id": user}) as r:
            await r.read()
            return r.status

    async with aiohttp.ClientSession() as http:
        stuffed = body("stuffer", 1, stream=True, usage=False)
        stuffed["tools"] = tools
        assert await stream("stuffer", stuffed) == 200
        codes = await asyncio.gather(*[stream("stuffer", stuffed) for _ in range(5)], *[stream("short", body("short", 4, stream=True)) for _ in range(5)])
        assert codes[:5] == [429] * 5 and codes[5:] == [200] * 5
        async with http.post(st.url + "/v1/chat/completions", json=stuffed, headers={"X-User-Id": "stuffer"}) as r:
            err = (await r.json())["error"]
            assert r.status == 429 and err["code"] == "rate_limited" and int(r.headers["Retry-After"]) >= 30


async def test_usage_the_proxy_asks_for_trues_up_a_small_estimate_and_the_client_never_sees_it(stack):
    """A stream whose client did not ask for ``include_usage``, with a prompt the estimate
    puts at a few tokens but the engine counts at 5 000 (a template, or a field the
    estimate does not see), to an engine that reports usage only when asked (as vLLM):
    the proxy asks (``upstream.stream_usage``), trues the 3 000 tokens/minute bucket up to
    the real 5 001, and strips the usage chunk. So the next request gets 429, which only
    the real usage can cause (the estimate alone leaves the bucket nearly full), and the
    client's stream carries no usage at all."""
    st = stack
    async with aiohttp.ClientSession() as http:
        hidden = body("stuffer", 1, stream=True, usage="asked", prompt=5000)
        async with http.post(st.url + "/v1/chat/completions", json=hidden, headers={"X-User-Id": "stuffer"}) as r:
            assert r.status == 200
            raw = await r.read()
        events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) >= 3, raw
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("usage" not in c and c["choices"] for c in chunks), raw  # no usage chunk, no "usage": null
        assert b"usage" not in raw
        # the estimate (~10 tokens) left the bucket nearly full: only the engine's 5 000
        # can refuse this one
        small = body("stuffer", 1, stream=True, usage="asked")
        async with http.post(st.url + "/v1/chat/completions", json=small, headers={"X-User-Id": "stuffer"}) as r:
            text = await r.text()
            assert r.status == 429, text[:300]  # 200 if the engine's usage never trued the bucket up
            err = json.loads(text)["error"]
            assert err["code"] == "rate_limited" and err.get("limit") == "tokens_per_minute", err
            assert int(r.headers["Retry-After"]) >= 30
        # a client that asks for usage itself gets the engine's usage chunk
        asks = body("short", 4, stream=True, usage="asked", prompt=77)
        asks["stream_options"] = {"include_usage": True}
        async with http.post(st.url + "/v1/chat/completions", json=asks, headers={"X-User-Id": "short"}) as r:
            assert r.status == 200
            raw = await r.read()
        last = json.loads([line[6:] for line in raw.decode().splitlines() if line.startswith("data: {")][-1])
        assert last["choices"] == [] and last["usage"]["prompt_tokens"] == 77, raw


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


@pytest.mark.parametrize("stack", [{"max_users": 100}], indirect=True)
async def test_identity_churn_keeps_state_bounded_and_honest_users_fair(stack):
    """3 000 distinct identities (a trusted identity header) one request each, while two
    honest users are backlogged: per-user state stays within ``admission.max_users``,
    ``/admin/status`` lists the top users and the total, the forgotten are counted, and
    the honest users still split tokens 50/50."""
    st = stack
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as http:
        warm = await hold_slots(http, st)
        honest = []
        for _ in range(40):
            honest.append(asyncio.create_task(post(http, st.url, "short", body("short", 4))))
            honest.append(asyncio.create_task(post(http, st.url, "long", body("long", 40, itl_s=0.002))))
        rss0 = _rss_kib(st.proxy.pid)
        sem = asyncio.Semaphore(48)

        async def one(i: int) -> int:
            async with sem:
                status, _ = await post(http, st.url, f"churn-{i}", body("churn", 1))
                return status

        churn = await asyncio.gather(*[one(i) for i in range(3000)])
        results = await asyncio.gather(*warm, *honest)
        assert all(s == 200 for s in churn) and all(s == 200 for s, _ in results)
        rss1 = _rss_kib(st.proxy.pid)
        async with http.get(st.url + "/admin/status", headers=ADMIN) as r:
            status = await r.json()
        async with http.get(st.url + "/admin/status?top=5", headers=ADMIN) as r:
            top5 = await r.json()
        async with http.get(st.url + "/metrics") as r:
            metrics = await r.text()
        shares = token_shares(await upstream_tags(http, st), COST, ("short", "long"), 30)
    assert status["users_total"] <= 100 and len(status["users"]) == 20 and len(top5["users"]) == 5
    forgotten = next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("llm_qos_users_forgotten_total"))
    assert forgotten >= 2900
    assert 0.35 <= shares["short"] <= 0.65, shares
    assert rss1 - rss0 < 40 * 1024, (rss0, rss1)  # a few MB of buffers, not one entry per identity
    if os.environ.get("LLM_QOS_VERBOSE"):
        print(f"proxy RSS {rss0 / 1024:.1f} -> {rss1 / 1024:.1f} MiB over 3000 identities")


# ------------------------------------------------------------------ reloads (attack 4)


def _tiers(upstream_url: str, top: list[str], bottom: list[str], **admission) -> dict:
    """Two groups, ``top`` above ``bottom`` (the default group), weight 1 each."""
    return {
        "upstream": {"url": upstream_url, "kind": "openai", "load_signal": {"enabled": False}},
        "admission": {"max_inflight": 1, "max_queue": 5000, "queue_timeout_s": 60, **admission},
        "identity": {"header": "X-User-Id"},
        "admin": {"api_key": "sk-admin"},
        "default_group": "bottom",
        "groups": [
            {"name": "top", "users": [{"id": u, "weight": 1} for u in top]},
            {"name": "bottom", "users": [{"id": u, "weight": 1} for u in bottom]},
        ],
    }


async def test_a_reload_moving_a_user_places_it_at_the_new_groups_virtual_time():
    """``mover`` has had a lot of service in ``top`` (so ``top``'s virtual time is far
    ahead of ``bottom``'s), has 20 requests waiting there, and a reload moves it to
    ``bottom``, where ``b1`` has 20 waiting. Its waiting requests move with it and it
    shares ``bottom`` evenly from the first dispatch (with the old accounting it kept its
    counter on ``top``'s scale and got none of the next ~40 dispatches)."""
    cfg = lambda url: _tiers(url, ["mover", "t-other"], ["b1"])  # noqa: E731
    with open_stack(cfg) as st:
        async with aiohttp.ClientSession() as http:
            for _ in range(40):  # top's virtual time: 40 x 18 weighted tokens
                results = await asyncio.gather(post(http, st.url, "mover", body("m0", 4)), post(http, st.url, "t-other", body("t0", 4)))
                assert all(status == 200 for status, _ in results)
            warm = await hold_slots(http, st, n=1)
            mover = [asyncio.create_task(post(http, st.url, "mover", body("mover", 4))) for _ in range(20)]
            await until("mover queued in top", lambda: _depths_are(http, st, top=20))
            b1 = [asyncio.create_task(post(http, st.url, "b1", body("b1", 4))) for _ in range(20)]
            await until("b1 queued in bottom", lambda: _depths_are(http, st, top=20, bottom=20))
            await st.reload(http, _tiers(st.upstream_url, ["t-other"], ["b1", "mover"]))
            assert await group_depths(http, st) == {"top": 0, "bottom": 40}  # at once, its waiting requests too
            results = await asyncio.gather(*warm, *mover, *b1)
            assert all(status == 200 for status, _ in results)
            tags = await upstream_tags(http, st)
    after = [t for t in tags[tags.index("warm") + 1 :] if t in ("mover", "b1")]
    first = after[:20]
    assert 7 <= first.count("mover") <= 13, after
    assert "mover" in after[:4], after  # no wait behind b1's backlog


async def test_a_reload_removing_a_user_gives_it_the_default_group_at_once_waiting_requests_included():
    """``vip`` (``top``) has three requests waiting when a reload removes it from the
    config: they go to the default group ``bottom`` at once, so ``bob`` (``top``), who
    arrives after the reload, goes before all of them (with the old rule a removed user
    kept its old group for as long as it had requests waiting)."""
    off = {"enabled": False}  # the order of dispatch alone: the warm request is not preempted
    cfg = lambda url: _tiers(url, ["vip", "bob"], ["carl"], preemption=off)  # noqa: E731
    with open_stack(cfg) as st:
        async with aiohttp.ClientSession() as http:
            warm = await hold_slots(http, st, n=1, user="carl")
            vip = [asyncio.create_task(post(http, st.url, "vip", body("vip", 4))) for _ in range(3)]
            await until("vip queued", lambda: _depths_are(http, st, top=3))
            carl = asyncio.create_task(post(http, st.url, "carl", body("carl", 4)))
            await until("carl queued", lambda: _depths_are(http, st, top=3, bottom=1))
            await st.reload(http, _tiers(st.upstream_url, ["bob"], ["carl"], preemption=off))
            assert await group_depths(http, st) == {"top": 0, "bottom": 4}
            bob = asyncio.create_task(post(http, st.url, "bob", body("bob", 4)))
            await until("bob queued", lambda: _depths_are(http, st, top=1, bottom=4))
            # a new request of vip's goes to the default group too
            later = asyncio.create_task(post(http, st.url, "vip", body("vip", 4)))
            await until("vip's new request queued", lambda: _depths_are(http, st, top=1, bottom=5))
            results = await asyncio.gather(*warm, *vip, carl, bob, later)
            assert all(status == 200 for status, _ in results)
            tags = await upstream_tags(http, st)
    assert tags[:2] == ["warm", "bob"], tags
    assert sorted(tags[2:]) == ["carl", "vip", "vip", "vip", "vip"], tags


async def _depths_are(http: aiohttp.ClientSession, st: Stack, **want: int) -> bool:
    depths = await group_depths(http, st)
    return all(depths.get(g, 0) == n for g, n in want.items())


# ---------------------------------------------------- eviction and min_share (attack 5)


def _floor_config(upstream_url: str) -> dict:
    return {
        "upstream": {"url": upstream_url, "kind": "openai", "load_signal": {"enabled": False}},
        "admission": {"max_inflight": 2, "max_queue": 6, "queue_timeout_s": 60},
        "identity": {"header": "X-User-Id"},
        "admin": {"api_key": "sk-admin"},
        "default_group": "gold",
        "groups": [
            {"name": "gold"},
            {"name": "bronze", "min_share": 0.3, "users": [{"id": "b0"}, {"id": "b1"}]},
        ],
    }


async def test_a_min_share_group_keeps_its_floor_while_higher_groups_keep_the_global_queue_full():
    """Thirty gold clients retry at once on every 429, so the global queue (6) is full all
    the time; two bronze clients (``min_share: 0.3``) send one request at a time. Bronze's
    newcomers evict gold's newest while bronze is under its floor, and bronze gets its
    30 % of the engine (with the old rule a floor group's newcomer got ``429 queue_full``
    whenever higher groups kept the queue full, and bronze got what it snatched)."""
    with open_stack(_floor_config) as st:
        stop_at = asyncio.get_running_loop().time() + 6.0
        outcomes: dict[str, list[int]] = {"gold": [], "bronze": []}

        async def client(http: aiohttp.ClientSession, user: str, group: str) -> None:
            while asyncio.get_running_loop().time() < stop_at:
                status, _ = await post(http, st.url, user, body(group, 8, itl_s=0.004))
                outcomes[group].append(status)
                if status != 200:
                    await asyncio.sleep(0.002)

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=100)) as http:
            await asyncio.gather(*[client(http, f"g{i}", "gold") for i in range(30)], *[client(http, f"b{i}", "bronze") for i in range(2)])
            tags = await upstream_tags(http, st)
    served = [t for t in tags if t in ("gold", "bronze")][40:]
    assert len(served) >= 60, len(served)
    frac = served.count("bronze") / len(served)
    assert 0.22 <= frac <= 0.45, (frac, len(served))
    assert outcomes["gold"].count(429) > 100  # the queue was full: gold was refused throughout
    if os.environ.get("LLM_QOS_VERBOSE"):
        print(f"bronze {frac:.1%} of {len(served)} dispatches; bronze answers {sorted(collections.Counter(outcomes['bronze']).items())}")


# ---------------------------------------------- token capacity and inversion (attack 6)


def _tokens_config(upstream_url: str) -> dict:
    return {
        "upstream": {"url": upstream_url, "kind": "openai", "load_signal": {"enabled": False}},
        "admission": {"max_inflight": 8, "max_inflight_tokens": 1000, "max_queue": 100, "queue_timeout_s": 60},
        "identity": {"header": "X-User-Id"},
        "admin": {"api_key": "sk-admin"},
        "default_group": "gold",
        "groups": [{"name": "gold"}, {"name": "bronze", "min_share": 0.5, "users": [{"id": "bz"}]}],
    }


async def test_an_oversize_low_priority_request_never_holds_a_higher_group_back():
    """With ``max_inflight_tokens: 1000``: a bronze request reserving more than 1000 tokens
    is refused at once (400 ``request_too_large``) and never reaches the engine. One that
    fits only beside nothing else (about 990 tokens) waits, owed (bronze has ``min_share``
    and no service), while a long gold request holds 104 tokens and five gold clients keep
    sending short ones, with slots free: gold's requests keep going past it, and it goes
    once gold stops (with the old rule the first was admitted to hold the engine, and the
    second held gold back while slots were free)."""
    with open_stack(_tokens_config) as st:
        stop_gold = asyncio.Event()
        gold_done: list[int] = []

        async def gold(http: aiohttp.ClientSession, i: int) -> None:
            while not stop_gold.is_set():
                status, _ = await post(http, st.url, f"g{i}", body("gold", 100, itl_s=0.003))
                gold_done.append(status)

        async with aiohttp.ClientSession() as http:
            anchor = asyncio.create_task(post(http, st.url, "g-long", body("anchor", 100, itl_s=0.06)))  # 6 s
            await until("the long gold request running", lambda: _started(http, st, "anchor", 1))
            golds = [asyncio.create_task(gold(http, i)) for i in range(5)]
            try:
                await until("gold running", lambda: _started(http, st, "gold", 5))
                t0 = asyncio.get_running_loop().time()
                status, err = await post(http, st.url, "bz", body("never", 2000))
                assert status == 400 and err["error"]["code"] == "request_too_large", err
                assert asyncio.get_running_loop().time() - t0 < 2.0  # at once, not queued
                big = asyncio.create_task(post(http, st.url, "bz", body("big", 985)))
                await until("big queued", lambda: _depths_are(http, st, bronze=1))
                mark = len(await upstream_tags(http, st))
                gold_waiting = 0
                for _ in range(40):  # 2 s
                    gold_waiting = max(gold_waiting, (await group_depths(http, st))["gold"])
                    await asyncio.sleep(0.05)
                during = (await upstream_tags(http, st))[mark:]
                assert "big" not in during and "anchor" not in during  # it never fits beside the long request ...
                assert during.count("gold") >= 10, during  # ... and gold is never held back by it
                assert gold_waiting == 0
            finally:
                stop_gold.set()
                await asyncio.gather(*golds)
            status, _ = await asyncio.wait_for(big, 20)
            assert (await anchor)[0] == 200
            tags = await upstream_tags(http, st)
    assert status == 200 and "never" not in tags and tags.count("big") == 1
    assert tags.index("big") > tags.index("anchor")
    assert all(s == 200 for s in gold_done)


async def _started(http: aiohttp.ClientSession, st: Stack, tag: str, n: int) -> bool:
    return (await upstream_tags(http, st)).count(tag) >= n
