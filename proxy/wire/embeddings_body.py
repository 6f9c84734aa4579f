"""The body of ``POST /v1/embeddings`` as admission reads it: its prompt size (an embedding
generates nothing, so admission reserves the prompt alone).

The parser returns :class:`proxy.wire.request_body.ParsedRequest` and takes the same
arguments as the chat and completion parsers, with the same prompt estimate
(:func:`proxy.wire.request_body.text_tokens`).

Source for the shape: the OpenAI API reference and its Python SDK's generated types
(``openai`` 1.x/3.x: ``types/embedding_create_params.py``).
"""

from __future__ import annotations

from .request_body import DEFAULT_COSTS, BadRequest, ParsedRequest, PromptCosts, load_object, text_tokens

#: OpenAI: an embeddings ``input`` array holds at most 2048 entries.
MAX_EMBEDDING_INPUTS = 2048


def _is_token_id(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


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
    obj = load_object(raw)
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
