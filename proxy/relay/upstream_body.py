"""The request body the proxy sends upstream: the client's, plus the proxy's own additions.

The proxy adds to a client's body only for its own bookkeeping, and only on the OpenAI
routes:

* ``upstream.stream_non_streaming``: a non-streaming request is sent with
  ``stream: true`` and ``stream_options.include_usage: true`` and the answer assembled in
  the proxy (:mod:`proxy.relay.assemble`);
* ``upstream.stream_usage``: a streaming request whose client did not ask for
  ``stream_options.include_usage`` is sent with it, so the engine reports the real token
  count that trues up the fair-share counters; the relay removes that usage again
  (:class:`proxy.wire.usage_strip.UsageStripper`).

An engine may reject ``stream_options`` (an older server with a strict schema). The
proxy then does not pass that 400 on for a valid request: when the rejection (400, 417
or 422) names ``stream_options`` or ``include_usage`` in its body, as schema validators
do (pydantic's ``loc``, OpenAI's ``param``), it sends the request once more without
``stream_options`` and, when that one is accepted, remembers per upstream not to add it
again (:class:`proxy.relay.upstream.Upstream`'s ``accepts_stream_options``, logged once). Why
retry rather than probe first: no start-up dependency on the engine or its model name,
no probe traffic, and a rejection costs one round trip once per upstream; a validation
error is answered before any generation starts, so the second attempt never doubles
one. A rejection that names neither (the client's own bad field) is relayed at once and
turns nothing off; so is a second rejection.
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
import orjson

from ..config.schema import UpstreamConfig
from ..wire.request_body import BadRequest, ParsedRequest
from .upstream import Upstream, UpstreamError

# statuses with which engines refuse a request's shape before generating: OpenAI-style
# 400, FastAPI/pydantic 422, LightLLM 417
REJECTED = frozenset({400, 417, 422})


@dataclass(frozen=True, slots=True)
class UpstreamBody:
    """What to send upstream for one request.

    Attributes:
        body: the bytes to send.
        fallback: the same request without the proxy's ``stream_options``, to send if the
            engine rejects ``body``; ``None`` when the proxy added no ``stream_options``.
        strip_usage: the proxy asked for usage on a stream whose client did not: the
            relay removes it.
        assemble: the client asked for no stream; the upstream streams and the proxy
            assembles the answer.
    """

    body: bytes
    fallback: bytes | None = None
    strip_usage: bool = False
    assemble: bool = False

    def without_stream_options(self) -> "UpstreamBody":
        """This request as sent after the engine rejected ``stream_options``."""
        assert self.fallback is not None
        return UpstreamBody(self.fallback, None, False, self.assemble)


def names_stream_options(body: bytes) -> bool:
    """Whether an engine's rejection body names the proxy's addition."""
    return b"stream_options" in body or b"include_usage" in body


def stream_options_of(fields: dict) -> dict | None:
    """The client's ``stream_options`` (``None`` when absent or null).

    Raises:
        BadRequest: it is neither an object nor null (OpenAI answers 400 too).
    """
    opts = fields.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise BadRequest(f"'stream_options' must be an object, got {type(opts).__name__}", "stream_options")
    return opts


def choices_of(fields: dict) -> int:
    """How many choices the request asks for (``n``, 1 when absent or not a count)."""
    n = fields.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 128 else 1


def plan_upstream_body(parsed: ParsedRequest, config: UpstreamConfig, accepts_stream_options: bool) -> UpstreamBody:
    """The body to send upstream for ``parsed`` (see the module docstring).

    Args:
        parsed: the client's parsed request (after any ``max_tokens`` cap).
        config: the ``upstream`` section.
        accepts_stream_options: whether this upstream has not rejected ``stream_options``.

    Only for chat and completions (:attr:`proxy.relay.request_kinds.RequestKind.proxy_fields`):
    other kinds' bodies go as they are.

    Raises:
        BadRequest: ``stream_options`` is not an object.
    """
    fields = parsed.fields
    opts = stream_options_of(fields)
    if not parsed.stream and config.stream_non_streaming:
        plain = orjson.dumps({**fields, "stream": True})
        if not accepts_stream_options:
            return UpstreamBody(plain, assemble=True)
        body = orjson.dumps({**fields, "stream": True, "stream_options": {**(opts or {}), "include_usage": True}})
        return UpstreamBody(body, plain, assemble=True)
    if parsed.stream and config.stream_usage and accepts_stream_options and not (opts or {}).get("include_usage"):
        body = orjson.dumps({**fields, "stream_options": {**(opts or {}), "include_usage": True}})
        return UpstreamBody(body, parsed.body, strip_usage=True)
    return UpstreamBody(parsed.body)


async def open_upstream(
    up: Upstream,
    method: str,
    path: str,
    plan: UpstreamBody,
    *,
    request_id: str,
    query: str,
    native: bool,
    trace: dict[str, str],
    body_headers: dict[str, str | None] | None = None,
) -> tuple[aiohttp.ClientResponse, UpstreamBody]:
    """Open the upstream request for ``plan`` on the engine ``up`` reaches
    (``body_headers``: the client's ``Content-Type`` and ``Accept`` for a pass-through
    body, ``None`` values left out; see :meth:`proxy.relay.upstream.Upstream.open`). An
    engine that rejects the proxy's own ``stream_options`` (a 400/417/422 whose body names
    it) gets the request once more without them (the module docstring); a native route's
    body is never retried.

    Returns:
        ``(response, plan)``: the upstream response, body unread (or read in full and
        kept, for a rejection relayed as it is), and the plan it was sent with.

    Raises:
        UpstreamError: as :meth:`proxy.relay.upstream.Upstream.open`; and 502
            ``upstream_error`` when the upstream fails while sending the rejection's body
            (a reset, a short body, ``idle_timeout_s`` of silence).
    """
    # body headers come only with a pass-through request, whose path is a client's: not cached
    upstream = await up.open(method, path, plan.body, query=query, request_id=request_id, trace=trace, body_headers=body_headers, cached=body_headers is None)
    if plan.fallback is None or native or upstream.status not in REJECTED:
        return upstream, plan
    try:
        body = await upstream.read()  # a refusal, before any generation; kept for relaying
    except (aiohttp.ClientError, TimeoutError) as e:
        # the upstream's failure (ClientPayloadError, aiohttp's ClientConnectionResetError,
        # an idle timeout), never the client's: a JSON 502, not aiohttp's text/plain 500
        upstream.close()
        raise UpstreamError(502, "upstream_error", f"the upstream failed while sending its answer: {type(e).__name__}", aborted=True) from None
    except BaseException:
        upstream.close()
        raise
    if not names_stream_options(body):
        return upstream, plan  # the client's own request was refused: relay that
    upstream.release()
    first = upstream.status
    plan = plan.without_stream_options()
    upstream = await up.open(method, path, plan.body, query=query, request_id=request_id, trace=trace)
    if upstream.status not in REJECTED:
        up.reject_stream_options(first)
    return upstream, plan
