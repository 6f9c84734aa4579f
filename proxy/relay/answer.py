"""An engine's answer to the client, the way the client asked for it: one choice among
the relays.

* a pass-through path's answer, any status: bytes as they come (:func:`~.relay.relay_stream`
  with the path's :class:`proxy.wire.sse.OpaqueStream`);
* a 200 event stream the client may read as one: relayed as a stream, counted as it goes;
* an event stream a non-streaming client gets (``upstream.stream_non_streaming``, or an
  engine that streams a request naming no ``stream``): assembled into the JSON it asked
  for (:mod:`.assemble`), for the kinds whose stream the proxy reads;
* anything else (JSON, an error status): the body as a whole (:func:`~.relay.relay_body`);
  LightLLM's validation errors (417) as the client's 400.

An answer the proxy cannot decode (a ``Content-Encoding`` it does not undo) is a 502.
"""

from __future__ import annotations

from collections.abc import Callable

import aiohttp
from aiohttp import web

from ..telemetry.metrics import OUTCOME_BAD_REQUEST, OUTCOME_OK, OUTCOME_UPSTREAM_ERROR
from ..wire.errors import error_response, lightllm_error_message
from ..wire.headers import DECODED_CODINGS, content_coding
from ..wire.request_body import ParsedRequest
from ..wire.sse import EventTooLarge
from .assemble import ASSEMBLED_KINDS, relay_assembled
from .relay import Exchange, relay_body, relay_stream
from .request_kinds import RequestKind
from .resume import StreamResume
from .upstream_body import UpstreamBody, choices_of


def _no_progress(tokens: int) -> None:
    """Progress of a pass-through answer: not recorded (it is admitted at a fixed cost)."""


async def relay_answer(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    ex: Exchange,
    kind: RequestKind,
    parsed: ParsedRequest,
    plan: UpstreamBody,
    *,
    base_url: str,
    lightllm: bool,
    write_timeout_s: float,
    on_progress: Callable[[int], None],
    show: Callable[[], None],
    hold_headers: bool,
    early: web.StreamResponse | None = None,
    resume: StreamResume | None = None,
) -> web.StreamResponse:
    """Relay ``upstream``'s answer to ``request`` (see the module docstring).

    Args:
        request: the client's request (a stream's response is prepared on it).
        upstream: the engine's response, body unread.
        ex: updated with status, first byte, token counts and outcome; a pass-through
            answer whose transfer broke sets ``ex.transfer_broke``, and one with a status
            of 400 or more that relayed well is counted ``upstream_error``.
        kind: the request's kind; parsed: its parsed body (``stream``, ``n``).
        plan: what the engine was sent (:func:`proxy.relay.upstream_body.plan_upstream_body`:
            assemble, strip usage).
        base_url: the engine's base URL (:func:`proxy.wire.headers.client_headers`).
        lightllm: a 417 is LightLLM's validation error (a native route, or a lightllm engine).
        write_timeout_s: a client whose socket stays full this long (seconds) is dropped.
        on_progress: the output token count of a stream as it grows.
        show: called when the client is first sent anything of the answer (after that
            the request is never preempted).
        hold_headers: a stream's status line and headers wait for its first event
            (``show`` is called then); else ``show`` is called at once.
        early: a stream's response already sent (status 200 and headers) while it
            waited (:mod:`proxy.admission.queue_status`); an event stream is written on
            it; any other answer comes back as it is, for the caller to end it with.
        resume: a resumable stream's state (:mod:`.resume`), or ``None``. In a resumed
            part (its client already shown the stream), an answer that is not a 200
            event stream ends the client's stream with an error event.

    Raises:
        asyncio.CancelledError, ConnectionResetError: the client went away (the caller
            aborts the upstream). The upstream's own failures become answers.
    """
    coding = content_coding(upstream.headers)
    if coding not in DECODED_CODINGS:
        ex.outcome, ex.detail = OUTCOME_UPSTREAM_ERROR, "upstream_bad_response"
        return error_response(502, f"the upstream answered with Content-Encoding {coding!r}, which the proxy cannot decode", code="upstream_bad_response")
    ctype = upstream.headers.get("Content-Type", "").lower()
    is_json = "json" in ctype
    if kind.opaque:  # any answer, relayed as bytes as they come: a file, audio, a stream
        show()  # its headers go to the client now: never preempted
        resp = await relay_stream(request, upstream, ex, _no_progress, kind.scanner(), write_timeout_s, base_url=base_url)
        ex.transfer_broke = ex.outcome == OUTCOME_UPSTREAM_ERROR
        if upstream.status >= 400 and ex.outcome == OUTCOME_OK:
            ex.outcome, ex.detail = OUTCOME_UPSTREAM_ERROR, f"upstream answered {upstream.status}"
        return resp
    # an event stream the client did not ask for (transformers serve streams a Responses
    # request that names no ``stream``) is assembled into the JSON it asked for, where the
    # proxy reads that kind's stream (chat, completions, Responses); any other kind's is
    # relayed and accounted as a stream, as the engine sent it
    event_stream = "text/event-stream" in ctype
    assemble = plan.assemble or (event_stream and not parsed.stream and kind.name in ASSEMBLED_KINDS)
    if resume is not None and resume.shown and not (upstream.status == 200 and event_stream and not is_json):
        try:
            await upstream.read()  # a refusal of the resumed request, before any generation
            ex.upstream_ended = True
        except (aiohttp.ClientError, TimeoutError):
            pass
        ex.outcome, ex.detail = OUTCOME_UPSTREAM_ERROR, f"resumed part answered {upstream.status}"
        return await resume.fail(f"the upstream refused to resume the stream ({upstream.status})", "upstream_resume_refused")
    if (parsed.stream or event_stream) and upstream.status == 200 and not is_json and not assemble:
        if not hold_headers:
            show()
        return await relay_stream(
            request,
            upstream,
            ex,
            on_progress,
            kind.scanner(),
            write_timeout_s=write_timeout_s,
            choices=choices_of(parsed.fields),
            strip_usage=plan.strip_usage,
            base_url=base_url,
            on_show=show if hold_headers else None,
            early=early,
            resume=resume,
        )
    try:
        if upstream.status == 417 and lightllm:  # LightLLM's validation errors, any route
            body = await upstream.read()
            ex.upstream_ended = True  # read in full: nothing to abort
            ex.outcome = OUTCOME_BAD_REQUEST
            return error_response(400, lightllm_error_message(body), code="invalid_request")
        if assemble and upstream.status == 200 and not is_json:
            return await relay_assembled(upstream, ex, kind.name, choices=choices_of(parsed.fields), base_url=base_url)
        return await relay_body(upstream, ex, native=kind.native, base_url=base_url)
    except (aiohttp.ClientError, TimeoutError, EventTooLarge) as e:
        ex.outcome, ex.detail = OUTCOME_UPSTREAM_ERROR, type(e).__name__
        return error_response(502, "the upstream failed while sending its answer", code="upstream_error")
