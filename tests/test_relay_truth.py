"""The relay tells the truth: what a client receives through the real proxy process, byte
for byte and header by header, for the wire shapes engines really send (issue 11).

The upstream is :mod:`tests.scripted_upstream`, a real socket answering each request
with bytes the test wrote; each test routes its requests by a ``model`` name of its own.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import pytest
import yaml
from yarl import URL
from prometheus_client.parser import text_string_to_metric_families

from proxy.config.loading import ConfigError, parse_config
from proxy.wire.headers import proxied_location
from tests.proxy_process import REPO_ROOT, start_proxy, stop_proxy
from tests.proc_util import free_port
from tests.scripted_upstream import (
    LAST_CHUNK,
    SSE,
    ScriptedUpstream,
    Script,
    Seen,
    chat_chunk,
    chunk,
    drop_after_read,
    gzipped,
    hang,
    head,
    reply,
    reset_after,
    response,
    stream,
)

CHAT = "/v1/chat/completions"
DONE = b"data: [DONE]\n\n"
JSON = [("Content-Type", "application/json")]


@dataclass
class Proxy:
    url: str
    proc: subprocess.Popen
    access_log: Path


ADMIN = "adm-relay-key"


def _start(up: ScriptedUpstream | None, folder: Path, upstream: dict | None = None, extra_args: list[str] | None = None, **top) -> Proxy:
    """The real proxy in front of ``up`` (or of the engines ``top["pools"]`` names)."""
    cfg = {
        "upstream": {**({"url": up.url} if up is not None else {}), "kind": "openai", "load_signal": {"enabled": False}, **(upstream or {})},
        "admission": {"max_inflight": 16, "max_queue": 50, "queue_timeout_s": 20},
        "admin": {"api_key": ADMIN},
        "default_group": "bronze",
        "groups": [
            {"name": "bronze", "users": [{"id": "carl", "api_key": "sk-carl-secret"}, {"id": "dora", "api_key": "sk-dora-secret"}]}
        ],
        **top,
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    access = folder / "access.log"
    port = free_port()
    proc = start_proxy(path, port, extra_args=["--access-log", str(access), *(extra_args or [])])
    return Proxy(f"http://127.0.0.1:{port}", proc, access)


@pytest.fixture(scope="module")
def up():
    with ScriptedUpstream() as u:
        yield u


@pytest.fixture(scope="module")
def proxy(up, tmp_path_factory):
    """Defaults: streams get usage asked for and stripped; non-streaming relayed as is."""
    p = _start(up, tmp_path_factory.mktemp("px"))
    yield p
    assert stop_proxy(p.proc) == 0


@pytest.fixture(scope="module")
def assembling(up, tmp_path_factory):
    """upstream.stream_non_streaming: true."""
    p = _start(up, tmp_path_factory.mktemp("asm"), {"stream_non_streaming": True})
    yield p
    assert stop_proxy(p.proc) == 0


@pytest.fixture(scope="module")
def impatient(up, tmp_path_factory):
    """Short upstream timeouts: no headers within 1 s is a 504, 1.5 s of silence idle."""
    p = _start(up, tmp_path_factory.mktemp("imp"), {"first_byte_timeout_s": 1.0, "idle_timeout_s": 1.5})
    yield p
    assert stop_proxy(p.proc) == 0


@pytest.fixture
def model(request) -> str:
    """A model name of this test's own: the scripted upstream routes by it."""
    return request.node.name


def chat(model: str, stream: bool = False, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "the secret prompt"}], "stream": stream, **extra}


async def call(url: str, body: dict | bytes | None = None, headers: dict | None = None, method: str = "POST", path: str = CHAT):
    """(status, headers, raw body) as a client receives them (no decompression)."""
    data = body if isinstance(body, bytes) else (None if body is None else json.dumps(body).encode())
    hdrs = {"Authorization": "Bearer sk-carl-secret", **({"Content-Type": "application/json"} if data is not None else {}), **(headers or {})}
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        req = s.request(method, URL(url + path, encoded=True), data=data, headers=hdrs, timeout=aiohttp.ClientTimeout(total=30), allow_redirects=False)
        async with req as r:
            return r.status, r.headers, await r.read()


