"""The OpenAI routes besides chat and completions: parsing ``POST /v1/embeddings``,
``POST /v1/responses`` and pass-through requests for admission, the start of a prompt for
engine affinity, and reading the Responses API's answers and typed event stream.

Parsers return :class:`proxy.request_body.ParsedRequest`, like the chat and completion
parsers beside them, with the same estimate of prompt size (characters / 4). To unify
with :mod:`proxy.request_body` later: one text-to-tokens estimate (``_tokens`` here,
``_text_tokens`` there), and ``cap_max_tokens`` taking the output-cap field of the kind
(``max_output_tokens`` for Responses: :func:`cap_max_output_tokens` here).

Sources for the shapes: the OpenAI API reference and its Python SDK's generated types
(``openai`` 1.x/3.x: ``types/embedding_create_params.py``, ``types/responses/
response_create_params.py``, ``response_input_item_param.py``, ``response_usage.py``,
``response_stream_event.py``, ``response_error_event.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import orjson

from .request_body import CHARS_PER_TOKEN, MESSAGE_OVERHEAD_TOKENS, BadRequest, ParsedRequest

#: OpenAI: an embeddings ``input`` array holds at most 2048 entries.
MAX_EMBEDDING_INPUTS = 2048
#: Keys whose string values are text the model reads, in Responses input items (message
#: ``content`` and parts' ``text``, ``function_call_output.output``, ``function_call.
#: arguments``); other strings (ids, roles, types, image URLs, file data) are not counted.
_TEXT_KEYS = frozenset({"content", "text", "output", "arguments"})
#: Terminal events of a Responses stream (no ``[DONE]`` follows them).
TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed", "error"})


def _tokens(chars: int) -> int:
    return (chars + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


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


def parse_embeddings(raw: bytes) -> ParsedRequest:
    """Parse a ``POST /v1/embeddings`` body. Admission reserves its prompt alone
    (``max_tokens`` 0: an embedding generates nothing).

    ``input`` is a non-empty string, a list of non-empty strings, a list of token ids, or a
    list of non-empty lists of token ids (at most :data:`MAX_EMBEDDING_INPUTS` entries).
    Prompt size: characters / 4 per string, exact for token ids.

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
        tokens = _tokens(len(inp))
    elif isinstance(inp, list) and inp:
        if len(inp) > MAX_EMBEDDING_INPUTS:
            raise BadRequest(f"'input' may hold at most {MAX_EMBEDDING_INPUTS} entries, got {len(inp)}", "input")
        if all(isinstance(x, str) and x for x in inp):
            tokens = sum(_tokens(len(x)) for x in inp)
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


