"""Route handlers: admit, relay, account. Thin; the logic lives in the modules they call.

The life of a completion request (``handle_generation``):

1. read and parse the body (400 on bad input, 413 over ``limits.max_body_bytes``);
2. resolve the caller (401 if ``require_api_key`` and no known key);
3. wait for admission (429 rate limit / queue full / timeout, 503 evicted / shutdown);
4. open the upstream request (502 unreachable, 504 no headers in time);
5. relay the answer; 6. release the slot exactly once, in ``finally``, with the real
   token counts; abort the upstream by closing its connection unless it ended cleanly.

A client that disconnects cancels the handler task (aiohttp ``handler_cancellation``),
which lands in the same ``finally`` wherever the request is: queued, waiting for the
upstream's first byte, mid-stream, or waiting for a non-streaming body.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import aiohttp
import orjson
from aiohttp import web

from qos import RefusalReason, Refused

from . import metrics as m
from .assemble import relay_assembled, stream_request_body
from .errors import error_response
from .relay import Exchange, relay_body, relay_stream
from .request_body import BadRequest, ParsedRequest, PromptCosts, cap_max_tokens, parse_chat, parse_completion, parse_generate
from .state import ProxyState
from .upstream import UpstreamError

STATE = web.AppKey("llm_qos_state", ProxyState)
access_log = logging.getLogger("llm_qos.access")
log = logging.getLogger("llm_qos.proxy")

_SERVICE_UNAVAILABLE = {RefusalReason.EVICTED, RefusalReason.SHUTDOWN}
_NOTHING_SERVED = {m.OUTCOME_UPSTREAM_ERROR, m.OUTCOME_BAD_REQUEST}  # with no output token


def _refusal_response(r: Refused) -> web.Response:
    if r.reason is RefusalReason.TOO_LARGE:  # no retry can help
        return error_response(400, r.detail, code=r.reason.value, param="max_tokens")
    status = 503 if r.reason in _SERVICE_UNAVAILABLE else 429
    return error_response(status, r.detail, code=r.reason.value, retry_after_s=r.retry_after_s)


async def handle_generation(
    request: web.Request, parse: Callable[[bytes, PromptCosts], ParsedRequest], path: str, native: bool = False
) -> web.StreamResponse:
    """Admit, forward and relay one generation request to ``path`` upstream."""
    state = request.app[STATE]
    active = state.active  # one config for the whole request
    loop = asyncio.get_running_loop()
    ex = Exchange(arrived_at=loop.time())
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return error_response(413, f"the body exceeds {state.max_body_bytes} bytes", code="body_too_large")
    except Exception as e:  # a body that cannot be decoded (bad Content-Encoding, broken chunking)
        return error_response(400, f"the request body could not be read: {type(e).__name__}", code="invalid_body")
    ident = active.identity.resolve(request.headers)
    if active.identity.require_api_key and not ident.authenticated:
        return error_response(401, "a valid API key is required (Authorization: Bearer KEY)", code="invalid_api_key")
    group_name = ident.group or active.config.default_group
    try:
        parsed = parse(raw, active.config.cost)
        cap = active.config.group(group_name).max_tokens
        if cap is not None:
            parsed = cap_max_tokens(parsed, cap, active.config.limits.max_tokens_action == "reject")
    except BadRequest as e:
        state.metrics.requests.labels(group_name, m.OUTCOME_BAD_REQUEST).inc()
        return error_response(400, e.message, code="invalid_request", param=e.param)

    admission = state.admission
    try:
        ticket = await admission.acquire(ident.user_id, None, parsed.prompt_tokens, parsed.max_tokens, parsed.choices)
    except Refused as r:
        now = loop.time()
        state.metrics.rejections.labels(group_name, r.reason.value).inc()
        state.metrics.requests.labels(group_name, m.OUTCOME_REFUSED).inc()
        _log_access(ident.user_id, group_name, ex, now, m.OUTCOME_REFUSED, r.reason.value, now - ex.arrived_at)
        return _refusal_response(r)
    except asyncio.CancelledError:
        now = loop.time()
        state.metrics.requests.labels(group_name, m.OUTCOME_CLIENT_GONE).inc()
        _log_access(ident.user_id, group_name, ex, now, m.OUTCOME_CLIENT_GONE, "while queued", now - ex.arrived_at)
        raise

    group = ticket.group
    queue_wait = loop.time() - ex.arrived_at
    upstream = None
    clean = False
    assemble = not native and not parsed.stream and active.config.upstream.stream_non_streaming
    try:
        try:
            upstream = await state.upstream.open("POST", path, stream_request_body(parsed.fields) if assemble else parsed.body)
        except UpstreamError as e:
            ex.outcome, ex.detail = m.OUTCOME_UPSTREAM_ERROR, e.code
            return error_response(e.status, e.message, code=e.code)
        if parsed.stream and upstream.status == 200:
            progress = lambda n: admission.scheduler.record_output(ticket, n)  # noqa: E731
            resp = await relay_stream(request, upstream, ex, progress, native=native, write_timeout_s=active.config.limits.client_write_timeout_s)
        else:
            if upstream.status == 417 and (native or active.config.upstream.kind == "lightllm"):  # LightLLM's validation errors, any route
                body = await upstream.read()
                ex.outcome, clean = m.OUTCOME_BAD_REQUEST, True  # read in full: nothing to abort
                return error_response(400, _message_of(body), code="invalid_request")
            try:
                if assemble and upstream.status == 200 and upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
                    resp = await relay_assembled(upstream, ex, chat=path == "/v1/chat/completions")
                else:
                    resp = await relay_body(upstream, ex, native=native)
            except (aiohttp.ClientError, TimeoutError) as e:
                ex.outcome, ex.detail = m.OUTCOME_UPSTREAM_ERROR, type(e).__name__
                return error_response(502, "the upstream failed while sending its answer", code="upstream_error")
        clean = ex.outcome == m.OUTCOME_OK
        return resp
    except (asyncio.CancelledError, ConnectionResetError):
        ex.outcome, ex.detail = m.OUTCOME_CLIENT_GONE, "client disconnected"
        raise
    finally:
        if upstream is not None:
            if clean:
                upstream.release()
            else:
                upstream.close()  # aborts the generation upstream
                state.metrics.upstream_aborts.labels(ex.outcome or "error").inc()
        if ex.output_tokens == 0 and ex.outcome in _NOTHING_SERVED:
            ex.prompt_tokens = 0  # the upstream refused or failed before any token: charge nothing
        admission.release(ticket, ex.prompt_tokens, ex.output_tokens)
        # metrics and the access line after the response has gone out, off its latency
        now = loop.time()
        loop.call_soon(_account, state, group, ex, parsed, queue_wait)
        loop.call_soon(_log_access, ident.user_id, group, ex, now, ex.outcome or m.OUTCOME_UPSTREAM_ERROR, ex.detail, queue_wait)


def _message_of(body: bytes) -> str:
    try:
        obj = orjson.loads(body)
        if isinstance(obj, dict) and isinstance(obj.get("message"), str):
            return obj["message"]
    except orjson.JSONDecodeError:
        pass
    return body[:500].decode("utf-8", "replace") or "the upstream rejected the request"


def _account(state: ProxyState, group: str, ex: Exchange, parsed: ParsedRequest, queue_wait: float) -> None:
    met = state.metrics
    met.queue_wait.labels(group).observe(queue_wait)
    met.requests.labels(group, ex.outcome or m.OUTCOME_UPSTREAM_ERROR).inc()
    if ex.first_byte_at is not None:
        met.ttft.labels(group).observe(ex.first_byte_at - ex.arrived_at)
    met.tokens.labels(group, "prompt").inc(ex.prompt_tokens if ex.prompt_tokens is not None else parsed.prompt_tokens)
    met.tokens.labels(group, "completion").inc(ex.output_tokens)


def _log_access(user: str, group: str, ex: Exchange, now: float, outcome: str, detail: str, queue_wait: float) -> None:
    if not access_log.isEnabledFor(logging.INFO):
        return
    access_log.info(
        orjson.dumps(
            {
                "user": user,
                "group": group,
                "outcome": outcome,
                "detail": detail or None,
                "queue_wait_s": round(queue_wait, 4),
                "ttft_s": None if ex.first_byte_at is None else round(ex.first_byte_at - ex.arrived_at, 4),
                "duration_s": round(now - ex.arrived_at, 4),
                "prompt_tokens": ex.prompt_tokens,
                "output_tokens": ex.output_tokens,
            }
        ).decode()
    )


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
    """``GET /v1/models``, passed through from the upstream (401 without a known key
    when ``identity.require_api_key`` is on)."""
    state = request.app[STATE]
    active = state.active
    if active.identity.require_api_key and not active.identity.resolve(request.headers).authenticated:
        return error_response(401, "a valid API key is required (Authorization: Bearer KEY)", code="invalid_api_key")
    try:
        upstream = await state.upstream.open("GET", "/v1/models")
    except UpstreamError as e:
        return error_response(e.status, e.message, code=e.code)
    try:
        body = await upstream.read()
    except (aiohttp.ClientError, TimeoutError):
        upstream.close()
        return error_response(502, "the upstream failed while sending its answer", code="upstream_error")
    upstream.release()
    return web.Response(status=upstream.status, body=body, headers={"Content-Type": upstream.headers.get("Content-Type", "application/json")})


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