async def scrape(url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    return {(smp.name, frozenset(smp.labels.items())): smp.value for fam in text_string_to_metric_families(text) for smp in fam.samples}


def metric(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


async def access_line(p: Proxy, request_id: str, timeout: float = 10.0) -> dict:
    """The access-log line of ``request_id`` (the log is flushed every second)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.access_log.exists():
            for line in p.access_log.read_text().splitlines():
                obj = json.loads(line)
                if obj["request_id"] == request_id:
                    return obj
        await asyncio.sleep(0.1)
    raise AssertionError(f"no access-log line for {request_id}")


def events(*evs: bytes) -> bytes:
    return b"".join(evs)


async def admin_status(p: Proxy) -> dict:
    async with aiohttp.ClientSession() as s, s.get(p.url + "/admin/status", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        assert r.status == 200
        return await r.json()


# ------------------------------------------------------------------- compression


def rejecting_stream_options(error_body: bytes, content: str) -> Script:
    """An engine with a strict request schema: a body with ``stream_options`` gets a 400
    with ``error_body``; any other gets a one-chunk stream answering ``content``."""

    def engine(sock, seen: Seen) -> bool:
        if "stream_options" in seen.json:
            sock.sendall(response(400, JSON, error_body))
        else:
            sock.sendall(head(200, SSE) + chunk(chat_chunk(content, "stop")) + LAST_CHUNK)
        return False

    return engine

async def test_gzip_stream_is_decoded_and_identity_was_asked(proxy, up, model):
    plain = events(chat_chunk("Hel"), chat_chunk("lo"), chat_chunk(None, "stop"), DONE)
    gz = gzipped(plain)
    up.on(model, stream([gz[:9], 0.02, gz[9:]], headers=[*SSE, ("Content-Encoding", "gzip")]))
    status, headers, raw = await call(proxy.url, chat(model, stream=True), headers={"Accept-Encoding": "gzip, br"})
    assert status == 200 and raw == plain  # decoded, byte for byte, nothing added
    assert "Content-Encoding" not in headers
    assert up.seen_for(model)[0].headers["accept-encoding"] == "identity"


async def test_gzip_stream_without_done_gets_done_after_the_decoded_bytes(proxy, up, model):
    plain = events(chat_chunk("a"), chat_chunk(None, "length"))
    up.on(model, stream([gzipped(plain)], headers=[*SSE, ("Content-Encoding", "gzip")]))
    status, headers, raw = await call(proxy.url, chat(model, stream=True))
    assert status == 200 and raw == plain + DONE and "Content-Encoding" not in headers


async def test_gzip_json_answer_is_decoded_with_matching_length(proxy, up, model):
    body = b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}'
    up.on(model, reply(response(200, [*JSON, ("Content-Encoding", "gzip")], gzipped(body))))
    status, headers, raw = await call(proxy.url, chat(model))
    assert status == 200 and raw == body
    assert "Content-Encoding" not in headers and headers["Content-Length"] == str(len(body))


@pytest.mark.parametrize("coding, stream_it", [("br", True), ("compress", False), ("gzip, br", False)])
async def test_a_coding_the_proxy_cannot_read_is_a_502_not_garbage(proxy, up, model, coding, stream_it):
    up.on(model, reply(response(200, [*SSE, ("Content-Encoding", coding)], b"\x8b\x00garbage")))
    status, headers, raw = await call(proxy.url, chat(model, stream=stream_it))
    assert status == 502 and headers["Content-Type"].startswith("application/json")
    assert json.loads(raw)["error"]["code"] == "upstream_bad_response" and b"[DONE]" not in raw


# ----------------------------------------------------------------------- headers

PASSED = [
    ("Retry-After", "7"),
    ("retry-after-ms", "6500"),
    ("x-should-retry", "true"),
    ("x-ratelimit-limit-requests", "60"),
    ("x-ratelimit-remaining-tokens", "0"),
    ("x-ratelimit-reset-requests", "1s"),
    ("anthropic-ratelimit-requests-remaining", "0"),
    ("openai-processing-ms", "12"),
    ("openai-version", "2020-10-01"),
    ("x-request-id", "req_engine_429"),
    ("Cache-Control", "no-store"),
    ("X-Vendor-Thing", "kept"),
]
DROPPED = [
    ("Set-Cookie", "__cf_bm=secret-session; path=/"),
    ("Connection", "close, X-Hop"),
    ("X-Hop", "named-by-connection"),
    ("Keep-Alive", "timeout=5"),
    ("Proxy-Authenticate", "Basic"),
    ("Trailer", "X-Checksum"),
    ("Alt-Svc", 'h3=":443"'),
    ("Strict-Transport-Security", "max-age=63072000"),
    ("Access-Control-Allow-Origin", "*"),
    ("WWW-Authenticate", "Bearer realm=engine"),
    ("Server", "engine/1.0"),
]


async def test_error_answer_headers_the_client_acts_on_pass_and_hop_by_hop_do_not(proxy, up, model):
    body = b'{"error":{"message":"slow down","type":"rate_limit_error","code":"rate_limit_exceeded"}}'
    up.on(model, reply(response(429, [*JSON, *PASSED, *DROPPED], body)))
    status, headers, raw = await call(proxy.url, chat(model))
    assert status == 429 and raw == body and headers["Content-Type"] == "application/json"
    for k, v in PASSED:
        assert headers.getall(k) == [v], k
    for k, v in DROPPED:
        assert v not in headers.getall(k, []), k
    assert "Set-Cookie" not in headers and "X-Hop" not in headers and "Alt-Svc" not in headers


async def test_stream_headers_pass_with_the_upstreams_content_type(proxy, up, model):
    hdrs = [("Content-Type", "text/event-stream; charset=utf-8"), ("x-ratelimit-remaining-requests", "59"), ("openai-processing-ms", "3"), ("Set-Cookie", "a=b")]
    up.on(model, stream([chat_chunk(None, "stop"), DONE], headers=hdrs))
    status, headers, raw = await call(proxy.url, chat(model, stream=True))
    assert status == 200 and raw == chat_chunk(None, "stop") + DONE
    assert headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert headers["x-ratelimit-remaining-requests"] == "59" and headers["openai-processing-ms"] == "3"
    assert headers["X-Accel-Buffering"] == "no" and "Set-Cookie" not in headers


async def test_openai_sdk_obeys_x_should_retry_false_through_the_proxy(proxy, up, model):
    """The engine says: do not retry. The SDK, behind the proxy, makes exactly one
    attempt; without that header it makes three (so the count is the header's doing)."""
    body = b'{"error":{"message":"overloaded","type":"server_error","code":null}}'
    up.on(model, reply(response(503, [*JSON, ("x-should-retry", "false")], body)))
    up.on(model + "-no-hint", reply(response(503, [*JSON, ("retry-after-ms", "1")], body)))
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-carl-secret", max_retries=2)
    try:
        for m in (model, model + "-no-hint"):
            with pytest.raises(openai.InternalServerError):
                await client.chat.completions.create(model=m, messages=[{"role": "user", "content": "hi"}])
    finally:
        await client.close()
    assert len(up.seen_for(model)) == 1
    assert len(up.seen_for(model + "-no-hint")) == 3


# ------------------------------------------------------------------ no second send


async def test_an_upstream_that_reads_the_post_then_drops_it_gets_it_once(proxy, up, model):
    up.on(model, drop_after_read())
    before = await scrape(proxy.url)
    status, headers, raw = await call(proxy.url, chat(model, max_tokens=5))
    assert status == 502 and json.loads(raw)["error"]["code"] == "upstream_disconnected"
    assert len(up.seen_for(model)) == 1  # exactly one generation could have started
    after = await scrape(proxy.url)
    key = dict(group="bronze", outcome="upstream_error")
    assert metric(after, "llm_qos_requests_total", **key) - metric(before, "llm_qos_requests_total", **key) == 1


# ---------------------------------------------------------------------- request id


async def test_client_request_id_is_forwarded_returned_and_logged(proxy, up, model):
    up.on(model, reply(response(200, JSON, b'{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}')))
    status, headers, _ = await call(proxy.url, chat(model), headers={"X-Request-Id": "trace-42:abc_DEF.9"})
    assert status == 200 and headers["X-Request-Id"] == "trace-42:abc_DEF.9"
    assert up.seen_for(model)[0].headers["x-request-id"] == "trace-42:abc_DEF.9"
    line = await access_line(proxy, "trace-42:abc_DEF.9")
    assert line["upstream_request_id"] is None and line["status"] == 200 and line["model"] == model and line["kind"] == "chat"


@pytest.mark.parametrize("given", ["x" * 129, "has space", "semi;colon", "ünïcode", ""])
async def test_unsafe_request_id_is_replaced_by_a_fresh_one(proxy, up, model, given):
    up.on(model, reply(response(200, JSON, b"{}")))
    _, headers, _ = await call(proxy.url, chat(model), headers={"X-Request-Id": given.encode("utf-8").decode("latin-1")})
    rid = headers["X-Request-Id"]
    assert rid != given and len(rid) == 32 and int(rid, 16) >= 0
    assert up.seen_for(model)[-1].headers["x-request-id"] == rid


async def test_engine_request_id_wins_on_the_answer_and_both_are_logged(proxy, up, model):
    up.on(model, stream([chat_chunk(None, "stop"), DONE], headers=[*SSE, ("X-Request-Id", "req_engine_7")]))
    _, headers, _ = await call(proxy.url, chat(model, stream=True), headers={"X-Request-Id": "mine-1"})
    assert headers.getall("X-Request-Id") == ["req_engine_7"]
    line = await access_line(proxy, "mine-1")
    assert line["upstream_request_id"] == "req_engine_7"


async def test_proxy_own_answers_carry_a_request_id(proxy):
    status, headers, raw = await call(proxy.url, b"{not json", headers={"X-Request-Id": "bad-body-1"})
    assert status == 400 and headers["X-Request-Id"] == "bad-body-1"
    line = await access_line(proxy, "bad-body-1")
    assert (line["status"], line["outcome"]) == (400, "bad_request")


# ------------------------------------------------------------ errors as success


VLLM_ERROR = b'data: {"error":{"object":"error","message":"CUDA out of memory","type":"InternalServerError","param":null,"code":500}}\n\n'


async def test_in_band_error_is_relayed_as_sent_and_counted_as_an_upstream_error(proxy, up, model):
    sent = events(chat_chunk("Hi"), VLLM_ERROR)
    up.on(model, stream([chat_chunk("Hi"), 0.01, VLLM_ERROR]))
    before = await scrape(proxy.url)
    status, _, raw = await call(proxy.url, chat(model, stream=True), headers={"X-Request-Id": "inband-1"})
    assert status == 200 and raw == sent  # no [DONE], no made-up event
    after = await scrape(proxy.url)
    for outcome, delta in (("upstream_error", 1), ("ok", 0)):
        key = dict(group="bronze", outcome=outcome)
        assert metric(after, "llm_qos_requests_total", **key) - metric(before, "llm_qos_requests_total", **key) == delta
    line = await access_line(proxy, "inband-1")
    assert line["outcome"] == "upstream_error" and line["output_tokens"] == 1  # charged only what was produced


@pytest.mark.parametrize(
    "error_event, status",
    [
        (VLLM_ERROR, 500),
        (b'data: {"object":"error","message":"bad grammar","type":"BadRequestError","param":null,"code":400}\n\n', 400),
        (b'event: error\ndata: {"error":{"message":"quota exceeded"}}\n\n', 502),
    ],
)
async def test_assembled_answer_with_an_in_band_error_is_an_error_not_a_200(assembling, up, model, error_event, status):
    up.on(model, stream([chat_chunk("partial "), chat_chunk("text"), error_event]))
    got, headers, raw = await call(assembling.url, chat(model))
    assert got == status and headers["Content-Type"].startswith("application/json")
    err = json.loads(raw)["error"]
    assert err["message"] in ("CUDA out of memory", "bad grammar", "quota exceeded")
    assert b"partial" not in raw


async def test_a_stream_with_no_events_is_an_upstream_error(proxy, up, model):
    up.on(model, stream([]))
    status, _, raw = await call(proxy.url, chat(model, stream=True), headers={"X-Request-Id": "empty-1"})
    assert status == 200 and b"[DONE]" not in raw
    assert json.loads(raw.removeprefix(b"data: "))["error"]["code"] == "upstream_stream_incomplete"
    assert (await access_line(proxy, "empty-1"))["outcome"] == "upstream_error"


async def test_a_finished_stream_without_done_gets_it_once(proxy, up, model):
    sent = events(chat_chunk("a"), chat_chunk("b"), chat_chunk(None, "stop"))
    up.on(model, stream([sent]))
    status, _, raw = await call(proxy.url, chat(model, stream=True))
    assert status == 200 and raw == sent + DONE


async def test_a_stream_with_its_own_done_is_passed_byte_for_byte(proxy, up, model):
    sent = events(chat_chunk("a"), chat_chunk(None, "stop"), DONE)
    up.on(model, stream([sent[:17], sent[17:]]))
    assert (await call(proxy.url, chat(model, stream=True)))[2] == sent


@pytest.mark.parametrize(
    "sent, n",
    [
        (events(chat_chunk("a"), chat_chunk("b")), 1),  # cut before the finish
        (events(chat_chunk("a", finish=""), chat_chunk("b", finish="")), 1),  # Ollama's "not yet"
        (events(chat_chunk("a", index=0), chat_chunk("b", index=1), chat_chunk(None, "stop", index=0)), 2),  # choice 1 never ended
    ],
)
async def test_a_stream_that_did_not_finish_ends_with_an_error_event(proxy, up, model, sent, n):
    up.on(model, stream([sent]))
    status, _, raw = await call(proxy.url, chat(model, stream=True, n=n))
    assert status == 200 and raw.startswith(sent) and b"[DONE]" not in raw
    assert json.loads(raw[len(sent) :].removeprefix(b"data: "))["error"]["code"] == "upstream_stream_incomplete"


async def test_assembled_answer_of_a_cut_stream_is_a_502(assembling, up, model):
    up.on(model, stream([chat_chunk("half an ans"), chat_chunk("wer")]))
    status, _, raw = await call(assembling.url, chat(model))
    assert status == 502 and json.loads(raw)["error"]["code"] == "upstream_stream_incomplete"


IN_BAND_400 = b'data: {"error":{"object":"error","message":"bad grammar","type":"BadRequestError","param":null,"code":400}}\n\n'
LIGHTLLM_TOO_LONG = b'data: {"error":{"message":"the input prompt token len 9000 is too long > 8192","type":"invalid_request_error"}}\n\n'


async def test_in_band_client_errors_never_eject_an_engine(tmp_path, model):
    """An engine that answers a client's bad request in-band (an error event with code
    400 after a 200, LightLLM's "prompt too long" event, a JSON 200 error body, an
    assembled answer's in-band 400) is answering, not failing: a pool of two engines
    with ``failures_to_eject: 2`` keeps both in rotation through six such answers in a
    row. The same pool ejects an engine on streams that really break (the control)."""
    with ScriptedUpstream() as a, ScriptedUpstream() as b:
        for u in (a, b):
            u.on(model + "-event", stream([IN_BAND_400]))
            u.on(model + "-lightllm", stream([LIGHTLLM_TOO_LONG]))
            u.on(model + "-json200", reply(response(200, JSON, b'{"error":{"message":"bad grammar","type":"BadRequestError","code":400}}')))
            u.on(model + "-assembled", stream([chat_chunk("x"), IN_BAND_400]))
            u.on(model + "-cut", stream([chat_chunk("x")], end=False))
        health = {"failures_to_eject": 2, "check_interval_s": 0, "eject_base_s": 60, "eject_max_s": 60}
        pools = [{"name": "p", "models": ["*"], "engines": [{"url": a.url, "name": "a"}, {"url": b.url, "name": "b"}], "health": health}]
        p = _start(None, tmp_path, {"stream_non_streaming": True}, pools=pools)
        try:
            for _ in range(2):
                for suffix, streamed, want in (("-event", True, 200), ("-lightllm", True, 200), ("-json200", True, 200), ("-assembled", False, 400)):
                    status, _, raw = await call(p.url, chat(model + suffix, stream=streamed))
                    assert status == want and b"error" in raw, (suffix, status, raw)
            engines = {e["name"]: e for e in (await admin_status(p))["engines"]}
            assert [engines[n]["state"] for n in ("a", "b")] == ["healthy", "healthy"]
            assert all(engines[n]["failures"]["stream_cut"] == 0 and engines[n]["ejections"] == 0 for n in ("a", "b"))
            assert len(a.seen) >= 2 and len(b.seen) >= 2  # both engines answered some
            for _ in range(4):  # the control: streams cut before their finish
                status, _, raw = await call(p.url, chat(model + "-cut", stream=True))
                assert b"upstream_stream_broken" in raw
            engines = {e["name"]: e for e in (await admin_status(p))["engines"]}
            assert "ejected" in [engines[n]["state"] for n in ("a", "b")]
        finally:
            assert stop_proxy(p.proc) == 0


FINISHED = events(chat_chunk("a"), chat_chunk(None, "stop"))
USAGE_FRAGMENT = b'data: {"id":"c","choices":[],"usage":{"prompt_to'  # an event cut short


@pytest.mark.parametrize(
    "parts, client_gets",
    [
        ([FINISHED], FINISHED + DONE),  # finish, then the connection closes mid-body
        ([FINISHED, DONE], FINISHED + DONE),  # its own [DONE], then the break: nothing added
        ([FINISHED + USAGE_FRAGMENT], FINISHED + DONE),  # the broken event was held back (usage is stripped): dropped
    ],
)
async def test_a_stream_that_finished_then_broke_is_closed_normally(proxy, up, model, parts, client_gets):
    """Every choice had its finish_reason when the connection broke before the end of
    the body (aiohttp: "Response payload is not completed"): nothing was lost, so the
    stream ends as a finished one (``[DONE]`` where it had none) and counts ``ok``."""
    up.on(model, stream(parts, end=False))
    before = await scrape(proxy.url)
    rid = f"fin-broke-{len(parts)}-{len(parts[0])}"
    status, _, raw = await call(proxy.url, chat(model, stream=True), headers={"X-Request-Id": rid})
    assert (status, raw) == (200, client_gets)
    after = await scrape(proxy.url)
    for outcome, delta in (("ok", 1), ("upstream_error", 0)):
        key = dict(group="bronze", outcome=outcome)
        assert metric(after, "llm_qos_requests_total", **key) - metric(before, "llm_qos_requests_total", **key) == delta
    line = await access_line(proxy, rid)
    assert (line["outcome"], line["output_tokens"]) == ("ok", 2) and "broke after the stream finished" in line["detail"]


async def test_a_stream_that_finished_then_went_idle_is_closed_normally(impatient, up, model):
    """The engine sent its finish and then nothing, never closing: after
    ``idle_timeout_s`` the stream is closed as finished, not cut."""
    up.on(model, stream([FINISHED, 5.0]))
    status, _, raw = await call(impatient.url, chat(model, stream=True), headers={"X-Request-Id": "fin-idle-1"})
    assert (status, raw) == (200, FINISHED + DONE)
    assert (await access_line(impatient, "fin-idle-1"))["outcome"] == "ok"


async def test_a_responses_stream_that_completed_then_broke_gets_nothing_added(proxy, up, model):
    sent = events(
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"hi","sequence_number":1}\n\n',
        b'event: response.completed\ndata: {"type":"response.completed","response":{"status":"completed","usage":{"input_tokens":3,"output_tokens":1}},"sequence_number":2}\n\n',
    )
    up.on(model, stream([sent], end=False))
    body = {"model": model, "input": "hi", "stream": True}
    status, _, raw = await call(proxy.url, body, path="/v1/responses", headers={"X-Request-Id": "resp-fin-broke"})
    assert (status, raw) == (200, sent)  # no [DONE], no error event
    assert (await access_line(proxy, "resp-fin-broke"))["outcome"] == "ok"


async def test_assembled_answer_of_a_stream_that_finished_then_broke_is_a_200(assembling, up, model):
    up.on(model, stream([chat_chunk("whole "), chat_chunk("answer"), chat_chunk(None, "stop") + USAGE_FRAGMENT], end=False))
    status, _, raw = await call(assembling.url, chat(model), headers={"X-Request-Id": "asm-fin-broke"})
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("whole answer", "stop")
    assert (await access_line(assembling, "asm-fin-broke"))["outcome"] == "ok"


async def test_assembled_answer_of_a_stream_that_broke_before_its_finish_is_still_a_502(assembling, up, model):
    up.on(model, stream([chat_chunk("half")], end=False))
    status, _, raw = await call(assembling.url, chat(model))
    assert status == 502 and json.loads(raw)["error"]["code"] == "upstream_error"


async def test_an_error_before_any_token_and_an_empty_stream_charge_nothing(proxy, up, model):
    """Fair share is charged only for what was produced: an in-band error before any
    token and a stream with no events leave the user's recent service at 0 (read from
    ``/admin/status``); a served stream then charges it (the control)."""
    dora = {"Authorization": "Bearer sk-dora-secret"}

    async def service() -> float:
        users = {u["user"]: u for u in (await admin_status(proxy))["users"]}
        return users["dora"]["recent_service"] if "dora" in users else 0.0

    up.on(model + "-error", stream([IN_BAND_400]))
    up.on(model + "-empty", stream([]))
    up.on(model + "-served", stream([chat_chunk("a"), chat_chunk("b"), chat_chunk(None, "stop"), DONE]))
    for suffix, rid in (("-error", "charge-error"), ("-empty", "charge-empty")):
        status, _, raw = await call(proxy.url, chat(model + suffix, stream=True), headers={**dora, "X-Request-Id": rid})
        assert status == 200 and b"error" in raw
        line = await access_line(proxy, rid)
        assert (line["user"], line["outcome"], line["output_tokens"]) == ("dora", "upstream_error", 0)
    assert await service() == 0
    await call(proxy.url, chat(model + "-served", stream=True), headers=dora)
    assert await service() > 0


# ------------------------------------------------------------------ stream_options


@pytest.mark.parametrize("bad", ["yes", 5, [], True])
async def test_non_object_stream_options_is_a_json_400(proxy, up, model, bad):
    status, headers, raw = await call(proxy.url, chat(model, stream=True, stream_options=bad))
    assert status == 400 and headers["Content-Type"].startswith("application/json")
    assert json.loads(raw)["error"]["param"] == "stream_options" and not up.seen_for(model)


async def test_usage_is_asked_for_and_removed_before_the_client_sees_it(proxy, up, model):
    """OpenAI's shape with include_usage: "usage":null on every chunk, then a usage-only
    chunk. The client, which did not ask, gets the chunks without either, every other
    byte unchanged; the scheduler and metrics get the engine's real count (42)."""
    c1 = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}],"usage":null}\n\n'
    c2 = b'data: {"id":"c","object":"chat.completion.chunk","usage":null,"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    usage = b'data: {"id":"c","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":42,"total_tokens":47}}\n\n'
    up.on(model, stream([c1, c2, usage, DONE]))
    before = await scrape(proxy.url)
    status, _, raw = await call(proxy.url, chat(model, stream=True, stream_options={"continuous_usage_stats": False}))
    assert status == 200
    assert raw == events(
        b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}\n\n',
        b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
        DONE,
    )
    assert up.seen_for(model)[0].json["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    after = await scrape(proxy.url)
    key = dict(group="bronze", direction="completion")
    assert metric(after, "llm_qos_tokens_total", **key) - metric(before, "llm_qos_tokens_total", **key) == 42


async def test_usage_the_client_asked_for_is_left_alone(proxy, up, model):
    usage = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}\n\n'
    sent = events(chat_chunk("x", usage=None), chat_chunk(None, "stop", usage=None), usage, DONE)
    up.on(model, stream([sent]))
    body = chat(model, stream=True, stream_options={"include_usage": True})
    assert (await call(proxy.url, body))[2] == sent
    assert up.seen_for(model)[0].json["stream_options"] == {"include_usage": True}