def _text_chars(value: object) -> int:
    """Characters of model-read text in a Responses ``input`` item (see
    :data:`_TEXT_KEYS`), walked without recursion (a deeply nested body cannot exhaust
    the stack). Linear in the size of the value."""
    chars = 0
    stack: list[tuple[object, bool]] = [(value, False)]
    while stack:
        v, is_text = stack.pop()
        if isinstance(v, str):
            if is_text:
                chars += len(v)
        elif isinstance(v, dict):
            stack.extend((x, k in _TEXT_KEYS) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((x, is_text) for x in v)
    return chars


def parse_responses(raw: bytes) -> ParsedRequest:
    """Parse a ``POST /v1/responses`` body (OpenAI's Responses API).

    ``input``: a string, or a list of input items (objects: messages whose ``content`` is a
    string or a list of parts, function call outputs, ...), or absent (a request that
    continues ``previous_response_id`` or a ``conversation``: the engine adds context this
    estimate cannot see; the real count from ``usage`` corrects it at the end).
    ``instructions``: a string. ``max_output_tokens``: a positive integer or absent (then
    the cost model's default is reserved). ``stream``: a boolean.

    Prompt size: characters of ``instructions`` and of the items' text (module
    :data:`_TEXT_KEYS`) / 4, plus :data:`proxy.request_body.MESSAGE_OVERHEAD_TOKENS` per item.

    Raises:
        BadRequest: not a JSON object, ``input`` neither a string nor a list of objects,
            ``instructions`` not a string, ``max_output_tokens`` not a positive integer,
            ``stream`` not a boolean (``param`` names the field).
    """
    obj = _object(raw)
    inp = obj.get("input")
    if inp is None:
        chars, items = 0, 0
    elif isinstance(inp, str):
        chars, items = len(inp), 1
    elif isinstance(inp, list):
        for i, item in enumerate(inp):
            if not isinstance(item, dict):
                raise BadRequest(f"'input[{i}]' must be an object (an input item)", f"input[{i}]")
        chars, items = _text_chars(inp), len(inp)
    else:
        raise BadRequest("'input' must be a string or a list of input items", "input")
    instructions = obj.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("'instructions' must be a string", "instructions")
        chars += len(instructions)
    cap = obj.get("max_output_tokens")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise BadRequest(f"'max_output_tokens' must be a positive integer, got {cap!r}", "max_output_tokens")
    return ParsedRequest(
        body=raw,
        stream=_opt_bool(obj, "stream"),
        max_tokens=cap,
        prompt_tokens=_tokens(chars) + MESSAGE_OVERHEAD_TOKENS * items,
        fields=obj,
    )


def cap_max_output_tokens(parsed: ParsedRequest, cap: int, reject: bool) -> ParsedRequest:
    """A group's ``max_tokens`` cap (tokens) applied to a Responses request, as
    :func:`proxy.request_body.cap_max_tokens` does for chat: a request asking for more,
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
    (:func:`proxy.router.affinity_key`), or ``None`` when it has no text prompt.

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


def sse_fields(event: bytes) -> tuple[str | None, bytes]:
    """The ``event:`` name (or ``None``) and the ``data:`` payload of one SSE event (its
    lines, as :func:`proxy.sse.split_events` returns it): several ``data:`` lines join with
    ``\\n``; one space after the colon is dropped; comments and other fields are ignored
    (WHATWG HTML, "Server-sent events", event stream interpretation)."""
    name: str | None = None
    data: list[bytes] = []
    for line in event.splitlines():
        field, sep, value = line.partition(b":")
        if not sep or not field:
            continue  # a comment (":...") or a line without a colon
        if value.startswith(b" "):
            value = value[1:]
        if field == b"event":
            name = value.decode("utf-8", "replace")
        elif field == b"data":
            data.append(value)
    return name, b"\n".join(data)


_SEQ = re.compile(rb'"sequence_number"\s*:\s*(\d{1,18})')


class ResponsesStreamScanner:
    """Follows a Responses API event stream, one event at a time, for accounting and to
    tell a real finish from a cut.

    Every event whose type ends in ``.delta`` (output text, refusal, reasoning, function
    call arguments, ...) counts as one output token until ``usage`` gives the real
    count. The stream has ended normally once a terminal event (:data:`TERMINAL_EVENTS`:
    ``response.completed``, ``response.incomplete``, ``response.failed``, ``error``) was
    seen; the engine sends no ``[DONE]`` and the proxy must add none. Only terminal events
    (and events without an ``event:`` line) are JSON-parsed.

    Attributes:
        tokens: output tokens so far (deltas, then ``usage.output_tokens``).
        prompt_tokens: ``usage.input_tokens`` once reported.
        terminal: the terminal event's type, or ``None`` while the stream is open.
        status: the final response's ``status`` (``completed``, ``incomplete``,
            ``failed``) or ``error``.
        sequence_number: the highest ``sequence_number`` seen (-1: none); a terminal error
            event the proxy appends uses the next one
            (:func:`proxy.errors.responses_error_event`).
    """

    __slots__ = ("tokens", "prompt_tokens", "terminal", "status", "sequence_number")

    def __init__(self) -> None:
        self.tokens = 0
        self.prompt_tokens: int | None = None
        self.terminal: str | None = None
        self.status: str | None = None
        self.sequence_number = -1

    @property
    def finished(self) -> bool:
        """Whether a terminal event was seen."""
        return self.terminal is not None

    def feed_event(self, event: bytes) -> None:
        """Account for one complete SSE event."""
        name, data = sse_fields(event)
        m = _SEQ.search(data)
        if m is not None:
            self.sequence_number = max(self.sequence_number, int(m.group(1)))
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
        if name == "error":
            self.status = "error"
            return
        if obj is None:
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                return
        usage = _usage_of_response(obj.get("response") if isinstance(obj, dict) else None)
        self.status = usage.status or name.removeprefix("response.")
        if usage.output_tokens is not None:
            self.tokens = usage.output_tokens
        if usage.input_tokens is not None:
            self.prompt_tokens = usage.input_tokens
