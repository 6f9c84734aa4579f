"""The real CPU engine: start ``python -m engine_server``, generate, stop within the grace period.

Slow (first run converts the model, ~25-60 s; a start takes ~6-10 s): marked ``engine``.
Deselect with ``-m "not engine"``.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp
import pytest

try:
    from tests.engine_fixture import DEFAULT_GRACE_S, free_port, start_cpu_engine, stop_engine
except ImportError:  # tests/ itself on sys.path
    from engine_fixture import DEFAULT_GRACE_S, free_port, start_cpu_engine, stop_engine  # type: ignore[no-redef]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


async def read_sse(resp: aiohttp.ClientResponse) -> list[str]:
    """The ``data:`` payloads of an SSE response, in order."""
    payloads = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data:"):
            payloads.append(line[len("data:"):].strip())
    return payloads


async def exercise(base_url: str, model: str) -> None:
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        async with http.get(f"{base_url}/v1/models") as resp:
            assert resp.status == 200
            models = await resp.json()
        assert [m["id"] for m in models["data"]] == [model]

        body = {"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 30}
        async with http.post(f"{base_url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            answer = await resp.json()
        text = answer["choices"][0]["message"]["content"]
        assert "Paris" in text, text
        assert answer["usage"]["completion_tokens"] >= 1

        # Streaming facts the proxy relies on (transformers 5.24): usage rides on the last chunk,
        # together with finish_reason, and there is no [DONE] sentinel.
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with http.post(f"{base_url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            payloads = await read_sse(resp)
        assert "[DONE]" not in payloads
        chunks = [json.loads(p) for p in payloads]
        assert "Paris" in "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert [i for i, c in enumerate(chunks) if "usage" in c] == [len(chunks) - 1]
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"

        # A name other than the pinned one is refused.
        async with http.post(f"{base_url}/v1/chat/completions", json={**body, "model": "other"}) as resp:
            assert resp.status == 400


@pytest.mark.engine
def test_cpu_engine_answers_and_stops_within_grace() -> None:
    proc, base_url = start_cpu_engine(free_port())
    try:
        ready_line: str = proc.ready_line  # type: ignore[attr-defined]
        assert ready_line.startswith(f"engine ready at {base_url} (backend=cpu, model=")
        model = ready_line.rsplit("model=", 1)[1].rstrip(")")
        asyncio.run(asyncio.wait_for(exercise(base_url, model), 180))
    finally:
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = stop_engine(proc)
        took = time.monotonic() - started
    assert code == 0
    assert took < DEFAULT_GRACE_S