async def test_an_engine_that_rejects_stream_options_still_serves_valid_requests(up, model, tmp_path):
    """First request: 400 naming stream_options, sent again without, served; remembered:
    later requests go without it at once. A client's own bad field is relayed at once."""

    strict = rejecting_stream_options(
        b'{"error":{"message":"Unrecognized request argument supplied: stream_options","type":"invalid_request_error","param":"stream_options","code":null}}', "ok"
    )

    def engine(sock, seen: Seen) -> bool:
        if "stream_options" not in seen.json and seen.json.get("temperature") == "hot":
            sock.sendall(response(400, JSON, b'{"error":{"message":"temperature must be a number","param":"temperature"}}'))
            return False
        return strict(sock, seen)

    up.on(model, engine)
    p = _start(up, tmp_path, {"stream_non_streaming": True})
    try:
        status, _, raw = await call(p.url, chat(model, stream=True))
        assert status == 200 and raw == chat_chunk("ok", "stop") + DONE
        assert ["stream_options" in s.json for s in up.seen_for(model)] == [True, False]
        status, _, raw = await call(p.url, chat(model))  # assembled, without stream_options at once
        assert status == 200 and json.loads(raw)["choices"][0]["message"]["content"] == "ok"
        status, _, raw = await call(p.url, chat(model, stream=True, temperature="hot"))
        assert status == 400 and json.loads(raw)["error"]["param"] == "temperature"
        assert ["stream_options" in s.json for s in up.seen_for(model)] == [True, False, False, False]
    finally:
        assert stop_proxy(p.proc) == 0
    assert "rejected stream_options" in p.proc.log_path.read_text()


