"""Relaying one upstream answer to the client, and counting its tokens on the way.

One concept over 400 lines: relaying one answer, streamed or whole, with the truth
about how it ended; the rules for every way a stream can end (the list below) meet in
:func:`relay_stream`, and the counts it keeps (:class:`Exchange`) are what its callers
read, so splitting them would part each rule from the place it is applied.

Streaming: every chunk the upstream sends is written to the client as it arrives, as
bytes (aiohttp's ``write`` waits while the client's socket buffer is full, so a slow
reader holds back the upstream instead of growing our memory). An :class:`~proxy.wire.sse.SSEScanner`
follows the events beside the relay to count output tokens, pick up ``usage``, and see
how the stream ends. When the proxy asked for usage the client did not, a
:class:`~proxy.wire.usage_strip.UsageStripper` removes it first (``proxy.relay.upstream_body``).

The relay tells the truth about how a stream ended (``shared/interop/lightllm.md``,
``shared/interop/cpu-engine.md``):

* it adds ``data: [DONE]`` only to an OpenAI-style stream that really finished: every
  choice got its ``finish_reason`` (transformers serve and LightLLM's chat route end so,
  without ``[DONE]``); a stream that carried its own ``[DONE]`` gets nothing added;
* LightLLM's native stream ends with an event whose ``finished`` is true, and gets
  nothing added;
* an in-band error event (``data: {"error": ...}``) is relayed as the engine sent it, with
  nothing added, and counted ``upstream_error``;
* a Responses API stream ends with its own terminal event (``response.completed`` or
  ``.incomplete``; ``response.failed`` and ``error`` are in-band errors) and never gets a
  ``[DONE]``; a cut one gets a terminal ``error`` event, numbered after the last one;
* a stream that had finished (or carried the engine's own error) and then broke or went
  idle before its end (aiohttp's "Response payload is not completed") lost nothing: it is
  closed as a finished stream (``[DONE]`` where it carried none), counted ``ok``;
* every other end (no events at all, no ``finish_reason``, a broken connection, an idle
  upstream) gets a terminal error event and is counted ``upstream_error``;
* a pass-through path's stream is relayed as bytes, with nothing added: when it breaks,
  the client's connection is dropped (the proxy cannot speak its format).

Each format's rules are its scanner's (:class:`StreamScanner`); the relay applies them.

Response headers are the upstream's, filtered by :mod:`proxy.wire.headers`.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import aiohttp
import orjson
from aiohttp import web

from ..wire.errors import error_status
from ..telemetry.metrics import OUTCOME_CLIENT_GONE, OUTCOME_OK, OUTCOME_UPSTREAM_ERROR
from ..wire.headers import REQUEST_ID, client_headers, content_coding
from ..wire.sse import DONE_EVENT, EventTooLarge, SSEScanner, error_of
from ..wire.usage_strip import UsageStripper

if TYPE_CHECKING:
    from .resume import StreamResume

#: a stream's output count goes to the scheduler and the engine's meter at most this often
#: (seconds), after its first token at once: a fast engine's tokens (1 ms apart) cost one
#: call per 20 ms, not one each; the count a user is charged lags by at most this long
PROGRESS_EVERY_S = 0.02
CLIENT_CLOSED = 499  # the access log's status for a client that left before any answer (nginx's)

__all__ = ["CLIENT_CLOSED", "DONE_EVENT", "Exchange", "SSEScanner", "StreamScanner", "relay_body", "relay_stream", "usage_of"]


@dataclass(slots=True)
class Exchange:
    """One request as the proxy handled it: what the access log, the metrics and the
    scheduler's true-up read.

    Attributes:
        arrived_at: loop time (seconds) the request arrived.
        request_id: the request's id (sent upstream and to the client).
        user, group: the caller, once known ("" before).
        model: the body's ``model`` (at most 128 characters), if any.
        kind: the request's kind (:attr:`proxy.relay.request_kinds.RequestKind.name`).
        status: the HTTP status sent to the client (0: none yet; 499: the client left
            before any).
        queue_wait: seconds from arrival to dispatch (or to refusal), once known.
        first_byte_at: loop time the first answer byte was relayed, or ``None``.
        prompt_tokens: prompt tokens reported by the upstream, or ``None``.
        output_tokens: output tokens counted or reported so far.
        outcome: a ``proxy.telemetry.metrics.OUTCOME_*`` value once known.
        detail: a short reason for a failure.
        upstream_request_id: the engine's own ``X-Request-Id`` when it differs.
        upstream_ended: the upstream answer was read to its end (its connection can be
            reused; there is nothing to abort).
        engine_error: the error was the engine's own answer (an in-band error event, a
            2xx JSON error body), not a broken or unfinished stream: for the engine's
            health it answered (:mod:`proxy.routing.engine_health`), as with a 4xx.
        engine_error_status: the 4xx/5xx that error names (its numeric ``code``), if any:
            a 5xx counts against the engine's health like a 5xx status.
        transfer_broke: a pass-through answer's transfer broke (the one thing its
            answer, any status, tells of the engine's health).
        preemptions: times the request was preempted before its answer (each attempt
            aborted upstream unseen by the client; :mod:`proxy.admission.admission`),
            or during it (resumed: ``resumes``).
        resumes: times its stream was preempted after its client was shown tokens and
            resumed (:mod:`proxy.relay.resume`).
        resume: why its stream was not resumable (``""``: it was, or its pool does not
            resume; :func:`proxy.relay.resume.resume_refusal`, or what pinned it).
    """

    arrived_at: float
    request_id: str = ""
    user: str = ""
    group: str = ""
    model: str | None = None
    kind: str = ""
    status: int = 0
    queue_wait: float | None = None
    first_byte_at: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    outcome: str = ""
    detail: str = ""
    upstream_request_id: str | None = None
    upstream_ended: bool = False
    engine_error: bool = False
    engine_error_status: int | None = None
    transfer_broke: bool = False
    preemptions: int = 0
    resumes: int = 0
    resume: str = ""

    def forget_attempt(self, preemptions: int) -> None:
        """Forget what a preempted attempt left here (its client was shown nothing of
        it: status, first byte, token counts, outcome, the engine's id and errors), and
        count the preemption (``preemptions``: the ticket's count so far)."""
        self.status, self.first_byte_at, self.prompt_tokens, self.output_tokens = 0, None, None, 0
        self.outcome = self.detail = ""
        self.upstream_request_id, self.upstream_ended, self.engine_error, self.engine_error_status = None, False, False, None
        self.transfer_broke = False
        self.preemptions = preemptions


def note_engine_error(ex: Exchange, err: dict, what: str = "in-band error") -> None:
    """Record that the engine itself reported ``err`` (``proxy.wire.sse.error_of``): the
    outcome is ``upstream_error``; its health hears an answer (see :class:`Exchange`);
    the access log's detail is ``what`` and :func:`error_detail`."""
    ex.outcome = OUTCOME_UPSTREAM_ERROR
    ex.engine_error = True
    ex.engine_error_status = error_status(err)
    ex.detail = what + error_detail(err)


_LABEL = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def error_detail(err: dict) -> str:
    """An engine's error for the access log: its ``code``, ``type`` and ``status`` when
    they are numbers or short labels (``": code=400 type=BadRequestError"``), never its
    ``message``: engines echo the request in messages (pydantic's ``input``, "the prompt
    ... is too long"), and the access log never carries a prompt."""
    parts = []
    for key in ("code", "type", "status"):
        v = err.get(key)
        if (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, str) and _LABEL.fullmatch(v)):
            parts.append(f"{key}={v}")
    return ": " + " ".join(parts) if parts else ""


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def usage_of(body: bytes, native: bool) -> tuple[int | None, int | None]:
    """(prompt_tokens, output_tokens) reported in a non-streaming answer, or Nones.

    OpenAI: ``usage.prompt_tokens`` / ``usage.completion_tokens`` (embeddings: the first
    alone; the Responses API: ``usage.input_tokens`` / ``usage.output_tokens``). LightLLM native
    ``/generate``: ``count_output_tokens`` (a list when ``n`` > 1: summed) and, on
    LightLLM main, ``prompt_tokens``.
    """
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None, None
    return _usage(obj, native)


def _usage(obj: object, native: bool) -> tuple[int | None, int | None]:
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
    if p is None and o is None:  # the Responses API's names
        p, o = usage.get("input_tokens"), usage.get("output_tokens")
    return (p if _is_count(p) else None), (o if _is_count(o) else None)


def note_upstream_id(ex: Exchange, headers) -> None:
    """Record the engine's own request id when it differs from ours (for the access log)."""
    rid = headers.get(REQUEST_ID)
    if rid is not None and rid != ex.request_id:
        ex.upstream_request_id = rid[:128]


class StreamScanner(Protocol):
    """What :func:`relay_stream` asks of the scanner that follows a stream's format.

    Attributes:
        tokens: output tokens so far; prompt_tokens: reported prompt tokens, or ``None``;
        error: an in-band error the engine reported (``{"message": ...}``), or ``None``;
        partial: bytes of an unterminated event are pending.
        sse: the stream is server-sent events the proxy reads (and may add to): its
            validators go and SSE headers are set; ``False``: bytes relayed untouched,
            with the engine's headers and length.
    """

    tokens: int
    prompt_tokens: int | None
    error: dict | None
    partial: bool
    sse: bool

    def feed(self, chunk: bytes) -> None: ...
    def end(self) -> None: ...
    def complete(self, choices: int = 1) -> bool:
        """Whether the stream really finished (its format's own end was seen)."""
    def closing(self) -> bytes:
        """Bytes to add to a finished stream (``data: [DONE]`` where it carried none)."""
    def cut(self, message: str, code: str) -> bytes | None:
        """The terminal error event of an unfinished stream, or ``None``: drop the connection."""
    def unfinished(self) -> str:
        """Why an ended stream is not complete (the access log's detail)."""


#: What reading an upstream answer raises when the upstream fails (not the client).
UPSTREAM_FAILURES = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError, EventTooLarge)


