"""The OpenAI surface besides chat and completions, end to end: ``POST /v1/embeddings``,
``POST /v1/responses`` (streaming and not) and pass-through paths, through the real proxy
process in front of scripted engines, each a process of its own on a real socket
(``bench.scripted_engine``), or a scripted upstream that records what it received.

Each kind is admitted (it waits in its pool's queue and is charged), routed by ``model``,
relayed as the engine sent it, and aborted upstream when its client leaves. Every wait is
bounded in time; assertions are on what the client and the engine saw.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
import orjson
import pytest
from yarl import URL

from tests.scripted_upstream import ScriptedUpstream, response, stream
from tests.test_pools_process import Proxy, engine_rows, engines, pools_config, proxies  # noqa: F401 (fixtures)

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
JSON = [("Content-Type", "application/json")]


async def stats(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(url + "/stats") as r:
        return await r.json()


async def eventually(check, what: str, timeout_s: float = 5.0) -> None:
    """Wait, bounded, until the async ``check()`` is true."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.05)


def two_pools(a_url: str, b_url: str, **extra) -> dict:
    return pools_config(
        [
            {"name": "embed", "models": ["embedder"], "engines": [{"url": a_url, "name": "a"}]},
            {"name": "chat", "models": ["chatter", {"name": "alias", "upstream_model": "engine-model"}], "engines": [{"url": b_url, "name": "b"}]},
        ],
        **extra,
    )


def sdk(px: Proxy, key: str = "sk-carl") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=px.url + "/v1", api_key=key, max_retries=0)


async def test_embeddings_are_routed_by_model_admitted_at_their_prompt_and_relayed(engines, proxies, tmp_path, http):
    a, b = engines("a", "b")
    px = proxies(tmp_path, two_pools(a.url, b.url))
    client = sdk(px)
    emb = await client.embeddings.create(model="embedder", input=["abcd" * 10, "efgh" * 5])
    assert [d.index for d in emb.data] == [0, 1] and emb.data[0].embedding == [0.0, 0.5, -0.5, 1.0]
    assert emb.usage.prompt_tokens == 15  # the engine's count, passed through
    await client.close()
    st = await px.status(http)
    rows = engine_rows(st)
    assert (rows["a"]["routed"], rows["b"]["routed"]) == (1, 0)
    (carl,) = [u for u in st["users"] if u["user"] == "carl"]
    assert carl["recent_service"] == pytest.approx(15, abs=0.5)  # charged the engine's prompt count, nothing generated
    async with http.post(px.url + "/v1/embeddings", json={"model": "embedder", "input": []}, headers={"Authorization": "Bearer sk-carl"}) as r:
        err = (await r.json())["error"]
        assert r.status == 400 and err["param"] == "input" and err["type"] == "invalid_request_error"
    async with http.post(px.url + "/v1/embeddings", json={"model": "nope", "input": "x"}) as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"


async def test_responses_stream_and_not_through_the_proxy_with_the_openai_sdk(engines, proxies, tmp_path, http):
    a, b = engines("a", "b")
    px = proxies(tmp_path, two_pools(a.url, b.url))
    client = sdk(px)
    events = [e async for e in await client.responses.create(model="chatter", input="hi", stream=True, max_output_tokens=3)]
    assert events[-1].type == "response.completed" and events[-1].response.usage.output_tokens == 3
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == " t0 t1 t2"
    resp = await client.responses.create(model="alias", input="hi", max_output_tokens=2)
    assert resp.output_text == " t0 t1" and resp.usage.input_tokens == 10
    await client.close()
    # the raw stream: the engine's events, byte for byte, and no [DONE] added
    body = {"model": "chatter", "input": "hi", "stream": True, "max_output_tokens": 2}
    async with http.post(px.url + "/v1/responses", json=body) as r:
        raw = await r.read()
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    async with http.post(b.url + "/v1/responses", json=body) as r:
        direct = await r.read()
    strip = lambda s: s.replace(b'"created_at":' + s.split(b'"created_at":')[1].split(b",")[0], b"")  # noqa: E731
    assert b"[DONE]" not in raw and raw.count(b"\n\n") == direct.count(b"\n\n") and strip(raw).split(b"\n\n")[2:] == strip(direct).split(b"\n\n")[2:]
    st = await px.status(http)
    assert engine_rows(st)["b"]["routed"] == 3 and st["inflight"] == 0