REJECTION_HEAD = b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n"


@pytest.mark.parametrize(
    "script",
    [
        reset_after(REJECTION_HEAD + b'{"error":{"message":"stream_o'),  # reset mid-body
        reply(REJECTION_HEAD + b'{"error":{"message":"stream_o'),  # closed short of its Content-Length
        stream([b'{"error":{"message":"stream_o', 5.0], headers=JSON, status=400),  # silent past idle_timeout_s
    ],
    ids=["reset", "short", "idle"],
)
async def test_a_rejection_body_that_breaks_is_a_json_502(impatient, up, model, script):
    """The engine refuses the request (400, which may name the proxy's own
    stream_options) and breaks while sending that refusal's body: the client gets a JSON
    502 ``upstream_error``, never aiohttp's text/plain 500, and the access log says the
    upstream failed, not that the client left."""
    up.on(model, script)
    before = await scrape(impatient.url)
    rid = "reject-broke-" + model.split("[")[-1].rstrip("]")
    status, headers, raw = await call(impatient.url, chat(model, stream=True), headers={"X-Request-Id": rid})
    assert status == 502 and headers["Content-Type"].startswith("application/json"), raw
    assert json.loads(raw)["error"]["code"] == "upstream_error"
    assert len(up.seen_for(model)) == 1  # not sent again
    line = await access_line(impatient, rid)
    assert (line["status"], line["outcome"]) == (502, "upstream_error")
    after = await scrape(impatient.url)
    key = dict(reason="upstream_error")
    assert metric(after, "llm_qos_upstream_aborts_total", **key) - metric(before, "llm_qos_upstream_aborts_total", **key) == 1


async def test_a_fresh_proxys_first_plain_request_to_an_engine_rejecting_stream_options(up, model, tmp_path):
    """The issue's own case: ``stream_non_streaming`` on, a fresh proxy, and its very
    first request is a plain (non-streaming) one; the engine rejects the
    ``stream_options`` the proxy added with a 400 naming it. The client gets the 200
    answer (sent once more without them), and the proxy remembers: the next plain
    request goes without them at once."""

    engine = rejecting_stream_options(
        b'{"object":"error","message":"[{\'type\': \'extra_forbidden\', \'loc\': (\'body\', \'stream_options\'), \'msg\': \'Extra inputs are not permitted\'}]","type":"BadRequestError","param":null,"code":400}',
        "fine",
    )
    up.on(model, engine)
    p = _start(up, tmp_path, {"stream_non_streaming": True})
    try:
        for _ in range(2):
            status, headers, raw = await call(p.url, chat(model))
            assert status == 200 and headers["Content-Type"].startswith("application/json"), raw
            answer = json.loads(raw)
            assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"] == "fine"
        sent = up.seen_for(model)
        assert ["stream_options" in s.json for s in sent] == [True, False, False]
        assert all(s.json["stream"] is True for s in sent)  # still streamed upstream, assembled here
    finally:
        assert stop_proxy(p.proc) == 0
    assert p.proc.log_path.read_text().count("rejected stream_options") == 1


