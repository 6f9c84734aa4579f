"""The proxy relays answers faithfully and reports errors in OpenAI's shape."""

from __future__ import annotations

import aiohttp
import orjson

from tests.conftest import wait_until


async def test_non_streaming_answer_is_passed_through(make_stack, http):
    st = await make_stack()
    async with http.post(st.proxy_url + "/v1/chat/completions", json=st.chat_body(5)) as r:
        assert r.status == 200
        body = await r.json()
    assert body["choices"][0]["message"]["content"] == " t0 t1 t2 t3 t4"
    assert body["usage"]["completion_tokens"] == 5
    assert st.state.admission.scheduler.inflight == set()


async def test_stream_is_relayed_with_sse_headers_and_done(make_stack, http):
    st = await make_stack()
    async with http.post(st.proxy_url + "/v1/chat/completions", json=st.chat_body(6, stream=True)) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        assert r.headers["Cache-Control"] == "no-cache"
        assert r.headers["X-Accel-Buffering"] == "no"
        raw = await r.read()
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert raw.count(b"[DONE]") == 1
    texts = [orjson.loads(e[6:])["choices"][0]["delta"].get("content") for e in events[:-1]]
    assert texts[:6] == [f" t{i}" for i in range(6)]


async def test_done_is_appended_when_upstream_omits_it(make_stack, http):
    st = await make_stack()
    async with http.post(st.proxy_url + "/v1/chat/completions", json=st.chat_body(3, stream=True, no_done=True)) as r:
        raw = await r.read()
    assert raw.endswith(b"data: [DONE]\n\n")
    assert raw.count(b"[DONE]") == 1


async def test_chunks_arrive_as_generated_not_buffered(make_stack, http):
    st = await make_stack(itl_s=0.3)
    async with http.post(st.proxy_url + "/v1/chat/completions", json=st.chat_body(4, stream=True)) as r:
        first = await r.content.readuntil(b"\n\n")
        # the first token arrives while the upstream is still generating the rest
        assert b" t0" in first
        assert st.stats.completed == 0
        await r.read()


async def test_completions_route_streams(make_stack, http):
    st = await make_stack()
    body = {"model": "fake-model", "prompt": "Once upon", "max_tokens": 3, "stream": True}
    async with http.post(st.proxy_url + "/v1/completions", json=body) as r:
        raw = await r.read()
    assert raw.count(b'"text_completion"') == 4 and raw.endswith(b"data: [DONE]\n\n")


async def test_models_passthrough(make_stack, http):
    st = await make_stack()
    async with http.get(st.proxy_url + "/v1/models") as r:
        assert r.status == 200
        assert (await r.json())["data"][0]["id"] == "fake-model"


async def test_health_ready_metrics(make_stack, http):
    st = await make_stack()
    async with http.get(st.proxy_url + "/health") as r:
        assert r.status == 200
    async with http.get(st.proxy_url + "/ready") as r:
        assert r.status == 200
    async with http.post(st.proxy_url + "/v1/chat/completions", json=st.chat_body(4)) as r:
        await r.read()
    async with http.get(st.proxy_url + "/metrics") as r:
        text = await r.text()
    assert 'llm_qos_requests_total{group="bronze",outcome="ok"} 1.0' in text
    assert 'llm_qos_tokens_total{direction="completion",group="bronze"} 4.0' in text
    assert "llm_qos_inflight_requests 0.0" in text


async def _error(r: aiohttp.ClientResponse) -> dict:
    body = await r.json()
    assert set(body["error"]) >= {"message", "type", "code"}
    return body["error"]


async def test_bad_input_gets_400_and_proxy_keeps_serving(make_stack, http):
    st = await make_stack()
    url = st.proxy_url + "/v1/chat/completions"
    async with http.post(url, data=b"{not json", headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400
        assert "JSON" in (await _error(r))["message"]
    async with http.post(url, json={"messages": "hi"}) as r:
        assert r.status == 400
        assert (await _error(r))["param"] == "messages"
    async with http.post(url, json={"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}) as r:
        assert r.status == 400
        assert (await _error(r))["param"] == "max_tokens"
    async with http.post(url, json={"messages": [{"role": "user", "content": "x"}], "stream": "yes"}) as r:
        assert r.status == 400
    async with http.post(url, data=b"\xff\xfe\x00garbage") as r:
        assert r.status == 400
    async with http.get(st.proxy_url + "/v1/nothing-here") as r:
        assert r.status == 404
        assert (await _error(r))["code"] == "not_found"
    async with http.get(url) as r:
        assert r.status == 405
    assert st.stats.started == 0  # nothing bad reached the upstream
    async with http.post(url, json=st.chat_body(2)) as r:
        assert r.status == 200


async def test_upstream_refused_is_502(make_stack, http, unused_tcp_port):
    st = await make_stack()
    st.state.upstream.reconfigure(st.state.active.config.upstream.model_copy(update={"url": f"http://127.0.0.1:{unused_tcp_port}"}))
    async with http.post(st.proxy_url + "/v1/chat/completions", json=st.chat_body(2)) as r:
        assert r.status == 502
        assert (await _error(r))["code"] == "upstream_unreachable"
    assert st.state.admission.scheduler.inflight == set()


async def test_upstream_error_status_is_passed_on(make_stack, http):
    st = await make_stack()
    async with http.post(st.proxy_url + "/v1/chat/completions", json=st.chat_body(2, stream=True, status=500)) as r:
        assert r.status == 500
    assert st.state.admission.scheduler.inflight == set()


async def test_upstream_break_mid_stream_ends_with_error_event(make_stack, http):
    st = await make_stack()
    async with http.post(st.proxy_url + "/v1/chat/completions", json=st.chat_body(10, stream=True, fail_after=3)) as r:
        raw = await r.read()
    assert b" t2" in raw
    assert raw.rstrip().endswith(b"}}")  # terminal error event, no [DONE]
    assert b"upstream_stream_broken" in raw and b"[DONE]" not in raw
    await wait_until(lambda: not st.state.admission.scheduler.inflight, what="slot released")


async def test_client_key_is_not_forwarded_upstream_key_is(make_stack, http, monkeypatch):
    st = await make_stack()
    monkeypatch.setenv("UPSTREAM_KEY_FOR_TEST", "sk-upstream")
    st.state.upstream.reconfigure(st.state.active.config.upstream.model_copy(update={"api_key_env": "UPSTREAM_KEY_FOR_TEST"}))
    async with http.post(st.proxy_url + "/v1/chat/completions", json=st.chat_body(1), headers={"Authorization": "Bearer sk-alice"}) as r:
        assert r.status == 200
    assert st.stats.authorization == ["Bearer sk-upstream"]
