"""Relaying one upstream answer to the client, and counting its tokens on the way.

Streaming: every chunk the upstream sends is written to the client as it arrives, as
bytes, unparsed (aiohttp's ``write`` waits while the client's socket buffer is full, so a
slow reader holds back the upstream instead of growing our memory). A light scanner
follows the SSE event boundaries beside the relay to count output tokens (one event ~
one token) and to pick up ``usage`` when the upstream reports it; only events that
mention ``usage`` (OpenAI) or every event of LightLLM's native stream (which carries
``count_output_tokens`` and ``finished``) are JSON-parsed.

Stream endings (LightLLM v1.2.0 ``api_lightllm.py``/``api_openai.py``, transformers 5.24
``serve``; docs/deploy.md):

* OpenAI-style streams from transformers serve and LightLLM 0.0.1 end without
  ``data: [DONE]``; the relay appends it so OpenAI clients end cleanly (LightLLM v1.2.0
  sends its own, which is relayed and not repeated).
* LightLLM's native stream ends with an event whose ``finished`` is true; a stream that
  ends without one is an upstream failure, and the client gets a terminal error event,
  unless LightLLM sent its own (v1.2.0: ``data: {"error": {...}}`` for a request it cannot
  run), which then is the last event.
* A connection broken mid-stream also ends with a terminal error event.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Callable

import aiohttp
import orjson
from aiohttp import web

from .errors import sse_error_event
from .metrics import OUTCOME_CLIENT_GONE, OUTCOME_OK, OUTCOME_UPSTREAM_ERROR

_EVENT_END = re.compile(rb"\r?\n\r?\n")
DONE_EVENT = b"data: [DONE]\n\n"
STREAM_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


@dataclass(slots=True)
class Exchange:
    """Accounting of one request as it is relayed.

    Attributes:
        arrived_at: loop time (seconds) the request arrived.
        first_byte_at: loop time the first answer byte was relayed, or ``None``.
        prompt_tokens: prompt tokens reported by the upstream, or ``None``.
        output_tokens: output tokens counted or reported so far.
        outcome: a ``proxy.metrics.OUTCOME_*`` value once known.
        detail: a short reason for a failure.
    """

    arrived_at: float
    first_byte_at: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    outcome: str = ""
    detail: str = ""


def take_events(buf: bytearray) -> list[bytes]:
    """Remove the complete SSE events (terminated by a blank line, ``\n`` or ``\r\n``)
    from the front of ``buf`` and return them, leading whitespace stripped; an
    unterminated event stays in ``buf``."""
    out = []
    start = 0
    for m in _EVENT_END.finditer(buf):
        out.append(bytes(buf[start : m.start()]).lstrip())
        start = m.end()
    if start:
        del buf[:start]
    return out


def sse_payloads(buf: bytearray) -> list[bytes]:
    """Remove the complete events from ``buf`` and return their ``data:`` payloads
    (stripped; ``[DONE]`` and events without data left out)."""
    out = []
    for ev in take_events(buf):
        if ev.startswith(b"data:"):
            payload = ev[5:].strip()
            if payload and payload != b"[DONE]":
                out.append(payload)
    return out


class SSEScanner:
    """Follows SSE events across arbitrary chunk boundaries.

    Args:
        native: True for LightLLM's native ``/generate_stream`` events.

    Attributes:
        tokens: output tokens so far (events, or the engine's own count when given).
        prompt_tokens: from a ``usage`` object, when one was seen.
        done: ``data: [DONE]`` was seen.
        finished: a native event with ``finished: true`` was seen.
        error: a native event carrying ``error`` instead of a token was seen (LightLLM
            v1.2.0 reports a request it cannot run, e.g. a prompt too long, this way after
            the 200 headers of a stream, and then ends the stream).
        partial: bytes of an unterminated event are pending.
    """

    __slots__ = ("native", "_buf", "tokens", "prompt_tokens", "done", "finished", "error")

    def __init__(self, native: bool = False) -> None:
        self.native = native
        self._buf = bytearray()
        self.tokens = 0
        self.prompt_tokens: int | None = None
        self.done = False
        self.finished = False
        self.error = False

    @property
    def partial(self) -> bool:
        return bool(self._buf.strip())

    def feed(self, chunk: bytes) -> None:
        """Scan ``chunk``; complete events update the counters."""
        buf = self._buf
        if (
            not buf
            and not self.native
            and chunk.endswith(b"\n\n")
            and b"\r" not in chunk
            and b'"usage"' not in chunk
            and b"[DONE]" not in chunk
        ):
            # the common case, whole events and nothing to parse: count the data events
            # without copying (same result as the general path below, a third of its cost)
            if chunk.count(b"\n\n") == 1:
                self.tokens += chunk.lstrip().startswith(b"data:")
            else:
                self.tokens += sum(1 for ev in chunk.split(b"\n\n") if ev.lstrip().startswith(b"data:"))
            return
        buf += chunk
        for ev in take_events(buf):
            self._event(ev)

    def _event(self, ev: bytes) -> None:
        if not ev.startswith(b"data:"):
            return
        payload = ev[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return
        if self.native:
            self._native(payload)
            return
        self.tokens += 1
        if b'"usage"' in payload:
            try:
                usage = orjson.loads(payload).get("usage")
            except (orjson.JSONDecodeError, AttributeError):
                return
            if isinstance(usage, dict):
                self._usage(usage)

    def _usage(self, usage: dict) -> None:
        out, prompt = usage.get("completion_tokens"), usage.get("prompt_tokens")
        if isinstance(out, int):
            self.tokens = out
        if isinstance(prompt, int):
            self.prompt_tokens = prompt

    def _native(self, payload: bytes) -> None:
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return
        if not isinstance(obj, dict):
            return
        token = obj.get("token")
        if token is None and "error" in obj:  # not a token: the stream's error report
            self.error = True
            return
        count = token.get("count_output_tokens") if isinstance(token, dict) else None
        # one event per token; the engine's own running count wins when it is ahead
        self.tokens = max(self.tokens + 1, count) if _is_count(count) else self.tokens + 1
        prompt = token.get("prompt_tokens") if isinstance(token, dict) else None  # LightLLM main only
        if _is_count(prompt) and prompt > 0:
            self.prompt_tokens = prompt
        if obj.get("finished") is True:
            self.finished = True


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def usage_of(body: bytes, native: bool) -> tuple[int | None, int | None]:
    """(prompt_tokens, output_tokens) reported in a non-streaming answer, or Nones.

    OpenAI: ``usage.prompt_tokens`` / ``usage.completion_tokens``. LightLLM native
    ``/generate``: ``count_output_tokens`` (a list when ``n`` > 1: summed) and, on
    LightLLM main, ``prompt_tokens``.
    """
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None, None
    if not isinstance(obj, dict):
        return None, None
    if native:
        n, p = obj.get("count_output_tokens"), obj.get("prompt_tokens")
        if isinstance(n, list) and n and all(_is_count(x) for x in n):
            n = sum(n)
        return (p if _is_count(p) and p > 0 else None), (n if _is_count(n) else None)
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return None, None
    p, o = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (p if isinstance(p, int) else None), (o if isinstance(o, int) else None)


_UPSTREAM_FAILURES = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError)


async def relay_stream(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    ex: Exchange,
    on_progress: Callable[[int], None],
    native: bool = False,
    write_timeout_s: float = 60.0,
) -> web.StreamResponse:
    """Relay an SSE answer chunk by chunk.

    Args:
        request: the client's request (the response is prepared on it).
        upstream: the upstream response, status 200, body unread.
        ex: updated with first-byte time, token counts and the outcome.
        on_progress: called with the cumulative output token count as it grows.
        native: LightLLM native stream semantics (see module docstring).
        write_timeout_s: a client whose socket stays full this long (seconds) is dropped.

    Returns:
        The stream response. ``ex.outcome`` is ``ok``, ``upstream_error`` (the client got
        a terminal error event), or ``client_disconnected`` (a write failed, or the client
        read nothing for ``write_timeout_s`` and its connection was dropped); the caller
        aborts the upstream unless it is ``ok``.

    Raises:
        asyncio.CancelledError: the client disconnected (aiohttp cancelled the handler).
    """
    loop = asyncio.get_running_loop()
    resp = web.StreamResponse(status=200, headers=STREAM_HEADERS)
    await resp.prepare(request)
    scanner = SSEScanner(native)
    watchdog = _WriteWatchdog(loop, write_timeout_s)
    try:
        try:
            async for chunk in upstream.content.iter_any():
                if ex.first_byte_at is None:
                    ex.first_byte_at = loop.time()
                watchdog.pending_since = loop.time()
                await resp.write(chunk)  # waits while the client's socket is full
                watchdog.pending_since = None
                before = scanner.tokens
                scanner.feed(chunk)
                if scanner.tokens != before:
                    ex.output_tokens = scanner.tokens
                    on_progress(scanner.tokens)
        except _UPSTREAM_FAILURES as e:
            _take_counts(ex, scanner)
            ex.outcome, ex.detail = OUTCOME_UPSTREAM_ERROR, f"upstream stream broke: {type(e).__name__}"
            if isinstance(e, TimeoutError):
                ending = sse_error_event("the upstream sent nothing for upstream.idle_timeout_s", "upstream_idle_timeout")
            else:
                ending = sse_error_event("the upstream connection failed mid-stream", "upstream_stream_broken")
        else:
            _take_counts(ex, scanner)
            pad = b"\n\n" if scanner.partial else b""
            if native and not scanner.finished and scanner.error:  # the upstream's own error event ends it
                ex.outcome, ex.detail = OUTCOME_UPSTREAM_ERROR, "native stream ended with an error event"
                ending = pad
            elif native and not scanner.finished:
                ex.outcome, ex.detail = OUTCOME_UPSTREAM_ERROR, "native stream ended without finished:true"
                ending = pad + sse_error_event("the upstream stream ended early", "upstream_stream_incomplete")
            else:
                ex.outcome = OUTCOME_OK
                ending = b"" if native or scanner.done else pad + DONE_EVENT
        watchdog.pending_since = loop.time()
        if ending:
            await resp.write(ending)
        await resp.write_eof()
        return resp
    except asyncio.CancelledError:
        if not watchdog.fired:
            raise  # the client disconnected (aiohttp cancels the handler)
        asyncio.current_task().uncancel()
        ex.outcome, ex.detail = OUTCOME_CLIENT_GONE, f"the client read nothing for {write_timeout_s:g} s"
        if request.transport is not None:
            request.transport.abort()
        return resp
    except ConnectionResetError:
        ex.outcome, ex.detail = OUTCOME_CLIENT_GONE, "the client disconnected mid-stream"
        return resp
    finally:
        watchdog.stop()


class _WriteWatchdog:
    """Cancels the relaying task when one write to the client has waited longer than
    ``timeout_s`` (the client stopped reading). One timer per stream, re-armed every
    ``timeout_s / 4``, instead of a timeout around every chunk's write; so a stuck
    client is dropped between 1 and 1.25 x ``timeout_s`` after its write began."""

    __slots__ = ("pending_since", "fired", "_loop", "_timeout_s", "_task", "_handle")

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self.pending_since: float | None = None
        self.fired = False
        self._loop = loop
        self._timeout_s = timeout_s
        self._task = asyncio.current_task()
        self._handle = loop.call_later(timeout_s / 4, self._check)

    def _check(self) -> None:
        since = self.pending_since
        if since is not None and self._loop.time() - since >= self._timeout_s:
            self.fired = True
            self._task.cancel()
            return
        self._handle = self._loop.call_later(self._timeout_s / 4, self._check)

    def stop(self) -> None:
        self._handle.cancel()


def _take_counts(ex: Exchange, scanner: SSEScanner) -> None:
    ex.output_tokens = scanner.tokens
    if scanner.prompt_tokens is not None:
        ex.prompt_tokens = scanner.prompt_tokens


async def relay_body(upstream: aiohttp.ClientResponse, ex: Exchange, native: bool = False) -> web.Response:
    """Relay a non-streaming answer whole, with the upstream's status and content type.

    Raises:
        asyncio.CancelledError: the client went away (the caller aborts the upstream).
        aiohttp.ClientError, TimeoutError: the upstream failed while sending the body.
    """
    body = await upstream.read()
    ex.first_byte_at = asyncio.get_running_loop().time()
    if upstream.status == 200:
        ex.prompt_tokens, out = usage_of(body, native)
        if out is not None:
            ex.output_tokens = out
    ex.outcome = OUTCOME_OK if upstream.status < 400 else OUTCOME_UPSTREAM_ERROR
    ctype = upstream.headers.get("Content-Type", "application/json")  # LightLLM /generate sends none
    return web.Response(status=upstream.status, body=body, headers={"Content-Type": ctype})
