"""Parse just enough of a request body to admit it: stream?, max_tokens, output
multiplier, and how many prompt tokens it will be.

The body is forwarded upstream as the client sent it (the raw bytes), so a field this
module does not know passes through untouched.

The prompt estimate counts everything an engine turns into prompt tokens, because
whatever it leaves out is free for a client to stuff (a 5 000-token prompt hidden in
``tools`` would pass a 3 000 tokens-a-minute limit every time):

* text: every message's content (strings and all text parts), and every other field of
  a message (``name``, ``tool_calls`` with their arguments, ``tool_call_id``, ...), at
  about 4 characters per token (the rule of thumb OpenAI documents for its
  tokenizers), plus :data:`MESSAGE_OVERHEAD_TOKENS` per message for the chat template;
* ``tools``, ``functions``, ``tool_choice``, ``response_format`` (a JSON schema),
  ``prediction``: their JSON text, as chat templates render them into the prompt; and
  vLLM's chat extras that end up in the prompt, ``documents`` (rendered by RAG
  templates), ``chat_template`` (a template of the client's own, its literal text) and
  ``chat_template_kwargs``;
* images (``image_url`` / ``input_image`` parts): a fixed ``cost.image_tokens`` each
  (an image's tokens depend on the model's vision encoder, not on the URL's length);
  audio, video and file parts: ``cost.media_tokens`` each. A part is known by its
  ``type`` first: an image part costs its image, whatever ``text`` it also carries;
* completions: ``prompt`` as a string, a list of strings, a list of token ids (each id
  is one token) or a list of token-id lists, plus ``suffix``;
* LightLLM native: ``inputs``, and ``multimodal_params.images`` at ``cost.image_tokens``
  each (``multimodal_params.audios``, where a version takes them, at
  ``cost.media_tokens``).

The output multiplier (``choices``) is ``max(n, best_of)`` (chat too: vLLM takes
``best_of`` there), times the number of prompts of a batched completions request: each
choice is generated and reserved separately.

Parsing is cheap and bounded: JSON depth is bounded by orjson's parser (1 024 levels);
values are measured by serializing them (C speed), and a value too deep for that is
walked with an explicit stack, never recursion. The scheduler trues the estimate up with
the upstream's reported ``usage`` when the response ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import orjson

CHARS_PER_TOKEN = 4
MESSAGE_OVERHEAD_TOKENS = 4  # role and separators of one chat message
PROMPT_FIELDS = ("tools", "functions", "tool_choice", "response_format", "prediction")
CHAT_EXTRA_FIELDS = ("documents", "chat_template", "chat_template_kwargs")  # vLLM's, rendered into the prompt
IMAGE_PARTS = frozenset({"image_url", "image", "input_image"})
MEDIA_PARTS = frozenset({"input_audio", "audio", "audio_url", "file", "input_file", "video_url", "video"})


class PromptCosts(Protocol):
    """Prompt tokens counted per non-text content part (``cost`` section of the config)."""

    image_tokens: int
    media_tokens: int


@dataclass(frozen=True, slots=True)
class DefaultPromptCosts:
    """The documented defaults of ``cost.image_tokens`` and ``cost.media_tokens``."""

    image_tokens: int = 1024
    media_tokens: int = 1024


DEFAULT_COSTS = DefaultPromptCosts()


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
        max_tokens: the client's output cap per choice (tokens), or ``None`` if it named
            none.
        prompt_tokens: estimated prompt length (tokens).
        fields: the parsed JSON object.
        choices: the output multiplier: ``max(n, best_of)`` times the number of
            prompts (>= 1).
    """

    body: bytes
    stream: bool
    max_tokens: int | None
    prompt_tokens: int
    fields: dict
    choices: int = 1


def load_object(raw: bytes) -> dict:
    """``raw`` parsed as a JSON object (every body parser here starts with it).

    Raises:
        BadRequest: not valid JSON, or JSON but not an object.
    """
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


