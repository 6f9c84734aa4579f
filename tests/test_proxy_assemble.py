"""upstream.stream_non_streaming: non-streaming answers assembled from an upstream stream."""

from __future__ import annotations

import asyncio

import aiohttp

from proxy.relay.assemble import Assembler
from tests.conftest import base_config, wait_until


def test_assembler_keeps_every_field_of_a_chat_stream():
    chunks = [
        {"id": "c1", "object": "chat.completion.chunk", "created": 7, "model": "m", "system_fingerprint": "fp", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {"content": "Hel"}, "logprobs": {"content": [{"token": "Hel", "logprob": -0.1}]}}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {"content": "lo", "tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_", "arguments": '{"ci'}}]}, "logprobs": {"content": [{"token": "lo", "logprob": -0.2}]}}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": "weather", "arguments": 'ty": "Paris"}'}}]}}]},
        {"id": "c1", "choices": [{"index": 1, "delta": {"role": "assistant", "content": "Other"}, "finish_reason": "stop"}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls", "stop_reason": 42}]},
        {"id": "c1", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}},
    ]
    asm = Assembler(chat=True)
    for c in chunks:
        asm.add(c)
    out = asm.result()
    assert out["object"] == "chat.completion" and out["id"] == "c1" and out["system_fingerprint"] == "fp" and out["created"] == 7
    c0, c1 = out["choices"]
    assert c0["message"] == {
        "role": "assistant",
        "content": "Hello",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
    }
    assert c0["finish_reason"] == "tool_calls" and c0["stop_reason"] == 42
    assert [t["token"] for t in c0["logprobs"]["content"]] == ["Hel", "lo"]
    assert c1["message"]["content"] == "Other" and c1["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == 4


def test_assembler_text_completions():
    asm = Assembler(chat=False)
    for piece in ("Once", " upon", " a time"):
        asm.add({"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": piece, "finish_reason": None, "logprobs": {"tokens": [piece], "token_logprobs": [-1.0]}}]})
    asm.add({"id": "x", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    out = asm.result()
    assert out["choices"][0]["text"] == "Once upon a time" and out["choices"][0]["finish_reason"] == "length"
    assert out["choices"][0]["logprobs"]["tokens"] == ["Once", " upon", " a time"]


def _config() -> dict:
    cfg = base_config("")
    cfg["upstream"]["stream_non_streaming"] = True
    return cfg


async def test_non_streaming_client_gets_assembled_answer(make_stack, http):
    st = await make_stack(config=_config())
    async with http.post(st.proxy_url + "/v1/chat/completions", json=st.chat_body(4, no_done=True)) as r:
        assert r.status == 200 and r.content_type == "application/json"
        body = await r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": " t0 t1 t2 t3"}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 4
    async with http.post(st.proxy_url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}) as r:
        assert (await r.json())["choices"][0]["text"] == " t0 t1 t2"
    async with http.post(st.proxy_url + "/v1/chat/completions", json=st.chat_body(2, status=500)) as r:
        assert r.status == 500  # upstream errors still pass through


async def test_non_streaming_disconnect_aborts_a_streamed_upstream(make_stack):
    """With the option on, leaving a non-streaming request stops the generation midway
    (the upstream was streaming: tokens were being sent when it was aborted)."""
    st = await make_stack(config=_config(), itl_s=0.02)
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(st.proxy_url + "/v1/chat/completions", json=st.chat_body(500)))
        await wait_until(lambda: st.stats.tokens_sent >= 5, what="upstream streaming")
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
    await wait_until(lambda: st.stats.aborted == 1, what="upstream aborted")
    assert 5 <= st.stats.tokens_sent < 500
    await wait_until(lambda: not st.state.admission.scheduler.inflight, what="slot released")


def test_responses_answer_is_the_terminal_response_with_its_items():
    """A terminal event whose response carries no ``output`` gets the items of the
    ``response.output_item.done`` events, in ``output_index`` order."""
    from proxy.relay.assemble import ResponsesAssembler

    asm = ResponsesAssembler()
    item = lambda i, text: {"type": "message", "id": f"m{i}", "role": "assistant", "content": [{"type": "output_text", "text": text}]}  # noqa: E731
    for ev in (
        {"type": "response.created", "response": {"id": "r", "status": "in_progress", "output": []}},
        {"type": "response.output_item.done", "output_index": 1, "item": item(1, "b")},
        {"type": "response.output_item.done", "output_index": 0, "item": item(0, "a")},
        {"type": "response.completed", "response": {"id": "r", "status": "completed", "usage": {"input_tokens": 1, "output_tokens": 2}}},
    ):
        asm.add(ev)
    out = asm.result()
    assert out["status"] == "completed" and [i["id"] for i in out["output"]] == ["m0", "m1"] and out["object"] == "response"


def test_legacy_function_call_deltas_join_like_tool_calls():
    asm = Assembler(chat=True)
    for d in ({"role": "assistant", "function_call": {"name": "get_weather", "arguments": ""}}, {"function_call": {"name": "get_weather", "arguments": '{"a":'}}, {"function_call": {"arguments": "1}"}}):
        asm.add({"choices": [{"index": 0, "delta": d}]})
    asm.add({"choices": [{"index": 0, "delta": {}, "finish_reason": "function_call"}]})
    assert asm.result()["choices"][0]["message"]["function_call"] == {"name": "get_weather", "arguments": '{"a":1}'}
