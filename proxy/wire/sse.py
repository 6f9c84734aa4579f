"""Server-sent events as LLM engines send them: splitting a byte stream into events,
reading an event's fields, and watching a stream for tokens, usage, its end and errors.

The grammar is the WHATWG HTML standard's (§9.2.6 "Interpreting an event stream"): a line
ends with CRLF, LF or a lone CR; an empty line ends an event; a line that starts with
``:`` is a comment (keep-alive pings); ``field:value`` drops one space after the colon;
several ``data`` lines of one event join with LF. Engines use all of these: LightLLM's
native stream writes ``data:{...}`` with no space, some hosted APIs send ``: ping``
comments and ``event:`` lines, Gemini-style servers end lines with CRLF.

What an OpenAI-style stream means (the OpenAI API reference, "chat completion chunk"):
every choice ends with a chunk whose ``finish_reason`` is set; ``data: [DONE]`` ends the
stream; an in-band failure is an event whose JSON object carries ``error`` (OpenAI, SGLang,
newer vLLM) or is vLLM's older ``{"object": "error", ...}``. With
``stream_options.include_usage`` a last chunk with ``choices: []`` carries ``usage``, and
every other chunk ``"usage": null`` (some engines put the ``usage`` object on the chunk
with the ``finish_reason`` instead; transformers serve does so even unasked). Taking
that usage out again when the client did not ask for it is :mod:`proxy.wire.usage_strip`.
"""

from __future__ import annotations

import re

import orjson

from .errors import sse_error_event

# an event ends at two line ends in a row; a lone CR is a line end too (a CR that is the
# first half of a CRLF split across chunks then ends an empty event: harmless)
EVENT_END = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?!\n)|\n)")
_LINE = re.compile(rb"\r\n|\r|\n")
DONE = b"[DONE]"
DONE_EVENT = b"data: [DONE]\n\n"
MAX_EVENT_BYTES = 16 * 1024 * 1024  # one event may not grow past this (bounds memory)


class EventTooLarge(Exception):
    """An event grew past :data:`MAX_EVENT_BYTES` without ending."""


def split_events(buf: bytearray) -> list[bytes]:
    """Remove the complete events from the front of ``buf`` and return them, each with
    its terminating blank line; an unterminated event stays in ``buf``."""
    out = []
    start = 0
    for m in EVENT_END.finditer(buf):
        out.append(bytes(buf[start : m.end()]))
        start = m.end()
    if start:
        del buf[:start]
    return out


def take_events(buf: bytearray, chunk: bytes) -> list[bytes]:
    """Append ``chunk`` to ``buf`` and return the complete events now at its front
    (:func:`split_events`); what is left is one unterminated event.

    Raises:
        EventTooLarge: that unterminated event grew past :data:`MAX_EVENT_BYTES` (the
            bound on what a stream may make the proxy hold).
    """
    buf += chunk
    events = split_events(buf)
    if len(buf) > MAX_EVENT_BYTES:
        raise EventTooLarge(f"an event grew past {MAX_EVENT_BYTES} bytes without ending")
    return events


def parse_event(raw: bytes) -> tuple[bytes | None, bytes | None]:
    """The ``(event, data)`` fields of one event (its terminator may be included).

    ``data`` is ``None`` for an event with no ``data`` line (a comment, a keep-alive);
    ``event`` is ``None`` when not named. Other fields (``id``, ``retry``) are ignored.
    """
    if raw.startswith(b"data:"):
        body = raw.rstrip(b"\r\n")
        if b"\n" not in body and b"\r" not in body:  # the common one-line event
            value = body[5:]
            return None, value[1:] if value.startswith(b" ") else value
    name = data = None
    for line in _LINE.split(raw):
        if not line or line.startswith(b":"):
            continue
        field, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if field == b"data":
            data = value if data is None else data + b"\n" + value
        elif field == b"event":
            name = value
    return name, data


def event_payloads(buf: bytearray) -> list[bytes]:
    """Remove the complete events from ``buf`` and return their ``data`` (stripped);
    ``[DONE]`` and events without data are left out."""
    out = []
    for ev in split_events(buf):
        _, data = parse_event(ev)
        if data is not None:
            data = data.strip()
            if data and data != DONE:
                out.append(data)
    return out


