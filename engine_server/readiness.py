"""Readiness probes: prove an engine really generates before traffic is sent to it.

A port that accepts connections is not enough: LightLLM 0.0.1's ``/health`` always answers 200,
and ``transformers serve`` loads its model before listening but initialises continuous
batching only on the first request. So each probe makes a real one-token generation.

* :class:`OpenAIProbe` (CPU engine): ``GET /health`` must answer 200 ``{"status": "ok"}``
  (503 means its batching worker died), then ``POST /v1/chat/completions`` with
  ``max_tokens: 1`` must answer 200 with a ``choices`` list.
  Caveat (transformers 5.24, continuous batching): the sampling settings of the FIRST request
  (temperature, top_p, do_sample) are fixed for every later request of that process. The probe
  is that first request, so its ``temperature`` decides how the engine samples (0 = greedy).
* :class:`VllmProbe`: ``GET /v1/models`` must answer 200 listing the served model (vLLM
  listens only once the model is loaded and compiled; its ``/health`` answers 200 with an
  empty body), then a one-token ``POST /v1/chat/completions`` must answer 200 with ``choices``.
* :class:`LightLLMProbe`: ``POST /generate`` ``{"inputs": "a", "parameters":
  {"max_new_tokens": 1}}`` must answer 200 with a JSON ``generated_text`` (the response has
  no Content-Type header; it is parsed anyway).

:func:`wait_ready` retries a probe with a short exponential backoff (0.1 s doubling to 1 s)
until it passes, the deadline passes (:class:`TimeoutError`), the child exits
(:class:`EngineExitedError`) or the engine answers a definite client error
(:class:`ProbeRejectedError`: our probe or configuration is wrong, retrying cannot help).
One attempt is bounded by ``attempt_timeout_s`` (60 s, doubled after each attempt that got
no answer in time); an attempt that times out is retried: only the deadline ends readiness.
While it waits, a line every 15 s says so (INFO on the ``engine_server.readiness`` logger).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

log = logging.getLogger(__name__)

#: Seconds the first readiness attempt may take (doubled after each attempt that timed out).
DEFAULT_ATTEMPT_TIMEOUT_S = 60.0
#: Seconds between the "engine not ready yet" progress lines while waiting.
PROGRESS_EVERY_S = 15.0

#: HTTP statuses on which a probe keeps retrying (not ready yet / transient).
RETRY_STATUSES = frozenset({404, 408, 425, 429, 500, 502, 503, 504})


class ProbeNotReady(Exception):
    """One probe attempt failed in a way that may pass later (refused, 503, timeout...)."""


class ProbeRejectedError(RuntimeError):
    """The engine answered the probe with a definite client error (e.g. 400/417/422)."""


class EngineExitedError(RuntimeError):
    """The engine process exited before it became ready.

    Attributes:
        returncode: the child's exit status (negative: killed by that signal).
    """

    def __init__(self, returncode: int | None):
        super().__init__(f"engine exited with code {returncode} before it was ready")
        self.returncode = returncode


class Probe(Protocol):
    """An async callable doing one readiness attempt; returns on success, raises otherwise."""

    async def __call__(self, session: aiohttp.ClientSession) -> None: ...


async def _read_json(resp: aiohttp.ClientResponse) -> Any:
    text = await resp.text()
    if resp.status in RETRY_STATUSES:
        raise ProbeNotReady(f"{resp.method} {resp.url.path} -> HTTP {resp.status}: {text[:200]}")
    if resp.status != 200:
        raise ProbeRejectedError(f"{resp.method} {resp.url.path} -> HTTP {resp.status}: {text[:500]}")
    try:
        return json.loads(text)  # parse whatever the Content-Type (LightLLM sends none)
    except ValueError as exc:
        raise ProbeRejectedError(f"{resp.url.path} answered non-JSON: {text[:200]!r}") from exc


@dataclass
class OpenAIProbe:
    """``/health`` then a one-token ``/v1/chat/completions`` on an OpenAI-compatible engine.

    Attributes:
        base_url: e.g. ``http://127.0.0.1:8001``.
        model: value of the request's ``model`` field; None leaves it out (a pinned
            ``transformers serve`` then uses its only model).
        temperature: sent with the probe; see the module note (it fixes the CPU engine's sampling).
    """

    base_url: str
    model: str | None = None
    temperature: float | None = 0.0

    async def __call__(self, session: aiohttp.ClientSession) -> None:
        base = self.base_url.rstrip("/")
        async with session.get(f"{base}/health") as resp:
            health = await _read_json(resp)
        if isinstance(health, dict) and health.get("status") not in (None, "ok"):
            raise ProbeNotReady(f"/health says {health}")
        body: dict[str, Any] = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1}
        if self.model is not None:
            body["model"] = self.model
        if self.temperature is not None:
            body["temperature"] = self.temperature
        async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
            answer = await _read_json(resp)
        if not isinstance(answer, dict) or not answer.get("choices"):
            raise ProbeRejectedError(f"chat completion without choices: {answer!r:.300}")


@dataclass
class VllmProbe:
    """``GET /v1/models`` (200, lists ``model``) then a one-token greedy chat completion.

    Attributes:
        base_url: e.g. ``http://127.0.0.1:8001``.
        model: the served model name (``--served-model-name``).
    """

    base_url: str
    model: str

    async def __call__(self, session: aiohttp.ClientSession) -> None:
        base = self.base_url.rstrip("/")
        async with session.get(f"{base}/v1/models") as resp:
            listing = await _read_json(resp)
        ids = [m.get("id") for m in listing.get("data", []) if isinstance(m, dict)] if isinstance(listing, dict) else []
        if self.model not in ids:
            raise ProbeRejectedError(f"/v1/models does not list {self.model!r}: {listing!r:.300}")
        body = {"model": self.model, "messages": [{"role": "user", "content": "a"}], "max_tokens": 1, "temperature": 0}
        async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
            answer = await _read_json(resp)
        if not isinstance(answer, dict) or not answer.get("choices"):
            raise ProbeRejectedError(f"chat completion without choices: {answer!r:.300}")


@dataclass
class LightLLMProbe:
    """One-token native ``POST /generate`` on LightLLM (its ``/health`` cannot be trusted)."""

    base_url: str

    async def __call__(self, session: aiohttp.ClientSession) -> None:
        body = {"inputs": "a", "parameters": {"max_new_tokens": 1}}
        async with session.post(f"{self.base_url.rstrip('/')}/generate", json=body) as resp:
            answer = await _read_json(resp)
        if not isinstance(answer, dict) or "generated_text" not in answer:
            raise ProbeRejectedError(f"/generate answered without generated_text: {answer!r:.300}")


async def _attempts(
    probe: Probe, deadline: float, initial_delay_s: float, max_delay_s: float, attempt_timeout_s: float
) -> None:
    delay = initial_delay_s
    limit = attempt_timeout_s
    last: BaseException | str | None = None
    attempt = 0
    began = time.monotonic()
    next_report = began + PROGRESS_EVERY_S
    # One session for all attempts; no keep-alive so a restarted engine is never hit on a stale
    # socket; no timeout of aiohttp's own (its default of 300 s would end readiness early):
    # each attempt is bounded below instead.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        while True:
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                raise TimeoutError(f"engine not ready in time (last error: {last})")
            if now >= next_report:
                log.info("engine not ready yet after %.0f s (%d attempts; last: %s)", now - began, attempt, last)
                next_report = now + PROGRESS_EVERY_S
            attempt += 1
            try:
                async with asyncio.timeout(min(limit, remaining)):
                    await probe(session)
                log.debug("readiness probe passed on attempt %d", attempt)
                return
            except ProbeRejectedError:
                raise
            except TimeoutError:  # ours or the probe's own: the engine may still be warming up
                last = f"attempt {attempt} got no answer within {min(limit, remaining):.1f} s"
                log.debug("readiness %s", last)
                limit *= 2  # a first generation slower than the limit still gets its chance
            except (ProbeNotReady, aiohttp.ClientError, OSError) as exc:
                last = exc
                log.debug("readiness attempt %d: %s", attempt, exc)
            # Backoff between attempts (the one accepted polling loop: an HTTP server gives no event).
            await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, max_delay_s)


async def wait_ready(
    probe: Probe,
    deadline_s: float,
    exited: Awaitable[int] | None = None,
    *,
    initial_delay_s: float = 0.1,
    max_delay_s: float = 1.0,
    attempt_timeout_s: float = DEFAULT_ATTEMPT_TIMEOUT_S,
) -> None:
    """Retry ``probe`` until it passes.

    Args:
        probe: see :class:`Probe`.
        deadline_s: seconds from now to give up.
        exited: awaitable completing with the child's return code when it exits
            (e.g. a task of ``process.wait()``); it is not cancelled here.
        initial_delay_s, max_delay_s: backoff between attempts, seconds.
        attempt_timeout_s: seconds one attempt may take; an attempt that gets no answer in
            time (or raises :class:`TimeoutError` itself) is abandoned and retried, with
            twice the limit, for as long as the deadline allows. Only the deadline ends
            readiness.

    Raises:
        TimeoutError: not ready within ``deadline_s``.
        EngineExitedError: ``exited`` completed first.
        ProbeRejectedError: the engine rejected the probe (HTTP 4xx other than retryable ones).
    """
    deadline = time.monotonic() + deadline_s
    probing = asyncio.ensure_future(_attempts(probe, deadline, initial_delay_s, max_delay_s, attempt_timeout_s))
    if exited is None:
        await probing
        return
    exit_fut = asyncio.ensure_future(exited)
    try:
        await asyncio.wait({probing, exit_fut}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not probing.done():
            probing.cancel()
            await asyncio.gather(probing, return_exceptions=True)
    if probing.done() and not probing.cancelled() and probing.exception() is None:
        return
    if exit_fut.done():
        raise EngineExitedError(exit_fut.result())
    probing.result()  # re-raise the probe's error