def opt_bool(obj: dict, key: str) -> bool:
    """``obj[key]`` as a boolean; absent or ``null``: ``False``.

    Raises:
        BadRequest: present and not a boolean (``param`` ``key``).
    """
    v = obj.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(f"{key!r} must be a boolean, got {type(v).__name__}", key)
    return v


def text_tokens(chars: int) -> int:
    """The token estimate of ``chars`` characters of text: ``ceil(chars / CHARS_PER_TOKEN)``."""
    return (chars + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


def json_chars(value: object) -> int:
    """Characters of ``value``'s JSON text (what a template renders into the prompt).

    Serialized by orjson; a value nested deeper than orjson serializes (254 levels) is
    walked with an explicit stack instead: linear in its size, no recursion.
    """
    if isinstance(value, str):
        return len(value)
    try:
        return len(orjson.dumps(value))
    except (orjson.JSONEncodeError, TypeError):
        pass
    n = 0
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            n += len(v) + 2
        elif isinstance(v, dict):
            n += 2
            for k, x in v.items():
                n += len(k) + 4
                stack.append(x)
        elif isinstance(v, list):
            n += 2 + len(v)
            stack.extend(v)
        else:
            n += 8
    return n


def _multiplier(obj: dict, *keys: str) -> int:
    m = 1
    for k in keys:
        v = _opt_int(obj, k)
        if v is not None:
            m = max(m, v)
    return m


def _content(content: object, param: str, costs: PromptCosts) -> tuple[int, int]:
    """(characters, tokens of non-text parts) of one message's ``content``."""
    if content is None:
        return 0, 0
    if isinstance(content, str):
        return len(content), 0
    if not isinstance(content, list):
        raise BadRequest(f"{param!r} must be a string or a list of content parts", param)
    chars = fixed = 0
    for part in content:
        if isinstance(part, str):
            chars += len(part)
        elif isinstance(part, dict):
            kind = part.get("type")  # the type first: an image part with "text": "" is an image
            text = part.get("text")
            if kind in IMAGE_PARTS:
                fixed += costs.image_tokens
            elif kind in MEDIA_PARTS:
                fixed += costs.media_tokens
            elif isinstance(text, str):
                chars += len(text)
            else:  # a refusal, or a part type not known here: its text, all of it
                chars += json_chars(part)
        else:
            chars += json_chars(part)
    return chars, fixed


def parse_chat(raw: bytes, costs: PromptCosts = DEFAULT_COSTS) -> ParsedRequest:
    """Parse a ``POST /v1/chat/completions`` body (see the module docstring for what the
    prompt estimate counts).

    Raises:
        BadRequest: not a JSON object; ``messages`` missing, empty or not a list of
            objects; a ``content`` neither a string nor a list; ``stream`` not a
            boolean; ``max_tokens`` / ``max_completion_tokens`` / ``n`` / ``best_of`` not
            a positive integer.
    """
    obj = load_object(raw)
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    chars = fixed = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"'messages[{i}]' must be an object", f"messages[{i}]")
        c, f = _content(m.get("content"), f"messages[{i}].content", costs)
        chars += c
        fixed += f
        for k, v in m.items():
            if k != "content" and k != "role" and v is not None:
                chars += json_chars(v)
    for k in (*PROMPT_FIELDS, *CHAT_EXTRA_FIELDS):
        v = obj.get(k)
        if v is not None:
            chars += json_chars(v)
    # both may be present; count the larger (upstreams differ in which one wins)
    caps = [v for v in (_opt_int(obj, "max_completion_tokens"), _opt_int(obj, "max_tokens")) if v is not None]
    return ParsedRequest(
        body=raw,
        stream=opt_bool(obj, "stream"),
        max_tokens=max(caps) if caps else None,
        prompt_tokens=text_tokens(chars) + fixed + MESSAGE_OVERHEAD_TOKENS * len(messages),
        fields=obj,
        choices=_multiplier(obj, "n", "best_of"),
    )