def _needs_parse(payload: bytes) -> bool:
    """Whether an OpenAI-style ``data`` payload may carry usage, an error or a set
    ``finish_reason``: only those are JSON-parsed.

    Runs on every relayed chunk, so it searches with ``bytes.find``: ``needle in
    payload`` with a ``bytes`` needle takes the buffer-protocol path and costs about
    twice as much on CPython 3.11 (0.40 against 0.20 µs on a 177-byte chunk)."""
    if payload.find(b'"usage"') >= 0 or payload.find(b'"error"') >= 0:
        return True
    i = payload.find(b'"finish_reason"')
    while i != -1:
        if not payload.startswith(b'"finish_reason":null', i):
            return True
        i = payload.find(b'"finish_reason"', i + 15)
    return False


def error_of(obj: object) -> dict | None:
    """The error an OpenAI-style event object reports, or ``None``: ``{"error": {...}}``
    (a truthy ``error``, as the OpenAI SDK tests it) or vLLM's ``{"object": "error"}``."""
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    if err:
        return err if isinstance(err, dict) else {"message": str(err)}
    if obj.get("object") == "error":
        return obj
    return None


class SSEScanner:
    """Follows a relayed stream's events across arbitrary chunk boundaries.

    Args:
        native: True for LightLLM's native ``/generate_stream`` events.

    Attributes:
        tokens: output tokens so far (one per data event, or the engine's own count:
            ``usage.completion_tokens``, LightLLM's ``count_output_tokens``).
        prompt_tokens: from a ``usage`` object (or LightLLM main's token), when seen.
        done: ``data: [DONE]`` was seen.
        finished: a LightLLM native event with ``finished: true`` was seen.
        ended_choices: indexes of the choices whose ``finish_reason`` was set (a
            non-empty string; Ollama sends ``""`` for "not yet").
        error: the error object of an in-band error event, if one was seen.
        events: data events seen (``[DONE]`` and error events excluded).

    Raises (from :meth:`feed`):
        EventTooLarge: an event grew past :data:`MAX_EVENT_BYTES`.
    """

    __slots__ = ("native", "_buf", "tokens", "prompt_tokens", "done", "finished", "ended_choices", "error", "events")
    sse = True  # events the proxy reads (:class:`proxy.relay.relay.StreamScanner`)

    def __init__(self, native: bool = False) -> None:
        self.native = native
        self._buf = bytearray()
        self.tokens = 0
        self.prompt_tokens: int | None = None
        self.done = False
        self.finished = False
        self.ended_choices: set[int] = set()
        self.error: dict | None = None
        self.events = 0

    @property
    def partial(self) -> bool:
        """Bytes of an unterminated event are pending."""
        return bool(self._buf.strip())

    def complete(self, choices: int = 1) -> bool:
        """Whether the stream really finished: LightLLM native: ``finished: true``;
        OpenAI-style: ``[DONE]``, or a ``finish_reason`` on each of ``choices`` choices
        (engines that omit ``[DONE]``: transformers serve, LightLLM's chat route)."""
        if self.native:
            return self.finished
        return self.done or len(self.ended_choices) >= max(1, choices)

    def closing(self) -> bytes:
        """What the relay adds to a stream that really finished (:meth:`complete`):
        ``data: [DONE]`` to an OpenAI-style stream that carried none (the OpenAI SDK and
        most clients wait for it); nothing to LightLLM's native stream, which has no such
        marker."""
        return b"" if self.native or self.done else DONE_EVENT

    def cut(self, message: str, code: str) -> bytes:
        """The terminal event for a stream that did not finish: an OpenAI-style error
        event (``data: {"error": {...}}``), which the OpenAI SDK raises as ``APIError``."""
        return sse_error_event(message, code)

    def unfinished(self) -> str:
        """Why a stream that ended without an error is not :meth:`complete` (for the
        access log)."""
        if self.native:
            return "native stream ended without finished:true"
        if self.events == 0:
            return "stream ended without any event"
        return "stream ended without finish_reason or [DONE]"

    def feed(self, chunk: bytes) -> None:
        """Scan ``chunk``; complete events update the attributes."""
        buf = self._buf
        if not buf and not self.native and chunk.startswith(b"data:") and chunk.endswith(b"\n\n"):
            # the common case, whole one-line data events with nothing to parse: count
            # them without copying (same result as the general path, a third of its cost)
            if chunk.find(b"\n") == len(chunk) - 2:
                n = 1  # one event, one line
            else:
                n = chunk.count(b"\n\n")
                if chunk.count(b"\n") != 2 * n or chunk.count(b"\n\ndata:") != n - 1:
                    n = 0
            # (13 is CR: an int's membership is a memchr, a bytes needle's a slower search)
            if n and 13 not in chunk and chunk.find(b"[DONE]") < 0 and not _needs_parse(chunk):
                self.tokens += n
                self.events += n
                return
        for ev in take_events(buf, chunk):
            self._event(ev)

    def end(self) -> None:
        """The stream ended: read an unterminated last event as if it were terminated
        (the relay terminates it for the client too)."""
        if self.partial:
            self._event(bytes(self._buf))
        self._buf.clear()

    def _event(self, ev: bytes) -> None:
        name, payload = parse_event(ev)
        if payload is None:
            return
        payload = payload.strip()
        if payload == DONE:
            self.done = True
            return
        if self.native:
            self.events += 1
            self._native(payload)
            return
        if name == b"error" or _needs_parse(payload):
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError:
                obj = None
            err = error_of(obj)
            if err is None and name == b"error":
                err = {"message": payload[:500].decode("utf-8", "replace")}
            if err is not None:
                self.error = err
                return
            self.tokens += 1
            self.events += 1
            if isinstance(obj, dict):
                self._object(obj)
            return
        self.tokens += 1
        self.events += 1

    def _object(self, obj: dict) -> None:
        usage = obj.get("usage")
        if isinstance(usage, dict):
            out, prompt = usage.get("completion_tokens"), usage.get("prompt_tokens")
            if _is_count(out):
                self.tokens = out
            if _is_count(prompt):
                self.prompt_tokens = prompt
        choices = obj.get("choices")
        if isinstance(choices, list):
            for ch in choices:
                if isinstance(ch, dict):
                    reason = ch.get("finish_reason")
                    if isinstance(reason, str) and reason:
                        idx = ch.get("index", 0)
                        self.ended_choices.add(idx if isinstance(idx, int) else 0)

    def _native(self, payload: bytes) -> None:
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return
        if not isinstance(obj, dict):
            return
        token = obj.get("token")
        if token is None and (err := error_of(obj)) is not None:
            # not a token: LightLLM v1.2.0 reports a request it cannot run (a prompt too
            # long, say) as an error event after the 200 headers, then ends the stream
            self.error = err
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


