"""The body of a pass-through request (any other path under ``/v1/``, the config's
``passthrough`` section) as admission reads it: forwarded as it came, never refused here.
"""

from __future__ import annotations

import orjson

from .request_body import ParsedRequest


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
