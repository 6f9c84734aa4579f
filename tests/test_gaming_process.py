"""One test per attack of issue 10, through the real proxy process (``python -m proxy``)
in front of the fake upstream (its own process, refusing max_tokens beyond its context
length with a 400 the way vLLM does): the honest users' outcome holds.

Dispatch order is read from the upstream's record of the requests it started (each body
carries a ``fake.tag``), so what is asserted is what the engine really saw.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

import aiohttp
import pytest
import yaml

from bench._harness import free_port, start_fake_upstream, stop
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
    """The fake upstream and the proxy, each its own process, on free loopback ports."""

    def __init__(self, tmp: Path, **admission) -> None:
        self.tmp = tmp
        up_port, px_port = free_port(), free_port()
        self.upstream = start_fake_upstream(up_port, tmp, max_model_len=CONTEXT)
        self.upstream_url = f"http://127.0.0.1:{up_port}"
        cfg = tmp / "config.yaml"
        cfg.write_text(yaml.safe_dump(_config(self.upstream_url, **admission)))
        self.proxy = start_proxy(cfg, px_port, extra_args=["--no-watch"])
        self.url = f"http://127.0.0.1:{px_port}"

    def close(self) -> None:
        stop_proxy(self.proxy)
        stop(self.upstream)


@pytest.fixture
def stack(request):
    with tempfile.TemporaryDirectory(prefix="llm-qos-gaming-") as d:
        s = Stack(Path(d), **getattr(request, "param", {}))
        try:
            yield s
        finally:
            s.close()


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


async def queued(http: aiohttp.ClientSession, st: Stack) -> int:
    async with http.get(st.url + "/admin/status", headers=ADMIN) as r:
        return (await r.json())["queued"]


async def hold_slots(http: aiohttp.ClientSession, st: Stack) -> list[asyncio.Task]:
    """Two slow requests that keep both slots busy while a backlog is built."""
    tasks = [asyncio.create_task(post(http, st.url, "warm", body("warm", 3, itl_s=0.4))) for _ in range(2)]
    for _ in range(200):
        if (await upstream_tags(http, st)).count("warm") == 2:
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


@pytest.mark.parametrize("reported", [{"usage": False}, {"prompt": 5200}], ids=["no-usage", "usage-asked-by-the-proxy"])
async def test_prompt_stuffed_in_tools_is_counted_against_the_rate_limit(stack, reported):
    """A user limited to 3 000 tokens a minute streams requests with a 5 000-token prompt
    in ``tools`` and no usage report: one such request goes (a request larger than the
    bucket is served once when the bucket is full), the next ones get 429 (with the old
    estimate, tools were free and, with no usage to true up, every one passed); the
    honest user is served throughout."""
    st = stack
    tools = [{"type": "function", "function": {"name": "f", "description": "d" * 20_000, "parameters": {"type": "object"}}}]

    async def stream(user: str, b: dict) -> int:
        async with http.post(st.url + "/v1/chat/completions", json=b, headers={"X-User-Id": user}) as r:
            await r.read()
            return r.status

    async with aiohttp.ClientSession() as http:
        # the engine reports no usage, or (asked by the proxy: upstream.stream_usage) the
        # real prompt size; either way the stuffed tools count
        stuffed = body("stuffer", 1, stream=True, **reported)
        stuffed["tools"] = tools
        assert await stream("stuffer", stuffed) == 200
        codes = await asyncio.gather(*[stream("stuffer", stuffed) for _ in range(5)], *[stream("short", body("short", 4, stream=True)) for _ in range(5)])
        assert codes[:5] == [429] * 5 and codes[5:] == [200] * 5
        async with http.post(st.url + "/v1/chat/completions", json=stuffed, headers={"X-User-Id": "stuffer"}) as r:
            err = (await r.json())["error"]
            assert r.status == 429 and err["code"] == "rate_limited" and int(r.headers["Retry-After"]) >= 30


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
