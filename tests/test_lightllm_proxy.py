"""The real proxy process in front of the LightLLM stand-in (``upstream.kind: lightllm``),
as LightLLM v1.2.0 (the pinned release) and, where it differs, 0.0.1: native routes through
identity and admission, LightLLM's streams relayed and ended properly, its 417s turned into
400s (its own 400s relayed), its tokens accounted, group caps applied to native requests
that name no limit, and client disconnects turned into LightLLM aborts."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import wait_until
from tests.engine_fixture import free_port
from tests.lightllm_wire import WireConfig, WireThread, token_text
from tests.proxy_process import start_proxy, stop_proxy

GROUPS = [
    {"name": "platinum", "users": [{"id": "alice", "weight": 1, "api_key": "sk-alice"}]},
    {"name": "bronze", "users": [{"id": "carl", "api_key": "sk-carl"}, {"id": "dave", "api_key": "sk-dave"}]},
]


@pytest.fixture(scope="module")
def wire():
    """LightLLM v1.2.0."""
    with WireThread(WireConfig(disconnect_poll_s=0.1)) as w:
        yield w


@pytest.fixture(scope="module")
def old_wire():
    """LightLLM 0.0.1, for operators who run it themselves."""
    with WireThread(WireConfig(flavor="0.0.1", disconnect_poll_s=0.1)) as w:
        yield w


def _proxy(wire: WireThread, tmp_path_factory, name: str, groups=GROUPS, **sections):
    cfg = {
        "upstream": {"url": wire.url, "kind": "lightllm", **sections.pop("upstream", {})},
        "admission": {"max_inflight": 4, "max_queue": 50, "queue_timeout_s": 20, **sections.pop("admission", {})},
        "identity": sections.pop("identity", {"header": "X-User-Id"}),
        "default_group": "bronze",
        "groups": groups,
    }
    path = tmp_path_factory.mktemp(name) / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = free_port()
    proc = start_proxy(path, port)
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def proxy(wire, tmp_path_factory):
    """max_inflight 4, no load signal (these tests fill the engine on purpose)."""
    proc, url = _proxy(wire, tmp_path_factory, "px", upstream={"load_signal": {"enabled": False}})
    yield url
    assert stop_proxy(proc) == 0


@pytest.fixture(scope="module")
def old_proxy(old_wire, tmp_path_factory):
    """In front of LightLLM 0.0.1, no load signal."""
    proc, url = _proxy(old_wire, tmp_path_factory, "old", upstream={"load_signal": {"enabled": False}})
    yield url
    assert stop_proxy(proc) == 0


@pytest.fixture(scope="module")
def capped_proxy(wire, tmp_path_factory):
    """bronze's requests capped at 40 output tokens."""
    groups = [GROUPS[0], {**GROUPS[1], "max_tokens": 40}]
    proc, url = _proxy(wire, tmp_path_factory, "capped", groups=groups, upstream={"load_signal": {"enabled": False}})
    yield url
    assert stop_proxy(proc) == 0


@pytest.fixture(scope="module")
def strict_proxy(wire, tmp_path_factory):
    """One slot, a queue of 2, API keys required."""
    proc, url = _proxy(
        wire, tmp_path_factory, "strict", admission={"max_inflight": 1, "max_queue": 2}, identity={"require_api_key": True}
    )
    yield url
    assert stop_proxy(proc) == 0


@pytest.fixture(autouse=True)
def _fresh_wire(wire, old_wire):
    wire.reset()
    old_wire.reset()


