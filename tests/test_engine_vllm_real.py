"""The real vLLM engine under ``llm-qos engine --backend vllm``: readiness and answers,
stopping the whole process group by signal, a crashed engine process, and client
disconnects through the real proxy aborting the generation inside vLLM.

Marked ``engine`` (slow: each engine start, eager, takes 30-110 s on 2 busy cores; three
starts and a restart). Without vLLM the tests skip (fail under CI), as the ``vllm_engine`` fixture does
(tests/vllm_engine.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest
import yaml

from tests.proc_util import free_port, live_processes
from tests.proxy_process import start_proxy, stop_proxy
from tests.vllm_engine import (
    DEFAULT_GRACE_S,
    VllmEngine,
    parse_metrics,
    running_vllm_engine,
)

pytestmark = pytest.mark.engine

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
#: A request that would run for over a minute here (1 500 tokens at ~20 tokens/s) unless aborted.
LONG = {"messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
        "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
ABORT_WITHIN_S = 5.0  # "within a few seconds": vLLM took < 1.5 s here after a disconnect


# ----- helpers: the engine's process group, read from /proc -----

def _engine_pid(engine: VllmEngine) -> int:
    """The vLLM server's pid (leader of the engine's process group), from the launcher's log."""
    found = re.findall(r"engine\[vllm\]: pid (\d+)", engine.log_path.read_text(errors="replace"))
    assert found, engine.log_tail()
    return int(found[-1])


def _group(pgid: int) -> dict[int, str]:
    """``{pid: comm}`` of the live (not zombie) processes of process group ``pgid``."""
    return {pid: comm for pid, comm, state, _ppid, group in live_processes() if group == pgid and state != "Z"}


def _wait_until(what: str, pred: Callable[[], bool], timeout_s: float, step_s: float = 0.1) -> float:
    """Read an external process's state until ``pred()`` holds (bounded in time); returns the
    seconds it took. Fails the test after ``timeout_s``."""
    started = time.monotonic()
    while not pred():
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"not within {timeout_s} s: {what}")
        time.sleep(step_s)
    return time.monotonic() - started


def _chat(url: str, body: dict, timeout_s: float = 120) -> dict:
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": "Bearer sk-alice"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


# ----- readiness and answers (the shared engine) -----

def test_ready_line_models_answer_and_metrics(vllm_engine: VllmEngine) -> None:
    assert vllm_engine.ready_line == f"engine ready at {vllm_engine.url} (backend=vllm, model=smollm2-135m-instruct)"
    with urllib.request.urlopen(f"{vllm_engine.url}/v1/models", timeout=10) as resp:
        assert [m["id"] for m in json.loads(resp.read())["data"]] == ["smollm2-135m-instruct"]
    answer = _chat(vllm_engine.url, {"model": vllm_engine.model, "messages": QUESTION, "temperature": 0, "max_tokens": 24})
    assert "Paris" in answer["choices"][0]["message"]["content"]
    assert answer["usage"]["completion_tokens"] >= 1
    gauges = vllm_engine.metrics()
    assert set(gauges) == {"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"}
    assert gauges["num_requests_running"] == 0 and gauges["num_requests_waiting"] == 0


