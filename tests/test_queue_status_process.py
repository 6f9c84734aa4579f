"""Telling waiting clients the truth, through the real proxy on real sockets in front of
the scripted fake engine (bench/fake_upstream.py): ``Retry-After`` follows the measured
drain rate (a slow engine gives a larger one than a fast one), the opt-in queue status
(``x-llm-qos-queue-status: 1``: SSE comment lines with a position that falls to
admission, headers on the proxy's own answers), a client without the header sees what
it saw before, and a client that leaves while waiting frees everything."""

from __future__ import annotations

import asyncio
import re

import aiohttp
import yaml

from proxy.admission.queue_status import QUEUE_ETA_S, QUEUE_POSITION, QUEUE_STATUS, QUEUE_WAIT_S
from tests.conftest import wait_until
from tests.proc_util import free_port
from tests.proxy_process import start_proxy, stop_proxy
from tests.scripted_upstream import ScriptedUpstream, chat_chunk, stream

OPT_IN = {QUEUE_STATUS: "1"}


async def _post(http: aiohttp.ClientSession, url: str, body: dict, headers: dict | None = None) -> tuple[int, dict, str]:
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers or {}) as r:
        return r.status, dict(r.headers), await r.text()


async def _drain_rate_measured(st, http, per_request_s: float, tokens: int = 4) -> None:
    """Keep one request in flight and one waiting until the proxy has measured three
    starts of a waiting request (one every ``per_request_s``)."""
    itl = per_request_s / tokens
    sched = st.state.admission.scheduler
    tasks = [asyncio.create_task(_post(http, st.proxy_url, st.chat_body(tokens, itl_s=itl))) for _ in range(2)]
    await wait_until(lambda: sched.queued == 1, what="one waiting")
    for _ in range(3):
        started = st.stats.started
        await wait_until(lambda: st.stats.started > started, timeout=10 * per_request_s + 5, what="the next start")
        tasks.append(asyncio.create_task(_post(http, st.proxy_url, st.chat_body(tokens, itl_s=itl))))
        await wait_until(lambda: sched.queued == 1, what="one waiting again")
    st.tasks = tasks
    assert sched.waits.drain.rate(sched._clock()) is not None


async def _refusals(st, http, n: int, headers: dict | None = None) -> list[tuple[int, dict, str]]:
    """Fill the queue (max_queue 2: one more) and send ``n`` more that are refused."""
    sched = st.state.admission.scheduler
    st.tasks.append(asyncio.create_task(_post(http, st.proxy_url, st.chat_body(4, itl_s=0.0))))
    await wait_until(lambda: sched.queued == 2, what="a full queue")
    return [await _post(http, st.proxy_url, st.chat_body(1), headers) for _ in range(n)]


async def test_retry_after_follows_the_drain_rate(make_stack, http):
    slow = await make_stack(max_inflight=1, max_queue=2, queue_timeout_s=60)
    await _drain_rate_measured(slow, http, per_request_s=2.4)
    rate = slow.state.admission.scheduler.drain_rate()
    assert 0.3 < rate < 0.5, rate  # one start every 2.4 s
    assert slow.state.admission.snapshot()["pools"][0]["drain_rate"] == round(rate, 3)  # /admin/status
    refused = await _refusals(slow, http, 2)
    assert [s for s, _h, _b in refused] == [429, 429]
    slow_after = [int(h["Retry-After"]) for _s, h, _b in refused]
    # a full queue has a place after one start (2.4 s: 3; more if the engine was late
    # on a loaded machine: the time since the last start counts once it is longer); the
    # next client refused with it is told to come one start (2.4 s) later
    assert slow_after[0] >= 3 and slow_after[1] - slow_after[0] in (2, 3), slow_after
    assert all(QUEUE_POSITION not in h and QUEUE_WAIT_S not in h for _s, h, _b in refused)  # not asked
    await asyncio.gather(*slow.tasks, return_exceptions=True)

    fast = await make_stack(max_inflight=1, max_queue=2, queue_timeout_s=60)
    await _drain_rate_measured(fast, http, per_request_s=0.3)
    refused = await _refusals(fast, http, 2, OPT_IN)
    fast_after = [int(h["Retry-After"]) for _s, h, _b in refused]
    assert fast_after == [1, 1], fast_after  # 0.3 s and 0.6 s: at least 1 s
    status, headers, body = refused[0]
    assert status == 429 and '"queue_full"' in body
    # asked: the place a request would take now (2 waiting: the third) and its estimate
    assert headers[QUEUE_POSITION] == "3"
    assert 0.5 < float(headers[QUEUE_ETA_S]) < 1.5  # 3 x 0.3 s
    assert float(headers[QUEUE_WAIT_S]) < 0.5
    await asyncio.gather(*fast.tasks, return_exceptions=True)


