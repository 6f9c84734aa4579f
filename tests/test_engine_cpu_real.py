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


@pytest.mark.engine
def test_first_preparation_shows_each_step_as_it_goes(tmp_path) -> None:
    """The one-time model preparation (what the first ``make up`` does) is not silent: a line
    per step, in order, as each starts, the weights' progress bar, and the total at the end."""
    import os
    import re
    import subprocess
    import sys

    from tests.proc_util import die_with_parent
    from tests.proxy_process import REPO_ROOT

    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "engine_server", "--backend", "cpu", "--port", str(free_port()),
           "--cache-dir", str(tmp_path / "model")]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=die_with_parent)
    seen: list[tuple[float, str]] = []
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 300
        buf = b""
        while time.monotonic() < deadline:
            chunk = proc.stderr.read1(4096)  # type: ignore[attr-defined]
            if not chunk:
                break
            buf += chunk
            *lines, buf = re.split(rb"[\r\n]", buf)
            seen += [(time.monotonic(), ln.decode(errors="replace")) for ln in lines if ln.strip()]
            if any("CPU model prepared at" in text for _, text in seen):
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    text = [t for _, t in seen]
    assert any("preparing the CPU model, once" in t for t in text), text[-20:]
    steps = [(at, t) for at, t in seen if re.search(r"step [1-4]/4: ", t)]
    assert [re.search(r"step ([1-4])/4", t).group(1) for _, t in steps] == ["1", "2", "3", "4"], text[-40:]
    assert any("de-quantizing GGUF tensors" in t and "%" in t for t in text), "no per-tensor progress shown"
    assert any("CPU model prepared at" in t for t in text)
    # the lines came out as the steps happened, not all at the end
    prepared_at = next(at for at, t in seen if "CPU model prepared at" in t)
    assert prepared_at - steps[0][0] > 1.0
    assert (tmp_path / "model" / "config.json").is_file()


def test_progress_lines_while_a_step_runs(caplog) -> None:
    import logging

    from engine_server.cpu_model import Steps

    logger = logging.getLogger("test.steps")
    with caplog.at_level(logging.INFO, logger="test.steps"):
        with Steps(2, every_s=0.1, logger=logger) as steps:
            steps.step("first")
            time.sleep(0.45)
            steps.step("second")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "step 1/2: first"
    assert sum(1 for ln in lines[1:lines.index("step 2/2: second")] if ln.startswith("still at step 1/2")) >= 2
