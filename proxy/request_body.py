"""Parse just enough of a request body to admit it: stream?, max_tokens, prompt size.

The body is forwarded upstream as the client sent it (the raw bytes), so a field this
module does not know passes through untouched.

Prompt size is an estimate (about 4 characters per token for English text, the rule of
thumb OpenAI documents for its tokenizers); the scheduler corrects it with the upstream's
reported ``usage`` when the response ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

CHARS_PER_TOKEN = 4
MESSAGE_OVERHEAD_TOKENS = 4  # role and separators of one chat message


class BadRequest(Exception):
    """The body is not a valid request; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(slots=True)
class ParsedRequest:
    """What admission needs to know about one request.

    Attributes:
        body: the bytes to send upstream.
        stream: whether the client asked for a streamed (SSE) answer.
        max_tokens: the client's output cap (tokens), or ``None`` if it named none.
        prompt_tokens: estimated prompt length (tokens).
        fields: the parsed JSON object.
    """

    body: bytes
    stream: bool
    max_tokens: int | None
    prompt_tokens: int
    fields: dict


def _load_object(raw: bytes) -> dict:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(obj).__name__}")
    return obj


def _opt_int(obj: dict, key: str, minimum: int = 1) -> int | None:
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{key!r} must be an integer, got {type(v).__name__}", key)
    if v < minimum:
        raise BadRequest(f"{key!r} must be >= {minimum}, got {v}", key)
    return v


def _opt_bool(obj: dict, key: str) -> bool:
    v = obj.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(f"{key!r} must be a boolean, got {type(v).__name__}", key)
    return v


def _text_tokens(chars: int) -> int:
    return (chars + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


def _content_chars(content: object, param: str) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        n = 0
        for part in content:
            if isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str):
                    n += len(text)
            elif isinstance(part, str):
                n += len(part)
        return n
    raise BadRequest(f"{param!r} must be a string or a list of content parts", param)


def parse_chat(raw: bytes) -> ParsedRequest:
    """Parse a ``POST /v1/chat/completions`` body.

    Raises:
        BadRequest: not a JSON object; ``messages`` missing, empty or not a list of
            objects; ``stream`` not a boolean; ``max_tokens`` /
            ``max_completion_tokens`` not a positive integer.
    """
    obj = _load_object(raw)
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    chars = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"'messages[{i}]' must be an object", f"messages[{i}]")
        chars += _content_chars(m.get("content"), f"messages[{i}].content")
    # both may be present; count the larger (upstreams differ in which one wins)
    caps = [v for v in (_opt_int(obj, "max_completion_tokens"), _opt_int(obj, "max_tokens")) if v is not None]
    max_tokens = max(caps) if caps else None
    return ParsedRequest(
        body=raw,
        stream=_opt_bool(obj, "stream"),
        max_tokens=max_tokens,
        prompt_tokens=_text_tokens(chars) + MESSAGE_OVERHEAD_TOKENS * len(messages),
        fields=obj,
    )


def parse_completion(raw: bytes) -> ParsedRequest:
    """Parse a ``POST /v1/completions`` body (``prompt``: a string or list of strings).

    Raises:
        BadRequest: as :func:`parse_chat`, for ``prompt`` instead of ``messages``.
    """
    obj = _load_object(raw)
    prompt = obj.get("prompt")
    if isinstance(prompt, str):
        chars = len(prompt)
    elif isinstance(prompt, list) and all(isinstance(p, (str, int)) for p in prompt):
        chars = sum(len(p) if isinstance(p, str) else CHARS_PER_TOKEN for p in prompt)
    else:
        raise BadRequest("'prompt' must be a string or a list of strings", "prompt")
    return ParsedRequest(
        body=raw,
        stream=_opt_bool(obj, "stream"),
        max_tokens=_opt_int(obj, "max_tokens"),
        prompt_tokens=_text_tokens(chars),
        fields=obj,
    )


def parse_generate(raw: bytes, stream: bool) -> ParsedRequest:
    """Parse a LightLLM native ``/generate`` or ``/generate_stream`` body:
    ``{"inputs": str, "parameters": {"max_new_tokens": int, ...}}`` (``parameters`` is
    required by LightLLM). Without ``max_new_tokens`` the request names no limit, like an
    OpenAI request without ``max_tokens``: LightLLM v1.2.0 then generates up to 65535 tokens,
    cut to its length limit (0.0.1: 16), so a group's cap applies
    (``core/objs/sampling_params.py``, ``httpserver/manager.py:_check_and_repair_length``).

    Raises:
        BadRequest: ``inputs`` not a string, ``parameters`` not an object,
            ``max_new_tokens`` not a positive integer.
    """
    obj = _load_object(raw)
    inputs = obj.get("inputs")
    if not isinstance(inputs, str):
        raise BadRequest("'inputs' must be a string", "inputs")
    params = obj.get("parameters")
    if not isinstance(params, dict):
        raise BadRequest("'parameters' must be an object", "parameters")
    max_new = _opt_int(params, "max_new_tokens")
    return ParsedRequest(
        body=raw,
        stream=stream,
        max_tokens=max_new,
        prompt_tokens=_text_tokens(len(inputs)),
        fields=obj,
    )


def cap_max_tokens(parsed: ParsedRequest, cap: int, reject: bool) -> ParsedRequest:
    """Apply a group's ``max_tokens`` cap (tokens) to a parsed request.

    A request asking for more than ``cap`` (or naming no limit, which would let the
    upstream use its own, possibly huge, default) is rewritten to ask for ``cap``: the
    body is re-serialized with the cap in the field the client used (``max_tokens``,
    ``max_completion_tokens``, or LightLLM's ``parameters.max_new_tokens``). Requests
    within the cap pass untouched, bytes and all.

    Raises:
        BadRequest: ``reject`` is true and the request explicitly asked for more.
    """
    if parsed.max_tokens is not None and parsed.max_tokens <= cap:
        return parsed
    fields = dict(parsed.fields)
    if isinstance(fields.get("parameters"), dict) and "inputs" in fields:
        target = fields["parameters"] = dict(fields["parameters"])
        keys = ["max_new_tokens"]
    else:
        target = fields
        keys = [k for k in ("max_tokens", "max_completion_tokens") if target.get(k) is not None] or ["max_tokens"]
    over = [k for k in keys if isinstance(target.get(k), int) and target[k] > cap]
    if reject and over:
        raise BadRequest(f"{over[0]!r} must be at most {cap} for your group, got {target[over[0]]}", over[0])
    for k in keys:
        target[k] = cap
    return ParsedRequest(orjson.dumps(fields), parsed.stream, cap, parsed.prompt_tokens, fields)
