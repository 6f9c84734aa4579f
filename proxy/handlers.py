"""Route handlers: admit, relay, account. Thin; the logic lives in the modules they call.

The life of a completion request (``handle_generation``):

1. read and parse the body (400 on bad input, 413 over ``limits.max_body_bytes``);
2. resolve the caller (401 if ``require_api_key`` and no known key);
3. wait for admission (429 rate limit / queue full / timeout, 503 evicted / shutdown);
4. open the upstream request, once (502 unreachable or closed without an answer, 504
   no headers in time; :mod:`proxy.upstream`), with the body :mod:`proxy.upstream_body`
   plans;
5. relay the answer (:mod:`proxy.relay`, :mod:`proxy.assemble`); 6. release the slot
   exactly once, in ``finally``, with the real token counts; abort the upstream by
   closing its connection unless its answer was read to the end;
7. log one access line (:func:`_log_access`), whatever the answer.

A client that disconnects cancels the handler task (aiohttp ``handler_cancellation``),
which lands in the same ``finally`` wherever the request is: queued, waiting for the
upstream's first byte, mid-stream, or waiting for a non-streaming body.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import aiohttp
import orjson
from aiohttp import web

from qos import RefusalReason, Refused

from . import metrics as m
from .assemble import relay_assembled
from .errors import error_response
from .relay import Exchange, relay_body, relay_stream
from .relay_headers import DECODED_CODINGS, REQUEST_ID, client_headers, content_coding, request_id_of
from .request_body import BadRequest, ParsedRequest, PromptCosts, cap_max_tokens, parse_chat, parse_completion, parse_generate
from .sse import EventTooLarge
from .state import ProxyState
from .upstream import UpstreamError
from .upstream_body import REJECTED, UpstreamBody, choices_of, names_stream_options, plan_upstream_body

STATE = web.AppKey("llm_qos_state", ProxyState)
access_log = logging.getLogger("llm_qos.access")
log = logging.getLogger("llm_qos.proxy")

_SERVICE_UNAVAILABLE = {RefusalReason.EVICTED, RefusalReason.SHUTDOWN}
_NOTHING_SERVED = {m.OUTCOME_UPSTREAM_ERROR, m.OUTCOME_BAD_REQUEST}  # with no output token
CLIENT_CLOSED = 499  # the access log's status for a client that left before any answer (nginx's)
MODEL_CHARS = 128  # a body's model name is logged up to this length


def _refusal_response(r: Refused) -> web.Response:
    if r.reason is RefusalReason.TOO_LARGE:  # no retry can help
        return error_response(400, r.detail, code=r.reason.value, param="max_tokens")
    status = 503 if r.reason in _SERVICE_UNAVAILABLE else 429
    extra = {"scope": r.scope, "limit": r.limit} if r.scope else None  # which rate limit tripped
    return error_response(status, r.detail, code=r.reason.value, retry_after_s=r.retry_after_s, extra=extra)


async def handle_generation(
    request: web.Request, parse: Callable[[bytes, PromptCosts], ParsedRequest], path: str, native: bool = False
) -> web.StreamResponse:
    """Admit, forward and relay one generation request to ``path`` upstream; every
    answer carries ``X-Request-Id`` and makes one access-log line."""
    loop = asyncio.get_running_loop()
    ex = Exchange(arrived_at=loop.time(), request_id=request_id_of(request.headers))
    try:
        resp = await _generation(request, ex, parse, path, native)
        if not resp.prepared:
            if REQUEST_ID not in resp.headers:
                resp.headers[REQUEST_ID] = ex.request_id
            ex.status = resp.status
        return resp
    except asyncio.CancelledError:
        ex.status = ex.status or CLIENT_CLOSED
        raise
    except Exception:
        ex.status = ex.status or 500
        raise
    finally:
        # the access line after the response has gone out, off its latency
        loop.call_soon(_log_access, ex, loop.time())


async def _generation(
    request: web.Request, ex: Exchange, parse: Callable[[bytes], ParsedRequest], path: str, native: bool
) -> web.StreamResponse:
    state = request.app[STATE]
    active = state.active  # one config for the whole request
    loop = asyncio.get_running_loop()
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        ex.outcome, ex.detail = m.OUTCOME_BAD_REQUEST, "body_too_large"
        return error_response(413, f"the body exceeds {state.max_body_bytes} bytes", code="body_too_large")
    except Exception as e:  # a body that cannot be decoded (bad Content-Encoding, broken chunking)
        ex.outcome, ex.detail = m.OUTCOME_BAD_REQUEST, "invalid_body"
        return error_response(400, f"the request body could not be read: {type(e).__name__}", code="invalid_body")
    ident = active.identity.resolve(request.headers)
    ex.user = ident.user_id
    if active.identity.require_api_key and not ident.authenticated:
        ex.outcome, ex.detail = m.OUTCOME_REFUSED, "invalid_api_key"
        return error_response(401, "a valid API key is required (Authorization: Bearer KEY)", code="invalid_api_key")
    group_name = ex.group = ident.group or active.config.default_group
    upstream_cfg = active.config.upstream
    try:
        parsed = parse(raw, active.config.cost)
        cap = active.config.group(group_name).max_tokens
        if cap is not None:
            parsed = cap_max_tokens(parsed, cap, active.config.limits.max_tokens_action == "reject")
        plan = plan_upstream_body(parsed, upstream_cfg, state.upstream.accepts_stream_options, native)
    except BadRequest as e:
        state.metrics.requests.labels(group_name, m.OUTCOME_BAD_REQUEST).inc()
        ex.outcome, ex.detail = m.OUTCOME_BAD_REQUEST, e.param or "invalid_request"
        return error_response(400, e.message, code="invalid_request", param=e.param)
    model = parsed.fields.get("model")
    if isinstance(model, str):
        ex.model = model[:MODEL_CHARS]

    admission = state.admission
    try:
        ticket = await admission.acquire(ident.user_id, None, parsed.prompt_tokens, parsed.max_tokens, parsed.choices)
    except Refused as r:
        ex.queue_wait = loop.time() - ex.arrived_at
        state.metrics.rejections.labels(group_name, r.reason.value).inc()
        state.metrics.requests.labels(group_name, m.OUTCOME_REFUSED).inc()
        ex.outcome, ex.detail = m.OUTCOME_REFUSED, r.reason.value
        return _refusal_response(r)
    except asyncio.CancelledError:
        ex.queue_wait = loop.time() - ex.arrived_at
        state.metrics.requests.labels(group_name, m.OUTCOME_CLIENT_GONE).inc()
        ex.outcome, ex.detail = m.OUTCOME_CLIENT_GONE, "while queued"
        raise

    ex.group = ticket.group
    ex.queue_wait = loop.time() - ex.arrived_at
    upstream = None
    aborted = False
    query = raw_query(request)
    try:
        try:
            upstream, plan = await _open(state, path, plan, ex, query, native)
        except UpstreamError as e:
            ex.outcome, ex.detail = m.OUTCOME_UPSTREAM_ERROR, e.code
            aborted = e.aborted
            return error_response(e.status, e.message, code=e.code)
        except asyncio.CancelledError:
            aborted = True  # the client left while the proxy waited for the upstream's headers
            raise
        coding = content_coding(upstream.headers)
        if coding not in DECODED_CODINGS:
            ex.outcome, ex.detail = m.OUTCOME_UPSTREAM_ERROR, "upstream_bad_response"
            return error_response(502, f"the upstream answered with Content-Encoding {coding!r}, which the proxy cannot decode", code="upstream_bad_response")
        is_json = "json" in upstream.headers.get("Content-Type", "").lower()
        if parsed.stream and upstream.status == 200 and not is_json:
            progress = lambda n: admission.scheduler.record_output(ticket, n)  # noqa: E731
            return await relay_stream(
                request,
                upstream,
                ex,
                progress,
                native=native,
                write_timeout_s=active.config.limits.client_write_timeout_s,
                choices=choices_of(parsed.fields),
                strip_usage=plan.strip_usage,
            )
        try:
            if upstream.status == 417 and (native or upstream_cfg.kind == "lightllm"):  # LightLLM's validation errors, any route
                body = await upstream.read()
                ex.upstream_ended = True  # read in full: nothing to abort
                ex.outcome = m.OUTCOME_BAD_REQUEST
                return error_response(400, _message_of(body), code="invalid_request")
            if plan.assemble and upstream.status == 200 and not is_json:
                return await relay_assembled(upstream, ex, chat=path == "/v1/chat/completions", choices=choices_of(parsed.fields))
            return await relay_body(upstream, ex, native=native)
        except (aiohttp.ClientError, TimeoutError, EventTooLarge) as e:
            ex.outcome, ex.detail = m.OUTCOME_UPSTREAM_ERROR, type(e).__name__
            return error_response(502, "the upstream failed while sending its answer", code="upstream_error")
    except (asyncio.CancelledError, ConnectionResetError):
        ex.outcome, ex.detail = m.OUTCOME_CLIENT_GONE, "client disconnected"
        raise
    finally:
        if upstream is not None:
            if ex.upstream_ended:
                upstream.release()
            else:
                upstream.close()  # aborts the generation upstream
                aborted = True
        if aborted:
            state.metrics.upstream_aborts.labels(ex.outcome or m.ABORT_UNKNOWN).inc()
        if ex.output_tokens == 0 and ex.outcome in _NOTHING_SERVED:
            ex.prompt_tokens = 0  # the upstream refused or failed before any token: charge nothing
        admission.release(ticket, ex.prompt_tokens, ex.output_tokens)
        # metrics after the response has gone out, off its latency
        loop.call_soon(_account, state, ex, parsed)


async def _open(
    state: ProxyState, path: str, plan: UpstreamBody, ex: Exchange, query: str, native: bool
) -> tuple[aiohttp.ClientResponse, UpstreamBody]:
    """Open the upstream request for ``plan``. An engine that rejects the proxy's own
    ``stream_options`` (a 400/417/422 whose body names it) gets the request once more
    without them (``proxy.upstream_body``).

    Raises:
        UpstreamError: as :meth:`proxy.upstream.Upstream.open`.
    """
    up = state.upstream
    upstream = await up.open("POST", path, plan.body, query=query, request_id=ex.request_id)
    if plan.fallback is None or native or upstream.status not in REJECTED:
        return upstream, plan
    try:
        body = await upstream.read()  # a refusal, before any generation; kept for relaying
    except BaseException:
        upstream.close()
        raise
    if not names_stream_options(body):
        return upstream, plan  # the client's own request was refused: relay that
    upstream.release()
    first = upstream.status
    plan = plan.without_stream_options()
    upstream = await up.open("POST", path, plan.body, query=query, request_id=ex.request_id)
    if upstream.status not in REJECTED:
        up.reject_stream_options(first)
    return upstream, plan


def raw_query(request: web.Request) -> str:
    """The client's query string exactly as it sent it (still percent-encoded; the
    parsed ``rel_url`` would decode ``%2F`` and the like)."""
    return request.raw_path.partition("?")[2]


def _message_of(body: bytes) -> str:
    """The message of a LightLLM error body: ``{"message"}`` (0.0.1) or ``{"error":
    {"message"}}`` (v1.2.0, ``api_errors.create_error_response``); else the body's start."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        obj = None
    if isinstance(obj, dict):
        inner = obj.get("error")
        for msg in (obj.get("message"), inner.get("message") if isinstance(inner, dict) else None):
            if isinstance(msg, str):
                return msg
    return body[:500].decode("utf-8", "replace") or "the upstream rejected the request"