def _comments(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"^: queue position=(\d+)", text, re.M)]


async def test_a_waiting_stream_is_told_its_position_until_it_is_admitted(make_stack, http):
    st = await make_stack(max_inflight=1, max_queue=10, queue_timeout_s=30)
    sched = st.state.admission.scheduler
    first = asyncio.create_task(_post(http, st.proxy_url, st.chat_body(4, itl_s=0.15)))
    await wait_until(lambda: st.stats.started == 1, what="the slot taken")
    ahead = [asyncio.create_task(_post(http, st.proxy_url, st.chat_body(4, itl_s=0.15))) for _ in range(2)]
    await wait_until(lambda: sched.queued == 2, what="two waiting")
    status, headers, text = await asyncio.wait_for(_post(http, st.proxy_url, st.chat_body(3, stream=True, itl_s=0.0), OPT_IN), 10)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    positions = _comments(text)
    # it waited behind three (one in flight, two queued): told 3, 2, 1, then admitted
    assert positions[0] == 3 and positions[-1] == 0, text
    assert positions == sorted(positions, reverse=True) and {3, 2, 1, 0} <= set(positions)
    assert re.search(r"^: queue position=3 eta_s=\d+\.\d$", text, re.M)
    data = [ln for ln in text.splitlines() if ln.startswith("data: ")]
    assert data[-1] == "data: [DONE]" and len(data) >= 4
    assert text.index(": queue position=0") < text.index("data: ")  # the status, then the answer
    await asyncio.gather(first, *ahead)
    assert not st.state.admission.default.watchers


async def test_a_client_without_the_header_sees_what_it_saw_before(make_stack, http):
    st = await make_stack(max_inflight=1, max_queue=10, queue_timeout_s=30)
    sched = st.state.admission.scheduler
    alone = await _post(http, st.proxy_url, st.chat_body(3, stream=True))
    first = asyncio.create_task(_post(http, st.proxy_url, st.chat_body(4, itl_s=0.15)))
    await wait_until(lambda: st.stats.started == 2, what="the slot taken")
    waited = asyncio.create_task(_post(http, st.proxy_url, st.chat_body(3, stream=True)))
    await wait_until(lambda: sched.queued == 1, what="it waits")
    status, headers, text = await asyncio.wait_for(waited, 10)
    await first
    assert status == alone[0] == 200
    assert ": queue" not in text and not any(k.lower().startswith("x-llm-qos") for k in headers)
    strip = lambda t: re.sub(r'"created": ?\d+', "", t)  # noqa: E731
    assert strip(text) == strip(alone[2])  # byte for byte as when it did not wait
    assert {k for k in headers if k not in ("Date", "X-Request-Id")} == {k for k in alone[1] if k not in ("Date", "X-Request-Id")}
    # and a non-streaming answer after a wait carries nothing added either
    first = asyncio.create_task(_post(http, st.proxy_url, st.chat_body(4, itl_s=0.15)))
    await wait_until(lambda: st.stats.started == 4, what="the slot taken")
    status, headers, _ = await _post(http, st.proxy_url, st.chat_body(2))
    await first
    assert status == 200 and not any(k.lower().startswith("x-llm-qos") for k in headers)
    # asked, a non-streaming answer says how long it waited
    first = asyncio.create_task(_post(http, st.proxy_url, st.chat_body(4, itl_s=0.15)))
    await wait_until(lambda: st.stats.started == 6, what="the slot taken")
    status, headers, _ = await _post(http, st.proxy_url, st.chat_body(2), OPT_IN)
    await first
    assert status == 200 and 0.1 < float(headers[QUEUE_WAIT_S]) < 5


async def test_a_stream_refused_after_its_status_went_out_ends_with_an_error_event(make_stack, http):
    st = await make_stack(max_inflight=1, max_queue=10, queue_timeout_s=1)
    first = asyncio.create_task(_post(http, st.proxy_url, st.chat_body(4, itl_s=0.5)))
    await wait_until(lambda: st.stats.started == 1, what="the slot taken")
    status, _h, text = await asyncio.wait_for(_post(http, st.proxy_url, st.chat_body(3, stream=True), OPT_IN), 10)
    assert status == 200 and _comments(text)[0] == 1
    last = [ln for ln in text.splitlines() if ln.startswith("data: ")]
    assert len(last) == 1 and '"error"' in last[0] and '"queue_timeout"' in last[0], text
    await first


