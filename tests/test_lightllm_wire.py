"""The LightLLM stand-in (tests/lightllm_wire.py) speaks LightLLM's wire format byte for
byte: checked on raw sockets, below any HTTP client library's forgiveness."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.conftest import wait_until
from tests.lightllm_wire import WireConfig, WireServer, token_text


@pytest.fixture
async def wire():
    servers: list[WireServer] = []

    async def make(**kw) -> WireServer:
        s = await WireServer(WireConfig(**kw)).start()
        servers.append(s)
        return s

    yield make
    for s in servers:
        await s.stop()


async def raw_http(url: str, method: str, path: str, body: dict | None = None, timeout: float = 10.0) -> tuple[bytes, dict, bytes]:
    """One request on a fresh socket: (status line, headers lower-cased, raw body bytes)."""
    host, port = url.split("//")[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps(body).encode() if body is not None else b""
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    writer.write(head.encode() + data)
    try:
        raw = await asyncio.wait_for(reader.read(-1), timeout)
    finally:
        writer.close()
    head_bytes, _, rest = raw.partition(b"\r\n\r\n")
    lines = head_bytes.split(b"\r\n")
    headers = {}
    for line in lines[1:]:
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    return lines[0], headers, rest


def dechunk(body: bytes) -> tuple[list[bytes], bool]:
    """The chunks of a chunked body, and whether it ended with the zero-size chunk."""
    chunks = []
    while body:
        size_line, sep, body = body.partition(b"\r\n")
        if not sep:
            return chunks, False
        size = int(size_line, 16)
        if size == 0:
            return chunks, True
        chunks.append(body[:size])
        body = body[size + 2 :]
    return chunks, False


def stdlib(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode()


def compact(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def logprobs(i: int) -> dict:
    return {str(1000 + i): {"logprob": -0.5, "rank": None, "decoded_token": token_text(i)}}


async def test_generate_has_no_content_type_and_a_list_of_texts_0_0_1(wire):
    w = await wire(flavor="0.0.1")
    status, headers, body = await raw_http(w.url, "POST", "/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 5}})
    assert status == b"HTTP/1.1 200 OK"
    assert "content-type" not in headers
    assert headers["server"] == "uvicorn"
    expected = {"generated_text": ["".join(token_text(i) for i in range(5))], "count_output_tokens": 5, "finish_reason": "length"}
    assert body == stdlib(expected)  # stdlib json.dumps spacing, as LightLLM 0.0.1 writes it
    assert isinstance(json.loads(body)["generated_text"], list)


async def test_v1_generate_is_compact_with_prompt_tokens_and_logprobs(wire):
    w = await wire()  # v1.2.0, the default
    status, headers, body = await raw_http(w.url, "POST", "/generate", {"inputs": "Hello there", "parameters": {"max_new_tokens": 2}})
    assert status == b"HTTP/1.1 200 OK" and "content-type" not in headers
    assert headers["server"] == "hypercorn-h11"
    assert body == compact({"generated_text": [" w0 w1"], "count_output_tokens": 2, "finish_reason": "length",
                            "prompt_tokens": 3, "logprobs": [logprobs(0), logprobs(1)]})


def native_event(i: int, last: bool, v1: bool, reason: str = "length", prompt_tokens: int = 1) -> bytes:
    token = {"id": 1000 + i, "text": token_text(i), "logprob": -0.5, "special": False, "count_output_tokens": i + 1}
    if v1:
        token["prompt_tokens"] = prompt_tokens
    event = {"token": token, "generated_text": None, "finished": last, "finish_reason": reason if last else None, "details": None}
    if v1:
        event["input_usage"] = None
        token["logprobs"] = logprobs(i)
    return b"data:" + (compact(event) if v1 else stdlib(event)) + b"\n\n"  # no space after "data:"


@pytest.mark.parametrize("flavor", ["v1.2.0", "0.0.1"])
async def test_generate_stream_events_byte_for_byte(wire, flavor):
    w = await wire(flavor=flavor)
    status, headers, body = await raw_http(w.url, "POST", "/generate_stream", {"inputs": "Hi", "parameters": {"max_new_tokens": 4}})
    assert status == b"HTTP/1.1 200 OK"
    assert headers["content-type"] == "text/event-stream; charset=utf-8"
    assert headers["transfer-encoding"] == "chunked"
    chunks, complete = dechunk(body)
    assert complete
    assert len(chunks) == 4  # one event per token, one HTTP chunk per event
    for i, chunk in enumerate(chunks):
        assert chunk == native_event(i, i == 3, flavor == "v1.2.0")
    assert json.loads(chunks[2][5:])["token"]["text"] == ""  # an incomplete multibyte character
    assert b"[DONE]" not in body


async def test_stop_ends_with_finish_reason_stop(wire):
    w = await wire()
    _, _, body = await raw_http(w.url, "POST", "/generate_stream", {"inputs": "Hi", "parameters": {"max_new_tokens": 9}, "wire": {"stop_after": 2}})
    chunks, _ = dechunk(body)
    last = json.loads(chunks[-1][5:])
    assert len(chunks) == 2 and last["finished"] is True and last["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "params, message",
    [
        ({"max_new_tokens": 4, "max_tokens": 4}, "SamplingParams.__init__() got an unexpected keyword argument 'max_tokens'"),
        ({"max_new_tokens": 0}, "max_new_tokens must be at least 1 , got 0."),
        ({"do_sample": True, "top_p": 1.5}, "top_p must in (0.0, 1.0], got 1.5"),
    ],
)
async def test_0_0_1_invalid_parameters_answer_417_with_a_message(wire, params, message):
    w = await wire(flavor="0.0.1")
    for path in ("/generate", "/generate_stream"):
        status, headers, body = await raw_http(w.url, "POST", path, {"inputs": "x", "parameters": params})
        assert status == b"HTTP/1.1 417 Expectation Failed"
        assert headers["content-type"] == "application/json"
        assert json.loads(body) == {"message": message}
    assert w.engine.stats.started == 0


@pytest.mark.parametrize(
    "params, status, message",
    [
        ({"max_new_tokens": 0}, 400, "max_new_tokens must be at least 1 , got 0."),
        ({"do_sample": True, "top_p": 1.5}, 400, "top_p must be in (0.0, 1.0], got 1.5"),
        ({"max_new_tokens": "9"}, 417, "'<' not supported between instances of 'str' and 'int'"),
    ],
)
async def test_v1_invalid_parameters_answer_400_or_417_in_openai_style(wire, params, status, message):
    w = await wire()
    for path in ("/generate", "/generate_stream"):
        line, headers, body = await raw_http(w.url, "POST", path, {"inputs": "x", "parameters": params})
        assert line.startswith(f"HTTP/1.1 {status} ".encode())
        assert headers["content-type"] == "application/json"
        assert json.loads(body) == {"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}}
    assert w.engine.stats.started == 0


async def test_v1_ignores_unknown_parameters_and_greedy_needs_no_temperature(wire):
    w = await wire()
    body = {"inputs": "x", "parameters": {"max_new_tokens": 2, "max_tokens": 4, "temperature": 0}}
    status, _, raw = await raw_http(w.url, "POST", "/generate", body)
    assert status == b"HTTP/1.1 200 OK" and json.loads(raw)["count_output_tokens"] == 2


async def test_v1_default_max_new_tokens_is_what_the_length_limit_leaves(wire):
    w = await wire(max_total_token_num=1000, max_req_total_len=50)
    _, _, raw = await raw_http(w.url, "POST", "/generate", {"inputs": "a" * 36, "parameters": {}})  # 10 prompt tokens
    assert json.loads(raw)["count_output_tokens"] == 40  # 65535 asked, cut to 50 - 10


async def test_token_load_shape_and_values(wire):
    w = await wire(max_total_token_num=1000, itl_s=0.05)
    _, headers, body = await raw_http(w.url, "GET", "/token_load")
    assert headers["content-type"] == "application/json"
    assert body == b'{"current_load":0.0,"logical_max_load":0.0,"dynamic_max_load":0.0}'
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(w.url + "/generate", json={"inputs": "a" * 36, "parameters": {"max_new_tokens": 90}}))
        await wait_until(lambda: w.engine.stats.tokens_sent >= 2, what="generating")
        async with s.get(w.url + "/token_load") as r:
            load = await r.json()
        assert load["dynamic_max_load"] == pytest.approx(0.1)  # (10 prompt + 90 reserved) / 1000
        assert 0.01 < load["current_load"] < 0.1
        (await task).release()
    assert w.engine.token_load()["dynamic_max_load"] == 0.0


async def test_0_0_1_chat_stream_has_a_space_no_finish_reason_and_no_done(wire):
    w = await wire(flavor="0.0.1")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    _, headers, raw = await raw_http(w.url, "POST", "/v1/chat/completions", body)
    assert headers["content-type"] == "text/event-stream; charset=utf-8"
    chunks, complete = dechunk(raw)
    assert complete and len(chunks) == 3
    assert all(c.startswith(b"data: {") and c.endswith(b"\n\n") for c in chunks)
    assert [json.loads(c[6:])["choices"][0]["finish_reason"] for c in chunks] == [None, None, None]
    assert b"[DONE]" not in raw


async def test_v1_chat_stream_role_chunk_contents_usage_and_done(wire):
    w = await wire()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    _, headers, raw = await raw_http(w.url, "POST", "/v1/chat/completions", body)
    assert headers["content-type"] == "text/event-stream; charset=utf-8"
    chunks, complete = dechunk(raw)
    events = [e for c in chunks for e in c.split(b"\n\n") if e]
    assert complete and all(e.startswith(b"data: ") for e in events)
    assert events[-1] == b"data: [DONE]"
    objs = [json.loads(e[6:]) for e in events[:-1]]
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""} and "prompt_token_ids" in objs[0]
    # token 2's text is empty: no chunk for it; the last token carries the finish_reason
    assert [o["choices"][0]["delta"].get("content") for o in objs[1:-1]] == [" w0", " w1", " é"]
    assert [o["choices"][0]["finish_reason"] for o in objs[1:-1]] == [None, None, "length"]
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 4


async def test_v1_completions_stream_ends_with_usage_and_done(wire):
    w = await wire()
    _, _, raw = await raw_http(w.url, "POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 3, "stream": True})
    events = [e for c in dechunk(raw)[0] for e in c.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 3
    _, _, raw = await raw_http(w.url, "GET", "/v1/models")
    assert json.loads(raw)["data"][0]["owned_by"] == "lightllm"
    w0 = await wire(flavor="0.0.1")
    status, _, _ = await raw_http(w0.url, "POST", "/v1/completions", {"prompt": "hi"})
    assert status.startswith(b"HTTP/1.1 404")


async def test_token_load_is_a_list_per_rank_with_dp(wire):
    w = await wire(dp=2, max_total_token_num=1000, itl_s=0.05)
    _, _, body = await raw_http(w.url, "GET", "/token_load")
    assert body == b'{"current_load":[0.0,0.0],"logical_max_load":[0.0,0.0],"dynamic_max_load":[0.0,0.0]}'
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(w.url + "/generate", json={"inputs": "a" * 36, "parameters": {"max_new_tokens": 90}}))
        await wait_until(lambda: w.engine.stats.tokens_sent >= 2, what="generating")
        async with s.get(w.url + "/token_load") as r:
            load = await r.json()
        assert load["dynamic_max_load"] == [pytest.approx(0.2), 0.0]  # (10 + 90) of rank 0's 500 tokens
        (await task).release()


async def test_fifo_queue_inside_the_engine_when_the_budget_is_full(wire):
    w = await wire(max_total_token_num=100, itl_s=0.02)
    async with aiohttp.ClientSession() as s:
        first = asyncio.create_task(s.post(w.url + "/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 60}}))
        await wait_until(lambda: w.engine.stats.running == 1, what="first running")
        second = asyncio.create_task(s.post(w.url + "/generate", json={"inputs": "y", "parameters": {"max_new_tokens": 60}}))
        await wait_until(lambda: w.engine.stats.waiting == 1, what="second queued inside the engine")
        assert w.engine.stats.running == 1
        for t in (first, second):
            r = await t
            assert r.status == 200
            await r.read()
    assert w.engine.stats.had_to_wait == 1 and w.engine.stats.completed == 2


async def test_disconnects_are_noticed_by_polling_and_counted(wire):
    w = await wire(max_total_token_num=100, itl_s=0.05, disconnect_poll_s=0.1)
    async with aiohttp.ClientSession() as keep, aiohttp.ClientSession() as gone:
        running = asyncio.create_task(keep.post(w.url + "/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 60}}))
        await wait_until(lambda: w.engine.stats.running == 1, what="first running")
        # a stream's 200 headers go out at once, before the request gets KV room
        queued = await gone.post(w.url + "/generate_stream", json={"inputs": "y", "parameters": {"max_new_tokens": 60}})
        assert queued.status == 200
        await wait_until(lambda: w.engine.stats.waiting == 1, what="second queued")
        queued.close()  # the client goes away
        await wait_until(lambda: w.engine.stats.aborted_queued == 1, timeout=2, what="queued request dropped")
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await wait_until(lambda: w.engine.stats.aborted == 2, timeout=2, what="running request aborted")
    assert w.engine.stats.running == 0 and w.engine.stats.waiting == 0 and w.engine.stats.completed == 0


async def test_0_0_1_overlong_prompt_on_a_stream_fails_after_the_headers(wire):
    w = await wire(flavor="0.0.1", max_req_input_len=8)
    status, _, body = await raw_http(w.url, "POST", "/generate_stream", {"inputs": "z" * 100, "parameters": {"max_new_tokens": 4}})
    assert status == b"HTTP/1.1 200 OK"
    chunks, complete = dechunk(body)
    assert chunks == [] and not complete  # the connection was dropped mid-body
    status, _, body = await raw_http(w.url, "POST", "/generate", {"inputs": "z" * 100, "parameters": {"max_new_tokens": 4}})
    assert status.startswith(b"HTTP/1.1 417") and b"too long" in body


async def test_v1_overlong_prompt_is_an_error_event_on_a_stream_and_400_otherwise(wire):
    w = await wire(max_req_total_len=20)
    body = {"inputs": "z" * 100, "parameters": {"max_new_tokens": 4}}  # 26 prompt tokens
    status, _, raw = await raw_http(w.url, "POST", "/generate_stream", body)
    assert status == b"HTTP/1.1 200 OK"
    chunks, complete = dechunk(raw)
    assert complete and chunks == [b'data: {"error":{"message":"the input prompt token len 26 + max_new_tokens 4 > 20","type":"invalid_request_error"}}\n\n']
    status, _, raw = await raw_http(w.url, "POST", "/generate", body)
    assert status.startswith(b"HTTP/1.1 400") and json.loads(raw)["error"]["message"].startswith("the input prompt token len 26")


async def test_health_routes(wire):
    w = await wire()
    for path in ("/health", "/healthz"):
        status, _, body = await raw_http(w.url, "GET", path)
        assert status == b"HTTP/1.1 200 OK" and json.loads(body) == {"message": "Ok"}
    status, _, _ = await raw_http(w.url, "HEAD", "/health")
    assert status == b"HTTP/1.1 200 OK"
    for path in ("/liveness", "/readiness"):
        _, _, body = await raw_http(w.url, "GET", path)
        assert json.loads(body) == {"status": "ok"}
    _, headers, body = await raw_http(w.url, "GET", "/metrics")
    assert b"lightllm_request_count_total" in body and b"vllm:" not in body and "content-type" not in headers