def _account(state: ProxyState, ex: Exchange, parsed: ParsedRequest) -> None:
    met = state.metrics
    group = ex.group
    met.queue_wait.labels(group).observe(ex.queue_wait or 0.0)
    met.requests.labels(group, ex.outcome or m.OUTCOME_UPSTREAM_ERROR).inc()
    if ex.first_byte_at is not None:
        met.ttft.labels(group).observe(ex.first_byte_at - ex.arrived_at)
    met.tokens.labels(group, "prompt").inc(ex.prompt_tokens if ex.prompt_tokens is not None else parsed.prompt_tokens)
    met.tokens.labels(group, "completion").inc(ex.output_tokens)


def _log_access(ex: Exchange, now: float) -> None:
    """One JSON object per request on the ``llm_qos.access`` logger (never a key, a
    prompt or an answer)."""
    if not access_log.isEnabledFor(logging.INFO):
        return
    line = orjson.dumps(
        {
            "ts": round(time.time(), 3),
            "request_id": ex.request_id,
            "upstream_request_id": ex.upstream_request_id,
            "user": ex.user or None,
            "group": ex.group or None,
            "model": ex.model,
            "status": ex.status,
            "outcome": ex.outcome or m.OUTCOME_UPSTREAM_ERROR,
            "detail": ex.detail or None,
            "queue_wait_s": None if ex.queue_wait is None else round(ex.queue_wait, 4),
            "ttft_s": None if ex.first_byte_at is None else round(ex.first_byte_at - ex.arrived_at, 4),
            "duration_s": round(now - ex.arrived_at, 4),
            "prompt_tokens": ex.prompt_tokens,
            "output_tokens": ex.output_tokens,
        }
    ).decode()
    # a record made directly: no caller lookup (logger.info's stack walk) for a line whose
    # source is always this function
    access_log.handle(logging.LogRecord(access_log.name, logging.INFO, __file__, 0, line, None, None))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions`` (streaming and not)."""
    return await handle_generation(request, parse_chat, "/v1/chat/completions")


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions`` (streaming and not)."""
    return await handle_generation(request, parse_completion, "/v1/completions")