# ------------------------------------------------------------------- query strings


async def test_the_client_query_string_reaches_the_upstream_as_sent(proxy, up, model):
    up.on(model, reply(response(200, JSON, b"{}")))
    await call(proxy.url, chat(model), path=CHAT + "?api-version=2024-06-01&q=a%20b&x=%2F")
    assert up.seen_for(model)[0].target == CHAT + "?api-version=2024-06-01&q=a%20b&x=%2F"
    up.on("/v1/models", reply(response(200, JSON, b'{"object":"list","data":[]}')))
    status, _, raw = await call(proxy.url, method="GET", path="/v1/models?api-version=1")
    assert status == 200 and raw == b'{"object":"list","data":[]}'
    assert up.seen_for("/v1/models")[-1].target == "/v1/models?api-version=1"


@pytest.mark.parametrize("url", ["http://engine:8000/v1?api-version=1", "http://engine:8000#frag"])
def test_an_upstream_url_with_a_query_or_fragment_is_refused(url, tmp_path):
    text = yaml.safe_dump({"upstream": {"url": url}, "default_group": "g", "groups": [{"name": "g"}]})
    with pytest.raises(ConfigError, match="must not have a query"):
        parse_config(text, "c.yaml")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"default_group": "g", "groups": [{"name": "g"}]}))
    run = subprocess.run(
        [sys.executable, "-m", "proxy", "proxy", "--config", str(cfg), "--port", str(free_port()), "--upstream", url],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )
    assert run.returncode == 2 and "must not have a query" in run.stderr


def _refused_at_start(cfg: dict, tmp_path: Path, *args: str) -> str:
    """Start the real proxy on ``cfg`` (plus CLI ``args``); it must refuse: exit 2. Its stderr."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = subprocess.run(
        [sys.executable, "-m", "proxy", "proxy", "--config", str(path), "--port", str(free_port()), *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=30,
    )
    assert run.returncode == 2, run.stderr[-2000:]
    return run.stderr


@pytest.mark.parametrize("url", ["http://engine-b:8000?api-version=1", "http://engine-b:8000/v1#frag"])
def test_a_pool_engine_url_with_a_query_or_fragment_is_refused(url, tmp_path):
    """The same rule as ``upstream.url`` (one validator): before, a pool engine's query
    was kept and every request went to ``...?api-version=1/v1/chat/completions``."""
    cfg = {
        "upstream": {"kind": "openai"},
        "default_group": "g",
        "groups": [{"name": "g"}],
        "pools": [{"name": "p", "models": ["*"], "engines": [{"url": "http://engine-a:8000"}, {"url": url}]}],
    }
    with pytest.raises(ConfigError, match=r"pools\.0\.engines\.1\.url: .*must not have a query"):
        parse_config(yaml.safe_dump(cfg), "c.yaml")
    assert "must not have a query" in _refused_at_start(cfg, tmp_path)


def test_repeated_upstream_flags_with_a_query_are_refused(tmp_path):
    """``--upstream A --upstream B`` makes a pool of two engines: B's query is refused too."""
    cfg = {"default_group": "g", "groups": [{"name": "g"}]}
    err = _refused_at_start(cfg, tmp_path, "--upstream", "http://engine-a:8000", "--upstream", "http://engine-b:8000?key=1")
    assert "--upstream" in err and "must not have a query" in err


# ------------------------------------------------------------------------- aborts


async def test_a_client_that_leaves_before_the_first_byte_counts_as_an_abort(proxy, up, model):
    up.on(model, hang(30))
    before = await scrape(proxy.url)
    with pytest.raises(asyncio.TimeoutError):
        async with aiohttp.ClientSession() as s:
            await s.post(proxy.url + CHAT, json=chat(model, stream=True), timeout=aiohttp.ClientTimeout(total=0.5))
    deadline = time.monotonic() + 10
    while model not in up.closed and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert model in up.closed  # the proxy closed the upstream connection: the engine aborts
    after = await scrape(proxy.url)
    key = dict(reason="client_disconnected")
    assert metric(after, "llm_qos_upstream_aborts_total", **key) - metric(before, "llm_qos_upstream_aborts_total", **key) == 1


async def test_no_headers_within_first_byte_timeout_is_a_504_and_an_abort(impatient, up, model):
    """``first_byte_timeout_s`` passed without the upstream's headers: the client gets a
    504, the proxy closes the upstream connection (the engine aborts), and
    ``llm_qos_upstream_aborts_total`` counts it."""
    up.on(model, hang(30))
    before = await scrape(impatient.url)
    status, _, raw = await call(impatient.url, chat(model, stream=True))
    assert status == 504 and json.loads(raw)["error"]["code"] == "upstream_timeout"
    deadline = time.monotonic() + 10
    while model not in up.closed and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert model in up.closed
    after = await scrape(impatient.url)
    key = dict(reason="upstream_error")
    assert metric(after, "llm_qos_upstream_aborts_total", **key) - metric(before, "llm_qos_upstream_aborts_total", **key) == 1


# --------------------------------------------------------------------- access log

ACCESS_KEYS = {
    "ts", "request_id", "upstream_request_id", "user", "group", "model", "kind", "status", "outcome", "detail",
    "queue_wait_s", "ttft_s", "duration_s", "prompt_tokens", "output_tokens", "preemptions", "resumes", "resume",
}  # fmt: skip


async def test_access_log_is_pure_json_without_keys_or_prompts(proxy, up, model):
    up.on(model, reply(response(200, JSON, b'{"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":3}}')))
    await call(proxy.url, chat(model), headers={"X-Request-Id": "json-line-1"})
    line = await access_line(proxy, "json-line-1")
    assert set(line) == ACCESS_KEYS
    assert (line["user"], line["group"], line["model"], line["status"], line["outcome"]) == ("carl", "bronze", model, 200, "ok")
    assert (line["prompt_tokens"], line["output_tokens"]) == (4, 3)
    assert line["queue_wait_s"] >= 0 and line["ttft_s"] >= line["queue_wait_s"] and line["duration_s"] >= line["ttft_s"]
    text = proxy.access_log.read_text()
    assert all(isinstance(json.loads(raw), dict) for raw in text.splitlines())  # nothing but JSON objects
    assert "sk-carl-secret" not in text and "the secret prompt" not in text
    diagnostic = proxy.proc.log_path.read_text().splitlines()
    assert diagnostic and all(not d.startswith("{") for d in diagnostic)  # readable text


ECHO = "ECHOED-PROMPT-0xC0FFEE my card is 4111"  # what a user typed, as the engine echoes it


@pytest.mark.parametrize("where", ["stream", "assembled", "json200", "responses"])
async def test_an_engines_error_message_never_reaches_the_access_log(proxy, assembling, up, model, where):
    """Engines echo the request in their error messages (pydantic's ``input``, "the
    prompt ... is too long"). The access log's detail names the engine's error code and
    type only; the message, and so the prompt, is never written. The client still gets
    the engine's error as it sent it."""
    msg = f"1 validation error: messages.0.content: input too long {ECHO!r}"
    err = {"error": {"object": "error", "message": msg, "type": "BadRequestError", "param": None, "code": 400}}
    event = b"data: " + json.dumps(err).encode() + b"\n\n"
    body, path, px = chat(model, stream=where != "assembled", messages=[{"role": "user", "content": ECHO}]), CHAT, proxy
    if where == "stream":
        up.on(model, stream([event]))
    elif where == "assembled":
        up.on(model, stream([chat_chunk("x"), event]))
        px = assembling
    elif where == "json200":
        up.on(model, reply(response(200, JSON, json.dumps(err).encode())))
    else:
        ev = {"type": "error", "code": "invalid_prompt", "message": msg, "param": None, "sequence_number": 0}
        up.on(model, stream([b"event: error\ndata: " + json.dumps(ev).encode() + b"\n\n"]))
        body, path = {"model": model, "input": ECHO, "stream": True}, "/v1/responses"
    rid = "echo-" + where
    status, _, raw = await call(px.url, body, path=path, headers={"X-Request-Id": rid})
    assert ECHO.encode() in raw  # the client sees the engine's message
    line = await access_line(px, rid)
    assert line["outcome"] == "upstream_error"
    want = {"stream": "in-band error: code=400 type=BadRequestError", "assembled": "in-band error: code=400 type=BadRequestError",
            "json200": "error body with status 200: code=400 type=BadRequestError", "responses": "in-band error: code=invalid_prompt"}
    assert line["detail"] == want[where]
    for text in (px.access_log.read_text(), px.proc.log_path.read_text()):
        # the echoed words, not a bare "4111": random hex request ids contain that now and then
        assert "C0FFEE" not in text and "card is 4111" not in text


