"""The body of ``POST /v1/responses`` (OpenAI's Responses API) as admission reads it: its
prompt size, its output cap (``max_output_tokens``), and a group's cap written into it.

The parser returns :class:`proxy.wire.request_body.ParsedRequest` and takes the same
arguments as the chat and completion parsers, with the same prompt estimate
(:func:`proxy.wire.request_body.text_tokens`, the same per-image and per-media costs). A
group's output cap is written in the Responses field, ``max_output_tokens``
(:func:`cap_max_output_tokens`). Its answers are read by :mod:`proxy.wire.responses_answer`.

Sources for the shapes: the OpenAI API reference and its Python SDK's generated types
(``openai`` 1.x/3.x: ``types/responses/response_create_params.py``,
``response_input_item_param.py``).
"""

from __future__ import annotations

import orjson

from .request_body import (
    DEFAULT_COSTS,
    IMAGE_PARTS,
    MEDIA_PARTS,
    MESSAGE_OVERHEAD_TOKENS,
    BadRequest,
    ParsedRequest,
    PromptCosts,
    json_chars,
    load_object,
    opt_bool,
    text_tokens,
)

#: Keys whose string values are text the model reads, in Responses input items (message
#: ``content`` and parts' ``text``, ``function_call_output.output``, ``function_call.
#: arguments``); other strings (ids, roles, types, image URLs, file data) are not counted.
_TEXT_KEYS = frozenset({"content", "text", "output", "arguments"})

#: Top-level Responses fields rendered into the prompt: tool definitions, the tool
#: choice, and ``text`` (its ``format`` may hold a JSON schema).
RESPONSES_PROMPT_FIELDS = ("tools", "tool_choice", "text")


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
    obj = load_object(raw)
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
        stream=opt_bool(obj, "stream"),
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
