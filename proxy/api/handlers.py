"""Route handlers: admit, relay, account. Thin; the logic lives in the modules they call.

The life of a completion request (``handle_generation``):

1. read and parse the body (400 on bad input, 413 over ``limits.max_body_bytes``);
2. resolve the caller (401 for a key the config does not know, or no known key under
   ``require_api_key``: :meth:`proxy.admission.identity.IdentityResolver.refusal`);
3. route it by ``model`` to a pool (404 ``model_not_found``; :mod:`proxy.routing.model_routing`);
4. wait for admission in that pool (429 rate limit / queue full / timeout, 503 evicted /
   shutdown / no healthy engine); the ticket comes back placed on an engine (bind late);
5. open the request on that engine, once (502 unreachable or closed without an answer,
   504 no headers in time; :mod:`proxy.relay.upstream`), with the body built for that engine
   (:mod:`proxy.relay.engine_body`: alias, two-level priority; :mod:`proxy.relay.upstream_body`). A
   connection that failed before any byte was sent moves the request to another engine
   of the pool (:meth:`proxy.admission.admission.Admission.reroute`); the engine's health hears of
   every outcome (:meth:`proxy.admission.admission.Admission.report`);
   A request preempted before its client was shown anything (:mod:`proxy.admission.admission`)
   closes its upstream request, waits at the head of its queue, and goes to step 5 again
   with the engine it is given then: its client sees only the later answer;
6. relay the answer (:mod:`proxy.relay.relay`, :mod:`proxy.relay.assemble`); 7. release the slot
   exactly once, in ``finally``, with the real token counts; abort the upstream by
   closing its connection unless its answer was read to the end;
8. log one access line (:func:`_log_access`), whatever the answer.

A client that disconnects cancels the handler task (aiohttp ``handler_cancellation``),
which lands in the same ``finally`` wherever the request is: queued, waiting for the
upstream's first byte, mid-stream, or waiting for a non-streaming body.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

import aiohttp
import orjson
from aiohttp import web

from qos import RefusalReason, Refused

from ..telemetry import metrics as m
from ..relay.assemble import ASSEMBLED_KINDS, relay_assembled
from ..relay.engine_body import body_for_engine, priority_value
from ..routing.engine_health import check_path_for
from ..wire.errors import error_response, retry_after_seconds
from ..routing.model_routing import ModelTable, Route, model_error, parse_models_body
from ..config.pools import public_url
from ..relay.relay import CLIENT_CLOSED, Exchange, relay_body, relay_stream
from ..wire.headers import DECODED_CODINGS, REQUEST_ID, client_headers, content_coding, request_id_of, trace_headers
from ..relay import request_kinds as kinds
from ..admission.admission import NoEngine
from ..wire.request_body import BadRequest, ParsedRequest
from ..relay.request_kinds import RequestKind, prompt_prefix
from ..routing.router import EngineState, affinity_key
from ..wire.sse import EventTooLarge
from ..runtime.state import ProxyState
from ..relay.upstream import UpstreamError
from ..runtime.workers import whole_server_metrics
from ..relay.upstream_body import REJECTED, UpstreamBody, choices_of, names_stream_options, plan_upstream_body, stream_options_of

STATE = web.AppKey("llm_qos_state", ProxyState)
#: the proxy's own resources, every route but the pass-through catch-all (set by the app)
OWN_RESOURCES = web.AppKey("llm_qos_own_resources", tuple)
access_log = logging.getLogger("llm_qos.access")
log = logging.getLogger("llm_qos.proxy")

_SERVICE_UNAVAILABLE = {RefusalReason.EVICTED, RefusalReason.SHUTDOWN, RefusalReason.NO_ENGINE}
_NOTHING_SERVED = {m.OUTCOME_UPSTREAM_ERROR, m.OUTCOME_BAD_REQUEST}  # with no output token
MODEL_CHARS = 128  # a body's model name is logged up to this length


def _refusal_response(r: Refused) -> web.Response:
    if r.reason is RefusalReason.TOO_LARGE:  # no retry can help
        return error_response(400, r.detail, code=r.reason.value, param="max_tokens")
    status = 503 if r.reason in _SERVICE_UNAVAILABLE else 429
    extra = {"scope": r.scope, "limit": r.limit} if r.scope else None  # which rate limit tripped
    return error_response(status, r.detail, code=r.reason.value, retry_after_s=r.retry_after_s, extra=extra)


async def handle_generation(request: web.Request, kind: RequestKind) -> web.StreamResponse:
    """Admit, forward and relay one request of ``kind`` (:mod:`proxy.relay.request_kinds`);
    every answer carries ``X-Request-Id`` and makes one access-log line."""
    loop = asyncio.get_running_loop()
    ex = Exchange(arrived_at=loop.time(), request_id=request_id_of(request.headers))
    try:
        resp = await _generation(request, ex, kind)
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


async def _generation(request: web.Request, ex: Exchange, kind: RequestKind) -> web.StreamResponse:
    state = request.app[STATE]
    ex.kind = kind.name
    native = kind.native
    path = kind.path if kind.path is not None else raw_target(request).partition("?")[0]
    loop = asyncio.get_running_loop()
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        ex.outcome, ex.detail = m.OUTCOME_BAD_REQUEST, "body_too_large"
        return error_response(413, f"the body exceeds {state.max_body_bytes} bytes", code="body_too_large")
    except Exception as e:  # a body that cannot be decoded (bad Content-Encoding, broken chunking)
        ex.outcome, ex.detail = m.OUTCOME_BAD_REQUEST, "invalid_body"
        return error_response(400, f"the request body could not be read: {type(e).__name__}", code="invalid_body")
    active = state.active  # one config for the rest of the request
    ident = active.identity.resolve(request.headers)
    ex.user = ident.user_id
    if (why := active.identity.refusal(ident)) is not None:  # an unknown key, or none under require_api_key
        ex.outcome, ex.detail = m.OUTCOME_REFUSED, "invalid_api_key"
        return error_response(401, why, code="invalid_api_key")
    group_name = ex.group = ident.group or active.config.default_group
    try:
        parsed = kind.parse(raw, active.config)
        cap = active.config.group(group_name).max_tokens
        if cap is not None and kind.cap is not None:
            parsed = kind.cap(parsed, cap, active.config.limits.max_tokens_action == "reject")
        if kind.proxy_fields:
            stream_options_of(parsed.fields)  # a bad one is the client's 400, before any wait
    except BadRequest as e:
        state.metrics.requests.labels(group_name, m.OUTCOME_BAD_REQUEST).inc()
        ex.outcome, ex.detail = m.OUTCOME_BAD_REQUEST, e.param or "invalid_request"
        return error_response(400, e.message, code="invalid_request", param=e.param)
    model = parsed.fields.get("model")
    if isinstance(model, str):
        ex.model = model[:MODEL_CHARS]
    if native:
        route = native_route(active.models, model)
    elif kind.opaque and not isinstance(model, str):  # no JSON body naming a model (an upload, a GET)
        route = Route(active.models.default_pool) if active.models.default_pool is not None else None
    else:
        route = active.models.route(model)
    if route is None:
        state.metrics.requests.labels(group_name, m.OUTCOME_BAD_REQUEST).inc()
        ex.outcome, ex.detail = m.OUTCOME_BAD_REQUEST, "model_not_found"
        return model_error(model)
    admission = state.admission
    pool = admission.pools[route.pool]
    if native and any(e.kind != "lightllm" for e in pool.spec.engines):
        ex.outcome, ex.detail = m.OUTCOME_BAD_REQUEST, "not_found"
        return error_response(404, f"{path} is LightLLM's native route; pool {pool.name!r} has engines that are not lightllm", code="not_found")
    key = None
    if pool.spec.routing.affinity.enabled:
        aff = pool.spec.routing.affinity
        session = request.headers.get(aff.session_header) if aff.session_header else None
        key = affinity_key(pool.spec.routing, session, prompt_prefix(parsed.fields, aff.prefix_chars) if aff.prefix_chars else None)

    admitted = not (kind.opaque and not active.config.passthrough.admit)
    outside = None  # the engine place of a request outside admission
    try:
        if admitted:
            ceiling = pool.spec.output_ceiling(parsed.prompt_tokens)  # the engines' context length, if known
            ticket = await admission.acquire(
                ident.user_id, None, parsed.prompt_tokens, parsed.max_tokens, parsed.choices, ceiling, pool=route.pool, key=key
            )
        else:  # passthrough.admit: false: straight to an engine, outside admission
            ticket = None
            outside = _OutsideAdmission()
            engine = pool.router.place_outside(outside, key)
            if engine is None:
                raise NoEngine(pool.name, pool.router.retry_after_s())
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

    if ticket is not None:
        ex.group = ticket.group
        engine = ticket.placement
    ex.queue_wait = loop.time() - ex.arrived_at
    upstream = None
    aborted = False
    transfer_broke = False  # a pass-through answer's transfer broke (its only health signal)
    query = raw_query(request)
    trace = trace_headers(request.headers)
    # a pass-through body is the client's own (a multipart upload, audio): its type goes with it
    body_headers = {"Content-Type": request.headers.get("Content-Type"), "Accept": request.headers.get("Accept")} if kind.opaque else None
    try:
        while True:  # once per dispatch: a preempted request waits in its queue, then goes again
            try:
                tried = []
                while True:
                    plan = _engine_plan(parsed, engine, route, kind, admission.policy, ex.group)
                    try:
                        upstream, plan = await _open(engine, request.method, path, plan, ex, query, native, trace, body_headers)
                        break
                    except UpstreamError as e:
                        if e.unsent:  # it never reached the engine: another one may take it
                            admission.report(engine, False, "connect", e.message)
                            tried.append(engine)
                            if ticket is not None:
                                nxt = admission.reroute(ticket, tried)
                            else:
                                nxt = pool.router.reroute(outside, tried, key, over=True)
                            if nxt is not None:
                                log.info("request %s: engine %s unreachable (%s); sent to engine %s", ex.request_id, engine.name, e.message, nxt.name)
                                engine = nxt
                                continue
                            if pool.tracks_health:
                                # no engine of the pool could take it (each one tried refused or timed
                                # out the connection, no other in rotation within its lease): answered
                                # as when none is in rotation, 503 with Retry-After (issue 21.8)
                                wait = pool.router.retry_after_s()
                                ex.outcome, ex.detail = m.OUTCOME_UPSTREAM_ERROR, RefusalReason.NO_ENGINE.value
                                why = f"no engine of pool {pool.name!r} could take the request (the last one tried: {e.message})"
                                return error_response(503, f"{why}; retry after {retry_after_seconds(wait)} s", code=RefusalReason.NO_ENGINE.value, retry_after_s=wait)
                        else:
                            admission.report(engine, False, "timeout" if e.status == 504 else "reset", e.message)
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
                ctype = upstream.headers.get("Content-Type", "").lower()
                is_json = "json" in ctype
                if kind.opaque:  # any answer, relayed as bytes as they come: a file, audio, a stream
                    if ticket is not None:
                        ticket.shown = True  # its headers go to the client now: never preempted
                    resp = await relay_stream(request, upstream, ex, _no_progress, kind.scanner(), active.config.limits.client_write_timeout_s, base_url=engine.url)
                    transfer_broke = ex.outcome == m.OUTCOME_UPSTREAM_ERROR
                    if upstream.status >= 400 and ex.outcome == m.OUTCOME_OK:
                        ex.outcome, ex.detail = m.OUTCOME_UPSTREAM_ERROR, f"upstream answered {upstream.status}"
                    return resp
                # an event stream the client did not ask for (transformers serve streams a Responses
                # request that names no ``stream``) is assembled into the JSON it asked for, where the
                # proxy reads that kind's stream (chat, completions, Responses); any other kind's is
                # relayed and accounted as a stream, as the engine sent it
                event_stream = "text/event-stream" in ctype
                assemble = plan.assemble or (event_stream and not parsed.stream and kind.name in ASSEMBLED_KINDS)
                if (parsed.stream or event_stream) and upstream.status == 200 and not is_json and not assemble:
                    progress = (lambda n: admission.record_output(ticket, n)) if ticket is not None else _no_progress
                    # with preemption on, its headers wait for its first event: until then
                    # its client has seen nothing and it may be preempted
                    held = ticket is not None and admission.preemption.enabled
                    if ticket is not None and not held:
                        ticket.shown = True
                    return await relay_stream(
                        request,
                        upstream,
                        ex,
                        progress,
                        kind.scanner(),
                        write_timeout_s=active.config.limits.client_write_timeout_s,
                        choices=choices_of(parsed.fields),
                        strip_usage=plan.strip_usage,
                        base_url=engine.url,
                        on_show=(lambda: _shown(ticket)) if held else None,
                    )
                try:
                    if upstream.status == 417 and (native or engine.kind == "lightllm"):  # LightLLM's validation errors, any route
                        body = await upstream.read()
                        ex.upstream_ended = True  # read in full: nothing to abort
                        ex.outcome = m.OUTCOME_BAD_REQUEST
                        return error_response(400, _message_of(body), code="invalid_request")
                    if assemble and upstream.status == 200 and not is_json:
                        return await relay_assembled(upstream, ex, kind.name, choices=choices_of(parsed.fields), base_url=engine.url)
                    return await relay_body(upstream, ex, native=native, base_url=engine.url)
                except (aiohttp.ClientError, TimeoutError, EventTooLarge) as e:
                    ex.outcome, ex.detail = m.OUTCOME_UPSTREAM_ERROR, type(e).__name__
                    return error_response(502, "the upstream failed while sending its answer", code="upstream_error")
            except asyncio.CancelledError:
                if ticket is None or not admission.preempted(ticket):
                    raise
                # preempted (its client was shown nothing): abort the upstream work, answer
                # nothing, wait at the head of its queue, and go again on the engine given then
                if upstream is not None:
                    upstream.close()  # aborts the generation upstream
                    upstream = None
                state.metrics.upstream_aborts.labels(m.ABORT_PREEMPTED).inc()
                _restart(ex, ticket.preemptions)
                aborted = transfer_broke = False
                try:
                    engine = await admission.wait_requeued(ticket)
                except Refused as r:
                    ex.queue_wait = loop.time() - ex.arrived_at
                    state.metrics.rejections.labels(ex.group, r.reason.value).inc()
                    ex.outcome, ex.detail = m.OUTCOME_REFUSED, r.reason.value
                    return _refusal_response(r)
                ex.group = ticket.group
                ex.queue_wait = loop.time() - ex.arrived_at
    except (asyncio.CancelledError, ConnectionResetError):
        # the client's side only: every upstream read above turns its failures (aiohttp's
        # ClientConnectionResetError is a ConnectionResetError too) into an answer first
        ex.outcome, ex.detail = m.OUTCOME_CLIENT_GONE, "client disconnected"
        raise
    finally:
        if upstream is not None:
            # the engine's health: a 5xx (as a status, or named by an error the engine
            # reported in-band) is a failure; an error the engine reported otherwise (an
            # in-band 400, "prompt too long") is the engine answering, like a 4xx status:
            # a client's bad requests must not eject it. A stream that broke or ended
            # unfinished is a failure. A pass-through path's answer, any status, says nothing
            # of the engine's health (a 5xx may be that path's own): only a broken transfer.
            if kind.opaque:
                admission.report(engine, not transfer_broke, "stream_cut", ex.detail)
            elif upstream.status >= 500:
                admission.report(engine, False, "http_5xx", f"answered {upstream.status}", status=upstream.status)
            elif (ex.engine_error_status or 0) >= 500:
                admission.report(engine, False, "http_5xx", f"reported a {ex.engine_error_status} error in its answer", status=ex.engine_error_status)
            elif ex.outcome == m.OUTCOME_UPSTREAM_ERROR and upstream.status < 400 and not ex.engine_error:
                admission.report(engine, False, "stream_cut", ex.detail)
            else:
                admission.report(engine, True)
            if ex.upstream_ended:
                upstream.release()
            else:
                upstream.close()  # aborts the generation upstream
                aborted = True
        if aborted:
            state.metrics.upstream_aborts.labels(ex.outcome or m.ABORT_UNKNOWN).inc()
        if ex.output_tokens == 0 and ex.outcome in _NOTHING_SERVED:
            ex.prompt_tokens = 0  # the upstream refused or failed before any token: charge nothing
        if ticket is not None:
            admission.release(ticket, ex.prompt_tokens, ex.output_tokens)
        elif outside is not None and pool.router.release(outside) is not None:
            pool.scheduler.dispatch()  # its place on the engine is free for the queue
        # metrics after the response has gone out, off its latency
        loop.call_soon(_account, state, ex, parsed)


def native_route(models: ModelTable, model: object) -> Route | None:
    """The pool of a LightLLM native request: the pool that lists its ``model`` when it
    names one a pool lists, else the catch-all (or only) pool."""
    route = models.route(model) if isinstance(model, str) else None
    if route is not None and (route.pool != models.catch_all or models.catch_all is None):
        return Route(route.pool)
    default = models.default_pool
    return Route(default) if default is not None else None


def _engine_plan(parsed: ParsedRequest, engine: EngineState, route: Route, kind: RequestKind, policy, group: str) -> UpstreamBody:
    """The body to send ``engine`` (bind late: built once the engine is known): the
    alias's model name and the two-level priority (:mod:`proxy.relay.engine_body`; a
    pass-through body gets only the alias, and only when it is a JSON object that names a
    model), then, for chat and completions, the proxy's own stream settings for that
    engine (:mod:`proxy.relay.upstream_body`)."""
    if kind.native:
        return UpstreamBody(parsed.body)
    spec = engine.spec
    priority = None
    if spec.priority_field is not None and not kind.opaque:
        priority = (spec.priority_field, priority_value(policy.group_index(group), len(policy.groups), spec.priority_order))
    alias = route.upstream_model if "model" in parsed.fields else None
    if alias is not None or priority is not None:
        body = body_for_engine(parsed.body, parsed.fields, alias, priority)
        parsed = replace(parsed, body=body, fields=orjson.loads(body))
    if not kind.proxy_fields:
        return UpstreamBody(parsed.body)
    return plan_upstream_body(parsed, spec.upstream, engine.client.accepts_stream_options)


class _OutsideAdmission:
    """The place on an engine of a pass-through request outside admission
    (:meth:`proxy.routing.router.PoolRouter.place_outside`): it reserves no tokens."""

    __slots__ = ()
    reserved_tokens = 0


def _no_progress(tokens: int) -> None:
    """Progress of a request outside admission: nothing to record."""


async def _open(
    engine: EngineState,
    method: str,
    path: str,
    plan: UpstreamBody,
    ex: Exchange,
    query: str,
    native: bool,
    trace: dict[str, str],
    body_headers: dict[str, str | None] | None = None,
) -> tuple[aiohttp.ClientResponse, UpstreamBody]:
    """Open the upstream request for ``plan`` on ``engine`` (``body_headers``: the
    client's ``Content-Type`` and ``Accept`` for a pass-through body, ``None`` values
    left out; see :meth:`proxy.relay.upstream.Upstream.open`). An engine that rejects the
    proxy's own ``stream_options`` (a 400/417/422 whose body names it) gets the request
    once more without them (``proxy.relay.upstream_body``).

    Raises:
        UpstreamError: as :meth:`proxy.relay.upstream.Upstream.open`; and 502
            ``upstream_error`` when the upstream fails while sending the rejection's body
            (a reset, a short body, ``idle_timeout_s`` of silence).
    """
    up = engine.client
    # body headers come only with a pass-through request, whose path is a client's: not cached
    upstream = await up.open(method, path, plan.body, query=query, request_id=ex.request_id, trace=trace, body_headers=body_headers, cached=body_headers is None)
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
    upstream = await up.open(method, path, plan.body, query=query, request_id=ex.request_id, trace=trace)
    if upstream.status not in REJECTED:
        up.reject_stream_options(first)
    return upstream, plan


def raw_query(request: web.Request) -> str:
    """The client's query string exactly as it sent it (still percent-encoded; the
    parsed ``rel_url`` would decode ``%2F`` and the like)."""
    return raw_target(request).partition("?")[2]


def raw_target(request: web.Request) -> str:
    """The request target's path and query as the client sent them (still
    percent-encoded), in origin form: an absolute-form target (``GET http://host/v1/x``,
    RFC 9112 §3.2.2) loses its scheme and authority, which name no engine of ours."""
    target = request.raw_path
    if target.startswith("/"):
        return target
    rest = target.partition("://")[2]
    i = rest.find("/")
    return rest[i:] if i >= 0 else "/"


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


def _shown(ticket) -> None:
    """The client is sent the first byte of ``ticket``'s answer: it is never preempted
    after this (:mod:`proxy.admission.admission`)."""
    ticket.shown = True


def _restart(ex: Exchange, preemptions: int) -> None:
    """Forget what a preempted attempt left in ``ex`` (its client was shown nothing of
    it), and count the preemption for the access log."""
    ex.status, ex.first_byte_at, ex.prompt_tokens, ex.output_tokens = 0, None, None, 0
    ex.outcome = ex.detail = ""
    ex.upstream_request_id, ex.upstream_ended, ex.engine_error, ex.engine_error_status = None, False, False, None
    ex.preemptions = preemptions


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
            "kind": ex.kind or None,
            "status": ex.status,
            "outcome": ex.outcome or m.OUTCOME_UPSTREAM_ERROR,
            "detail": ex.detail or None,
            "queue_wait_s": None if ex.queue_wait is None else round(ex.queue_wait, 4),
            "ttft_s": None if ex.first_byte_at is None else round(ex.first_byte_at - ex.arrived_at, 4),
            "duration_s": round(now - ex.arrived_at, 4),
            "prompt_tokens": ex.prompt_tokens,
            "output_tokens": ex.output_tokens,
            "preemptions": ex.preemptions,
        }
    ).decode()
    # a record made directly: no caller lookup (logger.info's stack walk) for a line whose
    # source is always this function
    access_log.handle(logging.LogRecord(access_log.name, logging.INFO, __file__, 0, line, None, None))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions`` (streaming and not)."""
    return await handle_generation(request, kinds.CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions`` (streaming and not)."""
    return await handle_generation(request, kinds.COMPLETION)


async def embeddings(request: web.Request) -> web.StreamResponse:
    """``POST /v1/embeddings``: admitted at its prompt's cost (it generates nothing),
    relayed as the engine answers; the engine's ``usage.prompt_tokens`` trues it up."""
    return await handle_generation(request, kinds.EMBEDDINGS)


async def responses(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses`` (OpenAI's Responses API, streaming and not): admitted and
    relayed like chat; a stream ends with the engine's own terminal event (no
    ``[DONE]``), a cut one with a terminal ``error`` event."""
    return await handle_generation(request, kinds.RESPONSES)


async def passthrough(request: web.Request) -> web.StreamResponse:
    """Any other path under ``/v1/``, any method: with ``passthrough.enabled``, sent to
    an engine (the pool of a JSON body's ``model``, else the catch-all or only pool),
    admitted at ``passthrough.cost_tokens`` unless ``passthrough.admit`` is false, and
    relayed as the engine answers; off (the default), ``404`` as for any unknown route.
    A path with a ``.`` or ``..`` segment is never passed (``404``)."""
    allowed = await _own_methods(request)
    if allowed:  # one of the proxy's own routes, with another method
        resp = error_response(405, f"method {request.method} not allowed on {request.path}", code="method_not_allowed")
        resp.headers["Allow"] = ",".join(sorted(allowed))
        return resp
    if not request.app[STATE].active.config.passthrough.enabled or not _plain_v1_path(request.path):
        return error_response(404, f"no route {request.method} {request.path}", code="not_found")
    return await handle_generation(request, kinds.PASSTHROUGH)


async def _own_methods(request: web.Request) -> set[str]:
    """The methods the proxy's own routes take on this path (empty: none of them is
    this path), from the resources registered before the pass-through catch-all
    (:data:`OWN_RESOURCES`; ``aiohttp.web.AbstractResource.resolve``)."""
    allowed: set[str] = set()
    for resource in request.app[OWN_RESOURCES]:
        _match, methods = await resource.resolve(request)
        allowed |= methods
    return allowed


def _plain_v1_path(path: str) -> bool:
    """Whether ``path`` (decoded) is under ``/v1/`` with no dot segment (RFC 3986 §3.3:
    an engine or a server in front of it could resolve ``..`` out of ``/v1/``)."""
    return path.startswith("/v1/") and not any(seg in (".", "..") for seg in path.split("/"))


def _native_unavailable(request: web.Request) -> web.Response | None:
    state = request.app[STATE]
    if not any(e.kind == "lightllm" for pool in state.admission.pools.values() for e in pool.spec.engines):
        what = "this proxy's upstream.kind is not lightllm" if state.active.models.single_upstream else "no pool of this proxy has lightllm engines"
        return error_response(404, f"{request.path} is LightLLM's native route; {what}", code="not_found")
    return None


async def generate(request: web.Request) -> web.StreamResponse:
    """LightLLM native ``POST /generate`` (404 unless the request's pool, by ``model``
    if the body names a listed one, else the catch-all pool, has only lightllm engines)."""
    if (unavailable := _native_unavailable(request)) is not None:
        return unavailable
    return await handle_generation(request, kinds.GENERATE)


async def generate_stream(request: web.Request) -> web.StreamResponse:
    """LightLLM native ``POST /generate_stream`` (as :func:`generate`)."""
    if (unavailable := _native_unavailable(request)) is not None:
        return unavailable
    return await handle_generation(request, kinds.GENERATE_STREAM)


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models`` (and ``HEAD``): with the single ``upstream``, the upstream's own
    answer passed through with its query string and end-to-end headers; with pools, every
    model a pool lists, then what the catch-all pool's engine lists
    (:meth:`proxy.routing.model_routing.ModelTable.models_list`). 401 for a key the config does not
    know, or without a known key when ``identity.require_api_key`` is on; every answer
    carries ``X-Request-Id``."""
    rid = request_id_of(request.headers)
    resp = await _models(request, rid)
    if REQUEST_ID not in resp.headers:
        resp.headers[REQUEST_ID] = rid
    return resp


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{id}``: the entry of ``GET /v1/models`` for that id, or 404
    ``model_not_found`` (401 as for :func:`models`)."""
    rid = request_id_of(request.headers)
    resp = await _model(request, rid)
    resp.headers[REQUEST_ID] = rid
    return resp


def _unauthorized(request: web.Request) -> web.Response | None:
    active = request.app[STATE].active
    if (why := active.identity.refusal(active.identity.resolve(request.headers))) is not None:
        return error_response(401, why, code="invalid_api_key")
    return None


async def _engine_models(request: web.Request, engine: EngineState, rid: str) -> tuple[aiohttp.ClientResponse | None, bytes, web.Response | None]:
    """``GET /v1/models`` of one engine: ``(response, body, None)``, or ``(None, b"",
    error answer)``."""
    try:
        upstream = await engine.client.open("GET", "/v1/models", query=raw_query(request), request_id=rid, trace=trace_headers(request.headers))
    except UpstreamError as e:
        return None, b"", error_response(e.status, e.message, code=e.code)
    coding = content_coding(upstream.headers)
    if coding not in DECODED_CODINGS:
        upstream.close()
        return None, b"", error_response(502, f"the upstream answered with Content-Encoding {coding!r}, which the proxy cannot decode", code="upstream_bad_response")
    try:
        body = await upstream.read()
    except (aiohttp.ClientError, TimeoutError):
        upstream.close()
        return None, b"", error_response(502, "the upstream failed while sending its answer", code="upstream_error")
    upstream.release()
    return upstream, body, None


async def _catch_all_models(request: web.Request, rid: str) -> list[dict]:
    """What the catch-all pool's engine lists (the first engine in rotation that answers
    2xx), or ``[]``."""
    state = request.app[STATE]
    name = state.active.models.catch_all
    pool = state.admission.pools.get(name) if name is not None else None
    if pool is None:
        return []
    for e in list(pool.router.engines.values()):
        if not e.in_rotation or e.client is None:
            continue
        upstream, body, _err = await _engine_models(request, e, rid)
        if upstream is not None and 200 <= upstream.status < 300:
            return parse_models_body(body)
    return []


async def _models(request: web.Request, rid: str) -> web.Response:
    state = request.app[STATE]
    if (denied := _unauthorized(request)) is not None:
        return denied
    table = state.active.models
    if not table.single_upstream:
        return web.json_response(table.models_list(await _catch_all_models(request, rid)))
    engine = next(iter(state.admission.default.router.engines.values()))
    upstream, body, err = await _engine_models(request, engine, rid)
    if err is not None:
        return err
    headers = client_headers(upstream.headers, rid, engine.url)
    if "Content-Type" not in headers:
        headers["Content-Type"] = "application/json"
    return web.Response(status=upstream.status, body=body, headers=headers)


async def _model(request: web.Request, rid: str) -> web.Response:
    state = request.app[STATE]
    if (denied := _unauthorized(request)) is not None:
        return denied
    model_id = request.match_info["model"]
    obj = state.active.models.model(model_id, await _catch_all_models(request, rid))
    if obj is None:
        return model_error(model_id)
    return web.json_response(obj)


async def health(request: web.Request) -> web.Response:
    """``GET /health``: the proxy process is alive."""
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """``GET /ready``: 200 when some pool can serve now: one of its engines in rotation
    answers its check (``GET /v1/models`` for openai engines, ``GET /token_load`` for
    lightllm ones, or the pool's ``health.check_path``) with a 2xx; 503 otherwise, and
    while shutting down. Any pool, not every pool: a replica that can serve some models
    stays in its load balancer's rotation (a pool without engines answers its own
    requests 503 at once). The body lists every pool's engines in rotation."""
    state = request.app[STATE]
    if state.draining:
        return error_response(503, "the proxy is shutting down", code="shutting_down")
    pools = {p.name: sum(e.in_rotation for e in p.router.engines.values()) for p in state.admission.pools.values()}
    problems = []
    for pool in state.admission.pools.values():
        for e in list(pool.router.engines.values()):
            if not e.in_rotation or e.client is None:
                continue
            path = check_path_for(pool.spec.health, e.kind)
            try:
                upstream = await e.client.open("GET", path)
            except UpstreamError as err:
                problems.append(f"{e.name}: {err.message}")
                continue
            status = upstream.status
            upstream.close()
            if status < 300:
                return web.json_response({"status": "ready", "upstream": public_url(e.url), "pools": pools})
            problems.append(f"{e.name}: answered {status} on {path}")
    if not problems:
        return error_response(503, "upstream not ready: no engine is in rotation", code="upstream_not_ready")
    if len(problems) == 1 and state.active.models.single_upstream:
        msg = problems[0].split(": ", 1)[1]
        if msg.startswith("answered"):
            return error_response(503, f"upstream {msg}", code="upstream_not_ready")
        return error_response(503, f"upstream not ready: {msg}", code="upstream_not_ready")
    return error_response(503, "upstream not ready: " + "; ".join(problems[:10]), code="upstream_not_ready")


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text format; under ``--workers``, every worker's series
    (:func:`proxy.runtime.workers.whole_server_metrics`)."""
    body = await whole_server_metrics(request.app[STATE])
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