async def scrape(url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    return {(smp.name, frozenset(smp.labels.items())): smp.value for fam in text_string_to_metric_families(text) for smp in fam.samples}


def metric(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def gen(n: int, prompt: str = "Hello there", **wire) -> dict:
    body: dict = {"inputs": prompt, "parameters": {"max_new_tokens": n}}
    if wire:
        body["wire"] = wire
    return body


def compact(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def native_event(i: int, last: bool, reason: str = "length", prompt_tokens: int = 3) -> bytes:
    """LightLLM v1.2.0's event for token ``i``."""
    token = {"id": 1000 + i, "text": token_text(i), "logprob": -0.5, "special": False, "count_output_tokens": i + 1,
             "prompt_tokens": prompt_tokens,
             "logprobs": {str(1000 + i): {"logprob": -0.5, "rank": None, "decoded_token": token_text(i)}}}
    ev = {"token": token, "generated_text": None, "finished": last, "finish_reason": reason if last else None, "details": None,
          "input_usage": None}
    return b"data:" + compact(ev) + b"\n\n"


def error_event(raw: bytes) -> dict:
    last = raw.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    assert last.startswith(b"data: "), raw[-300:]
    return json.loads(last[6:])["error"]


# ----------------------------------------------------------------- native routes


async def test_native_generate_is_relayed_as_json_and_accounted(proxy, wire):
    before = await scrape(proxy)
    async with aiohttp.ClientSession() as s, s.post(proxy + "/generate", json=gen(5)) as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == "application/json"  # LightLLM sent none
        body = await r.read()
    answer = json.loads(body)
    assert answer["generated_text"] == ["".join(token_text(i) for i in range(5))]
    assert (answer["count_output_tokens"], answer["prompt_tokens"], len(answer["logprobs"])) == (5, 3, 5)
    after = await scrape(proxy)
    assert metric(after, "llm_qos_tokens_total", group="bronze", direction="completion") - metric(
        before, "llm_qos_tokens_total", group="bronze", direction="completion"
    ) == 5
    assert metric(after, "llm_qos_requests_total", group="bronze", outcome="ok") == metric(before, "llm_qos_requests_total", group="bronze", outcome="ok") + 1
    prompt = lambda m: metric(m, "llm_qos_tokens_total", group="bronze", direction="prompt")  # noqa: E731
    assert prompt(after) - prompt(before) == 3  # LightLLM's own count


async def test_native_request_naming_no_limit_gets_the_group_cap(capped_proxy, wire):
    """LightLLM v1.2.0 generates up to 65535 tokens (cut to its length limit) when
    ``max_new_tokens`` is left out: the proxy must treat that as "no limit" and apply the cap."""
    body = {"inputs": "Hello there", "parameters": {}}
    async with aiohttp.ClientSession() as s, s.post(capped_proxy + "/generate", json=body) as r:
        assert r.status == 200
        assert (await r.json())["count_output_tokens"] == 40
    async with aiohttp.ClientSession() as s, s.post(wire.url + "/generate", json=body) as r:
        assert json.loads(await r.read())["count_output_tokens"] > 40  # what the engine does uncapped (no Content-Type)


@pytest.mark.parametrize("split", [False, True])
async def test_native_stream_is_relayed_byte_for_byte(proxy, wire, split):
    before = await scrape(proxy)
    async with aiohttp.ClientSession() as s, s.post(proxy + "/generate_stream", json=gen(6, split=split)) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = await r.read()
    assert raw == b"".join(native_event(i, i == 5) for i in range(6))  # no [DONE] added, no error event
    after = await scrape(proxy)
    done = lambda m: metric(m, "llm_qos_tokens_total", group="bronze", direction="completion")  # noqa: E731
    assert done(after) - done(before) == 6
    assert metric(after, "llm_qos_inflight_requests") == 0
    assert wire.stats.completed == 1 and wire.stats.aborted == 0


@pytest.mark.parametrize(
    "wire_knobs, code",
    [({"end_after": 3}, "upstream_stream_incomplete"), ({"break_after": 2}, "upstream_stream_broken")],
)
async def test_native_stream_without_its_final_event_ends_in_an_error_event(proxy, wire, wire_knobs, code):
    before = await scrape(proxy)
    async with aiohttp.ClientSession() as s, s.post(proxy + "/generate_stream", json=gen(8, **wire_knobs)) as r:
        assert r.status == 200
        raw = await r.read()
    n = next(iter(wire_knobs.values()))
    assert raw.startswith(b"".join(native_event(i, False) for i in range(n)))
    assert error_event(raw)["code"] == code
    after = await scrape(proxy)
    assert metric(after, "llm_qos_inflight_requests") == 0  # the slot is free
    errors = lambda m: metric(m, "llm_qos_requests_total", group="bronze", outcome="upstream_error")  # noqa: E731
    assert errors(after) == errors(before) + 1
    assert metric(after, "llm_qos_tokens_total", group="bronze", direction="completion") - metric(
        before, "llm_qos_tokens_total", group="bronze", direction="completion"
    ) == n


async def test_overlong_prompt_on_a_native_stream_ends_with_lightllms_error_event(proxy, wire):
    """v1.2.0 reports it after the headers as one error event and a clean end: relayed as
    the stream's last event (no second error event), counted as an upstream error, charged nothing."""
    before = await scrape(proxy)
    async with aiohttp.ClientSession() as s, s.post(proxy + "/generate_stream", json=gen(4, prompt="z" * 20000)) as r:
        assert r.status == 200  # LightLLM had sent its headers
        raw = await r.read()
    assert raw.count(b"data:") == 1 and error_event(raw)["type"] == "invalid_request_error"
    assert wire.stats.failed == 1
    after = await scrape(proxy)
    errors = lambda m: metric(m, "llm_qos_requests_total", group="bronze", outcome="upstream_error")  # noqa: E731
    assert errors(after) == errors(before) + 1
    for direction in ("prompt", "completion"):
        key = dict(group="bronze", direction=direction)
        assert metric(after, "llm_qos_tokens_total", **key) == metric(before, "llm_qos_tokens_total", **key)


async def test_0_0_1_overlong_prompt_on_a_native_stream_is_an_upstream_failure(old_proxy, old_wire):
    async with aiohttp.ClientSession() as s, s.post(old_proxy + "/generate_stream", json=gen(4, prompt="z" * 9000)) as r:
        assert r.status == 200  # LightLLM had sent its headers, then dropped the connection
        raw = await r.read()
    assert raw.count(b"data:") == 1 and error_event(raw)["code"] == "upstream_stream_broken"
    assert old_wire.stats.failed == 1


# --------------------------------------------------------------- OpenAI routes


async def test_openai_chat_stream_keeps_lightllms_done_and_counts_its_usage(proxy, wire):
    before = await scrape(proxy)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(proxy + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        raw = await r.read()
    events = raw.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""] and raw.count(b"[DONE]") == 1  # v1.2.0 sends it: not repeated
    chunks = [json.loads(e[6:]) for e in events[:-2]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "".join(token_text(i) for i in range(4))
    after = await scrape(proxy)
    key = dict(group="bronze", direction="completion")
    assert metric(after, "llm_qos_tokens_total", **key) - metric(before, "llm_qos_tokens_total", **key) == 4  # from usage


async def test_0_0_1_openai_chat_stream_ends_with_an_incomplete_error(old_proxy, old_wire):
    """LightLLM 0.0.1's chat stream leaves finish_reason null and sends no [DONE]: its end
    cannot be told from a cut-off stream, so it gets a terminal error event, not [DONE]."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(old_proxy + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        raw = await r.read()
    events = raw.split(b"\n\n")
    assert b"[DONE]" not in raw and json.loads(events[-2][6:])["error"]["code"] == "upstream_stream_incomplete" and events[-1] == b""
    chunks = [json.loads(e[6:]) for e in events[:-2]]
    assert [c["choices"][0]["delta"]["content"] for c in chunks] == [token_text(i) for i in range(4)]


async def test_openai_completions_route_is_relayed(proxy, wire):
    body = {"model": "m", "prompt": "hi", "max_tokens": 3, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(proxy + "/v1/completions", json=body) as r:
        assert r.status == 200
        raw = await r.read()
    assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b"[DONE]") == 1


async def test_openai_chat_usage_is_accounted(proxy, wire):
    before = await scrape(proxy)
    body = {"model": "m", "messages": [{"role": "user", "content": "hello hello hello"}], "max_tokens": 7}
    async with aiohttp.ClientSession() as s, s.post(proxy + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        answer = await r.json()
    assert {k: answer["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == {
        "prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
    after = await scrape(proxy)
    for direction, n in (("prompt", 5), ("completion", 7)):
        key = dict(group="bronze", direction=direction)
        assert metric(after, "llm_qos_tokens_total", **key) - metric(before, "llm_qos_tokens_total", **key) == n


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/generate", {"inputs": "x", "parameters": {"max_new_tokens": 3, "do_sample": True, "top_k": "2"}}, "'<' not supported between instances of 'str' and 'int'"),
        ("/generate_stream", {"inputs": "x", "parameters": {"max_new_tokens": 3, "best_of": 2}}, "stream api only support best_of == 1"),
    ],
)
async def test_lightllm_417_becomes_an_openai_style_400(proxy, wire, path, body, message):
    async with aiohttp.ClientSession() as s, s.post(proxy + path, json=body) as r:
        assert r.status == 400
        assert r.headers["Content-Type"].startswith("application/json")
        err = (await r.json())["error"]
    assert err == {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_request"}
    assert wire.stats.rejected == 1


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/generate", {"inputs": "x", "parameters": {"max_new_tokens": 3, "repetition_penalty": 0.5}}, "repetition_penalty must >= 1.0, got 0.5"),
        ("/generate_stream", {"inputs": "x", "parameters": {"max_new_tokens": 3, "top_k": 0, "do_sample": True}}, "top_k must be -1 (disable), or at least 1, got 0."),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}], "do_sample": True, "top_p": 1.5}, "top_p must be in (0.0, 1.0], got 1.5"),
    ],
)
async def test_lightllms_own_400_is_relayed_as_it_is(proxy, wire, path, body, message):
    async with aiohttp.ClientSession() as s, s.post(proxy + path, json=body) as r:
        assert r.status == 400
        answer = await r.json()
    assert answer == {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
    assert wire.stats.rejected == 1


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/generate", {"inputs": "x", "parameters": {"max_new_tokens": 3, "max_tokens": 3}}, "SamplingParams.__init__() got an unexpected keyword argument 'max_tokens'"),
        ("/generate_stream", {"inputs": "x", "parameters": {"max_new_tokens": 3, "top_k": 0, "do_sample": True}}, "top_k must be -1 (disable), or at least 1, got 0."),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}], "do_sample": True, "top_p": 1.5}, "top_p must in (0.0, 1.0], got 1.5"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True, "n": 2}, "stream api only support n = 1"),
    ],
)
async def test_0_0_1_417_becomes_an_openai_style_400(old_proxy, old_wire, path, body, message):
    async with aiohttp.ClientSession() as s, s.post(old_proxy + path, json=body) as r:
        assert r.status == 400
        assert r.headers["Content-Type"].startswith("application/json")
        err = (await r.json())["error"]
    assert err == {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_request"}
    assert old_wire.stats.rejected == 1


# ------------------------------------------------------------------ disconnects


async def test_client_leaving_mid_stream_aborts_lightllm(proxy, wire):
    async with aiohttp.ClientSession() as s:
        r = await s.post(proxy + "/generate_stream", json=gen(200, itl_s=0.05))
        for _ in range(2):
            await r.content.readuntil(b"\n\n")
        r.close()
    await wait_until(lambda: wire.stats.aborted == 1, timeout=3, what="LightLLM dropping the request")
    assert wire.stats.running == 0 and wire.stats.completed == 0 and wire.stats.tokens_sent < 200
    await wait_until_metric(proxy, "llm_qos_inflight_requests", 0)


async def test_client_leaving_a_non_streaming_generate_aborts_lightllm(proxy, wire):
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(proxy + "/generate", json=gen(200, itl_s=0.05)))
        await wait_until(lambda: wire.stats.running == 1, what="generating")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    await wait_until(lambda: wire.stats.aborted == 1, timeout=3, what="LightLLM dropping the request")
    await wait_until_metric(proxy, "llm_qos_inflight_requests", 0)


async def test_client_leaving_while_queued_inside_lightllm_aborts_it(proxy, wire):
    """LightLLM's own queue: the engine's KV budget is taken by two requests sent to it
    directly; the proxied one waits inside LightLLM (LightLLM has sent its headers; the
    proxy holds them back until the first event) and is dropped at LightLLM's next
    connection check once the client leaves."""
    fill = {"inputs": "a", "parameters": {"max_new_tokens": 2990}, "wire": {"ttft_s": 30}}
    async with aiohttp.ClientSession() as direct, aiohttp.ClientSession() as client:
        hogs = [asyncio.create_task(direct.post(wire.url + "/generate", json=fill)) for _ in range(2)]
        await wait_until(lambda: wire.stats.running == 2, what="engine full")
        # (its headers come with its first event: the client waits for them meanwhile)
        r = asyncio.create_task(client.post(proxy + "/generate_stream", json=gen(20)))
        await wait_until(lambda: wire.stats.waiting == 1, what="queued inside LightLLM")
        r.cancel()
        await wait_until(lambda: wire.stats.aborted_queued == 1, timeout=3, what="queued request dropped")
        for t in hogs:
            t.cancel()
        await asyncio.gather(*hogs, return_exceptions=True)
    await wait_until(lambda: wire.stats.running == 0, timeout=3, what="engine empty again")
    await wait_until_metric(proxy, "llm_qos_inflight_requests", 0)


async def wait_until_metric(url: str, name: str, value: float, timeout: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while metric(await scrape(url), name) != value:
        assert asyncio.get_running_loop().time() < deadline, f"{name} never became {value}"
        await asyncio.sleep(0.05)


# -------------------------------------------------------- identity and admission


async def test_native_routes_require_a_key_when_configured(strict_proxy, wire):
    async with aiohttp.ClientSession() as s:
        for path in ("/generate", "/generate_stream"):
            async with s.post(strict_proxy + path, json=gen(2)) as r:
                assert r.status == 401
                assert (await r.json())["error"]["code"] == "invalid_api_key"
            async with s.post(strict_proxy + path, json=gen(2), headers={"Authorization": "Bearer sk-carl"}) as r:
                assert r.status == 200
                await r.read()
    assert wire.stats.started == 2  # the refused ones never reached LightLLM


async def test_native_routes_are_admitted_by_priority(strict_proxy, wire):
    key = lambda k: {"Authorization": f"Bearer {k}"}  # noqa: E731
    async with aiohttp.ClientSession() as s:
        busy = asyncio.create_task(s.post(strict_proxy + "/generate", json=gen(10, itl_s=0.05, tag="busy"), headers=key("sk-carl")))
        await wait_until(lambda: wire.stats.running == 1, what="slot taken")
        low = asyncio.create_task(s.post(strict_proxy + "/generate_stream", json=gen(2, tag="bronze"), headers=key("sk-dave")))
        await asyncio.sleep(0.1)
        high = asyncio.create_task(s.post(strict_proxy + "/generate", json=gen(2, tag="platinum"), headers=key("sk-alice")))
        for t in (busy, low, high):
            r = await t
            assert r.status == 200
            await r.read()
    assert wire.stats.tags == ["busy", "platinum", "bronze"]


async def test_native_queue_full_is_a_429(strict_proxy, wire):
    key = {"Authorization": "Bearer sk-carl"}
    async with aiohttp.ClientSession() as s:
        busy = asyncio.create_task(s.post(strict_proxy + "/generate", json=gen(10, itl_s=0.05), headers=key))
        await wait_until(lambda: wire.stats.running == 1, what="slot taken")
        waiting = [asyncio.create_task(s.post(strict_proxy + "/generate_stream", json=gen(1), headers=key)) for _ in range(2)]
        await asyncio.sleep(0.2)
        async with s.post(strict_proxy + "/generate_stream", json=gen(1), headers=key) as r:
            assert r.status == 429
            assert (await r.json())["error"]["code"] == "queue_full"
            assert "Retry-After" in r.headers
        for t in [busy, *waiting]:
            r = await t
            assert r.status == 200
            await r.read()
