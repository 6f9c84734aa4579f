"""Shared fixtures: a real fake upstream and a real proxy, each on a 127.0.0.1 socket."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

import aiohttp
import pytest
import yaml

from bench.fake_upstream import STATS, Stats, make_app
from proxy.api.app import create_app
from proxy.config.loading import config_digest, parse_config
from proxy.api.handlers import STATE
from proxy.runtime.state import ProxyState
from tests.vllm_engine import vllm_engine  # noqa: F401  (session fixture: one real vLLM engine)


def base_config(upstream_url: str, **admission: Any) -> dict:
    """A config dict with platinum/bronze groups; ``admission`` keys override."""
    return {
        "upstream": {"url": upstream_url, "kind": "openai"},
        "admission": {"max_inflight": 4, "max_queue": 100, "queue_timeout_s": 10, **admission},
        "identity": {"header": "X-User-Id"},
        "default_group": "bronze",
        "groups": [
            {"name": "platinum", "users": [{"id": "alice", "weight": 3, "api_key": "sk-alice"}, {"id": "bob", "weight": 1}]},
            {"name": "bronze", "users": [{"id": "carl", "weight": 1, "api_key": "sk-carl"}]},
        ],
    }


@dataclass
class Stack:
    """A fake upstream and a proxy in front of it, both on real sockets."""

    upstream_url: str
    proxy_url: str
    stats: Stats
    state: ProxyState
    config_path: Path

    def chat_body(self, n: int = 8, stream: bool = False, **fake: Any) -> dict:
        body: dict = {"model": "fake-model", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": n, "stream": stream}
        if fake:
            body["fake"] = fake
        return body


async def wait_until(pred: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    """Wait (bounded) until ``pred()`` holds; fail the test otherwise."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.fixture
async def make_stack(aiohttp_server, tmp_path) -> Callable[..., Awaitable[Stack]]:
    """Factory: ``await make_stack(ttft_s=0, itl_s=0, config=None, **admission)``."""

    async def make(ttft_s: float = 0.0, itl_s: float = 0.0, config: dict | None = None, **admission: Any) -> Stack:
        up_app = make_app(ttft_s, itl_s)
        up = await aiohttp_server(up_app)
        upstream_url = str(up.make_url("")).rstrip("/")
        cfg = config if config is not None else base_config(upstream_url, **admission)
        cfg.setdefault("upstream", {})["url"] = upstream_url
        path = tmp_path / "config.yaml"
        text = yaml.safe_dump(cfg)
        path.write_text(text)
        app = create_app(parse_config(text, str(path)), config_digest(text), str(path))
        px = await aiohttp_server(app)
        return Stack(upstream_url, str(px.make_url("")).rstrip("/"), up_app[STATS], app[STATE], path)

    return make


@pytest.fixture
async def http():
    """A client session for talking to the proxy."""
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
def redis_server():
    """A real ``redis-server`` on a free 127.0.0.1 port, empty, no persistence
    (:class:`tests.redis_server.RedisServer`: stop, restart, kill, pause for fault tests)."""
    from tests.redis_server import RedisServer

    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()