async def test_json_diagnostic_log_with_the_flag(up, tmp_path):
    p = _start(up, tmp_path, extra_args=["--log-format", "json"])
    assert stop_proxy(p.proc) == 0
    lines = [json.loads(line) for line in p.proc.log_path.read_text().splitlines()]
    assert lines and all({"ts", "level", "logger", "message"} <= set(d) for d in lines)
    assert any("proxy listening" in d["message"] for d in lines)


# ----------------------------------------- what other gateways got wrong (beyond the issue)


async def test_crlf_separated_events_are_counted_and_end_properly(proxy, up, model):
    sent = chat_chunk("a").replace(b"\n\n", b"\r\n\r\n") + chat_chunk(None, "stop").replace(b"\n\n", b"\r\n\r\n")
    up.on(model, stream([sent]))
    status, _, raw = await call(proxy.url, chat(model, stream=True), headers={"X-Request-Id": "crlf-1"})
    assert raw == sent + DONE  # a finished stream, not "no events"
    assert (await access_line(proxy, "crlf-1"))["outcome"] == "ok"


async def test_comments_event_fields_and_multiline_data_pass_unchanged(proxy, up, model):
    sent = events(
        b": keep-alive\n\n",
        b'event: message\nid: 1\ndata: {"choices":[{"index":0,\ndata: "delta":{"content":"x"},"finish_reason":null}]}\n\n',
        b": PROCESSING\n",
        b'\ndata:{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
    )
    up.on(model, stream([sent[:30], sent[30:]]))
    status, _, raw = await call(proxy.url, chat(model, stream=True), headers={"X-Request-Id": "fields-1"})
    assert raw == sent + DONE
    line = await access_line(proxy, "fields-1")
    assert (line["outcome"], line["output_tokens"]) == ("ok", 2)


async def test_utf8_split_across_chunks_and_an_unterminated_last_event(proxy, up, model):
    ev = chat_chunk("🦙 é").replace(b"\\ud83e\\udd99 \\u00e9", "🦙 é".encode())
    cut = ev.index("🦙".encode()) + 2  # inside the 4-byte character
    last = chat_chunk(None, "stop")[:-2]  # no blank line after the last event
    up.on(model, stream([ev[:cut], 0.05, ev[cut:], last]))
    status, _, raw = await call(proxy.url, chat(model, stream=True))
    assert raw == ev + last + b"\n\n" + DONE
    assert "🦙 é" in json.loads(raw.split(b"\n\n")[0][6:])["choices"][0]["delta"]["content"]


async def test_a_huge_single_event_is_relayed_whole(proxy, up, model):
    big = chat_chunk("y" * 3_000_000)
    up.on(model, stream([big[i : i + 65536] for i in range(0, len(big), 65536)] + [chat_chunk(None, "stop")]))
    status, _, raw = await call(proxy.url, chat(model, stream=True))
    assert raw == big + chat_chunk(None, "stop") + DONE


async def test_a_json_error_with_status_200_to_a_stream_request_stays_json(proxy, up, model):
    body = b'{"error":{"message":"model not loaded","type":"server_error"}}'
    up.on(model, reply(response(200, JSON, body)))
    status, headers, raw = await call(proxy.url, chat(model, stream=True), headers={"X-Request-Id": "json200-1"})
    assert (status, raw) == (200, body) and headers["Content-Type"] == "application/json"  # no SSE, no [DONE]
    assert (await access_line(proxy, "json200-1"))["outcome"] == "upstream_error"


