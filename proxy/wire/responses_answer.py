"""The Responses API's answers as the relay reads them: the usage and status of a response
object (a non-streaming answer), and the typed event stream followed across chunks
(:class:`ResponsesStreamScanner`, the Responses counterpart of
:class:`proxy.wire.sse.SSEScanner`). The request side is :mod:`proxy.wire.responses_body`.

Sources for the shapes: the OpenAI API reference (Responses streaming) and its Python
SDK's generated types (``openai`` 1.x/3.x: ``types/responses/response_usage.py``,
``response_stream_event.py``, ``response_error_event.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import orjson

from .errors import responses_error_event
from .sse import parse_event, take_events

#: Terminal events of a Responses stream (no ``[DONE]`` follows them).
TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed", "error"})

@dataclass(slots=True)
class ResponsesUsage:
    """What a Responses answer reports.

    Attributes:
        input_tokens, output_tokens: from ``usage``, or ``None``.
        status: the response's ``status`` (``completed``, ``incomplete``, ``failed``,
            ``in_progress``, ...), or ``None``.
    """

    input_tokens: int | None = None
    output_tokens: int | None = None
    status: str | None = None


def _count(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _usage_of_response(resp: object) -> ResponsesUsage:
    if not isinstance(resp, dict):
        return ResponsesUsage()
    usage = resp.get("usage")
    status = resp.get("status") if isinstance(resp.get("status"), str) else None
    if not isinstance(usage, dict):
        return ResponsesUsage(status=status)
    return ResponsesUsage(_count(usage.get("input_tokens")), _count(usage.get("output_tokens")), status)


def responses_usage(body: bytes) -> ResponsesUsage:
    """Usage and status of a non-streaming Responses answer (a response object)."""
    try:
        return _usage_of_response(orjson.loads(body))
    except orjson.JSONDecodeError:
        return ResponsesUsage()


_SEQ = re.compile(rb'"sequence_number"\s*:\s*(\d{1,18})')


class ResponsesStreamScanner:
    """Follows a Responses API event stream across arbitrary chunk boundaries, for
    accounting and to tell a real finish from a cut; the same interface as
    :class:`proxy.wire.sse.SSEScanner`, for :func:`proxy.relay.relay.relay_stream`.

    Every event whose type ends in ``.delta`` (output text, refusal, reasoning, function
    call arguments, ...) counts as one output token until ``usage`` gives the real
    count. The stream has ended once a terminal event (:data:`TERMINAL_EVENTS`) was
    seen: ``response.completed`` and ``response.incomplete`` are a finish,
    ``response.failed`` and ``error`` an in-band error. The engine sends no ``[DONE]``
    and the proxy adds none (OpenAI's Responses streaming reference). Only terminal
    events (and events without an ``event:`` line) are JSON-parsed.

    Attributes:
        tokens: output tokens so far (deltas, then ``usage.output_tokens``).
        prompt_tokens: ``usage.input_tokens`` once reported.
        terminal: the terminal event's type, or ``None`` while the stream is open.
        status: the final response's ``status`` (``completed``, ``incomplete``,
            ``failed``) or ``error``.
        error: the in-band error (``{"message", "code"}``) of a failed stream, or ``None``.
        sequence_number: the highest ``sequence_number`` seen (-1: none); the terminal
            error event the proxy appends to a cut stream uses the next one (:meth:`cut`).

    Raises (from :meth:`feed`):
        proxy.wire.sse.EventTooLarge: an event grew past :data:`proxy.wire.sse.MAX_EVENT_BYTES`.
    """

    __slots__ = ("_buf", "tokens", "prompt_tokens", "terminal", "status", "error", "sequence_number")
    sse = True

    def __init__(self) -> None:
        self._buf = bytearray()
        self.tokens = 0
        self.prompt_tokens: int | None = None
        self.terminal: str | None = None
        self.status: str | None = None
        self.error: dict | None = None
        self.sequence_number = -1

    @property
    def finished(self) -> bool:
        """Whether a terminal event was seen."""
        return self.terminal is not None

    @property
    def partial(self) -> bool:
        """Bytes of an unterminated event are pending."""
        return bool(self._buf.strip())

    def feed(self, chunk: bytes) -> None:
        """Scan ``chunk``; complete events update the attributes."""
        for ev in take_events(self._buf, chunk):
            self.feed_event(ev)

    def end(self) -> None:
        """The stream ended: read an unterminated last event as if it were terminated."""
        if self.partial:
            self.feed_event(bytes(self._buf))
        self._buf.clear()

    def complete(self, choices: int = 1) -> bool:
        """Whether the response finished (``response.completed`` or ``.incomplete``)."""
        return self.terminal in _FINISHED

    def closing(self) -> bytes:
        """Nothing: a Responses stream has no end marker of its own."""
        return b""

    def cut(self, message: str, code: str) -> bytes:
        """The terminal ``error`` event for a stream that did not finish, numbered after
        the last event (:func:`proxy.wire.errors.responses_error_event`)."""
        return responses_error_event(message, code, self.sequence_number + 1)

    def unfinished(self) -> str:
        """Why a stream that ended without an error is not :meth:`complete`."""
        return "responses stream ended without a terminal event"

    def feed_event(self, event: bytes) -> None:
        """Account for one complete SSE event."""
        name_b, data = parse_event(event)
        if data is None:
            return
        m = _SEQ.search(data)
        if m is not None:
            self.sequence_number = max(self.sequence_number, int(m.group(1)))
        name = name_b.decode("utf-8", "replace") if name_b is not None else None
        obj: object = None
        if name is None and data:
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                return
            name = obj.get("type") if isinstance(obj, dict) and isinstance(obj.get("type"), str) else None
        if name is None:
            return
        if name.endswith(".delta"):
            self.tokens += 1
            return
        if name not in TERMINAL_EVENTS:
            return
        self.terminal = name
        if obj is None:
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                obj = None
        if name == "error":
            self.status = "error"
            self.error = _error_fields(obj)
            return
        resp = obj.get("response") if isinstance(obj, dict) else None
        usage = _usage_of_response(resp)
        self.status = usage.status or name.removeprefix("response.")
        if usage.output_tokens is not None:
            self.tokens = usage.output_tokens
        if usage.input_tokens is not None:
            self.prompt_tokens = usage.input_tokens
        if name == "response.failed":
            self.error = _error_fields(resp.get("error") if isinstance(resp, dict) else None)


_FINISHED = frozenset({"response.completed", "response.incomplete"})


def _error_fields(obj: object) -> dict:
    """``{"message", "code"}`` of a Responses error object (an ``error`` event, or a
    failed response's ``error``), with a stand-in message when it has none."""
    out = {"message": "the upstream reported an error"}
    if isinstance(obj, dict):
        for k in ("message", "code"):
            if isinstance(obj.get(k), str):
                out[k] = obj[k][:500]
    return out