def test_parse_metrics_sums_series() -> None:
    text = ('# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            'vllm:num_requests_waiting_by_reason{reason="capacity"} 7.0\n')
    assert parse_metrics(text) == {"num_requests_running": 3.0, "num_requests_waiting": 0.0, "kv_cache_usage_perc": 0.25}


# ----- stopping and crashes (engines of their own) -----

@pytest.fixture
def own_engine() -> Iterator[VllmEngine]:
    """An engine of the test's own, eager as the shared one (tests/vllm_engine.py says why)."""
    with running_vllm_engine() as engine:
        yield engine


def _stop_by(engine: VllmEngine, sig: signal.Signals) -> None:
    """Send ``sig`` to the launcher; the launcher, vLLM's server, EngineCore and Worker must
    all be gone within a few seconds, without SIGKILL, and the launcher exits 0."""
    pgid = _engine_pid(engine)
    members = _group(pgid)
    assert len(members) >= 3, members  # the server, VLLM::EngineCore, VLLM::Worker
    started = time.monotonic()
    engine.process.send_signal(sig)
    try:
        code = engine.process.wait(timeout=DEFAULT_GRACE_S + 5)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the launcher did not exit within {DEFAULT_GRACE_S + 5} s of {sig.name}:\n{engine.log_tail()}")
    took = time.monotonic() - started
    log = engine.log_tail(20000)
    assert code == 0, log
    assert "SIGKILL" not in log, log
    assert took < 8.0, f"{sig.name}: {took:.1f} s\n{log}"
    assert _group(pgid) == {}, f"left behind: {_group(pgid)}"


def test_sigint_stops_the_whole_group_without_sigkill(own_engine: VllmEngine) -> None:
    """Ctrl-C on ``llm-qos engine --backend vllm`` (issue 21 item 12)."""
    _stop_by(own_engine, signal.SIGINT)


def test_crashed_engine_core_is_restarted_then_sigterm_stops_all(own_engine: VllmEngine) -> None:
    """vLLM's EngineCore killed: the server exits, the launcher kills what is left of the group,
    restarts the engine after the backoff (1 s), prints the ready line again, and the new
    engine answers. Then SIGTERM stops the new group as SIGINT does."""
    engine = own_engine
    pgid = _engine_pid(engine)
    members = _group(pgid)
    core = [pid for pid, comm in members.items() if comm.startswith("VLLM::EngineCor")]
    assert core, members
    os.kill(core[0], signal.SIGKILL)
    second = start_line = None
    try:
        from tests.proc_util import wait_for_line

        second = wait_for_line(engine.process, "engine ready at ", 600, "restarted vllm engine", engine.log_tail)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    start_line = second
    assert start_line == engine.ready_line
    log = engine.log_tail(200000)
    assert re.search(r"engine\[vllm\]: exited with code -?\d+ after [\d.]+ s ready", log), log[-3000:]
    assert "restart in 1.0 s" in log
    assert _group(pgid) == {}, f"the crashed engine's processes live on: {_group(pgid)}"
    assert _engine_pid(engine) != pgid
    answer = _chat(engine.url, {"model": engine.model, "messages": QUESTION, "temperature": 0, "max_tokens": 24})
    assert "Paris" in answer["choices"][0]["message"]["content"]
    _stop_by(engine, signal.SIGTERM)


# ----- client disconnects through the real proxy -----

@pytest.fixture(scope="module")
def proxied(vllm_engine: VllmEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, VllmEngine]]:
    """The proxy process in front of the shared vLLM engine, one request in flight at a time
    (so a second one queues in the proxy)."""
    cfg = {
        "upstream": {"url": vllm_engine.url, "kind": "openai"},
        "admission": {"max_inflight": 1, "max_queue": 10, "queue_timeout_s": 120},
        "default_group": "bronze",
        "groups": [
            {"name": "platinum", "users": [{"id": "alice", "weight": 1, "api_key": "sk-alice"}]},
            {"name": "bronze", "users": []},
        ],
    }
    path = tmp_path_factory.mktemp("vllm-proxy") / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = free_port()
    px = start_proxy(path, port)
    try:
        yield f"http://127.0.0.1:{port}", vllm_engine
    finally:
        assert stop_proxy(px) == 0


def _open(url: str, body: dict) -> socket.socket:
    """Send a chat completion to ``url`` on a raw socket and return it unread."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-alice\r\n"
                 b"Content-Type: application/json\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def _leave(sock: socket.socket) -> None:
    """The client goes away: an RST, as a killed client's kernel sends."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()


def _proxy_gauge(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name) and not line.startswith("#"))