async def test_a_body_shorter_than_its_content_length_is_a_502(proxy, up, model):
    up.on(model, reply(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n" + b'{"choices":'))
    status, _, raw = await call(proxy.url, chat(model))
    assert status == 502 and json.loads(raw)["error"]["code"] == "upstream_error"


async def test_bytes_after_the_content_length_never_reach_a_client(proxy, up, model):
    """An upstream that sends more than its Content-Length: aiohttp's parser refuses the
    answer, so the client gets a 502 saying the upstream's answer could not be read,
    never the garbage; the connection is dropped and others are served as before."""
    body = b'{"choices":[]}'
    up.on(model, reply(response(200, JSON, body, close=False) + b"TRAILING GARBAGE", keep=True))
    for _ in range(3):
        status, _, raw = await call(proxy.url, chat(model))
        assert b"TRAILING" not in raw
        assert (status, raw) == (200, body) or (status == 502 and json.loads(raw)["error"]["code"] == "upstream_bad_response")
    up.on(model + "-fine", reply(response(200, JSON, body)))
    assert (await call(proxy.url, chat(model + "-fine")))[:3:2] == (200, body)


async def test_a_close_delimited_stream_without_chunking_is_relayed(proxy, up, model):
    sent = events(chat_chunk("a"), chat_chunk(None, "stop"))

    def script(sock, seen) -> bool:
        sock.sendall(head(200, SSE, chunked=False) + sent)
        return False

    up.on(model, script)
    assert (await call(proxy.url, chat(model, stream=True)))[2] == sent + DONE


async def test_head_and_options(proxy, up):
    up.on("/v1/models", reply(response(200, JSON, b'{"object":"list","data":[]}')))
    status, headers, raw = await call(proxy.url, method="HEAD", path="/v1/models", headers={"X-Request-Id": "head-1"})
    assert status == 200 and raw == b"" and headers["Content-Type"] == "application/json"
    assert headers["X-Request-Id"] == "head-1" and up.seen_for("/v1/models")[-1].method == "GET"
    status, headers, raw = await call(proxy.url, method="OPTIONS", path=CHAT)
    assert status == 405 and json.loads(raw)["error"]["code"] == "method_not_allowed"
    assert "POST" in headers["Allow"]


async def test_a_slow_stream_reaches_the_client_event_by_event(proxy, up, model):
    """With usage asked for and stripped, events still go out as they come."""
    first_seen = threading.Event()

    def script(sock, seen) -> bool:
        sock.sendall(head(200, SSE) + chunk(chat_chunk("first")))
        first_seen.wait(20)  # the rest only once the client has the first event
        sock.sendall(chunk(chat_chunk(None, "stop")) + LAST_CHUNK)
        return False

    up.on(model, script)
    async with aiohttp.ClientSession() as s:
        async with s.post(proxy.url + CHAT, json=chat(model, stream=True), headers={"Authorization": "Bearer sk-carl-secret"}) as r:
            got = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
            first_seen.set()
            rest = await r.read()
    assert got == chat_chunk("first") and rest == chat_chunk(None, "stop") + DONE


async def test_done_without_a_space_is_the_engines_own_end(proxy, up, model):
    sent = events(chat_chunk("a"), b"data:[DONE]\n\n")  # "data:" with no space is valid SSE
    up.on(model, stream([sent]))
    assert (await call(proxy.url, chat(model, stream=True)))[2] == sent  # no second [DONE]


async def test_curl_expect_100_continue_with_a_large_prompt(proxy, up, model):
    """curl sends ``Expect: 100-continue`` before a large body and waits for the go-ahead;
    the proxy gives it at once, and the header goes no further than the proxy."""
    answer = b'{"choices":[],"usage":{"prompt_tokens":900,"completion_tokens":1}}'
    up.on(model, reply(response(200, JSON, answer)))
    body = json.dumps(chat(model, messages=[{"role": "user", "content": "z" * 5000}])).encode()
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-carl-secret\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\nExpect: 100-continue\r\n\r\n" % len(body)
        )
        await writer.drain()
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        await writer.drain()
        head_ = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head_.startswith(b"HTTP/1.1 200 ")
        length = int(next(h.split(b":")[1] for h in head_.split(b"\r\n") if h.lower().startswith(b"content-length")))
        assert await reader.readexactly(length) == answer
    finally:
        writer.close()
    assert "expect" not in up.seen_for(model)[0].headers


async def test_a_redirect_never_shows_the_engines_internal_url(proxy, up, model):
    """A 3xx is passed on (the proxy follows no redirect), its ``Location`` made
    relative to the proxy when it points under the engine's base URL (nginx's
    ``proxy_redirect default``), dropped when it names the engine's host otherwise, and
    unchanged when it names another host."""
    engine_port = int(up.url.rsplit(":", 1)[1])
    cases = [
        (307, f"{up.url}/v1/chat/completions?api-version=2", "/v1/chat/completions?api-version=2"),
        (301, f"http://127.0.0.1:{engine_port + 1}/internal", None),  # the engine's host, another port
        (302, "https://files.example.com/out.jsonl", "https://files.example.com/out.jsonl"),
        (303, "/v1/files/abc", "/v1/files/abc"),  # relative already
    ]
    for i, (code, location, want) in enumerate(cases):
        m = f"{model}-{i}"
        body = b'{"error":{"message":"moved"}}'
        up.on(m, reply(response(code, [*JSON, ("Location", location), ("Content-Location", location)], body)))
        status, headers, raw = await call(proxy.url, chat(m))
        assert (status, raw) == (code, body)
        assert headers.get("Location") == want and headers.get("Content-Location") == want, (code, location)
        assert str(engine_port) not in headers.get("Location", "")


def test_proxied_location_keeps_what_follows_the_base_url():
    base = "http://engine:8000/openai"
    assert proxied_location("http://engine:8000/openai/v1/x?a=1#f", base) == "/v1/x?a=1#f"
    assert proxied_location("HTTP://ENGINE:8000/openai", base) == "/"
    assert proxied_location("http://engine:8000/openai-other/x", base) is None  # not under the base path
    assert proxied_location("https://engine:8000/openai/x", base) is None  # another scheme: another service
    assert proxied_location("http://engine/x", "http://engine:80") == "/x"
    assert proxied_location("http://elsewhere:8000/openai/x", base) == "http://elsewhere:8000/openai/x"


async def test_w3c_trace_context_and_baggage_reach_the_engine(proxy, up, model):
    """``traceparent``, ``tracestate`` and ``baggage`` go upstream as the client sent
    them (an engine that traces joins the client's trace), on generation routes and
    ``/v1/models``; the client's other headers still do not."""
    trace = {
        "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "tracestate": "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7",
        "baggage": "userId=alice,serverNode=DF%2028",
    }
    up.on(model, reply(response(200, JSON, b"{}")))
    up.on("/v1/models", reply(response(200, JSON, b'{"object":"list","data":[]}')))
    await call(proxy.url, chat(model), headers={**trace, "X-Internal-Secret": "s3", "Cookie": "session=1"})
    await call(proxy.url, method="GET", path="/v1/models", headers=trace)
    for seen in (up.seen_for(model)[-1], up.seen_for("/v1/models")[-1]):
        assert {k: seen.headers.get(k) for k in trace} == trace
    assert "x-internal-secret" not in up.seen_for(model)[-1].headers and "cookie" not in up.seen_for(model)[-1].headers
    await call(proxy.url, chat(model))  # none sent: none made up
    assert not any(k in up.seen_for(model)[-1].headers for k in trace)


VALIDATORS = [("ETag", '"v1-abc"'), ("Content-MD5", "Q2hlY2sgSW50ZWdyaXR5IQ=="), ("Content-Digest", "sha-256=:X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE=:"), ("Repr-Digest", "sha-256=:X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE=:"), ("Digest", "SHA-256=X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE=")]  # fmt: skip


async def test_validators_of_bytes_the_proxy_changed_do_not_reach_the_client(proxy, assembling, up, model):
    """After decoding a gzip body, the engine's digests describe bytes the client never
    gets (dropped) and its strong ETag an encoding it never sees (weakened: ``W/``). An
    identity body keeps them all; a stream the proxy may add to loses the digests; an
    assembled answer, another representation, has no ETag."""
    body = b'{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}'
    up.on(model + "-gzip", reply(response(200, [*JSON, ("Content-Encoding", "gzip"), *VALIDATORS], gzipped(body))))
    up.on(model + "-plain", reply(response(200, [*JSON, *VALIDATORS], body)))
    up.on(model + "-stream", stream([FINISHED], headers=[*SSE, *VALIDATORS]))
    up.on(model + "-asm", stream([FINISHED], headers=[*SSE, *VALIDATORS]))
    status, headers, raw = await call(proxy.url, chat(model + "-gzip"))
    assert (status, raw) == (200, body) and headers["ETag"] == 'W/"v1-abc"'
    assert not any(k in headers for k in ("Content-MD5", "Content-Digest", "Repr-Digest", "Digest"))
    _, headers, raw = await call(proxy.url, chat(model + "-plain"))
    assert raw == body and all(headers[k] == v for k, v in VALIDATORS)
    _, headers, raw = await call(proxy.url, chat(model + "-stream", stream=True))
    assert raw == FINISHED + DONE and headers["ETag"] == 'W/"v1-abc"' and "Content-Digest" not in headers
    status, headers, _ = await call(assembling.url, chat(model + "-asm"))
    assert status == 200 and "ETag" not in headers and not any(k in headers for k in ("Content-MD5", "Content-Digest", "Repr-Digest", "Digest"))


async def test_an_upstream_url_ending_in_v1_is_warned_about_once(up, model, tmp_path):
    """``upstream.url: http://engine:8000/v1`` (the OpenAI SDK's base_url form) sends
    ``/v1/v1/chat/completions``. Not refused, since an engine mounted under a ``/v1``
    prefix is possible, but warned about once at start-up, naming the URL it makes."""
    up.on(model, reply(response(200, JSON, b"{}")))
    folder = tmp_path
    cfg = {
        "upstream": {"url": up.url + "/v1", "kind": "openai", "load_signal": {"enabled": False}},
        "default_group": "bronze",
        "groups": [{"name": "bronze", "users": [{"id": "carl", "api_key": "sk-carl-secret"}]}],
    }
    (folder / "c.yaml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    proc = start_proxy(folder / "c.yaml", port)
    try:
        for _ in range(2):
            assert (await call(f"http://127.0.0.1:{port}", chat(model)))[0] == 200
        assert [s.target for s in up.seen_for(model)] == ["/v1/v1/chat/completions"] * 2
    finally:
        assert stop_proxy(proc) == 0
    log = proc.log_path.read_text()
    assert log.count("ends in /v1") == 1 and f"{up.url}/v1/v1/chat/completions" in log


# ------------------------------------------------ usage on the last content chunk (issue 21)


async def test_usage_an_engine_puts_on_its_last_content_chunk_is_removed_too(proxy, up, model):
    """Some engines answer include_usage with a ``usage`` object on the chunk that
    carries the finish_reason (no usage-only chunk). A client that did not ask gets that
    chunk without it, every other byte as the engine sent it; the count still trues up
    the scheduler (42)."""
    c1 = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}\n\n'
    last = (
        b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"y"},"finish_reason":"stop"}],'
        b'"usage":{"prompt_tokens":5,"completion_tokens":42,"total_tokens":47,"prompt_tokens_details":{"cached_tokens":0}},"system_fingerprint":"fp"}\n\n'
    )
    up.on(model, stream([c1, last, DONE]))
    before = await scrape(proxy.url)
    status, _, raw = await call(proxy.url, chat(model, stream=True))
    assert status == 200
    assert raw == events(
        c1,
        b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"y"},"finish_reason":"stop"}],"system_fingerprint":"fp"}\n\n',
        DONE,
    )
    assert up.seen_for(model)[0].json["stream_options"] == {"include_usage": True}
    key = dict(group="bronze", direction="completion")
    assert metric(await scrape(proxy.url), "llm_qos_tokens_total", **key) - metric(before, "llm_qos_tokens_total", **key) == 42


# --------------------------------------------------- assembled tool calls (issue 21)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ARGS = ['{"city": ', '"Paris"', "}"]


def _chunks(deltas: list[dict], finish: str = "tool_calls", **choice_extra) -> list[bytes]:
    """One chat chunk per delta (choice 0), then the finish chunk: the shape of a tool
    call stream, with the engine's own choice fields (``choice_extra``)."""
    out = []
    for i, d in enumerate([*deltas, {}]):
        ch = {"index": 0, "delta": d, "finish_reason": finish if i == len(deltas) else None, **choice_extra}
        out.append(b"data: " + json.dumps({"id": "chatcmpl-9", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [ch]}).encode() + b"\n\n")
    return out