def _native_unavailable(request: web.Request) -> web.Response | None:
    if request.app[STATE].active.config.upstream.kind != "lightllm":
        return error_response(404, f"{request.path} is LightLLM's native route; this proxy's upstream.kind is not lightllm", code="not_found")
    return None


async def generate(request: web.Request) -> web.StreamResponse:
    """LightLLM native ``POST /generate`` (404 unless ``upstream.kind`` is lightllm)."""
    if (unavailable := _native_unavailable(request)) is not None:
        return unavailable
    return await handle_generation(request, lambda raw, costs: parse_generate(raw, False, costs), "/generate", native=True)


async def generate_stream(request: web.Request) -> web.StreamResponse:
    """LightLLM native ``POST /generate_stream`` (404 unless ``upstream.kind`` is lightllm)."""
    if (unavailable := _native_unavailable(request)) is not None:
        return unavailable
    return await handle_generation(request, lambda raw, costs: parse_generate(raw, True, costs), "/generate_stream", native=True)


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models`` (and ``HEAD``), passed through from the upstream with its query
    string and end-to-end headers (401 without a known key when
    ``identity.require_api_key`` is on); every answer carries ``X-Request-Id``."""
    rid = request_id_of(request.headers)
    resp = await _models(request, rid)
    if REQUEST_ID not in resp.headers:
        resp.headers[REQUEST_ID] = rid
    return resp


async def _models(request: web.Request, rid: str) -> web.Response:
    state = request.app[STATE]
    active = state.active
    if active.identity.require_api_key and not active.identity.resolve(request.headers).authenticated:
        return error_response(401, "a valid API key is required (Authorization: Bearer KEY)", code="invalid_api_key")
    try:
        upstream = await state.upstream.open("GET", "/v1/models", query=raw_query(request), request_id=rid)
    except UpstreamError as e:
        return error_response(e.status, e.message, code=e.code)
    coding = content_coding(upstream.headers)
    if coding not in DECODED_CODINGS:
        upstream.close()
        return error_response(502, f"the upstream answered with Content-Encoding {coding!r}, which the proxy cannot decode", code="upstream_bad_response")
    try:
        body = await upstream.read()
    except (aiohttp.ClientError, TimeoutError):
        upstream.close()
        return error_response(502, "the upstream failed while sending its answer", code="upstream_error")
    upstream.release()
    headers = client_headers(upstream.headers, rid)
    if "Content-Type" not in headers:
        headers["Content-Type"] = "application/json"
    return web.Response(status=upstream.status, body=body, headers=headers)


async def health(request: web.Request) -> web.Response:
    """``GET /health``: the proxy process is alive."""
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """``GET /ready``: the upstream answers ``GET /v1/models`` (openai) or
    ``GET /token_load`` (lightllm) with a 2xx; 503 otherwise."""
    state = request.app[STATE]
    if state.draining:
        return error_response(503, "the proxy is shutting down", code="shutting_down")
    path = "/token_load" if state.active.config.upstream.kind == "lightllm" else "/v1/models"
    try:
        upstream = await state.upstream.open("GET", path)
    except UpstreamError as e:
        return error_response(503, f"upstream not ready: {e.message}", code="upstream_not_ready")
    status = upstream.status
    upstream.close()
    if status >= 300:
        return error_response(503, f"upstream answered {status} on {path}", code="upstream_not_ready")
    return web.json_response({"status": "ready", "upstream": state.active.config.upstream.url})


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text format."""
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
