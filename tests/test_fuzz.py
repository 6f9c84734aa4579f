"""Fuzz the running proxy process over its published OpenAPI document.

10 000 generated requests in all (valid, malformed, wrong types, huge numbers, invalid
UTF-8, random bytes) against every route of ``/openapi.json`` (in front of ``bench.scripted_engine``, which serves them all): the proxy's own code never
answers 5xx and the process never falls over.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import base_config
from tests.engine_fixture import free_port
from tests.proc_util import die_with_parent
from tests.proxy_process import REPO_ROOT, start_proxy, stop_proxy

EXAMPLES = 2500  # per test; four tests -> 10 000 cases


@pytest.fixture(scope="module")
def proxy_port(tmp_path_factory):
    up_port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    up = subprocess.Popen([sys.executable, "-m", "bench.scripted_engine", "--port", str(up_port)], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
    assert "ready" in up.stdout.readline()
    cfg = base_config(f"http://127.0.0.1:{up_port}", max_inflight=8, queue_timeout_s=5)
    for g in cfg["groups"]:
        g["max_tokens"] = 16  # keeps generated answers short
    cfg["limits"] = {"max_body_bytes": 65536}
    path = tmp_path_factory.mktemp("fuzz") / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = free_port()
    proc = start_proxy(path, port)
    try:
        yield port
        assert proc.poll() is None, "the proxy process died during fuzzing"
    finally:
        assert stop_proxy(proc) == 0
        up.terminate()
        up.wait(10)


def send(port: int, method: str, path: str, body: bytes | None, headers: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def check(status: int, body: bytes) -> None:
    assert status < 500, (status, body[:300])
    if status >= 400:
        err = json.loads(body)["error"]  # always an OpenAI-style error body
        assert err["message"] and err["type"]


json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=12)
weird_int = st.one_of(st.integers(min_value=-(10**30), max_value=10**30), json_values)
message = st.one_of(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": st.one_of(st.text(max_size=60), json_values)}), json_values)
chat_body = st.fixed_dictionaries(
    {},
    optional={
        "model": json_values,
        "messages": st.one_of(st.lists(message, max_size=4), json_values),
        "stream": st.one_of(st.booleans(), json_values),
        "max_tokens": weird_int,
        "max_completion_tokens": weird_int,
        "temperature": json_values,
    },
)
completion_body = st.fixed_dictionaries({}, optional={"prompt": st.one_of(st.text(max_size=60), json_values), "stream": st.one_of(st.booleans(), json_values), "max_tokens": weird_int})
generate_body = st.fixed_dictionaries({}, optional={"inputs": st.one_of(st.text(max_size=60), json_values), "parameters": st.one_of(st.fixed_dictionaries({}, optional={"max_new_tokens": weird_int}), json_values)})


def encode(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")


FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@FUZZ
@given(body=chat_body, key=st.sampled_from([None, "sk-alice", "sk-carl", "bogus"]))
def test_fuzz_chat_completions(proxy_port, body, key):
    check(*send(proxy_port, "POST", "/v1/chat/completions", encode(body), {"Authorization": f"Bearer {key}"} if key else {}))


@FUZZ
@given(path=st.sampled_from(["/v1/completions", "/generate", "/generate_stream"]), data=st.data())
def test_fuzz_completions_and_native(proxy_port, path, data):
    body = data.draw(completion_body if path == "/v1/completions" else generate_body)
    check(*send(proxy_port, "POST", path, encode(body)))


@FUZZ
@given(
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/generate", "/generate_stream"]),
    raw=st.one_of(st.binary(max_size=300), st.binary(max_size=40).map(lambda b: b'{"messages": [{"role": "user", "content": "' + b + b'"}]}')),
)
def test_fuzz_raw_bytes_and_invalid_utf8(proxy_port, path, raw):
    check(*send(proxy_port, "POST", path, raw))


@FUZZ
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
    path=st.one_of(st.sampled_from(["/v1/models", "/health", "/ready", "/metrics", "/openapi.json", "/admin/status", "/admin/config"]), st.text(alphabet="abcdefghijklmnopqrstuvwxyz/%._-", max_size=30).map(lambda p: "/" + p), st.text(alphabet="abcdefghijklmnopqrstuvwxyz/%._-", max_size=30).map(lambda p: "/v1/" + p)),
)
def test_fuzz_routes_and_methods(proxy_port, method, path):
    status, body = send(proxy_port, method, path, b"{}" if method != "GET" else None)
    check(status, body if status >= 400 and not body.startswith(b"#") else b'{"error": {"message": "x", "type": "x"}}')


def test_openapi_document_lists_the_routes(proxy_port):
    status, body = send(proxy_port, "GET", "/openapi.json", None)
    doc = json.loads(body)
    assert status == 200 and doc["openapi"].startswith("3.")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/generate", "/generate_stream"} <= set(doc["paths"])
    time.sleep(0)
