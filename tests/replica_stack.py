"""Several real proxy processes (replicas of one deployment) sharing one real Redis, in
front of one fake engine, for the cross-replica tests and ``bench/replicas.py``."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

from tests.proc_util import free_port
from tests.proxy_process import start_proxy, stop_proxy

ADMIN_KEY = "admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def replica_config(engine_url: str, redis_url: str | None, prefix: str, groups: list[dict], **admission) -> dict:
    """A config for every replica: one engine, ``groups``, the shared state (short
    interval and lease; ``redis_url`` None: standalone)."""
    cfg = {
        "upstream": {"url": engine_url, "kind": "openai", "load_signal": {"enabled": False}},
        "admission": {"max_inflight": 6, "max_queue": 1000, "queue_timeout_s": 60, **admission},
        "identity": {"header": "X-User-Id"},
        "admin": {"api_key": ADMIN_KEY},
        "default_group": groups[-1]["name"],
        "groups": groups,
    }
    if redis_url is not None:
        cfg["shared_state"] = {"url": redis_url, "key_prefix": prefix, "sync_interval_s": 0.05, "lease_s": 1.0, "timeout_s": 0.1}
    return cfg


@dataclass
class Replicas:
    """The running replicas: their processes and base URLs."""

    procs: list[subprocess.Popen] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    paths: list[Path] = field(default_factory=list)

    def start(self, configs: list[dict], extra_args: list[str] | None = None) -> "Replicas":
        """Start one proxy per config (each on a free port), waiting for each to be ready."""
        for cfg in configs:
            path = Path(tempfile.mkstemp(prefix="replica-", suffix=".yaml")[1])
            path.write_text(yaml.safe_dump(cfg))
            port = free_port()
            self.procs.append(start_proxy(path, port, None, 60.0, ["--no-watch", *(extra_args or [])]))
            self.urls.append(f"http://127.0.0.1:{port}")
            self.paths.append(path)
        return self

    def kill(self, i: int) -> None:
        """SIGKILL replica ``i`` (no goodbye to Redis)."""
        os.kill(self.procs[i].pid, signal.SIGKILL)
        self.procs[i].wait()

    def stop(self) -> list[int]:
        """SIGTERM every replica still running; their exit codes."""
        codes = [stop_proxy(p, grace_s=20.0) for p in self.procs]
        for p in self.paths:
            p.unlink(missing_ok=True)
        return codes


async def status(session: aiohttp.ClientSession, url: str) -> dict:
    """``GET /admin/status`` of one replica."""
    async with session.get(f"{url}/admin/status", headers=ADMIN) as r:
        assert r.status == 200
        return await r.json()


async def wait_all(session: aiohttp.ClientSession, urls: list[str], pred, timeout_s: float, what: str) -> list[dict]:
    """Poll every replica's status until ``pred(shared_state)`` holds for all (bounded)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        shared = [(await status(session, u))["shared_state"] for u in urls]
        if all(pred(s) for s in shared):
            return shared
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}: {shared}")
        await asyncio.sleep(0.05)


def chat(user: str, tag: str, n: int = 8, **fake) -> tuple[dict, dict]:
    """A chat request's body (``fake.tag`` = ``tag``, ``max_tokens`` = ``n``) and headers."""
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": n, "fake": {"tag": tag, **fake}}
    return body, {"X-User-Id": user}


async def post(session: aiohttp.ClientSession, url: str, user: str, tag: str, n: int = 8, **fake) -> tuple[int, dict, dict]:
    """One chat request; (status, JSON body, headers)."""
    body, headers = chat(user, tag, n, **fake)
    async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        return r.status, await r.json(content_type=None), dict(r.headers)