async def relay_stream(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    ex: Exchange,
    on_progress: Callable[[int], None],
    scanner: StreamScanner,
    write_timeout_s: float = 60.0,
    choices: int = 1,
    strip_usage: bool = False,
    base_url: str | None = None,
    on_show: Callable[[], None] | None = None,
    early: web.StreamResponse | None = None,
    resume: "StreamResume | None" = None,
) -> web.StreamResponse:
    """Relay an SSE answer chunk by chunk, with the upstream's status and headers.

    Args:
        request: the client's request (the response is prepared on it).
        upstream: the upstream response, body unread.
        ex: updated with status, first-byte time, token counts and the outcome.
        on_progress: called with the cumulative output token count as it grows: at the
            first token, then at most every :data:`PROGRESS_EVERY_S` (the caller's
            release trues the count up at the end).
        scanner: follows the stream in its format and says how it ended
            (:class:`StreamScanner`: OpenAI-style or LightLLM native,
            :class:`proxy.wire.sse.SSEScanner`; Responses API,
            :class:`proxy.wire.responses_answer.ResponsesStreamScanner`; a pass-through path's,
            :class:`proxy.wire.sse.OpaqueStream`).
        write_timeout_s: a client whose socket stays full this long (seconds) is dropped.
        choices: how many choices the client asked for (``n``): each must get its
            ``finish_reason`` for a stream without ``[DONE]`` to count as finished.
        strip_usage: remove the usage the proxy asked for and the client did not.
        base_url: the engine's base URL (:func:`proxy.wire.headers.client_headers`).
        on_show: given, the status line and headers wait for the answer's first bytes
            (the engine sends its headers at once, before its first token), and
            ``on_show()`` is called right before they go to the client: until then the
            client has been shown nothing (a request still waiting inside the engine
            may be preempted, :mod:`proxy.admission.admission`). ``None``: headers at once.
        early: the client's response, its status and headers already sent while the
            request waited in its queue (:mod:`proxy.admission.queue_status`): the
            stream is written on it (the engine's status and headers are not sent).
        resume: a resumable stream's state (:class:`proxy.relay.resume.StreamResume`):
            the bytes written go through its ``feed`` (after the usage stripper), and a
            later part writes on the response the first part made (its status and
            headers already sent). ``None`` (every stream not resumable): nothing added.

    Returns:
        The stream response. ``ex.outcome`` is ``ok``, ``upstream_error`` (an in-band
        error, or the client got a terminal error event), or ``client_disconnected`` (a
        write failed, or the client read nothing for ``write_timeout_s`` and its
        connection was dropped). ``ex.upstream_ended`` says whether the upstream answer
        was read to its end; if not, the caller aborts it.

    Raises:
        asyncio.CancelledError: the client disconnected (aiohttp cancelled the handler).
    """
    loop = asyncio.get_running_loop()
    # a stream the proxy reads may get [DONE] added or usage removed: not the same bytes
    headers = client_headers(upstream.headers, ex.request_id, base_url, transformed=scanner.sse)
    note_upstream_id(ex, upstream.headers)
    if scanner.sse:
        if "Content-Type" not in headers:
            headers["Content-Type"] = "text/event-stream"
        if "Cache-Control" not in headers:
            headers["Cache-Control"] = "no-cache"
        headers["X-Accel-Buffering"] = "no"  # nginx in front: do not buffer the stream
    if resume is None or resume.response is None:
        resp = early if early is not None else web.StreamResponse(status=upstream.status, headers=headers)
        if resume is not None:
            resume.response, resume.early = resp, resp is early
    else:
        resp = resume.response  # a resumed part: the client's stream goes on
    length = upstream.content_length
    if not scanner.sse and length is not None and content_coding(upstream.headers) in ("", "identity") and request.method != "HEAD" and upstream.status not in (204, 304):
        resp.content_length = length  # bytes relayed as they are: a download keeps its length
    stripper = UsageStripper() if strip_usage else None
    # what the bytes go through before the client: nothing, the stripper, the resume, both
    feed = None if stripper is None else stripper.feed
    if resume is not None:
        feed = resume.feed if stripper is None else (lambda c, s=stripper.feed, r=resume.feed: r(s(c)))
    watchdog = _WriteWatchdog(loop, write_timeout_s)

    shown = resp.prepared and resp is not early  # an early response has shown only its wait

    async def show() -> None:
        nonlocal shown
        if shown:
            return
        shown = True
        if on_show is not None:
            on_show()
        if not resp.prepared:
            watchdog.pending_since = loop.time()  # the headers are the first write
            await resp.prepare(request)  # a client gone by now is a reset here: handled below
            watchdog.pending_since = None
        ex.status = upstream.status

    try:
        if on_show is None:
            await show()
        broke: Exception | None = None
        reported_at = -PROGRESS_EVERY_S
        try:
            read = upstream.content.readany  # iter_any() without its wrapper coroutine per chunk
            while chunk := await read():  # b"": the upstream answer ended
                now = loop.time()
                if ex.first_byte_at is None:
                    ex.first_byte_at = now
                out = chunk if feed is None else feed(chunk)
                if out:
                    if not shown:
                        await show()
                    watchdog.pending_since = now
                    await resp.write(out)  # waits while the client's socket is full
                    watchdog.pending_since = None
                before = scanner.tokens
                scanner.feed(chunk)
                if scanner.tokens != before:
                    ex.output_tokens = scanner.tokens
                    # the first token at once (time to first token), then at most every
                    # PROGRESS_EVERY_S: the end's true-up counts the rest
                    if before == 0 or now - reported_at >= PROGRESS_EVERY_S:
                        reported_at = now
                        on_progress(scanner.tokens)
        except UPSTREAM_FAILURES as e:
            if watchdog.pending_since is not None:
                raise  # the client's write failed (aiohttp's ClientConnectionResetError), not the upstream
            broke = e
        if resume is not None:
            resume.pin("the upstream answer ended")  # its end goes to the client: never resumed
        if broke is None:
            ex.upstream_ended = True
            held = stripper.flush() if stripper is not None else b""
            if resume is not None:
                held = resume.feed(held) + resume.flush()
            # an unterminated last event is terminated, so the client's parser sees it
            pad = b"\n\n" if scanner.partial else b""
            scanner.end()
        elif scanner.error is not None or scanner.complete(choices):
            # the engine had ended its answer (its finish, or its own error) when the
            # connection broke or went idle before its end: nothing was lost, so the
            # stream is closed as if it had ended there. An unterminated event is what
            # broke: held back, it is dropped; already relayed, it is terminated. The
            # connection is closed, never reused; there is no generation left to abort.
            ex.upstream_ended = True
            upstream.close()
            held = b""
            pad = b"\n\n" if stripper is None and scanner.partial else b""
        else:
            _take_counts(ex, scanner)
            ex.outcome, ex.detail = OUTCOME_UPSTREAM_ERROR, f"upstream stream broke: {type(broke).__name__}"
            held = stripper.flush() if stripper is not None else b""
            if resume is not None:
                held = resume.feed(held) + resume.flush()
            pad = b"\n\n" if held.strip() or scanner.partial else b""
            if isinstance(broke, TimeoutError):
                cut = scanner.cut("the upstream sent nothing for upstream.idle_timeout_s", "upstream_idle_timeout")
            elif isinstance(broke, EventTooLarge):
                cut = scanner.cut(str(broke), "upstream_event_too_large")
            else:
                cut = scanner.cut("the upstream connection failed mid-stream", "upstream_stream_broken")
            ending = None if cut is None else held + pad + cut
        if ex.upstream_ended:
            _take_counts(ex, scanner)
            ending = held + pad
            if scanner.error is not None:
                note_engine_error(ex, scanner.error)
            elif scanner.complete(choices):
                ex.outcome = OUTCOME_OK
                if broke is not None:
                    ex.detail = f"the upstream broke after the stream finished: {type(broke).__name__}"
                ending += scanner.closing()
            else:
                ex.outcome, ex.detail = OUTCOME_UPSTREAM_ERROR, scanner.unfinished()
                cut = scanner.cut("the upstream stream ended before it finished", "upstream_stream_incomplete")
                ending = None if cut is None else ending + cut
        if ending is None:  # a format the proxy cannot end in: the client sees the break
            if request.transport is not None:
                request.transport.abort()
            return resp
        await show()
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
        ex.status = ex.status or CLIENT_CLOSED  # gone before the headers were out
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