async def test_a_cut_responses_stream_ends_with_a_numbered_error_event_and_counts_as_an_upstream_error(engines, proxies, tmp_path, http):
    a, b = engines("a", "b")
    px = proxies(tmp_path, two_pools(a.url, b.url))
    body = {"model": "chatter", "input": "hi", "stream": True, "max_output_tokens": 8, "fake": {"fail_after": 2}}
    async with http.post(px.url + "/v1/responses", json=body) as r:
        raw = await r.read()
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1].startswith(b"event: error\ndata: ")
    last = orjson.loads(events[-1].split(b"data: ", 1)[1])
    assert (last["type"], last["code"]) == ("error", "upstream_stream_broken")
    assert last["sequence_number"] == 4 + 2  # four opening events and two deltas: 0..5
    async with http.get(px.url + "/metrics") as r:
        text = await r.text()
    assert 'llm_qos_requests_total{group="bronze",outcome="upstream_error"} 1.0' in text
    # the OpenAI SDK hands the caller the error event
    client = sdk(px)
    got = [e async for e in await client.responses.create(model="chatter", input="hi", stream=True, max_output_tokens=8, extra_body={"fake": {"fail_after": 1}})]
    assert isinstance(got[-1], openai.types.responses.ResponseErrorEvent) and got[-1].code == "upstream_stream_broken"
    await client.close()


@pytest.mark.parametrize("kind", ["responses_stream", "responses", "embeddings_queued"])
async def test_a_client_that_leaves_frees_its_slot_and_the_engine_aborts(kind, engines, proxies, tmp_path, http):
    (a,) = engines("a")
    await a.script(http, ttft_s=0.2, itl_s=0.2)
    px = proxies(tmp_path, pools_config([{"name": "p", "models": ["*"], "engines": [{"url": a.url, "name": "a", "max_inflight": 1}]}]))
    if kind == "embeddings_queued":
        # a slow Responses request holds the only slot; an embeddings request waits behind it and leaves
        hold = asyncio.create_task(http.post(px.url + "/v1/responses", json={"model": "m", "input": "x", "max_output_tokens": 5}, headers={"X-User-Id": "alice"}))
        await eventually(lambda: _inflight(http, px, 1), "the slow request admitted")
        waiter = asyncio.create_task(http.post(px.url + "/v1/embeddings", json={"model": "m", "input": "x"}))
        await eventually(lambda: _queued(http, px, 1), "the embeddings request queued")
        waiter.cancel()
        await eventually(lambda: _queued(http, px, 0), "the queue emptied when its client left")
        async with await hold as r:
            assert r.status == 200
        assert (await stats(http, a.url))["started"] == 1  # the embeddings request never reached the engine
        return
    body = {"model": "m", "input": "x", "max_output_tokens": 50, "stream": kind == "responses_stream"}

    async def leave_early() -> None:
        async with http.post(px.url + "/v1/responses", json=body) as r:
            if kind == "responses_stream":
                await r.content.readline()  # the first bytes arrived: the generation is under way
            await asyncio.sleep(0.5)

    task = asyncio.create_task(leave_early())
    await eventually(lambda: _inflight(http, px, 1), "the request admitted")
    await asyncio.sleep(0.4)
    task.cancel()
    await eventually(lambda: _inflight(http, px, 0), "the slot freed when the client left")

    async def aborted() -> bool:
        s = await stats(http, a.url)
        return s["aborted"] == 1 and s["active"] == 0

    await eventually(aborted, "the engine's generation aborted")
    async with http.get(px.url + "/metrics") as r:
        assert 'llm_qos_upstream_aborts_total{reason="client_disconnected"} 1.0' in await r.text()


async def _inflight(http, px: Proxy, n: int) -> bool:
    return (await px.status(http))["inflight"] == n


async def _queued(http, px: Proxy, n: int) -> bool:
    return (await px.status(http))["queued"] == n


async def test_two_level_priority_is_written_on_embeddings_and_responses_not_on_pass_through(proxies, tmp_path, http):
    with ScriptedUpstream() as up:
        for key in ("emb", "resp", "speech"):  # the scripted upstream routes by the body's model
            up.on(key, lambda sock, seen: sock.sendall(response(200, JSON, b'{"object":"list","data":[],"usage":{"prompt_tokens":1}}')))
        cfg = pools_config([{"name": "p", "models": ["*"], "engines": [{"url": up.url, "name": "vllm", "priority_field": "priority"}]}])
        cfg["passthrough"] = {"enabled": True}
        px = proxies(tmp_path, cfg)
        for path, model in (("/v1/embeddings", "emb"), ("/v1/responses", "resp"), ("/v1/audio/speech", "speech")):
            async with http.post(px.url + path, json={"model": model, "input": "x"}, headers={"Authorization": "Bearer sk-alice"}) as r:
                assert r.status == 200, (path, await r.text())
        (emb,), (resp,), (speech,) = up.seen_for("emb"), up.seen_for("resp"), up.seen_for("speech")
        assert (emb.target, emb.json["priority"]) == ("/v1/embeddings", 0)
        assert (resp.target, resp.json["priority"]) == ("/v1/responses", 0)
        assert speech.target == "/v1/audio/speech" and speech.json == {"model": "speech", "input": "x"}  # as the client sent it


