"""Embeddings, Responses and pass-through requests as admission reads them; the prompt prefix
for affinity; the Responses event stream as the relay must follow it (read from a real
scripted engine, and checked against the real OpenAI SDK)."""

from __future__ import annotations

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from bench.scripted_engine import make_app as scripted_engine
from proxy.wire.errors import responses_error_event
from proxy.wire.sse import split_events
from proxy.wire.request_body import BadRequest
from proxy.wire.embeddings_body import MAX_EMBEDDING_INPUTS, parse_embeddings
from proxy.wire.passthrough_body import parse_passthrough
from proxy.wire.prompt_prefix import prompt_prefix
from proxy.wire.responses_answer import ResponsesStreamScanner, responses_usage
from proxy.wire.responses_body import cap_max_output_tokens, parse_responses


def body(**fields) -> bytes:
    return orjson.dumps(fields)


# ---------------------------------------------------------------- embeddings


@pytest.mark.parametrize(
    "inp,tokens",
    [
        ("12345678", 2),
        ("123456789", 3),
        (["abcd", "abcde"], 1 + 2),
        ([101, 7, 0, 55], 4),
        ([[1, 2, 3], [4]], 4),
    ],
)
def test_embeddings_reserve_their_prompt_alone(inp, tokens):
    raw = body(model="e", input=inp)
    p = parse_embeddings(raw)
    assert (p.prompt_tokens, p.max_tokens, p.stream) == (tokens, 0, False)
    assert p.body is raw  # forwarded as sent


@pytest.mark.parametrize(
    "inp",
    ["", [], [""], ["a", 1], [True, 2], [-1], [[1], []], [[1], ["a"]], {"text": "a"}, 3, None, [1.5], ["a"] * (MAX_EMBEDDING_INPUTS + 1)],
)
def test_bad_embeddings_input_is_a_400_naming_input(inp):
    with pytest.raises(BadRequest) as e:
        parse_embeddings(body(model="e", input=inp))
    assert e.value.param == "input"


def test_embeddings_body_must_be_an_object():
    with pytest.raises(BadRequest):
        parse_embeddings(b"[1, 2]")
    with pytest.raises(BadRequest):
        parse_embeddings(b"{nope")


# ----------------------------------------------------------------- responses


def test_responses_string_input_instructions_and_cap():
    p = parse_responses(body(model="m", input="x" * 40, instructions="y" * 8, max_output_tokens=50, stream=True))
    assert (p.prompt_tokens, p.max_tokens, p.stream) == (12 + 4, 50, True)


def test_responses_items_count_the_text_the_model_reads_and_images_at_their_cost():
    items = [
        {"role": "system", "content": "a" * 40},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "b" * 40}, {"type": "input_image", "image_url": "data:image/png;base64," + "Q" * 10_000}]},
        {"type": "function_call", "call_id": "call_" + "z" * 500, "name": "f", "arguments": "c" * 40},
        {"type": "function_call_output", "call_id": "call_1", "output": "d" * 40},
    ]
    p = parse_responses(body(model="m", input=items))
    assert p.prompt_tokens == 40 + 1024 + 4 * 4 and p.max_tokens is None and not p.stream  # the image at cost.image_tokens (1024)


def test_responses_without_input_continue_a_previous_response():
    p = parse_responses(body(model="m", previous_response_id="resp_1"))
    assert p.prompt_tokens == 0


def test_deeply_nested_input_is_walked_without_recursion():
    depth = 1000  # just inside orjson's parsing limit (1024 levels); far past Python's recursion
    raw = b'{"model": "m", "input": [{"content": ' + b"[" * depth + b'"xxxxxxxx"' + b"]" * depth + b"}]}"
    p = parse_responses(raw)
    assert p.prompt_tokens == 2 + 4


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"input": 5}, "input"),
        ({"input": ["hello"]}, "input[0]"),
        ({"input": "x", "instructions": ["a"]}, "instructions"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "max_output_tokens": True}, "max_output_tokens"),
        ({"input": "x", "max_output_tokens": "5"}, "max_output_tokens"),
        ({"input": "x", "stream": "yes"}, "stream"),
    ],
)
def test_bad_responses_fields_are_a_400_naming_them(fields, param):
    with pytest.raises(BadRequest) as e:
        parse_responses(body(model="m", **fields))
    assert e.value.param == param


