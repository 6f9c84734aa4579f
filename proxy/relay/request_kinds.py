"""The kinds of request the proxy admits (:class:`RequestKind`, one per route: chat,
completions, LightLLM's native routes, embeddings, the Responses API, pass-through), and
the OpenAI routes besides chat and completions: parsing ``POST /v1/embeddings``,
``POST /v1/responses`` and pass-through requests for admission, the start of a prompt for
engine affinity, and reading the Responses API's answers and typed event stream.

Parsers return :class:`proxy.wire.request_body.ParsedRequest` and take the same arguments as
the chat and completion parsers beside them, with the same prompt estimate
(:func:`proxy.wire.request_body.text_tokens`, the same per-image and per-media costs). A
group's output cap is written in the kind's own field (``max_output_tokens`` for
Responses: :func:`cap_max_output_tokens`).

Sources for the shapes: the OpenAI API reference and its Python SDK's generated types
(``openai`` 1.x/3.x: ``types/embedding_create_params.py``, ``types/responses/
response_create_params.py``, ``response_input_item_param.py``, ``response_usage.py``,
``response_stream_event.py``, ``response_error_event.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import orjson

from ..wire.errors import responses_error_event
from ..wire.request_body import (
    DEFAULT_COSTS,
    IMAGE_PARTS,
    MEDIA_PARTS,
    MESSAGE_OVERHEAD_TOKENS,
    BadRequest,
    ParsedRequest,
    PromptCosts,
    cap_max_tokens,
    json_chars,
    parse_chat,
    parse_completion,
    parse_generate,
    text_tokens,
)
from ..wire.sse import OpaqueStream, SSEScanner, parse_event, take_events

if TYPE_CHECKING:
    from ..config.schema import Config
    from .relay import StreamScanner

#: OpenAI: an embeddings ``input`` array holds at most 2048 entries.
MAX_EMBEDDING_INPUTS = 2048
#: Keys whose string values are text the model reads, in Responses input items (message
#: ``content`` and parts' ``text``, ``function_call_output.output``, ``function_call.
#: arguments``); other strings (ids, roles, types, image URLs, file data) are not counted.
_TEXT_KEYS = frozenset({"content", "text", "output", "arguments"})
#: Terminal events of a Responses stream (no ``[DONE]`` follows them).
TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed", "error"})


def _object(raw: bytes) -> dict:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(obj).__name__}")
    return obj


def _opt_bool(obj: dict, key: str) -> bool:
    v = obj.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(f"{key!r} must be a boolean, got {type(v).__name__}", key)
    return v


def _is_token_id(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


# --------------------------------------------------------------- embeddings


def parse_embeddings(raw: bytes, costs: PromptCosts = DEFAULT_COSTS) -> ParsedRequest:
    """Parse a ``POST /v1/embeddings`` body. Admission reserves its prompt alone
    (``max_tokens`` 0: an embedding generates nothing).

    ``input`` is a non-empty string, a list of non-empty strings, a list of token ids, or a
    list of non-empty lists of token ids (at most :data:`MAX_EMBEDDING_INPUTS` entries).
    Prompt size: characters / 4 per string, exact for token ids (``costs`` is taken for
    the parsers' common signature; text-only inputs use none of it).

    Raises:
        BadRequest: not a JSON object, or ``input`` of none of those shapes (``param``
            ``input``).
    """
    obj = _object(raw)
    inp = obj.get("input")
    shapes = "a string, a list of strings, a list of token ids, or a list of lists of token ids"
    if isinstance(inp, str):
        if not inp:
            raise BadRequest("'input' cannot be an empty string", "input")
        tokens = text_tokens(len(inp))
    elif isinstance(inp, list) and inp:
        if len(inp) > MAX_EMBEDDING_INPUTS:
            raise BadRequest(f"'input' may hold at most {MAX_EMBEDDING_INPUTS} entries, got {len(inp)}", "input")
        if all(isinstance(x, str) and x for x in inp):
            tokens = sum(text_tokens(len(x)) for x in inp)
        elif all(_is_token_id(x) for x in inp):
            tokens = len(inp)
        elif all(isinstance(x, list) and x and all(_is_token_id(i) for i in x) for x in inp):
            tokens = sum(len(x) for x in inp)
        else:
            raise BadRequest(f"'input' must be {shapes} (no empty entries)", "input")
    else:
        raise BadRequest(f"'input' must be {shapes}", "input")
    return ParsedRequest(body=raw, stream=False, max_tokens=0, prompt_tokens=tokens, fields=obj)


# ---------------------------------------------------------------- responses


def _input_size(value: object, costs: PromptCosts) -> tuple[int, int]:
    """(characters of model-read text, tokens of images and other media) in a Responses
    ``input`` (see :data:`_TEXT_KEYS`; ``input_image`` parts cost ``costs.image_tokens``
    each, audio and file parts ``costs.media_tokens``), walked without recursion (a
    deeply nested body cannot exhaust the stack). Linear in the size of the value."""
    chars = fixed = 0
    stack: list[tuple[object, bool]] = [(value, False)]
    while stack:
        v, is_text = stack.pop()
        if isinstance(v, str):
            if is_text:
                chars += len(v)
        elif isinstance(v, dict):
            kind = v.get("type")
            if kind in IMAGE_PARTS:
                fixed += costs.image_tokens
                continue
            if kind in MEDIA_PARTS:
                fixed += costs.media_tokens
                continue
            stack.extend((x, k in _TEXT_KEYS) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((x, is_text) for x in v)
    return chars, fixed


#: Top-level Responses fields rendered into the prompt: tool definitions, the tool
#: choice, and ``text`` (its ``format`` may hold a JSON schema).
RESPONSES_PROMPT_FIELDS = ("tools", "tool_choice", "text")


def parse_responses(raw: bytes, costs: PromptCosts = DEFAULT_COSTS) -> ParsedRequest:
    """Parse a ``POST /v1/responses`` body (OpenAI's Responses API).

    ``input``: a string, or a list of input items (objects: messages whose ``content`` is a
    string or a list of parts, function call outputs, ...), or absent (a request that
    continues ``previous_response_id`` or a ``conversation``: the engine adds context this
    estimate cannot see; the real count from ``usage`` corrects it at the end).
    ``instructions``: a string. ``max_output_tokens``: a positive integer or absent (then
    the cost model's default is reserved). ``stream``: a boolean.

    Prompt size: characters of ``instructions``, of the items' text (module
    :data:`_TEXT_KEYS`) and of the JSON of :data:`RESPONSES_PROMPT_FIELDS`, / 4; plus
    ``costs.image_tokens`` per image and ``costs.media_tokens`` per audio or file part;
    plus :data:`proxy.wire.request_body.MESSAGE_OVERHEAD_TOKENS` per item (as for chat,
    :mod:`proxy.wire.request_body`).

    Raises:
        BadRequest: not a JSON object, ``input`` neither a string nor a list of objects,
            ``instructions`` not a string, ``max_output_tokens`` not a positive integer,
            ``stream`` not a boolean (``param`` names the field).
    """
    obj = _object(raw)
    inp = obj.get("input")
    fixed = 0
    if inp is None:
        chars, items = 0, 0
    elif isinstance(inp, str):
        chars, items = len(inp), 1
    elif isinstance(inp, list):
        for i, item in enumerate(inp):
            if not isinstance(item, dict):
                raise BadRequest(f"'input[{i}]' must be an object (an input item)", f"input[{i}]")
        (chars, fixed), items = _input_size(inp, costs), len(inp)
    else:
        raise BadRequest("'input' must be a string or a list of input items", "input")
    instructions = obj.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("'instructions' must be a string", "instructions")
        chars += len(instructions)
    for k in RESPONSES_PROMPT_FIELDS:
        v = obj.get(k)
        if v is not None:
            chars += json_chars(v)
    cap = obj.get("max_output_tokens")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise BadRequest(f"'max_output_tokens' must be a positive integer, got {cap!r}", "max_output_tokens")
    return ParsedRequest(
        body=raw,
        stream=_opt_bool(obj, "stream"),
        max_tokens=cap,
        prompt_tokens=text_tokens(chars) + fixed + MESSAGE_OVERHEAD_TOKENS * items,
        fields=obj,
    )


def cap_max_output_tokens(parsed: ParsedRequest, cap: int, reject: bool) -> ParsedRequest:
    """A group's ``max_tokens`` cap (tokens) applied to a Responses request, as
    :func:`proxy.wire.request_body.cap_max_tokens` does for chat: a request asking for more,
    or for no limit, is rewritten to ask for ``cap`` in ``max_output_tokens``; one
    within the cap passes untouched, bytes and all.

    Raises:
        BadRequest: ``reject`` is true and the request explicitly asked for more.
    """
    if parsed.max_tokens is not None and parsed.max_tokens <= cap:
        return parsed
    if reject and parsed.max_tokens is not None:
        raise BadRequest(f"'max_output_tokens' must be at most {cap} for your group, got {parsed.max_tokens}", "max_output_tokens")
    fields = {**parsed.fields, "max_output_tokens": cap}
    return ParsedRequest(orjson.dumps(fields), parsed.stream, cap, parsed.prompt_tokens, fields)


# -------------------------------------------------------------- pass-through


def parse_passthrough(raw: bytes, cost_tokens: int) -> ParsedRequest:
    """A request to another path under ``/v1/`` (``passthrough`` in the config): its body
    is forwarded as it came, never refused here. When it is a JSON object, its ``model``
    routes it and a boolean ``stream`` says how to relay it; anything else (no body,
    multipart uploads) routes to the default pool. Admission reserves ``cost_tokens``.
    """
    fields: dict = {}
    if raw[:1] in (b"{", b" ", b"\n", b"\t", b"\r"):
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            fields = obj
    stream = fields.get("stream") is True
    return ParsedRequest(body=raw, stream=stream, max_tokens=0, prompt_tokens=cost_tokens, fields=fields)


# ------------------------------------------------------------ prompt prefix


def prompt_prefix(fields: dict, chars: int) -> str | None:
    """The first ``chars`` characters of a request's prompt, for the affinity hash
    (:func:`proxy.routing.router.affinity_key`), or ``None`` when it has no text prompt.

    Chat: each message as ``role: text`` on its own line (a shared system prompt makes a
    shared prefix); completions: ``prompt`` (the first one of a list); Responses:
    ``instructions``, then ``input`` (a string, or its items' text); LightLLM native:
    ``inputs``. Reads only as much of the body as needed.
    """
    if chars <= 0:
        return None
    parts: list[str] = []
    have = 0

    def add(text: str) -> bool:
        nonlocal have
        parts.append(text[: chars - have])
        have += len(parts[-1])
        return have >= chars

    msgs = fields.get("messages")
    if isinstance(msgs, list):
        for m in msgs:
            if isinstance(m, dict) and add(f"{m.get('role')}: {_message_text(m.get('content'))}\n"):
                break
    elif isinstance(fields.get("prompt"), (str, list)):
        p = fields["prompt"]
        first = p if isinstance(p, str) else (p[0] if p and isinstance(p[0], str) else "")
        add(first)
    elif "input" in fields or "instructions" in fields:
        full = isinstance(fields.get("instructions"), str) and add(fields["instructions"] + "\n")
        inp = fields.get("input")
        if full:
            pass
        elif isinstance(inp, str):
            add(inp)
        elif isinstance(inp, list):
            for item in inp:
                if isinstance(item, dict) and add(f"{item.get('role')}: {_message_text(item.get('content'))}\n"):
                    break
    elif isinstance(fields.get("inputs"), str):
        add(fields["inputs"])
    text = "".join(parts)
    return text or None


def _message_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


# ------------------------------------------------------ Responses answers


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


# ------------------------------------------------------------ request kinds


@dataclass(frozen=True, slots=True)
class RequestKind:
    """How one route's requests are read, capped, sent upstream and relayed: the table
    :func:`proxy.api.handlers.handle_generation` follows, one entry per route.

    Attributes:
        name: the kind (``chat``, ``completion``, ``generate``, ``embeddings``,
            ``responses``, ``passthrough``): the access log's ``kind``.
        path: the upstream path; ``None``: the client's own path (pass-through).
        parse: ``(body, config) -> ParsedRequest`` (:class:`proxy.config.schema.Config`).
            Raises :class:`proxy.wire.request_body.BadRequest`.
        cap: applies a group's ``max_tokens`` cap, ``(parsed, cap, reject) ->
            ParsedRequest``; ``None``: nothing for the cap to bound (embeddings,
            pass-through).
        scanner: makes the follower of this kind's stream (:class:`proxy.relay.relay.StreamScanner`).
        proxy_fields: the proxy may add its own stream settings (``stream_options``,
            ``upstream.stream_non_streaming``: :mod:`proxy.relay.upstream_body`); chat and
            completions only.
        native: LightLLM's native routes: the body is never rewritten, and the pool's
            engines must all be ``kind: lightllm``.
        opaque: a pass-through path: any method, the body forwarded as it came (but an
            alias's ``model``), no priority field written, relayed as bytes
            (:class:`proxy.wire.sse.OpaqueStream`), a stream known by its content type.
    """

    name: str
    path: str | None
    parse: Callable[[bytes, "Config"], ParsedRequest]
    cap: Callable[[ParsedRequest, int, bool], ParsedRequest] | None
    scanner: Callable[[], "StreamScanner"]
    proxy_fields: bool = False
    native: bool = False
    opaque: bool = False


CHAT = RequestKind("chat", "/v1/chat/completions", lambda raw, c: parse_chat(raw, c.cost), cap_max_tokens, SSEScanner, proxy_fields=True)
COMPLETION = RequestKind("completion", "/v1/completions", lambda raw, c: parse_completion(raw, c.cost), cap_max_tokens, SSEScanner, proxy_fields=True)
GENERATE = RequestKind("generate", "/generate", lambda raw, c: parse_generate(raw, False, c.cost), cap_max_tokens, lambda: SSEScanner(native=True), native=True)
GENERATE_STREAM = RequestKind("generate", "/generate_stream", lambda raw, c: parse_generate(raw, True, c.cost), cap_max_tokens, lambda: SSEScanner(native=True), native=True)
EMBEDDINGS = RequestKind("embeddings", "/v1/embeddings", lambda raw, c: parse_embeddings(raw, c.cost), None, SSEScanner)
RESPONSES = RequestKind("responses", "/v1/responses", lambda raw, c: parse_responses(raw, c.cost), cap_max_output_tokens, ResponsesStreamScanner)
PASSTHROUGH = RequestKind("passthrough", None, lambda raw, c: parse_passthrough(raw, c.passthrough.cost_tokens), None, OpaqueStream, opaque=True)
