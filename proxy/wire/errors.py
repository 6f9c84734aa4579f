"""OpenAI-style error bodies: the one function every error response is built by.

Shape (as the OpenAI API answers): ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import math

import orjson
from aiohttp import web

from qos import RefusalReason, Refused

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "upstream_error",
    503: "overloaded_error",
    504: "upstream_timeout",
}


def error_body(status: int, message: str, code: str | None = None, param: str | None = None, extra: dict | None = None) -> bytes:
    """The JSON bytes of an OpenAI-style error; ``extra`` adds fields to the error object
    (after the four standard ones, which it cannot replace)."""
    error = {"message": message, "type": _TYPES.get(status, "error"), "param": param, "code": code}
    if extra:
        error = {**extra, **error}
    return orjson.dumps({"error": error})


def retry_after_seconds(retry_after_s: float) -> int:
    """The whole seconds ``Retry-After`` says for a wait of ``retry_after_s``: rounded
    up, at least 1. A message that states the wait uses it too, to agree with the header."""
    return max(1, math.ceil(retry_after_s))


def error_response(
    status: int,
    message: str,
    code: str | None = None,
    param: str | None = None,
    retry_after_s: float | None = None,
    extra: dict | None = None,
) -> web.Response:
    """An aiohttp response carrying an OpenAI-style error.

    Args:
        status: HTTP status (4xx/5xx).
        message: a sentence for people.
        code: a stable machine-readable code (e.g. ``queue_full``).
        param: the offending request field, if any.
        retry_after_s: adds ``Retry-After`` (whole seconds, rounded up, at least 1).
        extra: more fields of the error object (e.g. a 429's ``scope`` and ``limit``).
    """
    headers = {}
    if retry_after_s is not None:
        headers["Retry-After"] = str(retry_after_seconds(retry_after_s))
    return web.Response(
        status=status,
        body=error_body(status, message, code, param, extra),
        content_type="application/json",
        headers=headers,
    )


#: refusals answered 503 (the service, not the caller, is the reason); every other is a 429
SERVICE_UNAVAILABLE = frozenset({RefusalReason.EVICTED, RefusalReason.SHUTDOWN, RefusalReason.NO_ENGINE})


def refusal_response(r: Refused) -> web.Response:
    """The answer to a request admission refused (:class:`qos.Refused`): 400
    ``too_large`` (``param: max_tokens``; no retry can help); 503 for
    :data:`SERVICE_UNAVAILABLE`; else 429 (rate limit, queue full, timeout). ``code`` is
    the reason's value; ``Retry-After`` the refusal's hint; a rate limit's error object
    also names its ``scope`` and ``limit``."""
    if r.reason is RefusalReason.TOO_LARGE:  # no retry can help
        return error_response(400, r.detail, code=r.reason.value, param="max_tokens")
    status = 503 if r.reason in SERVICE_UNAVAILABLE else 429
    extra = {"scope": r.scope, "limit": r.limit} if r.scope else None  # which rate limit tripped
    return error_response(status, r.detail, code=r.reason.value, retry_after_s=r.retry_after_s, extra=extra)


def lightllm_error_message(body: bytes) -> str:
    """The message of a LightLLM error body: ``{"message"}`` (0.0.1) or ``{"error":
    {"message"}}`` (v1.2.0, ``api_errors.create_error_response``); else the body's start
    (500 bytes)."""
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


def sse_error_event(message: str, code: str) -> bytes:
    """A terminal SSE event for a stream that fails after its headers were sent."""
    return b"data: " + error_body(502, message, code) + b"\n\n"


def error_status(err: dict) -> int | None:
    """The HTTP status an engine's error object names: its numeric ``code`` (vLLM,
    SGLang) or ``status`` when that is a 4xx/5xx, else ``None``."""
    for key in ("code", "status"):
        v = err.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and 400 <= v <= 599:
            return v
    return None


def engine_error_response(err: dict) -> web.Response:
    """An error the engine reported inside a stream (``data: {"error": {...}}``), answered
    to a client that asked for a non-streaming answer: the engine's error object as the
    body's ``error``, and the engine's numeric ``code`` (or ``status``) as the HTTP
    status when it is a 4xx/5xx, else 502.

    Args:
        err: the engine's error object (``proxy.wire.sse.error_of``).
    """
    status = error_status(err) or 502
    body = {k: v for k, v in err.items() if k != "object"}
    body.setdefault("message", "the upstream reported an error")
    body.setdefault("type", _TYPES.get(status, "error"))
    return web.Response(status=status, body=orjson.dumps({"error": body}), content_type="application/json")


def responses_error_event(message: str, code: str, sequence_number: int) -> bytes:
    """A terminal ``error`` event for a Responses API stream that fails after its headers
    were sent (that stream has no ``[DONE]``; the OpenAI SDK hands this event to the caller
    as a ``ResponseErrorEvent``): ``event: error`` with ``{"type": "error", "code", "message", "param": null,
    "sequence_number"}`` (OpenAI's ``ResponseErrorEvent``)."""
    payload = {"type": "error", "code": code, "message": message, "param": None, "sequence_number": sequence_number}
    return b"event: error\ndata: " + orjson.dumps(payload) + b"\n\n"
