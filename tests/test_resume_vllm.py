"""Resuming a preempted stream on the real vLLM engine (CPU build, SmolLM2-135M), through
the real proxy process (``preemption.resume``; docs/scheduling.md, "Resuming a shown
stream").

The proxy runs one request at a time (``max_inflight: 1``). A bronze chat stream, greedy
(``temperature: 0``) and of a fixed length (``ignore_eos``), shows its client its first
tokens; a platinum request waits ``after_s`` and takes its place: the bronze stream is
aborted in vLLM, waits, and is resumed with its partial answer as a final assistant
message (``continue_final_message``). Its client reads one stream: the text it had, then
the rest, with one role, one ``finish_reason``, one usage adding both parts, and the text
greedy decoding gives without the preemption (the same request, unpreempted, first).
Skips without vLLM (fails under CI): tests/vllm_engine.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import orjson
import pytest
import yaml

from tests.proc_util import free_port
from tests.proxy_process import start_proxy, stop_proxy

AFTER_S = 1.0
N = 48  # bronze output tokens
SHOWN = 6  # content events the bronze client reads before platinum is sent


@pytest.fixture
def proxy(vllm_engine, tmp_path: Path):
    cfg = {
        "upstream": {"url": vllm_engine.url, "kind": "openai", "server": "vllm", "load_signal": {"enabled": False}},
        "admission": {
            "max_inflight": 1, "queue_timeout_s": 300, "capacity": {"mode": "fixed"},
            "preemption": {"after_s": AFTER_S, "max_per_request": 1, "resume": True},
        },
        "identity": {"header": "X-User-Id"},
        "default_group": "bronze",
        "groups": [{"name": "platinum", "users": [{"id": "alice"}]}, {"name": "bronze"}],
    }  # fmt: skip
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    access = tmp_path / "access.log"
    port = free_port()
    proc = start_proxy(path, port, extra_args=["--access-log", str(access)])
    proc.url, proc.access = f"http://127.0.0.1:{port}", access  # type: ignore[attr-defined]
    try:
        yield proc
    finally:
        stop_proxy(proc)


def _body(model: str) -> dict:
    return {
        "model": model, "messages": [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
        "max_tokens": N, "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip


class _Reader:
    """Reads one SSE stream, keeping its events and counting the content events."""

    def __init__(self) -> None:
        self.events: list[object] = []
        self.contents = 0
        self.status = 0

    async def read(self, http: aiohttp.ClientSession, url: str, body: dict, rid: str) -> None:
        async with http.post(url + "/v1/chat/completions", json=body, headers={"X-User-Id": "carl", "X-Request-Id": rid}) as r:
            self.status = r.status
            buf = b""
            async for chunk in r.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    ev, buf = buf.split(b"\n\n", 1)
                    ev = ev.strip()
                    if not ev:
                        continue
                    assert ev.startswith(b"data: "), ev
                    data = ev[6:]
                    obj = data if data == b"[DONE]" else orjson.loads(data)
                    self.events.append(obj)
                    if isinstance(obj, dict) and any((ch.get("delta") or {}).get("content") for ch in obj.get("choices") or []):
                        self.contents += 1
            assert not buf.strip(), buf

    @property
    def objects(self) -> list[dict]:
        return [e for e in self.events if isinstance(e, dict)]

    def text(self) -> str:
        return "".join((ch.get("delta") or {}).get("content") or "" for e in self.objects for ch in e.get("choices") or [])


async def _access(path: Path, rid: str, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            for raw in path.read_text().splitlines():
                if raw.startswith("{") and (line := json.loads(raw))["request_id"] == rid:
                    return line
        await asyncio.sleep(0.1)
    raise AssertionError(f"no access line for {rid}")


async def _until(pred, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)


async def test_a_resumed_greedy_stream_is_whole_and_continues_its_partial_answer(vllm_engine, proxy):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        ref = _Reader()
        await asyncio.wait_for(ref.read(http, proxy.url, _body(vllm_engine.model), "ref"), 300)
        assert ref.status == 200
        low = _Reader()
        task = asyncio.create_task(low.read(http, proxy.url, _body(vllm_engine.model), "low"))
        await _until(lambda: low.contents >= SHOWN or task.done(), "the bronze stream's first tokens", 300)
        assert not task.done()
        partial = low.text()
        plat = {"model": vllm_engine.model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}
        async with http.post(proxy.url + "/v1/chat/completions", json=plat, headers={"X-User-Id": "alice"}) as r:
            assert r.status == 200
            plat_done_at_content = low.contents
        await asyncio.wait_for(task, 300)
    assert low.status == 200
    line = await _access(proxy.access, "low")
    assert line["resumes"] == 1, line  # it was preempted after showing tokens, and resumed
    assert plat_done_at_content < N  # platinum ended while the bronze stream was paused
    text, objs = low.text(), low.objects
    print(f"shown before the preemption: {partial!r}\nresumed answer: {text!r}\nunpreempted:    {ref.text()!r}")
    assert text.startswith(partial) and len(text) > len(partial)  # it went on from the partial answer
    assert not any("error" in e for e in objs)
    assert low.events[-1] == b"[DONE]" and low.events.count(b"[DONE]") == 1
    assert len({e["id"] for e in objs}) == 1 and len({e["created"] for e in objs}) == 1
    assert sum("role" in (ch.get("delta") or {}) for e in objs for ch in e["choices"]) == 1
    assert [ch["finish_reason"] for e in objs for ch in e["choices"] if ch.get("finish_reason")] == ["length"]
    usage = [e["usage"] for e in objs if e.get("usage")]
    ref_usage = [e["usage"] for e in ref.objects if e.get("usage")]
    assert len(usage) == 1 and usage[0]["completion_tokens"] == N  # both parts, as asked
    # the original prompt, as the engine counts it, up to the seam's re-tokenization
    assert abs(usage[0]["prompt_tokens"] - ref_usage[0]["prompt_tokens"]) <= 2
    # greedy: the text of the unpreempted answer, the partial one re-read as prompt
    assert text == ref.text()