async def test_pass_through_is_off_by_default_and_forwards_any_method_path_and_query_when_on(proxies, tmp_path, http):
    with ScriptedUpstream() as up:
        up.on("/v1/files/file-1/content", lambda sock, seen: sock.sendall(response(200, [("Content-Type", "application/octet-stream")], b"\x00\x01raw")))
        up.on("/v1/audio/transcriptions", lambda sock, seen: sock.sendall(response(201, JSON + [("X-Engine-Thing", "yes")], b'{"text":"ok"}')))
        up.on("/v1/batches/b1", lambda sock, seen: sock.sendall(response(404, JSON, b'{"error":{"message":"no such batch"}}')))
        cfg = pools_config([{"name": "p", "models": ["*"], "engines": [{"url": up.url, "name": "e"}]}])
        px = proxies(tmp_path, cfg)
        async with http.get(px.url + "/v1/files/file-1/content") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
        async with http.options(px.url + "/v1/chat/completions") as r:  # the proxy's own route, another method
            assert r.status == 405 and "POST" in r.headers["Allow"]
        cfg["passthrough"] = {"enabled": True, "cost_tokens": 7}
        px.write(cfg)
        await px.reload(http)
        async with http.get(URL(px.url + "/v1/files/file-1/content?api-version=2024-10-01&x=%2F", encoded=True), headers={"Authorization": "Bearer sk-carl"}) as r:
            assert (r.status, await r.read()) == (200, b"\x00\x01raw")
        seen = up.seen_for("/v1/files/file-1/content")[-1]
        assert seen.method == "GET" and seen.target.endswith("?api-version=2024-10-01&x=%2F")
        form = aiohttp.FormData()
        form.add_field("file", b"RIFF....", filename="a.wav", content_type="audio/wav")
        form.add_field("model", "whisper-1")
        async with http.post(px.url + "/v1/audio/transcriptions", data=form, headers={"Authorization": "Bearer sk-carl"}) as r:
            assert (r.status, await r.json(), r.headers["X-Engine-Thing"]) == (201, {"text": "ok"}, "yes")
        assert b"RIFF...." in up.seen_for("/v1/audio/transcriptions")[-1].body  # the upload, as the client sent it
        async with http.delete(px.url + "/v1/batches/b1") as r:
            assert r.status == 404 and (await r.json()) == {"error": {"message": "no such batch"}}  # the engine's own 404
        assert up.seen_for("/v1/batches/b1")[-1].method == "DELETE"
        async with http.get(URL(px.url + "/v1/files/../../admin/status", encoded=True)) as r:
            assert r.status in (400, 404)
        async with http.get(URL(px.url + "/v1/files/%2E%2E/secret", encoded=True)) as r:
            assert r.status == 404 and not up.seen_for("/v1/secret")
        st = await px.status(http)
        (carl,) = [u for u in st["users"] if u["user"] == "carl"]
        assert carl["recent_service"] == pytest.approx(2 * 7, abs=0.5)  # admitted at passthrough.cost_tokens each


async def test_pass_through_outside_admission_is_never_queued(engines, proxies, tmp_path, http):
    with ScriptedUpstream() as up:
        up.on("/v1/files", lambda sock, seen: sock.sendall(response(200, JSON, b'{"data":[]}')))
        cfg = pools_config([{"name": "p", "models": ["*"], "engines": [{"url": up.url, "name": "e", "max_inflight": 1}]}])
        cfg["passthrough"] = {"enabled": True, "admit": False}
        px = proxies(tmp_path, cfg)
        for _ in range(3):
            async with http.get(px.url + "/v1/files") as r:
                assert r.status == 200
        st = await px.status(http)
        assert st["users"] == [] and st["inflight"] == 0  # never admitted, never charged