def _engine_counter(engine: VllmEngine, name: str) -> float:
    with urllib.request.urlopen(f"{engine.url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.split("{", 1)[0].split(" ", 1)[0] == name)


def _finished(engine: VllmEngine, reason: str | None = None) -> float:
    """``vllm:request_success_total`` for one ``finished_reason`` (``stop``, ``length``...),
    or summed over all of them: requests vLLM finished. A request aborted because its
    client left is not counted there (vllm 0.32 drops its state without finished stats:
    ``OutputProcessor.abort_requests``), so an unchanged sum beside ``num_requests_running``
    back at 0 means the request was aborted, not completed."""
    with urllib.request.urlopen(f"{engine.url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{") and (reason is None or f'finished_reason="{reason}"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _running(engine: VllmEngine) -> float:
    return engine.metrics()["num_requests_running"]


def _idle(engine: VllmEngine) -> bool:
    g = engine.metrics()
    return g["num_requests_running"] == 0 and g["num_requests_waiting"] == 0


def test_disconnect_mid_stream_aborts_in_vllm(proxied: tuple[str, VllmEngine]) -> None:
    url, engine = proxied
    _wait_until("the engine idle", lambda: _idle(engine), 30)
    finished = _finished(engine)
    sock = _open(url, {"model": engine.model, **LONG, "stream": True})
    received = b""
    while received.count(b"data:") < 5:  # a few tokens have come through
        chunk = sock.recv(65536)
        assert chunk, received
        received += chunk
    assert _running(engine) == 1
    _leave(sock)
    took = _wait_until("vLLM aborted the stream", lambda: _running(engine) == 0, ABORT_WITHIN_S)
    assert _finished(engine) == finished  # aborted, not finished
    print(f"mid-stream: running 0 after {took:.2f} s")


def test_disconnect_during_non_streaming_request_aborts_in_vllm(proxied: tuple[str, VllmEngine]) -> None:
    url, engine = proxied
    _wait_until("the engine idle", lambda: _idle(engine), 30)
    tokens_before = _engine_counter(engine, "vllm:generation_tokens_total")
    finished = _finished(engine)
    sock = _open(url, {"model": engine.model, **LONG})
    _wait_until("the request generating in vLLM",
                lambda: _engine_counter(engine, "vllm:generation_tokens_total") > tokens_before + 5, 30)
    _leave(sock)
    took = _wait_until("vLLM aborted the request", lambda: _running(engine) == 0, ABORT_WITHIN_S)
    assert _finished(engine) == finished  # aborted, not finished
    print(f"non-streaming: running 0 after {took:.2f} s")


def test_disconnect_before_the_first_token_aborts_in_vllm(proxied: tuple[str, VllmEngine]) -> None:
    """The client leaves as soon as the proxy has sent its request to vLLM, while vLLM reads
    its long prompt: the proxy relayed nothing to it (its time-to-first-token count did not
    move), and vLLM drops the request after at most the prefill's one token."""
    url, engine = proxied
    _wait_until("the engine idle", lambda: _idle(engine), 30)
    # ~1 800 tokens, never seen before (vLLM's prefix cache would skip a repeated prompt's
    # prefill): reading it takes vLLM about a second or more here, the window
    prompt = f"{time.time_ns()} Summarise this. " + "The quick brown fox jumps over the lazy dog. " * 180
    tokens_before = _engine_counter(engine, "vllm:generation_tokens_total")
    finished = _finished(engine)
    first_tokens = _proxy_gauge(url, "llm_qos_time_to_first_token_seconds_count")
    sock = _open(url, {"model": engine.model, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": 200, "ignore_eos": True, "stream": True})
    _wait_until("the request sent to vLLM", lambda: _proxy_gauge(url, "llm_qos_inflight_requests") == 1, 30, 0.01)
    _leave(sock)
    took = _wait_until("vLLM dropped the request", lambda: _idle(engine) and _proxy_gauge(url, "llm_qos_inflight_requests") == 0, ABORT_WITHIN_S)
    # the window was right: nothing had been relayed to the client when it left
    assert _proxy_gauge(url, "llm_qos_time_to_first_token_seconds_count") == first_tokens, "the client left after its first token"
    assert _finished(engine) == finished  # aborted, not finished
    assert _engine_counter(engine, "vllm:generation_tokens_total") - tokens_before <= 1  # the prefill's token at most
    print(f"before the first token: idle after {took:.2f} s")


def test_disconnect_while_queued_in_the_proxy_never_reaches_vllm(proxied: tuple[str, VllmEngine]) -> None:
    """With the proxy's one slot taken, a second client queues in the proxy and leaves: it is
    never sent to vLLM; the first client leaves too and vLLM is idle within seconds."""
    url, engine = proxied
    _wait_until("the engine idle", lambda: _idle(engine), 30)
    finished = _finished(engine)
    prompt_tokens = _engine_counter(engine, "vllm:prompt_tokens_total")
    first = _open(url, {"model": engine.model, **LONG, "stream": True})
    _wait_until("the first request running in vLLM, its prompt counted",
                lambda: _running(engine) == 1 and _engine_counter(engine, "vllm:prompt_tokens_total") > prompt_tokens, 30)
    first_prompt = _engine_counter(engine, "vllm:prompt_tokens_total") - prompt_tokens
    queued = _open(url, {"model": engine.model, **LONG, "stream": True})
    _wait_until("the second request queued in the proxy", lambda: _proxy_gauge(url, "llm_qos_queue_depth") == 1, 10)
    _leave(queued)
    _wait_until("the queue emptied", lambda: _proxy_gauge(url, "llm_qos_queue_depth") == 0, ABORT_WITHIN_S)
    _leave(first)
    took = _wait_until("vLLM aborted the first request", lambda: _idle(engine), ABORT_WITHIN_S)
    # vLLM saw one request only (its prompt's tokens, no more), aborted: the queued one never left the proxy
    assert _finished(engine) == finished
    assert _engine_counter(engine, "vllm:prompt_tokens_total") - prompt_tokens == first_prompt
    assert _proxy_gauge(url, "llm_qos_inflight_requests") == 0
    print(f"queued: idle after {took:.2f} s")