class OpaqueStream:
    """A stream of a shape the proxy does not read (a pass-through path's answer): its
    bytes are relayed untouched, nothing is counted, and nothing is ever added.

    Its end is the upstream's: a stream that ended cleanly is finished. One that broke
    gets no event the proxy made up (it cannot know the format): :meth:`cut` returns
    ``None`` and the relay drops the client's connection instead, so the client sees a
    broken transfer, as it would from the engine itself. Same interface as
    :class:`SSEScanner`, for :func:`proxy.relay.relay.relay_stream`.
    """

    __slots__ = ("_ended",)
    sse = False
    tokens = 0
    prompt_tokens: int | None = None
    error: dict | None = None
    partial = False

    def __init__(self) -> None:
        self._ended = False

    def feed(self, chunk: bytes) -> None:
        """Nothing to scan."""

    def end(self) -> None:
        """The stream ended cleanly."""
        self._ended = True

    def complete(self, choices: int = 1) -> bool:
        """A stream that ended cleanly is finished; a broken one never is (the proxy
        cannot see its format's end)."""
        return self._ended

    def closing(self) -> bytes:
        """Nothing is added."""
        return b""

    def cut(self, message: str, code: str) -> None:
        """``None``: drop the client's connection (see the class docstring)."""
        return None

    def unfinished(self) -> str:
        return ""