def test_a_groups_cap_rewrites_max_output_tokens():
    within = parse_responses(body(model="m", input="x", max_output_tokens=10))
    assert cap_max_output_tokens(within, 20, reject=True) is within
    over = parse_responses(body(model="m", input="x", max_output_tokens=100))
    clamped = cap_max_output_tokens(over, 20, reject=False)
    assert clamped.max_tokens == 20 and orjson.loads(clamped.body)["max_output_tokens"] == 20 and orjson.loads(clamped.body)["input"] == "x"
    with pytest.raises(BadRequest) as e:
        cap_max_output_tokens(over, 20, reject=True)
    assert e.value.param == "max_output_tokens"
    unbounded = parse_responses(body(model="m", input="x"))
    assert cap_max_output_tokens(unbounded, 20, reject=True).max_tokens == 20  # no limit named: the cap is written in


# -------------------------------------------------------------- pass-through


def test_passthrough_reads_model_and_stream_and_never_refuses():
    p = parse_passthrough(body(model="whisper", stream=True, x=1), 7)
    assert (p.fields["model"], p.stream, p.prompt_tokens, p.max_tokens) == ("whisper", True, 7, 0)
    for raw in (b"", b"--boundary\r\nContent-Disposition: form-data", b"{broken", b"[1]", b'{"stream": "yes"}'):
        p = parse_passthrough(raw, 1)
        assert p.body == raw and not p.stream and p.prompt_tokens == 1
        assert p.fields == ({} if raw != b'{"stream": "yes"}' else {"stream": "yes"})


# ------------------------------------------------------------- prompt prefix


def test_prompt_prefix_of_each_kind():
    chat = {"messages": [{"role": "system", "content": "You are kind."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    assert prompt_prefix(chat, 1000) == "system: You are kind.\nuser: Hi\n"
    assert prompt_prefix(chat, 10) == "system: Yo"
    assert prompt_prefix({"prompt": "Once upon a time"}, 4) == "Once"
    assert prompt_prefix({"prompt": ["first", "second"]}, 100) == "first"
    assert prompt_prefix({"instructions": "Be brief.", "input": "Why?"}, 100) == "Be brief.\nWhy?"
    assert prompt_prefix({"input": [{"role": "user", "content": "Q"}]}, 100) == "user: Q\n"
    assert prompt_prefix({"inputs": "native"}, 3) == "nat"
    assert prompt_prefix({"input": [1, 2]}, 100) is None  # embeddings token ids: no text
    assert prompt_prefix(chat, 0) is None
    assert prompt_prefix({"messages": [{"role": "user", "content": "x" * 10**6}]}, 64) == "user: " + "x" * 58


# --------------------------------------------------------- Responses streams


def test_the_responses_scanner_reads_every_event_form_across_any_chunk_boundary():
    stream = (
        b"event: response.output_text.delta\r\ndata: {\"type\": \"response.output_text.delta\", \"sequence_number\": 1}\r\n\r\n"
        b": keep-alive\n\n"
        b'data: {"type": "response.output_text.delta", "sequence_number": 2}\n\n'
        b"event:response.completed\ndata: {\"type\": \"response.completed\",\ndata: \"sequence_number\": 3, \"response\": {\"status\": \"completed\", \"usage\": {\"input_tokens\": 7, \"output_tokens\": 2}}}\n\n"
    )
    for size in (1, 2, 7, len(stream)):
        s = ResponsesStreamScanner()
        for i in range(0, len(stream), size):
            s.feed(stream[i : i + size])
        s.end()
        assert (s.tokens, s.prompt_tokens, s.sequence_number) == (2, 7, 3), size
        assert s.complete() and s.error is None and s.closing() == b""


def test_a_failed_response_or_an_error_event_is_an_in_band_error():
    s = ResponsesStreamScanner()
    s.feed(b'event: response.failed\ndata: {"type": "response.failed", "sequence_number": 4, "response": {"status": "failed", "error": {"code": "server_error", "message": "boom"}}}\n\n')
    assert s.error == {"message": "boom", "code": "server_error"} and not s.complete()
    s = ResponsesStreamScanner()
    s.feed(b'event: error\ndata: {"type": "error", "code": "rate_limit", "message": "slow down", "sequence_number": 0}')
    s.end()  # an unterminated last event is read at the end
    assert s.error == {"message": "slow down", "code": "rate_limit"} and not s.complete()


def test_a_cut_responses_stream_gets_the_next_sequence_number():
    s = ResponsesStreamScanner()
    s.feed(b'event: response.created\ndata: {"type": "response.created", "sequence_number": 0}\n\n')
    s.feed(b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta", "sequence_number": 1}\n\n')
    assert not s.complete() and s.error is None
    assert s.cut("gone", "upstream_stream_broken") == responses_error_event("gone", "upstream_stream_broken", 2)


def test_responses_tools_text_format_and_images_are_prompt_tokens():
    from proxy.wire.request_body import DefaultPromptCosts

    costs = DefaultPromptCosts(image_tokens=100, media_tokens=50)
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "string", "description": "d" * 4000}}}}]
    bare = parse_responses(body(model="m", input="hi"), costs)
    stuffed = parse_responses(body(model="m", input="hi", tools=tools, text={"format": {"type": "json_schema", "schema": {"description": "s" * 400}}}), costs)
    assert stuffed.prompt_tokens - bare.prompt_tokens >= (4000 + 400) // 4
    items = [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}, {"type": "input_file", "file_id": "f"}, {"type": "input_image", "text": "", "image_url": "u"}]}]
    assert parse_responses(body(model="m", input=items), costs).prompt_tokens == 100 + 50 + 100 + 4


