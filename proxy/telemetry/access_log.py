"""The access log: one JSON object per request, on the ``llm_qos.access`` logger.

Its fields (never a key, a prompt or an answer): ``ts`` (wall clock, seconds),
``request_id``, ``upstream_request_id`` (the engine's own id when it differs), ``user``,
``group``, ``model`` (the body's, at most 128 characters), ``kind``, ``status`` (the HTTP
status sent; 499: the client left before any), ``outcome`` (a ``metrics.OUTCOME_*``
value), ``detail``, ``queue_wait_s``, ``ttft_s``, ``duration_s``, ``prompt_tokens``,
``output_tokens``, ``preemptions``, ``resumes`` (times its stream was resumed after a
preemption), ``resume`` (``null`` where its pool does not resume streams; else
``resumable``, ``not resumable: <why>`` or ``pinned: <why>``). How the line is written to its file:
:mod:`.log_format`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson

from .metrics import OUTCOME_UPSTREAM_ERROR

ACCESS_LOG = logging.getLogger("llm_qos.access")


def access_line(ex: Any, now: float) -> str:
    """The access line of one request, as JSON text.

    Args:
        ex: the request as the proxy handled it (a :class:`proxy.relay.relay.Exchange`;
            read only).
        now: the loop time (seconds) it ended at (``duration_s`` is from its
            ``arrived_at``).
    """
    return orjson.dumps(
        {
            "ts": round(time.time(), 3),
            "request_id": ex.request_id,
            "upstream_request_id": ex.upstream_request_id,
            "user": ex.user or None,
            "group": ex.group or None,
            "model": ex.model,
            "kind": ex.kind or None,
            "status": ex.status,
            "outcome": ex.outcome or OUTCOME_UPSTREAM_ERROR,
            "detail": ex.detail or None,
            "queue_wait_s": None if ex.queue_wait is None else round(ex.queue_wait, 4),
            "ttft_s": None if ex.first_byte_at is None else round(ex.first_byte_at - ex.arrived_at, 4),
            "duration_s": round(now - ex.arrived_at, 4),
            "prompt_tokens": ex.prompt_tokens,
            "output_tokens": ex.output_tokens,
            "preemptions": ex.preemptions,
            "resumes": ex.resumes,
            "resume": ex.resume or None,
        }
    ).decode()


def log_access(ex: Any, now: float) -> None:
    """Write :func:`access_line` of ``ex`` on :data:`ACCESS_LOG`, if it logs ``INFO``.
    Called once per request, after its answer has gone out (``loop.call_soon``)."""
    if not ACCESS_LOG.isEnabledFor(logging.INFO):
        return
    line = access_line(ex, now)
    # a record made directly: no caller lookup (logger.info's stack walk) for a line whose
    # source is always this function
    ACCESS_LOG.handle(logging.LogRecord(ACCESS_LOG.name, logging.INFO, __file__, 0, line, None, None))