async def test_a_client_that_leaves_while_waiting_frees_everything(make_stack, http):
    st = await make_stack(max_inflight=1, max_queue=10, queue_timeout_s=30)
    sched, pool = st.state.admission.scheduler, st.state.admission.default
    first = asyncio.create_task(_post(http, st.proxy_url, st.chat_body(4, itl_s=0.3)))
    await wait_until(lambda: st.stats.started == 1, what="the slot taken")
    async with aiohttp.ClientSession() as own:
        r = await own.post(st.proxy_url + "/v1/chat/completions", json=st.chat_body(3, stream=True), headers=OPT_IN)
        assert r.status == 200
        line = await asyncio.wait_for(r.content.readline(), 5)
        assert line.startswith(b": queue position=1")
        assert sched.queued == 1 and len(pool.watchers) == 1
        r.close()  # the client goes away while its request waits
    await wait_until(lambda: sched.queued == 0 and not pool.watchers, what="its place freed")
    await first
    await wait_until(lambda: not sched.inflight, what="nothing in flight")
    assert st.stats.started == 1  # it never reached the engine
    assert not [t for t in asyncio.all_tasks() if "report_while_waiting" in repr(t.get_coro())]


async def test_a_waiting_stream_preempted_before_its_first_token_is_one_stream(make_stack, http):
    st = await make_stack(max_inflight=1, max_queue=10, queue_timeout_s=30, preemption={"after_s": 0.2})
    sched = st.state.admission.scheduler
    first = asyncio.create_task(_post(http, st.proxy_url, st.chat_body(2, itl_s=0.3, tag="first")))
    await wait_until(lambda: st.stats.started == 1, what="the slot taken")
    # a bronze stream that waits (its status lines), then waits 1 s for its first token
    low = asyncio.create_task(_post(http, st.proxy_url, st.chat_body(3, stream=True, ttft_s=1.0, tag="low"), OPT_IN))
    await wait_until(lambda: st.stats.started == 2, timeout=10, what="the bronze stream dispatched")
    high = await _post(http, st.proxy_url, st.chat_body(2, tag="high"), {"Authorization": "Bearer sk-alice"})
    assert high[0] == 200
    status, _h, text = await asyncio.wait_for(low, 15)
    await first
    assert st.stats.tags == ["first", "low", "high", "low"] and st.stats.aborted == 1  # preempted once
    assert status == 200 and _comments(text)[0] == 1 and _comments(text)[-1] == 0
    data = [ln for ln in text.splitlines() if ln.startswith("data: ")]
    assert data[-1] == "data: [DONE]" and not any('"error"' in d for d in data)
    assert text.count('"role"') <= 1 and sched.queued == 0 and not sched.inflight


async def test_the_proxy_process_tells_a_waiting_stream_and_only_the_one_that_asks(tmp_path):
    """The real proxy process (``python -m proxy proxy``) in front of the scripted engine:
    a stream that asks gets its status lines, then the engine's events; one that does not
    ask gets the engine's bytes exactly as when it did not wait."""
    events = [chat_chunk("Hello"), chat_chunk(" there", finish="stop"), b"data: [DONE]\n\n"]
    with ScriptedUpstream() as up:
        up.on("busy", stream([1.0, *events]))  # holds the one slot 1 s
        up.on("m", stream(events))
        cfg = {
            "upstream": {"url": up.url, "kind": "openai", "load_signal": {"enabled": False}},
            "admission": {"max_inflight": 1, "max_queue": 10, "queue_timeout_s": 30},
            "identity": {"header": "X-User-Id"},
            "default_group": "bronze",
            "groups": [{"name": "platinum", "users": [{"id": "alice"}]}, {"name": "bronze"}],
        }
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(cfg))
        port = free_port()
        proc = start_proxy(path, port)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        try:
            async with aiohttp.ClientSession() as http:

                async def chat(model: str, headers: dict) -> tuple[int, dict, bytes]:
                    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
                    async with http.post(url, json=body, headers={"X-User-Id": "carl", **headers}) as r:
                        return r.status, dict(r.headers), await r.read()

                alone = await chat("m", {})
                busy = asyncio.create_task(chat("busy", {}))
                await wait_until(lambda: len(up.seen_for("busy")) == 1, what="the slot taken")
                asked = asyncio.create_task(chat("m", OPT_IN))
                plain = asyncio.create_task(chat("m", {}))
                (s1, _h1, raw1), (s2, h2, raw2), _ = await asyncio.wait_for(asyncio.gather(asked, plain, busy), 15)
        finally:
            stop_proxy(proc)
    assert s1 == 200 and raw1.startswith(b": queue position=1 eta_s=")
    text = raw1.decode()
    assert _comments(text)[-1] == 0 and text.endswith("".join(e.decode() for e in events))
    assert s2 == alone[0] == 200 and raw2 == alone[2]  # byte for byte: it waited, unseen
    assert {k for k in h2 if k not in ("Date", "X-Request-Id")} == {k for k in alone[1] if k not in ("Date", "X-Request-Id")}
