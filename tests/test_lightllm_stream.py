"""The relay's SSE scanner on LightLLM's streams as the stand-in really sends them, cut at
every possible chunk boundary."""

from __future__ import annotations

import random

import aiohttp
import pytest

from proxy.relay.relay import SSEScanner, usage_of
from tests.lightllm_wire import WireConfig, WireServer


async def fetch(flavor: str, path: str, body: dict) -> bytes:
    """The raw (de-chunked) body the stand-in answers to ``body`` on ``path``."""
    server = await WireServer(WireConfig(flavor=flavor)).start()
    try:
        async with aiohttp.ClientSession() as s, s.post(server.url + path, json=body) as r:
            assert r.status == 200
            return await r.read()
    finally:
        await server.stop()


def native(n: int, **wire) -> dict:
    body: dict = {"inputs": "Hello there, general", "parameters": {"max_new_tokens": n}}
    if wire:
        body["wire"] = wire
    return body


def scan(pieces: list[bytes], native_mode: bool = True) -> SSEScanner:
    sc = SSEScanner(native=native_mode)
    for p in pieces:
        sc.feed(p)
    return sc


@pytest.mark.parametrize("flavor", ["0.0.1", "v1.2.0"])
async def test_every_two_way_split_of_a_native_stream(flavor):
    raw = await fetch(flavor, "/generate_stream", native(6))
    assert raw.count(b"data:{") == 6
    for k in range(len(raw) + 1):
        sc = scan([raw[:k], raw[k:]])
        assert (sc.tokens, sc.finished, sc.done, sc.partial) == (6, True, False, False), k


async def test_byte_by_byte_and_random_chunkings():
    raw = await fetch("0.0.1", "/generate_stream", native(9))
    sc = scan([raw[i : i + 1] for i in range(len(raw))])
    assert sc.tokens == 9 and sc.finished
    rng = random.Random(5)
    for _ in range(200):
        pieces, i = [], 0
        while i < len(raw):
            n = rng.randint(1, 40)
            pieces.append(raw[i : i + n])
            i += n
        sc = scan(pieces)
        assert sc.tokens == 9 and sc.finished


async def test_tokens_with_empty_text_are_counted():
    raw = await fetch("0.0.1", "/generate_stream", native(8))
    assert raw.count(b'"text": ""') == 2  # tokens 2 and 6: halves of multibyte characters
    assert scan([raw]).tokens == 8


async def test_prompt_tokens_come_from_v1_streams_only():
    assert scan([await fetch("v1.2.0", "/generate_stream", native(3))]).prompt_tokens == 6
    assert scan([await fetch("0.0.1", "/generate_stream", native(3))]).prompt_tokens is None


async def test_a_v1_error_event_is_no_token_and_no_finish():
    server = await WireServer(WireConfig(max_req_total_len=4)).start()
    try:
        async with aiohttp.ClientSession() as s, s.post(server.url + "/generate_stream", json=native(3)) as r:
            raw = await r.read()
    finally:
        await server.stop()
    assert raw.startswith(b'data: {"error":')
    for k in range(len(raw) + 1):
        sc = scan([raw[:k], raw[k:]])
        assert (sc.tokens, sc.finished, sc.error is not None) == (0, False, True), k


async def test_a_stream_cut_before_its_final_event_is_not_finished():
    raw = await fetch("0.0.1", "/generate_stream", native(6))
    events = raw.split(b"\n\n")
    truncated = b"\n\n".join(events[:4]) + b"\n\n"
    sc = scan([truncated])
    assert (sc.tokens, sc.finished, sc.partial) == (4, False, False)
    sc = scan([truncated + events[4][:30]])  # and half of the next event
    assert (sc.tokens, sc.finished, sc.partial) == (4, False, True)


async def test_stop_before_max_new_tokens_still_finishes():
    raw = await fetch("0.0.1", "/generate_stream", native(20, stop_after=3))
    sc = scan([raw])
    assert sc.tokens == 3 and sc.finished


async def test_lightllm_chat_streams_are_counted():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    raw = await fetch("0.0.1", "/v1/chat/completions", body)  # one event per token, no [DONE]
    for k in range(0, len(raw), 7):
        sc = scan([raw[:k], raw[k:]], native_mode=False)
        assert (sc.tokens, sc.done) == (5, False)
    raw = await fetch("v1.2.0", "/v1/chat/completions", body)  # role chunk, usage chunk, [DONE]
    for k in range(0, len(raw), 7):
        sc = scan([raw[:k], raw[k:]], native_mode=False)
        assert (sc.tokens, sc.done, sc.prompt_tokens) == (5, True, 1)


def test_usage_of_native_generate_answers():
    assert usage_of(b'{"generated_text": ["a b"], "count_output_tokens": 2, "finish_reason": "stop"}', True) == (None, 2)
    assert usage_of(b'{"generated_text":["a"],"count_output_tokens":1,"finish_reason":"length","prompt_tokens":7}', True) == (7, 1)
    multi = b'{"generated_text": ["a", "b"], "count_output_tokens": [3, 4], "finish_reason": ["stop", "length"]}'
    assert usage_of(multi, True) == (None, 7)
    assert usage_of(b'{"message": "boom"}', True) == (None, None)
    assert usage_of(b"not json", True) == (None, None)