async def test_pass_through_without_a_model_goes_to_the_only_pool_else_names_model(proxies, tmp_path, http):
    with ScriptedUpstream() as one, ScriptedUpstream() as other:
        for up in (one, other):
            up.on("/v1/files", lambda sock, seen: sock.sendall(response(200, JSON, b'{"data":[]}')))
            up.on("chatter", lambda sock, seen: sock.sendall(response(200, JSON, b'{"ok":true}')))
        single = pools_config([{"name": "only", "models": ["listed"], "engines": [{"url": one.url, "name": "one"}]}])
        single["passthrough"] = {"enabled": True}
        px = proxies(tmp_path, single)
        async with http.get(px.url + "/v1/files") as r:  # no body, no model: the only pool
            assert r.status == 200 and len(one.seen_for("/v1/files")) == 1
        two = pools_config(
            [
                {"name": "a", "models": ["listed"], "engines": [{"url": one.url, "name": "one"}]},
                {"name": "b", "models": ["chatter"], "engines": [{"url": other.url, "name": "other"}]},
            ]
        )
        two["passthrough"] = {"enabled": True}
        px.write(two)
        await px.reload(http)
        async with http.get(px.url + "/v1/files") as r:  # two pools, no catch-all: which one is the client's to say
            assert r.status == 400 and (await r.json())["error"]["param"] == "model"
        async with http.post(px.url + "/v1/rerank", json={"model": "chatter", "query": "q"}) as r:
            assert r.status == 200 and other.seen_for("chatter")[-1].target == "/v1/rerank"
        async with http.post(px.url + "/v1/rerank", json={"model": "unknown"}) as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"


async def test_a_pass_through_answer_is_relayed_as_it_comes_with_the_clients_body_type(proxies, tmp_path, http):
    """A download or audio answer is not held whole in the proxy's memory: its first bytes
    reach the client while the engine is still sending, with the engine's length; an
    upload keeps its own ``Content-Type`` (the multipart boundary) and ``Accept``."""
    big = b"x" * 200_000

    def download(sock, seen):
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % (len(big) + 5))
        sock.sendall(big)
        time.sleep(1.5)
        sock.sendall(b"tail!")

    with ScriptedUpstream() as up:
        up.on("/v1/files/f/content", download)
        up.on("tts", stream([b"ID3-audio-1", 1.5, b"-audio-2"], headers=[("Content-Type", "audio/mpeg")]))
        up.on("/v1/uploads", lambda sock, seen: sock.sendall(response(200, JSON, b'{"ok":true}')))
        cfg = pools_config([{"name": "p", "models": ["*"], "engines": [{"url": up.url, "name": "e"}]}])
        cfg["passthrough"] = {"enabled": True}
        px = proxies(tmp_path, cfg)
        t0 = time.monotonic()
        async with http.get(px.url + "/v1/files/f/content") as r:
            assert r.status == 200 and r.headers["Content-Length"] == str(len(big) + 5)
            first = await r.content.read(1000)
            first_at = time.monotonic() - t0
            rest = await r.read()
        assert first_at < 1.2 and first + rest == big + b"tail!"
        t0 = time.monotonic()
        async with http.post(px.url + "/v1/audio/speech", json={"model": "tts", "input": "hi"}) as r:
            assert r.headers["Content-Type"] == "audio/mpeg" and "X-Accel-Buffering" not in r.headers
            first = await r.content.readany()
            first_at = time.monotonic() - t0
            assert first.startswith(b"ID3") and first_at < 1.2 and first + await r.read() == b"ID3-audio-1-audio-2"
        form = aiohttp.FormData()
        form.add_field("file", b"data", filename="a.txt", content_type="text/plain")
        async with http.post(px.url + "/v1/uploads", data=form, headers={"Accept": "*/*"}) as r:
            assert r.status == 200
        seen = up.seen_for("/v1/uploads")[-1]
        assert seen.headers["content-type"].startswith("multipart/form-data; boundary=") and seen.headers["accept"] == "*/*"
        boundary = seen.headers["content-type"].split("boundary=", 1)[1]
        assert boundary.encode() in seen.body


async def test_an_engines_own_5xx_on_a_pass_through_path_does_not_eject_it(proxies, tmp_path, http):
    with ScriptedUpstream() as a, ScriptedUpstream() as b:
        for up in (a, b):
            up.on("/v1/boom", lambda sock, seen: sock.sendall(response(500, JSON, b'{"error":{"message":"this path fails"}}')))
        cfg = pools_config(
            [{"name": "p", "models": ["*"], "engines": [{"url": a.url, "name": "a"}, {"url": b.url, "name": "b"}], "health": {"failures_to_eject": 2, "check_interval_s": 60}}]
        )
        cfg["passthrough"] = {"enabled": True}
        px = proxies(tmp_path, cfg)
        for _ in range(6):
            async with http.get(px.url + "/v1/boom") as r:
                assert r.status == 500 and (await r.json())["error"]["message"] == "this path fails"  # the engine's answer, relayed
        st = await px.status(http)
        assert {e["name"]: e["state"] for e in st["engines"]} == {"a": "healthy", "b": "healthy"}