@pytest.fixture
async def engine(aiohttp_server):
    server = await aiohttp_server(scripted_engine("a", ["m"]))
    return str(server.make_url("")).rstrip("/")


async def _scan(http: aiohttp.ClientSession, url: str, **fake) -> tuple[ResponsesStreamScanner, bytes]:
    scanner = ResponsesStreamScanner()
    raw = bytearray()
    buf = bytearray()
    req = {"model": "m", "input": "hi", "stream": True, "max_output_tokens": 5}
    if fake:
        req["fake"] = fake
    async with http.post(url + "/v1/responses", json=req) as r:
        assert r.status == 200
        try:
            async for chunk in r.content.iter_any():
                raw += chunk
                buf += chunk
                for ev in split_events(buf):
                    scanner.feed_event(ev)
        except aiohttp.ClientPayloadError:
            pass  # the scripted cut
    return scanner, bytes(raw)


async def test_a_complete_responses_stream_is_finished_with_its_usage(engine, http):
    s, raw = await _scan(http, engine)
    assert s.finished and s.terminal == "response.completed" and s.status == "completed"
    assert (s.tokens, s.prompt_tokens) == (5, 10)  # usage: output_tokens, input_tokens
    assert s.sequence_number == raw.count(b"\n\n") - 1 and b"[DONE]" not in raw


async def test_an_incomplete_responses_stream_also_ends_normally(engine, http):
    s, _ = await _scan(http, engine, incomplete=True)
    assert s.terminal == "response.incomplete" and s.status == "incomplete" and s.tokens == 5


async def test_a_cut_responses_stream_is_not_finished_and_counts_its_deltas(engine, http):
    s, _ = await _scan(http, engine, fail_after=3)
    assert not s.finished and s.tokens == 3 and s.prompt_tokens is None and s.sequence_number == 3 + 3


def test_data_only_events_and_error_events():
    s = ResponsesStreamScanner()
    s.feed_event(b'data: {"type": "response.output_text.delta", "delta": "a", "sequence_number": 4}')
    s.feed_event(b'data: {"type": "response.refusal.delta", "delta": "b", "sequence_number": 5}')
    s.feed_event(b"data: not json")
    assert s.tokens == 2 and not s.finished and s.sequence_number == 5
    s.feed_event(b'event: error\ndata: {"type": "error", "code": "x", "message": "m", "sequence_number": 6}')
    assert s.finished and s.status == "error" and s.tokens == 2


