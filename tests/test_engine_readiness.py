"""Readiness probes against small real aiohttp servers on 127.0.0.1 and real child processes."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import pytest
from aiohttp import web

from engine_server.readiness import (
    EngineExitedError,
    LightLLMProbe,
    OpenAIProbe,
    ProbeRejectedError,
    wait_ready,
)

try:
    from tests.engine_fixture import free_port
except ImportError:  # tests/ itself on sys.path (pytest rootdir-less import)
    from engine_fixture import free_port  # type: ignore[no-redef]


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


@pytest.mark.asyncio
async def test_openai_probe_waits_for_health_then_generation() -> None:
    seen: list[dict] = []
    health_calls = 0

    async def health(_req: web.Request) -> web.Response:
        nonlocal health_calls
        health_calls += 1
        if health_calls < 3:  # like a CB worker not up yet
            return web.json_response({"status": "unhealthy"}, status=503)
        return web.json_response({"status": "ok"})

    async def chat(req: web.Request) -> web.Response:
        seen.append(await req.json())
        return web.json_response({"choices": [{"message": {"content": "A"}}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat)
    runner, url = await serve(app)
    try:
        await wait_ready(OpenAIProbe(url, model="/m", temperature=0.0), deadline_s=10, initial_delay_s=0.01)
    finally:
        await runner.cleanup()
    assert health_calls == 3
    assert seen == [{"messages": [{"role": "user", "content": "a"}], "max_tokens": 1, "model": "/m", "temperature": 0.0}]


@pytest.mark.asyncio
async def test_lightllm_probe_parses_body_without_content_type() -> None:
    bodies: list[dict] = []

    async def generate(req: web.Request) -> web.Response:
        bodies.append(await req.json())
        # LightLLM sends no Content-Type; the probe must parse it anyway
        return web.Response(body=json.dumps({"generated_text": ["x"], "count_output_tokens": 1}).encode())

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner, url = await serve(app)
    try:
        await wait_ready(LightLLMProbe(url), deadline_s=10)
    finally:
        await runner.cleanup()
    assert bodies == [{"inputs": "a", "parameters": {"max_new_tokens": 1}}]


@pytest.mark.asyncio
async def test_rejected_probe_fails_fast() -> None:
    async def generate(_req: web.Request) -> web.Response:
        return web.json_response({"message": "bad parameter"}, status=417)

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner, url = await serve(app)
    try:
        started = time.monotonic()
        with pytest.raises(ProbeRejectedError, match="417"):
            await wait_ready(LightLLMProbe(url), deadline_s=30)
        assert time.monotonic() - started < 5
    finally:
        await runner.cleanup()


@pytest.mark.asyncio
async def test_timeout_when_nothing_listens() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await wait_ready(LightLLMProbe(f"http://127.0.0.1:{free_port()}"), deadline_s=0.5)
    assert time.monotonic() - started < 3


@pytest.mark.asyncio
async def test_child_exit_before_ready() -> None:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "import sys; sys.exit(5)")
    exited = asyncio.ensure_future(proc.wait())
    with pytest.raises(EngineExitedError) as info:
        await wait_ready(LightLLMProbe(f"http://127.0.0.1:{free_port()}"), deadline_s=20, exited=exited)
    assert info.value.returncode == 5