def parse_completion(raw: bytes, costs: PromptCosts = DEFAULT_COSTS) -> ParsedRequest:
    """Parse a ``POST /v1/completions`` body: ``prompt`` is a string, a list of strings, a
    list of token ids, or a list of token-id lists (a batch: each prompt gets its own
    ``max(n, best_of)`` choices).

    Raises:
        BadRequest: as :func:`parse_chat`, for ``prompt`` instead of ``messages``, and
            ``best_of`` not a positive integer.
    """
    obj = load_object(raw)
    prompt = obj.get("prompt")
    chars = tokens = 0
    prompts = 1
    if isinstance(prompt, str):
        chars = len(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        tokens = len(prompt)  # token ids: one token each
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        chars = sum(len(p) for p in prompt)
        prompts = max(1, len(prompt))
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in p) for p in prompt):
        tokens = sum(len(p) for p in prompt)
        prompts = len(prompt)
    else:
        raise BadRequest("'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists", "prompt")
    suffix = obj.get("suffix")
    if isinstance(suffix, str):
        chars += len(suffix)
    return ParsedRequest(
        body=raw,
        stream=opt_bool(obj, "stream"),
        max_tokens=_opt_int(obj, "max_tokens"),
        prompt_tokens=text_tokens(chars) + tokens,
        fields=obj,
        choices=_multiplier(obj, "n", "best_of") * prompts,
    )


def parse_generate(raw: bytes, stream: bool, costs: PromptCosts = DEFAULT_COSTS) -> ParsedRequest:
    """Parse a LightLLM native ``/generate`` or ``/generate_stream`` body:
    ``{"inputs": str, "parameters": {"max_new_tokens": int, "best_of": int, "n": int,
    ...}, "multimodal_params": {"images": [{"type": "url" | "base64", "data": ...}, ...]}}``
    (``parameters`` is required by LightLLM; each image costs ``costs.image_tokens``).
    Without ``max_new_tokens`` the request
    names no limit, like an OpenAI request without ``max_tokens``: LightLLM v1.2.0 then
    generates up to 65535 tokens, cut to its length limit (0.0.1: 16), so a group's cap
    applies (``core/objs/sampling_params.py``, ``httpserver/manager.py:_check_and_repair_length``).

    Raises:
        BadRequest: ``inputs`` not a string, ``parameters`` not an object,
            ``max_new_tokens`` / ``best_of`` / ``n`` not a positive integer.
    """
    obj = load_object(raw)
    inputs = obj.get("inputs")
    if not isinstance(inputs, str):
        raise BadRequest("'inputs' must be a string", "inputs")
    params = obj.get("parameters")
    if not isinstance(params, dict):
        raise BadRequest("'parameters' must be an object", "parameters")
    max_new = _opt_int(params, "max_new_tokens")
    fixed = 0
    media = obj.get("multimodal_params")
    if isinstance(media, dict):
        images, audios = media.get("images"), media.get("audios")
        if isinstance(images, list):
            fixed += costs.image_tokens * len(images)
        if isinstance(audios, list):
            fixed += costs.media_tokens * len(audios)
    return ParsedRequest(
        body=raw,
        stream=stream,
        max_tokens=max_new,
        prompt_tokens=text_tokens(len(inputs)) + fixed,
        fields=obj,
        choices=_multiplier(params, "n", "best_of"),
    )


def cap_max_tokens(parsed: ParsedRequest, cap: int, reject: bool) -> ParsedRequest:
    """Apply a group's ``max_tokens`` cap (tokens) to a parsed request.

    A request asking for more than ``cap`` (or naming no limit, which would let the
    upstream use its own, possibly huge, default) is rewritten: the body is
    re-serialized with each limit field the client set (``max_tokens``,
    ``max_completion_tokens``, or LightLLM's ``parameters.max_new_tokens``) lowered to
    at most ``cap`` (a smaller one stays as it is), or, when it set none, with ``cap`` in
    ``max_tokens`` (``max_new_tokens``); the reservation is the largest of them.
    Requests within the cap pass untouched, bytes and all.

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
        v = target.get(k)
        target[k] = min(v, cap) if isinstance(v, int) and not isinstance(v, bool) else cap
    return ParsedRequest(orjson.dumps(fields), parsed.stream, max(target[k] for k in keys), parsed.prompt_tokens, fields, parsed.choices)