async def test_non_streaming_responses_usage(engine, http):
    async with http.post(engine + "/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 4}) as r:
        u = responses_usage(await r.read())
    assert (u.input_tokens, u.output_tokens, u.status) == (10, 4, "completed")
    assert responses_usage(b"nope").status is None


async def test_the_openai_sdk_reads_the_scripted_engines_answers(engine):
    """The scripted engine speaks the Responses and embeddings APIs as the SDK expects
    (phase 2's end-to-end tests rely on it)."""
    client = openai.AsyncOpenAI(base_url=engine + "/v1", api_key="x", max_retries=0)
    events = [e async for e in await client.responses.create(model="m", input="hi", stream=True, max_output_tokens=3)]
    assert [e.type for e in events][-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == " t0 t1 t2"
    assert events[-1].response.usage.output_tokens == 3
    resp = await client.responses.create(model="m", input="hi", max_output_tokens=2)
    assert resp.output_text == " t0 t1" and resp.usage.input_tokens == 10
    emb = await client.embeddings.create(model="m", input=["abcd", "efgh"])
    assert len(emb.data) == 2 and emb.usage.prompt_tokens == 2
    await client.close()


async def test_the_openai_sdk_reads_our_terminal_error_event(aiohttp_server):
    async def cut(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta", "item_id": "m", "output_index": 0, "content_index": 0, "delta": "x", "logprobs": [], "sequence_number": 0}\n\n')
        await resp.write(responses_error_event("the upstream closed the stream", "upstream_disconnected", 1))
        return resp

    app = web.Application()
    app.router.add_post("/v1/responses", cut)
    server = await aiohttp_server(app)
    client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0)
    events = [e async for e in await client.responses.create(model="m", input="hi", stream=True)]
    last = events[-1]
    assert isinstance(last, openai.types.responses.ResponseErrorEvent)
    assert (last.code, last.sequence_number, last.message) == ("upstream_disconnected", 1, "the upstream closed the stream")
    s = ResponsesStreamScanner()
    s.feed_event(responses_error_event("m", "c", 9).strip())
    assert s.finished and s.status == "error"
    await client.close()


async def test_the_test_engines_answer_an_absurd_token_count_with_a_bounded_one(engine, http):
    """``max_output_tokens`` / ``max_tokens`` far above ``MAX_TOKENS`` sent to the
    scripted engine (and :mod:`bench.fake_upstream`, whose chat and completions it
    serves) is answered with ``MAX_TOKENS`` tokens where the answer is built whole (a
    Responses answer, streamed or not; a chat or completion one not streamed): asked for
    2**62, it built the whole text (8 GB and counting). A chat stream, one token at a
    time, keeps the count asked. 10 x ``MAX_TOKENS`` here, so that a regression fails
    instead of hanging the test process, in-process as the engine is."""
    from bench.fake_upstream import MAX_TOKENS

    big = 10 * MAX_TOKENS
    for stream in (False, True):
        async with http.post(engine + "/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": big, "stream": stream}, timeout=aiohttp.ClientTimeout(total=20)) as r:
            raw = await r.read()
        if stream:
            last = orjson.loads(raw.rstrip().rsplit(b"\ndata: ", 1)[1])["response"]
        else:
            last = orjson.loads(raw)
        assert last["usage"]["output_tokens"] == MAX_TOKENS and last["output"][0]["content"][0]["text"].endswith(f" t{MAX_TOKENS - 1}")
    for path, field in (("/v1/chat/completions", "max_tokens"), ("/v1/completions", "max_completion_tokens")):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", field: big}
        async with http.post(engine + path, json=body, timeout=aiohttp.ClientTimeout(total=20)) as r:
            assert (await r.json())["usage"]["completion_tokens"] == MAX_TOKENS, path
    async with http.post(engine + "/v1/chat/completions", json={"model": "m", "messages": [], "max_tokens": MAX_TOKENS + 5, "stream": True}) as r:
        assert (await r.read()).count(b'"content"') == MAX_TOKENS + 5