async def test_an_event_stream_the_client_did_not_ask_for_is_assembled_and_charged(proxies, tmp_path, http):
    """transformers serve streams a Responses request that names no ``stream``: the client
    asked for no stream and gets the response object as JSON (the OpenAI SDK's default
    ``responses.create`` parses it), and the user is charged for the engine's output."""
    events = [
        b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n',
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"a","sequence_number":1}\n\n',
        b'event: response.completed\ndata: {"type":"response.completed","sequence_number":2,"response":{"id":"r1","object":"response","status":"completed",'
        b'"output":[{"type":"message","id":"m1","role":"assistant","status":"completed","content":[{"type":"output_text","text":"a","annotations":[]}]}],'
        b'"usage":{"input_tokens":3,"output_tokens":40}}}\n\n',
    ]
    with ScriptedUpstream() as up:
        up.on("resp", stream(events))
        px = proxies(tmp_path, pools_config([{"name": "p", "models": ["*"], "engines": [{"url": up.url, "name": "e"}]}]))
        async with http.post(px.url + "/v1/responses", json={"model": "resp", "input": "hi"}, headers={"Authorization": "Bearer sk-carl"}) as r:
            body = await r.json()
            assert r.status == 200 and r.headers["Content-Type"].startswith("application/json")
        assert body["id"] == "r1" and body["output"][0]["content"][0]["text"] == "a" and body["usage"]["output_tokens"] == 40
        resp = await sdk(px).responses.create(model="resp", input="hi")
        assert resp.output_text == "a"
        (carl,) = [u for u in (await px.status(http))["users"] if u["user"] == "carl"]
        assert carl["recent_service"] >= 80  # the engine's usage, twice


async def test_an_absolute_form_request_target_is_served_by_its_path(proxies, tmp_path, http):
    with ScriptedUpstream() as up:
        up.on("/v1/files", lambda sock, seen: sock.sendall(response(200, JSON, b'{"data":[]}')))
        cfg = pools_config([{"name": "p", "models": ["*"], "engines": [{"url": up.url, "name": "e"}]}])
        cfg["passthrough"] = {"enabled": True}
        px = proxies(tmp_path, cfg)
        reader, writer = await asyncio.open_connection("127.0.0.1", px.port)
        writer.write(b"GET http://evil.example/v1/files?limit=2 HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200") and b'{"data":[]}' in answer
        assert up.seen_for("/v1/files")[-1].target == "/v1/files?limit=2"


async def test_a_reload_drains_an_engine_under_a_pass_through_transfer_outside_admission(proxies, tmp_path, http):
    """``passthrough.admit: false`` still holds its place on the engine: a reload that
    removes the engine mid-transfer drains it (the transfer completes) instead of closing
    its connections; the routed count and in flight show it."""

    def slow_download(sock, seen):
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: 10\r\nConnection: close\r\n\r\n12345")
        time.sleep(1.5)
        sock.sendall(b"67890")

    with ScriptedUpstream() as a, ScriptedUpstream() as b:
        a.on("/v1/files/f/content", slow_download)
        pool = lambda url, name: [{"name": "p", "models": ["*"], "engines": [{"url": url, "name": name}]}]  # noqa: E731
        cfg = pools_config(pool(a.url, "a"))
        cfg["passthrough"] = {"enabled": True, "admit": False}
        px = proxies(tmp_path, cfg)
        async with http.get(px.url + "/v1/files/f/content") as r:
            first = await r.content.readexactly(5)
            rows = engine_rows(await px.status(http))
            assert rows["a"]["inflight"] == 1 and rows["a"]["routed"] == 1
            cfg = pools_config(pool(b.url, "b"))
            cfg["passthrough"] = {"enabled": True, "admit": False}
            px.write(cfg)
            await px.reload(http)
            assert engine_rows(await px.status(http))["a"]["state"] == "draining"
            assert first + await r.read() == b"1234567890"
        await eventually(lambda: _engines_are(http, px, {"b"}), "the drained engine left once its transfer ended")


async def _engines_are(http, px: Proxy, names: set[str]) -> bool:
    return set(engine_rows(await px.status(http))) == names
