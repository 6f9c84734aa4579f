"""The way of one generation request (chat, completions, embeddings, Responses,
LightLLM's native routes, pass-through), as five named steps; the routes
(:mod:`.routes`) call :func:`handle_generation`.

1. **resolve** (:func:`_resolve`): the body (400 on bad input, 413 over
   ``limits.max_body_bytes``), who is asking (401: :mod:`proxy.admission.identity`),
   which pool serves its ``model`` (404 ``model_not_found``:
   :mod:`proxy.routing.model_routing`).
2. **admit** (:class:`proxy.admission.admitted.Admitted`, an ``async with``): wait in
   that pool's queue (429 rate limit / queue full / timeout, 503 evicted / shutdown / no
   healthy engine: :func:`proxy.wire.errors.refusal_response`); the ticket comes back
   placed on an engine (bind late). The ``async with`` releases ticket and engine place
   exactly once, however the request ends.
3. **open** (:func:`_open`): the body built for that engine
   (:func:`proxy.relay.engine_body.engine_plan`), opened once
   (:func:`proxy.relay.upstream_body.open_upstream`; 502, 504). A connection that failed
   before any byte was sent moves the request to another engine of the pool
   (:meth:`~proxy.admission.admitted.Admitted.reroute`).
4. **relay** (:func:`proxy.relay.answer.relay_answer`): streamed, whole or assembled. A
   request preempted before its client was shown anything (:func:`_serve`) closes its
   upstream request, waits at the head of its queue
   (:meth:`~proxy.admission.admitted.Admitted.requeue`), and goes to step 3 again with
   the engine it is given then: its client sees only the later answer. With
   ``preemption.resume``, a stream that has shown tokens may be preempted too: its
   client's stream stays open, and the next dispatch continues the text already sent
   (:mod:`proxy.relay.resume`).
5. **account** (:func:`_settle`, the ``async with``'s exit, :func:`handle_generation`):
   the engine's health verdict (:meth:`_Attempt.judge`, the one caller of
   :func:`proxy.routing.exchange_verdict.exchange_verdict`); the upstream released, or
   closed (which aborts the generation) unless its answer was read to the end; the
   ticket trued up with the real token counts and released; after the answer has gone
   out, the metrics (:meth:`proxy.telemetry.metrics.Metrics.observe_request`) and one
   access line (:func:`proxy.telemetry.access_log.log_access`), whatever the answer.

A client that disconnects cancels the handler task (aiohttp ``handler_cancellation``),
which unwinds through the same steps wherever the request is: queued, waiting for the
upstream's first byte, mid-stream, or waiting for a non-streaming body.

One concept over 400 lines: these five steps and the ways out of each (refusal,
reroute, preemption and resume, the early answer of a waiting stream) are one request's
lifetime; the steps' work lives in the modules named above.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace

import aiohttp
from aiohttp import web

from qos import RefusalReason, Refused
from qos.objectives import TPOT, TTFT

from ..admission.admission import Pool
from ..admission.admitted import Admitted
from ..admission.queue_status import QUEUE_REASONS, WaitReporter, queue_answer, wants_status
from ..relay.answer import relay_answer
from ..relay.engine_body import engine_plan
from ..relay.relay import CLIENT_CLOSED, Exchange
from ..relay.request_kinds import RequestKind
from ..relay.resume import UNPINNED_ENDS, StreamResume, resume_refusal
from ..wire.prompt_prefix import prompt_prefix
from ..relay.upstream import UpstreamError
from ..relay.upstream_body import UpstreamBody, open_upstream, stream_options_of
from ..routing.exchange_verdict import exchange_verdict
from ..routing.model_routing import Route, model_error
from ..routing.engine_state import EngineState
from ..routing.placement import affinity_key
from ..runtime.state import ActiveConfig, ProxyState
from ..telemetry import metrics as m
from ..telemetry.access_log import log_access
from ..telemetry.objectives import TokenTimes
from ..wire.errors import error_response, refusal_response, retry_after_seconds
from ..wire.headers import REQUEST_ID, origin_form, request_id_of, trace_headers
from ..wire.request_body import BadRequest, ParsedRequest

STATE = web.AppKey("llm_qos_state", ProxyState)
log = logging.getLogger("llm_qos.proxy")

_NOTHING_SERVED = {m.OUTCOME_UPSTREAM_ERROR, m.OUTCOME_BAD_REQUEST}  # with no output token
MODEL_CHARS = 128  # a body's model name is logged up to this length


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
        loop.call_soon(log_access, ex, loop.time())


async def _generation(request: web.Request, ex: Exchange, kind: RequestKind) -> web.StreamResponse:
    """The steps in order (the module docstring): resolve, admit, serve (open and relay,
    again after each preemption), account."""
    state = request.app[STATE]
    req = await _resolve(request, ex, kind, state)
    if not isinstance(req, _Resolved):
        return req  # answered before admission: 400, 401, 404, 413
    parsed = req.parsed
    admitted = Admitted(state.admission, req.pool, ex.user, parsed.prompt_tokens, parsed.max_tokens, parsed.choices, key=req.key, admit=req.admit)
    status = req.admit and wants_status(request.headers)  # its queue status, opt-in (proxy.admission.queue_status)
    reporter = WaitReporter(request, req.pool, ex.request_id, asyncio.get_running_loop().time) if status and parsed.stream and not kind.opaque else None
    try:
        async with admitted:
            if reporter is not None:
                req.early = await reporter.stop()
            if parsed.stream:
                admitted.mark_stream()  # its first token is timed and awaited
            _dispatched(ex, admitted)
            resp = await _serve(request, ex, req, admitted, state)
            return resp if not status else await queue_answer(resp, req.early, ex.queue_wait, None)
    except Refused as r:
        if admitted.entered:
            raise  # not admission's: only entering refuses (_serve answers a requeue's)
        state.metrics.requests.labels(ex.group, m.OUTCOME_REFUSED).inc()
        resp = _refused(state, ex, r)
        if not status:
            return resp
        place = req.pool.scheduler.would_wait(ex.group) if r.reason in QUEUE_REASONS else None
        return await queue_answer(resp, None if reporter is None else await reporter.stop(), ex.queue_wait, place)
    except asyncio.CancelledError:
        if not admitted.entered:
            ex.queue_wait = asyncio.get_running_loop().time() - ex.arrived_at
            state.metrics.requests.labels(ex.group, m.OUTCOME_CLIENT_GONE).inc()
            ex.outcome, ex.detail = m.OUTCOME_CLIENT_GONE, "while queued"
        raise
    finally:
        if reporter is not None:
            reporter.close()
        if admitted.entered:  # released by now; its metrics after the response has gone out
            asyncio.get_running_loop().call_soon(state.metrics.observe_request, ex, parsed.prompt_tokens)


@dataclass(slots=True)
class _Resolved:
    """What step 1 found: the rest of the request works from it (one config throughout).

    Attributes:
        kind: the request's kind.
        active: the config active when it arrived.
        path, query: the upstream path and the client's query (still percent-encoded).
        parsed: its parsed body (after the group's ``max_tokens`` cap).
        route: its pool and the model name that pool's engines get.
        pool: that pool.
        key: its affinity key, or ``None``.
        admit: it waits for admission (``False``: ``passthrough.admit: false``).
        trace: the client's trace headers, sent upstream.
        body_headers: a pass-through body's ``Content-Type`` and ``Accept``, or ``None``.
        early: a stream's response already sent while it waited, its client having
            asked for its queue status (:mod:`proxy.admission.queue_status`), else ``None``.
    """

    kind: RequestKind
    active: ActiveConfig
    path: str
    query: str
    parsed: ParsedRequest
    route: Route
    pool: Pool
    key: str | None
    admit: bool
    trace: dict[str, str]
    body_headers: dict[str, str | None] | None
    early: web.StreamResponse | None = None


async def _resolve(request: web.Request, ex: Exchange, kind: RequestKind, state: ProxyState) -> _Resolved | web.Response:
    """Step 1: the body, the caller, the pool (the module docstring). Returns what the
    later steps need, or the answer that ends the request here."""
    ex.kind = kind.name
    target_path, query = origin_form(request.raw_path)
    path = kind.path if kind.path is not None else target_path
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
    if kind.native:
        route = active.models.native_route(model)
    elif kind.opaque and not isinstance(model, str):  # no JSON body naming a model (an upload, a GET)
        route = active.models.unnamed_route()
    else:
        route = active.models.route(model)
    if route is None:
        state.metrics.requests.labels(group_name, m.OUTCOME_BAD_REQUEST).inc()
        ex.outcome, ex.detail = m.OUTCOME_BAD_REQUEST, "model_not_found"
        return model_error(model)
    pool = state.admission.pools[route.pool]
    if kind.native and any(e.kind != "lightllm" for e in pool.spec.engines):
        ex.outcome, ex.detail = m.OUTCOME_BAD_REQUEST, "not_found"
        return error_response(404, f"{path} is LightLLM's native route; pool {pool.name!r} has engines that are not lightllm", code="not_found")
    key = None
    if pool.spec.routing.affinity.enabled:
        aff = pool.spec.routing.affinity
        session = request.headers.get(aff.session_header) if aff.session_header else None
        key = affinity_key(pool.spec.routing, session, prompt_prefix(parsed.fields, aff.prefix_chars) if aff.prefix_chars else None)
    # a pass-through body is the client's own (a multipart upload, audio): its type goes with it
    body_headers = {"Content-Type": request.headers.get("Content-Type"), "Accept": request.headers.get("Accept")} if kind.opaque else None
    admit = not (kind.opaque and not active.config.passthrough.admit)
    return _Resolved(kind, active, path, query, parsed, route, pool, key, admit, trace_headers(request.headers), body_headers)


class _Attempt:
    """The exchange with the engine a dispatch is on (steps 3 and 4).

    Attributes:
        engine: the engine it is sent to (changes on a reroute or a requeue).
        upstream: the engine's response once opened, else ``None``.
        aborted: the upstream request was closed under a generation (a metric).
        tokens: when its stream's output tokens came (the time per output token), only
            for a stream of a group with objectives (``None`` otherwise: nothing per chunk).
        resume: a resumable stream's state (:mod:`proxy.relay.resume`: its pool has
            ``preemption.resume``), else ``None``.
    """

    __slots__ = ("engine", "upstream", "aborted", "tokens", "resume")

    def __init__(self, engine: EngineState, timed: bool, resume: StreamResume | None = None) -> None:
        self.engine = engine
        self.upstream: aiohttp.ClientResponse | None = None
        self.aborted = False
        self.tokens = TokenTimes(asyncio.get_running_loop().time) if timed else None
        self.resume = resume

    def judge(self, admitted: Admitted, ex: Exchange, kind: RequestKind, error: UpstreamError | None = None) -> None:
        """Tell the engine's health what this exchange says of it: ``error``, the open
        that failed; else the answer as relayed (nothing when none was opened). The one
        call of :func:`proxy.routing.exchange_verdict.exchange_verdict`."""
        if error is not None:
            verdict = exchange_verdict(None, True, error.message, unsent=error.unsent, timed_out=error.status == 504)
        elif self.upstream is None:
            verdict = exchange_verdict(None)
        else:
            failed = ex.transfer_broke if kind.opaque else ex.outcome == m.OUTCOME_UPSTREAM_ERROR
            verdict = exchange_verdict(
                self.upstream.status, failed, ex.detail, opaque=kind.opaque, engine_error=ex.engine_error, engine_error_status=ex.engine_error_status
            )
        admitted.report(self.engine, verdict)


async def _serve(request: web.Request, ex: Exchange, req: _Resolved, admitted: Admitted, state: ProxyState) -> web.StreamResponse:
    """Steps 3 and 4 on the admitted engine, once per dispatch (a preempted request waits
    in its queue, then goes again), then :func:`_settle`."""
    att = _Attempt(admitted.engine, timed=req.parsed.stream and ex.group in state.objectives.objectives, resume=_resumable(req, admitted, ex))
    tokens, resume, original = att.tokens, att.resume, req.parsed

    def timed_progress(output_tokens: int) -> None:
        tokens.progress(output_tokens)
        admitted.record_output(output_tokens)

    progress = admitted.record_output if tokens is None else timed_progress

    try:
        while True:
            try:
                plan = await _open(request, ex, req, admitted, att, state)
                if not isinstance(plan, UpstreamBody):
                    if resume is not None and resume.shown:  # a resumed part: its stream is open
                        return await resume.fail(f"the stream could not be resumed: {ex.detail}", ex.detail or "upstream_error")
                    return plan  # it could not be opened
                engine, limits = att.engine, req.active.config.limits
                return await relay_answer(
                    request, att.upstream, ex, req.kind, req.parsed, plan, base_url=engine.url, lightllm=req.kind.native or engine.kind == "lightllm",
                    write_timeout_s=limits.client_write_timeout_s,
                    on_progress=progress if resume is None or not resume.part else (lambda n, done=resume.done_tokens: progress(n + done)),
                    show=admitted.show if resume is None else _unshown,  # a resumable stream stays preemptible until pinned
                    hold_headers=admitted.holds_headers,  # with preemption on, a stream's headers wait for its first event
                    early=req.early,
                    resume=resume,
                )
            except asyncio.CancelledError:
                if not admitted.preempted():
                    raise
            # preempted (its client was shown nothing): abort the upstream work, answer
            # nothing, wait at the head of its queue, and go again on the engine given then
            if att.upstream is not None:
                att.upstream.close()  # aborts the generation upstream
                att.upstream = None
            state.metrics.upstream_aborts.labels(m.ABORT_PREEMPTED).inc()
            if resume is not None and resume.shown:
                # its client was shown part of the answer: the stream stays open, and the
                # next part continues the text sent (proxy.relay.resume)
                state.metrics.resumes.labels(req.pool.name, att.engine.name, ex.group).inc()
                resume.next_part()
                if admitted.ticket is not None:
                    admitted.ticket.resuming = True  # never shed while its client reads part of it
                ex.preemptions, ex.resumes = admitted.preemptions, ex.resumes + 1
                ex.prompt_tokens, ex.output_tokens, ex.upstream_ended = None, 0, False  # the parts before: in resume
                req = replace(req, parsed=resume.body(original))
            else:
                ex.forget_attempt(admitted.preemptions)
                if resume is not None:
                    resume.restart()
                if att.tokens is not None:
                    att.tokens.forget()
            att.aborted = False
            try:
                att.engine = await admitted.requeue()
            except Refused as r:
                if resume is not None and resume.shown:
                    _refused(state, ex, r)  # counted; its answer cannot be sent now
                    return await resume.fail(f"the stream could not be resumed: {r.reason.value}", r.reason.value)
                return _refused(state, ex, r)
            _dispatched(ex, admitted)
    except (asyncio.CancelledError, ConnectionResetError):
        # the client's side only: every upstream read above turns its failures (aiohttp's
        # ClientConnectionResetError is a ConnectionResetError too) into an answer first
        ex.outcome, ex.detail = m.OUTCOME_CLIENT_GONE, "client disconnected"
        raise
    finally:
        _settle(ex, req, admitted, att, state)


async def _open(request: web.Request, ex: Exchange, req: _Resolved, admitted: Admitted, att: _Attempt, state: ProxyState) -> UpstreamBody | web.Response:
    """Step 3: open the request on ``att.engine`` with the body built for it, moving it
    to another engine while its connection fails before any byte is sent. Returns the
    plan it was sent with (``att.upstream`` set), or the error answer (502/503/504)."""
    tried: list[EngineState] = []
    while True:
        engine = att.engine
        plan = engine_plan(req.parsed, req.kind, engine.spec, engine.client, req.route.upstream_model, state.admission.policy, ex.group)
        try:
            att.upstream, plan = await open_upstream(
                engine.client, request.method, req.path, plan, request_id=ex.request_id, query=req.query, native=req.kind.native, trace=req.trace, body_headers=req.body_headers
            )
            return plan
        except UpstreamError as e:
            att.judge(admitted, ex, req.kind, e)
            if e.unsent:  # it never reached the engine: another one may take it
                tried.append(engine)
                nxt = admitted.reroute(tried)
                if nxt is not None:
                    log.info("request %s: engine %s unreachable (%s); sent to engine %s", ex.request_id, engine.name, e.message, nxt.name)
                    att.engine = nxt
                    continue
                if req.pool.tracks_health:
                    # no engine of the pool could take it (each one tried refused or timed
                    # out the connection, no other in rotation within its lease): answered
                    # as when none is in rotation, 503 with Retry-After (issue 21.8)
                    wait = req.pool.router.retry_after_s()
                    ex.outcome, ex.detail = m.OUTCOME_UPSTREAM_ERROR, RefusalReason.NO_ENGINE.value
                    why = f"no engine of pool {req.pool.name!r} could take the request (the last one tried: {e.message})"
                    return error_response(503, f"{why}; retry after {retry_after_seconds(wait)} s", code=RefusalReason.NO_ENGINE.value, retry_after_s=wait)
            ex.outcome, ex.detail = m.OUTCOME_UPSTREAM_ERROR, e.code
            att.aborted = e.aborted
            return error_response(e.status, e.message, code=e.code)
        except asyncio.CancelledError:
            att.aborted = True  # the client left while the proxy waited for the upstream's headers
            raise


def _settle(ex: Exchange, req: _Resolved, admitted: Admitted, att: _Attempt, state: ProxyState) -> None:
    """Step 5's part before the release, however steps 3 and 4 ended: the engine's
    health verdict; the upstream released when its answer was read to the end, else
    closed (which aborts the generation, counted); the token counts the release trues
    the ticket up with (nothing charged when the upstream refused or failed before any
    output token)."""
    att.judge(admitted, ex, req.kind)  # no claim when nothing was opened
    if att.upstream is not None:
        if ex.upstream_ended:
            att.upstream.release()
        else:
            att.upstream.close()  # aborts the generation upstream
            att.aborted = True
    if att.aborted:
        state.metrics.upstream_aborts.labels(ex.outcome or m.ABORT_UNKNOWN).inc()
    resume = att.resume
    if resume is not None:
        if resume.part:  # every part's tokens (proxy.relay.resume: StreamResume.charge)
            ex.prompt_tokens, ex.output_tokens = resume.charge(ex.prompt_tokens, ex.output_tokens)
        if resume.pinned and resume.why_pinned not in UNPINNED_ENDS:
            ex.resume = f"pinned: {resume.why_pinned}"
    if ex.output_tokens == 0 and ex.outcome in _NOTHING_SERVED:
        ex.prompt_tokens = 0  # the upstream refused or failed before any token: charge nothing
    admitted.true_up(ex.prompt_tokens, ex.output_tokens)
    _observe_objectives(ex, req, att, state)


def _observe_objectives(ex: Exchange, req: _Resolved, att: _Attempt, state: ProxyState) -> None:
    """Record a streamed answer's latency in its group's objectives on its engine
    (:mod:`qos.objectives`): its time to first token from arrival (queue included) when
    a first byte was relayed, and its time per output token when measured
    (:class:`proxy.telemetry.objectives.TokenTimes`). Only streams (a client that asked
    ``stream: true``): a non-streaming answer's first byte is its whole answer."""
    tracker = state.objectives
    if att.tokens is None or ex.group not in tracker.objectives:
        return
    now, engine = time.monotonic(), (att.engine.spec.pool, att.engine.name)
    if ex.first_byte_at is not None:
        tracker.observe(now, ex.group, engine, TTFT, ex.first_byte_at - ex.arrived_at)
    tpot = att.tokens.tpot_s()
    if tpot is not None:
        tracker.observe(now, ex.group, engine, TPOT, tpot)