def _repeating(first_extra: dict, every: dict, pieces: list[str]) -> list[dict]:
    """Deltas whose every tool-call fragment repeats ``every`` (id, type, name)."""
    return [{**(first_extra if i == 0 else {}), "tool_calls": [{"index": 0, **every, "function": {"name": "get_weather", "arguments": p}}]} for i, p in enumerate(pieces)]


# the chunk shapes of real engines for one call get_weather({"city": "Paris"})
TOOL_STREAMS = {
    # vLLM: the name alone first (no arguments member), then argument fragments by index
    "vllm": (
        [{"role": "assistant", "content": ""}, {"tool_calls": [{"id": "chatcmpl-tool-1", "type": "function", "index": 0, "function": {"name": "get_weather"}}]}]
        + [{"tool_calls": [{"index": 0, "function": {"arguments": p}}]} for p in ARGS],
        "tool_calls",
        "chatcmpl-tool-1",
    ),
    # SGLang: every member present, nulls where nothing is sent
    "sglang": (
        [{"role": "assistant", "content": None, "reasoning_content": None, "tool_calls": None},
         {"role": None, "content": None, "reasoning_content": None, "tool_calls": [{"id": "call_1", "index": 0, "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}]
        + [{"role": None, "content": None, "reasoning_content": None, "tool_calls": [{"id": None, "index": 0, "type": "function", "function": {"name": None, "arguments": p}}]} for p in ARGS],
        "tool_calls",
        "call_1",
    ),
    # MiniMax through NVIDIA NIM: the whole name again in every fragment
    "minimax-nim": (
        [{"role": "assistant", "tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}]
        + [{"tool_calls": [{"index": 0, "type": "function", "function": {"name": "get_weather", "arguments": p}}]} for p in ARGS],
        "tool_calls",
        "call_1",
    ),
    # Fireworks: id, type and name again in every fragment
    "fireworks": (_repeating({"role": "assistant"}, {"id": "call_1", "type": "function"}, ["", *ARGS]), "tool_calls", "call_1"),
    # LM Studio: a new id with every argument fragment, the name empty after the first
    "lmstudio": (
        [{"role": "assistant", "tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}]
        + [{"tool_calls": [{"index": 0, "id": f"call_{i}", "type": "function", "function": {"name": "", "arguments": p}}]} for i, p in enumerate(ARGS)],
        "tool_calls",
        "call_a",
    ),
    # Gemini's OpenAI-compatible API: no index; later fragments with empty id and type
    "gemini": (
        [{"role": "assistant", "tool_calls": [{"id": "function-call-1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS[0]}, "extra_content": {"google": {"thought_signature": "c2ln"}}}]},
         {"tool_calls": [{"id": "", "type": "", "function": {"arguments": ARGS[1]}}]},
         {"tool_calls": [{"function": {"arguments": ARGS[2]}}]}],
        "stop",
        "function-call-1",
    ),
}


@pytest.mark.parametrize("engine", list(TOOL_STREAMS))
async def test_an_assembled_tool_call_is_one_call_with_its_name_once(assembling, up, model, engine):
    """upstream.stream_non_streaming: whatever shape the engine streams a tool call in
    (index or none, id, type and name once or in every fragment), the client gets one
    call, named once, with the arguments joined, as the OpenAI SDK parses it."""
    deltas, finish, call_id = TOOL_STREAMS[engine]
    up.on(model, stream([*_chunks(deltas, finish), DONE]))
    client = openai.AsyncOpenAI(base_url=assembling.url + "/v1", api_key="sk-carl-secret", max_retries=0)
    out = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER])
    await client.close()
    (tc,) = out.choices[0].message.tool_calls
    assert (tc.id, tc.type, tc.function.name, tc.function.arguments) == (call_id, "function", "get_weather", '{"city": "Paris"}')
    assert out.choices[0].finish_reason == finish
    if engine == "gemini":  # a field of the engine's own is kept (Gemini wants it back next turn)
        assert tc.model_extra["extra_content"] == {"google": {"thought_signature": "c2ln"}}


PARALLEL = {
    "vllm": [
        {"tool_calls": [{"id": "t1", "type": "function", "index": 0, "function": {"name": "get_weather"}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]},
        {"tool_calls": [{"id": "t2", "type": "function", "index": 1, "function": {"name": "get_time"}}]},
        {"tool_calls": [{"index": 1, "function": {"arguments": '{"city": "Oslo"}'}}]},
    ],
    "fireworks": [
        {"tool_calls": [{"index": 0, "id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 0, "id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '"Paris"}'}}]},
        {"tool_calls": [{"index": 1, "id": "t2", "type": "function", "function": {"name": "get_time", "arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 1, "id": "t2", "type": "function", "function": {"name": "get_time", "arguments": '"Oslo"}'}}]},
    ],
    "gemini": [  # each call whole in one fragment, told apart by its id
        {"tool_calls": [{"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"tool_calls": [{"id": "t2", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'}}]},
    ],
}


@pytest.mark.parametrize("engine", list(PARALLEL))
async def test_parallel_assembled_tool_calls_stay_apart(assembling, up, model, engine):
    up.on(model, stream([*_chunks(PARALLEL[engine]), DONE]))
    status, _, raw = await call(assembling.url, chat(model, tools=[WEATHER]))
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["message"]["tool_calls"] == [
        {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "t2", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'}},
    ]


# ------------------------------------- a Responses request that did not ask for a stream (issue 21)

RESP_EVENTS = [
    b'event: response.created\ndata: {"type":"response.created","sequence_number":0,"response":{"id":"resp_1","object":"response","status":"in_progress","output":[]}}\n\n',
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","item_id":"msg_1","output_index":0,"content_index":0,"delta":"Par","sequence_number":1}\n\n',
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","item_id":"msg_1","output_index":0,"content_index":0,"delta":"is","sequence_number":2}\n\n',
]
RESP_DONE = (
    b'event: response.completed\ndata: {"type":"response.completed","sequence_number":3,"response":{"id":"resp_1","object":"response","created_at":1,'
    b'"model":"m","status":"completed","output":[{"type":"message","id":"msg_1","status":"completed","role":"assistant","content":'
    b'[{"type":"output_text","text":"Paris","annotations":[]}]}],"usage":{"input_tokens":3,"output_tokens":40,"total_tokens":43}}}\n\n'
)


async def test_a_responses_request_without_stream_gets_json_from_a_streaming_engine(proxy, up, model):
    """An engine that streams by default (transformers serve) answers a Responses request
    that names no ``stream`` with events; the client asked for none and gets the
    response object, as the OpenAI SDK's default ``responses.create`` expects."""
    up.on(model, stream([*RESP_EVENTS, RESP_DONE]))
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-carl-secret", max_retries=0)
    resp = await client.responses.create(model=model, input="capital of France?", extra_headers={"X-Request-Id": "resp-json-1"})
    await client.close()
    assert resp.output_text == "Paris" and resp.id == "resp_1" and resp.usage.output_tokens == 40
    line = await access_line(proxy, "resp-json-1")
    assert (line["outcome"], line["output_tokens"], line["prompt_tokens"]) == ("ok", 40, 3)


@pytest.mark.parametrize(
    "parts, status, code",
    [
        (RESP_EVENTS, 502, "upstream_stream_incomplete"),  # ended before its terminal event
        ([*RESP_EVENTS, b'event: response.failed\ndata: {"type":"response.failed","sequence_number":3,"response":{"status":"failed","error":{"code":"server_error","message":"engine failed"}}}\n\n'], 502, "server_error"),
        ([RESP_EVENTS[0], b'event: error\ndata: {"type":"error","code":"invalid_prompt","message":"bad prompt","param":null,"sequence_number":1}\n\n'], 502, "invalid_prompt"),
    ],
)
async def test_a_responses_stream_that_did_not_complete_is_an_error_answer_not_a_200(proxy, up, model, parts, status, code):
    up.on(model, stream(parts))
    got, headers, raw = await call(proxy.url, {"model": model, "input": "hi"}, path="/v1/responses")
    assert (got, json.loads(raw)["error"]["code"]) == (status, code) and headers["Content-Type"].startswith("application/json")
