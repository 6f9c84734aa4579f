"""What one exchange with an engine tells that engine's health: :func:`exchange_verdict`,
the one place where the passive rule (:mod:`proxy.routing.engine_health`) reads a
request's outcome, and the :class:`Verdict` it gives.
"""

from __future__ import annotations

from dataclasses import dataclass

@dataclass(frozen=True, slots=True)
class Verdict:
    """What this replica tells an engine's health after one exchange with it: the
    arguments of :meth:`EngineHealth.record_request` (through
    :meth:`proxy.routing.router.PoolRouter.report`).

    Attributes:
        ok: the engine answered (4xx included): its failure streak is reset.
        reason: for a failure, one of :data:`proxy.routing.engine_health.FAILURE_REASONS`.
        detail: a short description of the failure, for status pages.
        status: an ``http_5xx`` failure's status, when known.
    """

    ok: bool
    reason: str | None = None
    detail: str = ""
    status: int | None = None


ANSWERED = Verdict(True)


def exchange_verdict(
    answered: int | None,
    failed: bool = False,
    detail: str = "",
    *,
    unsent: bool = False,
    timed_out: bool = False,
    opaque: bool = False,
    engine_error: bool = False,
    engine_error_status: int | None = None,
) -> Verdict | None:
    """The engine-health verdict of one exchange with an engine: the one place where the
    passive rule (:mod:`proxy.routing.engine_health`) reads a request's outcome.

    What does this replica claim for an engine it skips? Nothing: ``None``. An exchange
    that heard nothing from the engine and did not fail to reach it (the client left, or
    the request was preempted, while it waited for the engine's headers; no request was
    opened) is no evidence either way: no success that would reset the engine's failure
    streak, no failure that would count toward ejecting it. Nor is an engine the router
    passed over told anything. (The single-``upstream`` form claims nothing at all: its
    pool tracks no health, :attr:`proxy.admission.admission.Pool.tracks_health`.)

    Args:
        answered: the status of the engine's answer once its headers came; ``None``
            when none came.
        failed: the exchange failed on the engine's side. Without an answer: the
            request could not be opened (see ``unsent``, ``timed_out``; else the
            connection was reset or closed without an answer). With one: the relay ended
            it as ``upstream_error`` (a stream cut or unfinished, a body that broke, an
            encoding the proxy cannot read, or an error the engine reported itself: see
            ``engine_error``); for a pass-through answer, its transfer broke.
        detail: the failure's short description.
        unsent: the open failed before any byte reached the engine (``connect``).
        timed_out: the open got no headers in time (``timeout``).
        opaque: a pass-through path's answer: its status, any status, says nothing of
            the engine's health (a 5xx may be that path's own); only a broken transfer.
        engine_error: the failure was an error the engine reported in its answer (an
            in-band error event, a JSON error body): the engine answered, as with a 4xx.
        engine_error_status: the 4xx/5xx that error names, if any: a 5xx is a failure.

    Returns:
        ``None`` (no claim), :data:`ANSWERED`, or a failure: ``connect``, ``timeout``,
        ``reset`` (no answer), ``http_5xx`` (a 5xx status, or one the engine named in its
        answer), ``stream_cut`` (an answer below 400 that broke or ended unfinished).
    """
    if answered is None:
        if not failed:
            return None
        return Verdict(False, "connect" if unsent else "timeout" if timed_out else "reset", detail)
    if opaque:
        return Verdict(False, "stream_cut", detail) if failed else ANSWERED
    if answered >= 500:
        return Verdict(False, "http_5xx", f"answered {answered}", answered)
    if engine_error_status is not None and engine_error_status >= 500:
        return Verdict(False, "http_5xx", f"reported a {engine_error_status} error in its answer", engine_error_status)
    if failed and answered < 400 and not engine_error:
        return Verdict(False, "stream_cut", detail)
    return ANSWERED


__all__ = ["ANSWERED", "Verdict", "exchange_verdict"]
