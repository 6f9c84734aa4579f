"""The active side of engine health: :class:`HealthChecker` sends the checks and probes
that each engine's :class:`proxy.routing.engine_health.EngineHealth` asks for, one
asyncio task per engine, each sleeping until its next check is due or its state changes
(an event: no polling loop). The rule (when a check is due, what it decides) is
:mod:`proxy.routing.engine_health`'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

import aiohttp

from ..config.pools import HealthConfig
from .engine_health import EngineHealth, check_path_for


class HealthChecker:
    """Sends the active checks and probes that engines' :class:`~proxy.routing.engine_health.EngineHealth` ask for.

    One asyncio task per watched engine. The task sleeps until
    :meth:`proxy.routing.engine_health.EngineHealth.check_due_in` says a check or probe is due, or until the
    engine's health changes (its ``on_change`` sets the task's event: a passive ejection
    moves the next probe), then sends one ``GET`` and reports the result. Nothing runs
    while nothing is due. Each check opens a fresh connection (``force_close``), so a check
    proves the engine still accepts connections, and its answer body is read to at most
    64 KiB.

    An engine is anything with ``name``, ``url``, ``health`` (an :class:`proxy.routing.engine_health.EngineHealth`)
    and ``spec.kind`` / ``spec.upstream.credential()`` (a :class:`proxy.routing.engine_state.EngineState`).

    ``on_checked``, when given, is called with the engine after each check or probe has
    been recorded (the proxy dispatches the engine's pool there: room may have come back).

    Create and use it inside a running event loop; :meth:`close` it on shutdown.
    """

    MAX_BODY = 64 * 1024

    def __init__(self, on_checked: Callable[[Any], None] | None = None) -> None:
        self._tasks: dict[Any, asyncio.Task] = {}
        self._session: aiohttp.ClientSession | None = None
        self.on_checked = on_checked

    @property
    def watched(self) -> list[Any]:
        """The engines being watched."""
        return list(self._tasks)

    def sync(self, engines: Iterable[Any]) -> None:
        """Watch exactly ``engines`` (all engines in rotation or ejected, across pools):
        start tasks for new ones, stop those of engines no longer listed."""
        keep = {e for e in engines if not getattr(e, "draining", False)}
        for e in list(self._tasks):
            if e not in keep:
                self.unwatch(e)
        for e in keep:
            self.watch(e)

    def watch(self, engine: Any) -> None:
        """Start checking ``engine`` (a no-op when it is watched already)."""
        if engine not in self._tasks:
            self._tasks[engine] = asyncio.get_running_loop().create_task(self._run(engine), name=f"llm-qos health {engine.name}")

    def unwatch(self, engine: Any) -> None:
        """Stop checking ``engine`` (its task is cancelled)."""
        task = self._tasks.pop(engine, None)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        """Stop every task and close the checks' connections."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _run(self, engine: Any) -> None:
        health: EngineHealth = engine.health
        wake = asyncio.Event()
        health.on_change = wake.set
        try:
            while True:
                wake.clear()
                due = health.check_due_in()
                if due is None:
                    await wake.wait()
                    continue
                if due > 0:
                    try:
                        async with asyncio.timeout(due):
                            await wake.wait()
                    except TimeoutError:
                        pass
                    continue
                ok, detail = await self.check(engine)
                if self._tasks.get(engine) is not asyncio.current_task():
                    return  # unwatched while the check was in flight
                health.record_check(ok, detail)
                if self.on_checked is not None:
                    self.on_checked(engine)  # an engine back in rotation: dispatch its pool
        finally:
            if health.on_change == wake.set:
                health.on_change = None

    async def check(self, engine: Any) -> tuple[bool, str]:
        """One ``GET`` of ``engine``'s check path. Returns ``(passed, detail)``: passed
        on a 2xx answer within ``check_timeout_s``; detail says what went wrong."""
        cfg: HealthConfig = engine.health.config
        path = check_path_for(cfg, engine.spec.kind)
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True, limit=0),
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=True,
            )
        headers = {"Accept": "application/json"}
        key = engine.spec.upstream.credential()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        try:
            async with asyncio.timeout(cfg.check_timeout_s):
                async with self._session.get(engine.url + path, headers=headers, allow_redirects=False) as resp:
                    await resp.content.read(self.MAX_BODY)
                    status = resp.status
        except TimeoutError:
            return False, f"GET {path}: no answer within {cfg.check_timeout_s:g} s"
        except (aiohttp.ClientError, OSError) as e:
            return False, f"GET {path}: {type(e).__name__}: {e}"
        if 200 <= status < 300:
            return True, ""
        return False, f"GET {path} answered {status}"


__all__ = ["HealthChecker"]
