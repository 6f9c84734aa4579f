"""Preemption through the real proxy (aiohttp on real sockets, the scripted fake engine
of bench/fake_upstream.py): a lower group's request that has shown its client nothing
gives its slot to a higher group's request that waited past ``admission.preemption.after_s``,
is aborted upstream, requeued at the head of its queue and answered later, never with an
error. The same against the real vLLM engine: tests/test_preemption_vllm.py."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import aiohttp
import yaml

from tests.conftest import wait_until
from tests.proc_util import free_port
from tests.proxy_process import start_proxy, stop_proxy
from tests.scripted_upstream import ScriptedUpstream, chat_chunk, stream

AFTER_S = 0.2


async def _post(http: aiohttp.ClientSession, url: str, body: dict, **headers: str) -> tuple[int, dict]:
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        return r.status, await r.json()


async def _status(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(url + "/admin/status", headers={"Authorization": "Bearer adm"}) as r:
        assert r.status == 200
        return await r.json()


def _preemption(**kw) -> dict:
    return {"after_s": AFTER_S, **kw}


async def _metric(http: aiohttp.ClientSession, url: str, name: str) -> dict[str, float]:
    """``{label text: value}`` of every sample of ``name`` in ``/metrics``."""
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            key, _, value = line.rpartition(" ")
            out[key[len(name) :]] = float(value)
    return out


async def test_preempted_request_is_requeued_and_answered_without_error(make_stack, http, caplog, monkeypatch):
    monkeypatch.setenv("LLM_QOS_ADMIN_KEY", "adm")
    caplog.set_level(logging.INFO, logger="llm_qos.access")
    st = await make_stack(max_inflight=1, preemption=_preemption())
    sched = st.state.admission.scheduler
    # a bronze request, not streaming: 5 tokens 0.2 s apart, so ~1 s of work
    low = asyncio.create_task(_post(http, st.proxy_url, st.chat_body(5, itl_s=0.2, tag="low"), **{"X-Request-Id": "low-1"}))
    await wait_until(lambda: st.stats.started == 1, what="the slot taken by bronze")
    high = asyncio.create_task(_post(http, st.proxy_url, st.chat_body(2, tag="high"), Authorization="Bearer sk-alice"))
    status, body = await asyncio.wait_for(high, 5)
    assert status == 200
    status, body = await asyncio.wait_for(low, 10)
    assert status == 200 and body["usage"]["completion_tokens"] == 5  # the whole answer, later
    assert st.stats.tags == ["low", "high", "low"]  # high ran first once it had waited
    assert st.stats.aborted == 1  # the first attempt was aborted upstream
    assert sched.queued == 0 and not sched.inflight
    counted = await _metric(http, st.proxy_url, "llm_qos_preemptions_total")
    assert list(counted.values()) == [1.0] and 'group="bronze"' in next(iter(counted))
    aborts = await _metric(http, st.proxy_url, "llm_qos_upstream_aborts_total")
    assert aborts['{reason="preempted"}'] == 1.0
    snap = await _status(http, st.proxy_url)
    assert [p["preemptions"] for p in snap["pools"]] == [1]
    await asyncio.sleep(0.05)  # the access line is written after the response
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "llm_qos.access"]
    mine = [ln for ln in lines if ln["request_id"] == "low-1"]
    assert len(mine) == 1 and mine[0]["preemptions"] == 1 and mine[0]["status"] == 200 and mine[0]["outcome"] == "ok"


async def test_a_stream_that_has_shown_tokens_keeps_running(make_stack, http):
    st = await make_stack(max_inflight=1, preemption=_preemption())
    sched = st.state.admission.scheduler

    async def stream() -> tuple[int, bytes]:
        async with http.post(st.proxy_url + "/v1/chat/completions", json=st.chat_body(5, stream=True, itl_s=0.15, tag="low")) as r:
            return r.status, await r.read()

    low = asyncio.create_task(stream())
    await wait_until(lambda: st.stats.tokens_sent >= 1, what="the stream's first token")
    high = asyncio.create_task(_post(http, st.proxy_url, st.chat_body(1, tag="high"), Authorization="Bearer sk-alice"))
    status, raw = await asyncio.wait_for(low, 10)
    assert status == 200 and raw.rstrip().endswith(b"data: [DONE]")
    assert (await asyncio.wait_for(high, 5))[0] == 200
    assert st.stats.tags == ["low", "high"] and st.stats.aborted == 0
    assert not sched.inflight and sched.queued == 0


async def test_each_request_is_preempted_at_most_max_per_request(make_stack, http):
    st = await make_stack(max_inflight=1, preemption=_preemption(max_per_request=1))
    low = asyncio.create_task(_post(http, st.proxy_url, st.chat_body(4, itl_s=0.2, tag="low")))
    await wait_until(lambda: st.stats.started == 1, what="the slot taken by bronze")
    first = asyncio.create_task(_post(http, st.proxy_url, st.chat_body(1, tag="high1"), Authorization="Bearer sk-alice"))
    assert (await asyncio.wait_for(first, 5))[0] == 200
    await wait_until(lambda: st.stats.started == 3, what="bronze running again")
    second = asyncio.create_task(_post(http, st.proxy_url, st.chat_body(1, tag="high2"), Authorization="Bearer sk-alice"))
    status, body = await asyncio.wait_for(low, 10)
    assert status == 200 and body["usage"]["completion_tokens"] == 4
    assert (await asyncio.wait_for(second, 5))[0] == 200
    # bronze was taken once; the second platinum request waited for it to finish
    assert st.stats.tags == ["low", "high1", "low", "high2"] and st.stats.aborted == 1


async def test_client_leaving_while_requeued_frees_everything(make_stack, http):
    st = await make_stack(max_inflight=1, preemption=_preemption())
    sched = st.state.admission.scheduler
    low = asyncio.create_task(_post(http, st.proxy_url, st.chat_body(5, itl_s=0.2, tag="low"), **{"X-User-Id": "leaver"}))
    await wait_until(lambda: st.stats.started == 1, what="the slot taken by bronze")
    # platinum holds the slot long enough for the requeued bronze request to be waiting
    high = asyncio.create_task(_post(http, st.proxy_url, st.chat_body(10, itl_s=0.1, tag="high"), Authorization="Bearer sk-alice"))
    await wait_until(lambda: st.stats.started == 2 and sched.queued == 1, what="bronze preempted and queued again")
    low.cancel()  # the client leaves while its request waits again
    await wait_until(lambda: sched.queued == 0, what="the requeued request gone from the queue")
    assert sched.user_state("leaver")["inflight"] == 0 and sched.user_state("leaver")["queued"] == 0
    assert (await asyncio.wait_for(high, 5))[0] == 200
    assert not sched.inflight and st.stats.tags == ["low", "high"]
    assert st.state.admission.default.router.inflight == 0


async def test_disabled_preemption_leaves_strict_priority_alone(make_stack, http):
    st = await make_stack(max_inflight=1, preemption={"enabled": False, "after_s": AFTER_S})
    low = asyncio.create_task(_post(http, st.proxy_url, st.chat_body(4, itl_s=0.15, tag="low")))
    await wait_until(lambda: st.stats.started == 1, what="the slot taken by bronze")
    high = asyncio.create_task(_post(http, st.proxy_url, st.chat_body(1, tag="high"), Authorization="Bearer sk-alice"))
    assert (await asyncio.wait_for(low, 5))[0] == 200 and (await asyncio.wait_for(high, 5))[0] == 200
    assert st.stats.tags == ["low", "high"] and st.stats.aborted == 0


# ------------------------------------------- a stream that has shown nothing yet


def _scripted_proxy(up, folder: Path):
    cfg = {
        "upstream": {"url": up.url, "kind": "openai", "load_signal": {"enabled": False}},
        "admission": {"max_inflight": 1, "queue_timeout_s": 30, "preemption": {"after_s": AFTER_S}},
        "identity": {"header": "X-User-Id"},
        "default_group": "bronze",
        "groups": [{"name": "platinum", "users": [{"id": "alice"}]}, {"name": "bronze"}],
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = free_port()
    proc = start_proxy(path, port)
    return proc, f"http://127.0.0.1:{port}"


async def test_a_stream_before_its_first_token_is_preempted_and_its_client_sees_one_answer(tmp_path):
    """The engine sends a stream's headers at once and its first event only when the
    first token is out (vLLM does): the proxy holds the headers back until that event,
    so a bronze stream still waiting for its first token has shown its client nothing,
    and is preempted for a platinum request like a non-streaming one. Its client gets one
    200 stream with the whole answer, from the second attempt."""
    events = [chat_chunk("Hello"), chat_chunk(" there", finish="stop"), b"data: [DONE]\n\n"]
    with ScriptedUpstream() as up:
        up.on("low", stream([2.0, *events]))  # 2 s before the first token
        up.on("high", stream(events))
        proc, url = _scripted_proxy(up, tmp_path)
        try:
            async with aiohttp.ClientSession() as http:

                async def chat(model: str, user: str) -> tuple[int, bytes, float]:
                    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
                    async with http.post(url + "/v1/chat/completions", json=body, headers={"X-User-Id": user}) as r:
                        return r.status, await r.read(), time.monotonic()

                low = asyncio.create_task(chat("low", "carl"))
                await wait_until(lambda: len(up.seen_for("low")) == 1, what="the bronze stream sent to the engine")
                status, raw, high_done = await asyncio.wait_for(chat("high", "alice"), 10)
                assert status == 200 and raw.count(b"data: ") == 3
                status, raw, low_done = await asyncio.wait_for(low, 20)
        finally:
            stop_proxy(proc)
    assert status == 200 and raw.startswith(b"data: ") and raw.count(b"data: [DONE]") == 1
    assert b"Hello" in raw and raw.count(b"Hello") == 1  # one answer: the second attempt's
    assert len(up.seen_for("low")) == 2  # sent again after its preemption
    assert high_done < low_done
