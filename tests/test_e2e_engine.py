"""End to end: the real CPU engine process, the real proxy process, the OpenAI SDK."""

from __future__ import annotations

import re
import time
import urllib.request

import http.client
import json
import openai
import pytest
import yaml

from tests.engine_fixture import cpu_engine, free_port  # noqa: F401  (session fixture)
from tests.proxy_process import start_proxy, stop_proxy

pytestmark = pytest.mark.engine

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def proxied(cpu_engine, tmp_path_factory):  # noqa: F811
    """The proxy process in front of the engine: yields (proxy_url, model_name, proc)."""
    proc, engine_url = cpu_engine
    model = re.search(r"model=([^)\s,]+)", proc.ready_line).group(1)
    cfg = {
        "upstream": {"url": engine_url, "kind": "openai", "stream_non_streaming": True},
        "admission": {"max_inflight": 2, "max_queue": 50, "queue_timeout_s": 120},
        "default_group": "bronze",
        "groups": [
            {"name": "platinum", "users": [{"id": "alice", "weight": 3, "api_key": "sk-alice"}]},
            {"name": "bronze", "users": []},
        ],
    }
    path = tmp_path_factory.mktemp("e2e") / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = free_port()
    px = start_proxy(path, port)
    try:
        yield f"http://127.0.0.1:{port}", model, px
    finally:
        assert stop_proxy(px) == 0


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="sk-alice", timeout=120, max_retries=0)


def test_sdk_non_streaming_answers_paris(proxied):
    url, model, _ = proxied
    out = _client(url).chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=24)
    assert "Paris" in out.choices[0].message.content


def test_sdk_streaming_answers_paris(proxied):
    url, model, _ = proxied
    stream = _client(url).chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=24, stream=True)
    text = "".join((c.choices[0].delta.content or "") for c in stream if c.choices)
    assert "Paris" in text  # and the SDK's iterator ended: the proxy closed the stream cleanly


def test_sdk_responses_without_stream_gets_a_response_object(proxied):
    """The engine streams a Responses request that names no ``stream`` (transformers
    serve's default); the OpenAI SDK's default ``responses.create`` asked for none and
    gets the response object (it failed on the relayed stream: a ``str`` has no
    ``output_text``)."""
    url, model, _ = proxied
    resp = _client(url).responses.create(model=model, input="What is the capital of France?", temperature=0, max_output_tokens=24)
    assert resp.status == "completed" and "Paris" in resp.output_text
    assert resp.usage.output_tokens > 0


def test_a_stream_that_did_not_ask_for_usage_carries_none(proxied):
    """The proxy asks the engine for usage on every stream; the engine puts it on its
    last content chunk. A client that did not ask sees no ``usage`` member at all."""
    url, model, _ = proxied
    body = {"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 8, "stream": True}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Authorization": "Bearer sk-alice", "Content-Type": "application/json"})
    raw = urllib.request.urlopen(req, timeout=120).read()
    assert b'"finish_reason":"length"' in raw.replace(b" ", b"") and raw.endswith(b"data: [DONE]\n\n")
    assert b'"usage"' not in raw


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_mid_stream_disconnect_frees_slot_and_closes_engine_connection(proxied):
    """Against the real engine: a client that leaves mid-stream has its upstream
    connection closed (counted by the proxy) and its slot freed at once."""
    url, model, _ = proxied
    aborts_before = _metric(url, "llm_qos_upstream_aborts_total")
    body = {"model": model, "messages": [{"role": "user", "content": "Write a very long story about a dragon."}], "max_tokens": 400, "stream": True}
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Authorization": "Bearer sk-alice", "Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    events = 0
    while events < 6:
        line = r.readline()
        assert line, "stream ended early"
        events += line.startswith(b"data:")
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if _metric(url, "llm_qos_upstream_aborts_total") > aborts_before and _metric(url, "llm_qos_inflight_requests") == 0:
            break
        time.sleep(0.05)
    assert _metric(url, "llm_qos_upstream_aborts_total") == aborts_before + 1
    assert _metric(url, "llm_qos_inflight_requests") == 0
    # the engine is free for the next request
    out = _client(url).chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=24)
    assert "Paris" in out.choices[0].message.content