def _resumable(req: _Resolved, admitted: Admitted, ex: Exchange) -> StreamResume | None:
    """The resume state of a stream whose pool resumes preempted streams
    (``preemption.resume``), or ``None``: its pool does not, preemption is off, or the
    request cannot be resumed (``ex.resume`` says why: the access log)."""
    if not req.pool.spec.resume or not admitted.holds_headers or not req.parsed.stream:
        return None
    why = resume_refusal(req.kind.name, req.parsed)
    if why is not None:
        ex.resume = f"not resumable: {why}"
        return None
    ex.resume = "resumable"
    return StreamResume(req.kind.name == "chat", req.parsed.max_tokens, admitted.show, req.parsed.prompt_tokens)


def _unshown() -> None:
    """A resumable stream's ``show``: its ticket is marked shown only when it is pinned
    (:class:`proxy.relay.resume.StreamResume`)."""


def _dispatched(ex: Exchange, admitted: Admitted) -> None:
    """Record a dispatch (after admission, or again after a requeue): the class it was
    admitted in, and its wait from arrival."""
    if admitted.group is not None:
        ex.group = admitted.group
    ex.queue_wait = asyncio.get_running_loop().time() - ex.arrived_at


def _refused(state: ProxyState, ex: Exchange, r: Refused) -> web.Response:
    """Answer a refusal of admission (on entering, or after a preemption's requeue):
    counted in ``rejections``, its wait recorded."""
    ex.queue_wait = asyncio.get_running_loop().time() - ex.arrived_at
    state.metrics.rejections.labels(ex.group, r.reason.value).inc()
    ex.outcome, ex.detail = m.OUTCOME_REFUSED, r.reason.value
    return refusal_response(r)
