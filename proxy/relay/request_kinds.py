"""The kinds of request the proxy admits (:class:`RequestKind`, one per route: chat,
completions, LightLLM's native routes, embeddings, the Responses API, pass-through): the
table :func:`proxy.api.handlers.handle_generation` follows.

A kind pairs the parser of its body (:mod:`proxy.wire.request_body` for chat, completions
and LightLLM; :mod:`proxy.wire.embeddings_body`, :mod:`proxy.wire.responses_body`,
:mod:`proxy.wire.passthrough_body`) with the scanner that follows its answer
(:class:`proxy.wire.sse.SSEScanner`, :class:`proxy.wire.responses_answer.ResponsesStreamScanner`,
:class:`proxy.wire.sse.OpaqueStream`): a :class:`~proxy.relay.relay.StreamScanner` for the
relay beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..wire.embeddings_body import parse_embeddings
from ..wire.passthrough_body import parse_passthrough
from ..wire.request_body import ParsedRequest, cap_max_tokens, parse_chat, parse_completion, parse_generate
from ..wire.responses_answer import ResponsesStreamScanner
from ..wire.responses_body import cap_max_output_tokens, parse_responses
from ..wire.sse import OpaqueStream, SSEScanner

if TYPE_CHECKING:
    from ..config.schema import Config
    from .relay import StreamScanner

__all__ = ["RequestKind", "CHAT", "COMPLETION", "GENERATE", "GENERATE_STREAM", "EMBEDDINGS", "RESPONSES", "PASSTHROUGH"]


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