def _take_counts(ex: Exchange, scanner: StreamScanner) -> None:
    ex.output_tokens = scanner.tokens
    if scanner.prompt_tokens is not None:
        ex.prompt_tokens = scanner.prompt_tokens


async def relay_body(upstream: aiohttp.ClientResponse, ex: Exchange, native: bool = False, base_url: str | None = None) -> web.Response:
    """Relay a whole (non-SSE) answer: the upstream's status, body bytes and headers.

    A 2xx answer whose JSON body reports an error (``{"error": ...}``) is relayed as is
    and counted ``upstream_error``, like every 4xx/5xx. A 3xx is relayed as is (the
    proxy follows no redirect), its ``Location`` made relative to the proxy when it
    points under ``base_url``, the engine's (:func:`proxy.wire.headers.client_headers`).

    Raises:
        asyncio.CancelledError: the client went away (the caller aborts the upstream).
        aiohttp.ClientError, TimeoutError: the upstream failed while sending the body.
    """
    body = await upstream.read()
    ex.upstream_ended = True
    ex.first_byte_at = asyncio.get_running_loop().time()
    headers = client_headers(upstream.headers, ex.request_id, base_url)
    note_upstream_id(ex, upstream.headers)
    if "Content-Type" not in headers:
        headers["Content-Type"] = "application/json"  # LightLLM /generate sends none
    failed = upstream.status >= 400
    if upstream.status < 300:
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            obj = None
        if (err := error_of(obj)) is not None:
            note_engine_error(ex, err, "error body with status %d" % upstream.status)
            failed = True
        else:
            ex.prompt_tokens, out = _usage(obj, native)
            if out is not None:
                ex.output_tokens = out
    if failed and not ex.detail:
        ex.detail = "upstream answered %d" % upstream.status
    ex.outcome = OUTCOME_UPSTREAM_ERROR if failed else OUTCOME_OK
    ex.status = upstream.status
    return web.Response(status=upstream.status, body=body, headers=headers)
