"""Rate limits reserved in the shared state (Redis) before a request reaches the scheduler.

With ``shared_state``, a request's RPM/TPM take is one atomic script in Redis
(:meth:`proxy.shared.SharedState.reserve_rate`), so the limits hold across every replica.
The take is asynchronous (a round trip) and the scheduler is not, so the proxy reserves
*before* submitting, and hands the reservation to the scheduler through
:class:`SharedRateLimiter`, an object with the surface of :class:`qos.RateLimiter`: the
scheduler then refunds it (refused, evicted, timed out or cancelled while queued, drained
at shutdown) and settles it (dispatched: trued up to the real tokens at release) on its
usual paths, and those go to Redis with the next sync. A request the scheduler refuses at
submit (queue full, shutting down, too large) is refunded by :func:`reserve_and_submit`.

Why not keep the scheduler's local :class:`qos.RateLimiter` as a view of Redis: a local
check can only say what Redis said up to one interval ago, so N replicas checking
locally let up to N requests through per bucket and interval; the atomic take cannot.
The shared state's own mirror (``Mirror``) still refuses locally, without a round trip, a
request that the levels Redis last reported say cannot fit.

What a client sees is unchanged: 429 with ``Retry-After``, and ``error.scope`` /
``error.limit`` naming the bucket that needs the longest wait.
"""

from __future__ import annotations

from typing import Any, Callable

from qos import RefusalReason, Refused, Scheduler, Ticket

from ..shared import RateLimited, Reservation


class SharedRateLimiter:
    """The :class:`qos.RateLimiter` surface over reservations already taken in the shared
    state. :meth:`tripped` never refuses (the shared state decided), :meth:`reserve`
    returns the reservation handed over just before ``submit``, :meth:`refund` and
    :meth:`settle` go to the shared state.

    Args:
        shared: the shared state (:class:`proxy.shared.SharedState`).
    """

    max_buckets = 0  # no local buckets

    def __init__(self, shared) -> None:
        self.shared = shared
        self.handed: Reservation | None = None

    def __len__(self) -> int:
        return 0

    def tripped(self, *_args) -> tuple[float, str | None, str | None]:
        return 0.0, None, None

    def check(self, *_args) -> float:
        return 0.0

    def reserve(self, *_args) -> Reservation | None:
        res, self.handed = self.handed, None
        return res

    def refund(self, res: Reservation | None, now: float) -> None:
        if res is not None:
            self.shared.refund_rate(res)

    def settle(self, res: Reservation | None, tokens_used: int, now: float) -> None:
        if res is not None:
            self.shared.settle_rate(res, tokens_used)


def _limited(limits) -> bool:
    return bool(limits.requests_per_minute or limits.tokens_per_minute)


async def reserve_and_submit(scheduler: Scheduler, limiter: SharedRateLimiter, request: dict[str, Any], submit: Callable[[], Ticket]) -> Ticket:
    """Reserve the request's rate limits in the shared state, then submit it.

    Args:
        scheduler: the scheduler whose ``rate_limiter`` is ``limiter``.
        limiter: the scheduler's :class:`SharedRateLimiter`.
        request: the request as :meth:`qos.Scheduler.rate_request` takes it
            (``user_id``, ``group``, ``prompt_tokens``, ``max_output_tokens``,
            ``choices``, ``output_ceiling``).
        submit: submits it (``scheduler.submit(...)`` with those arguments), called once,
            synchronously, after the take.

    Returns:
        The ticket (ADMITTED or QUEUED), as ``submit`` returns it.

    Raises:
        Refused: RATE_LIMITED (scope and limit of the bucket that needs the longest wait;
            nothing taken), or whatever ``submit`` raises (the take is refunded).
        asyncio.CancelledError: the client left during the round trip (a take that
            succeeded meanwhile is refunded by the shared state).
    """
    if scheduler.closed:
        raise Refused(RefusalReason.SHUTDOWN, 1.0, "the server is shutting down")
    up, gpol, tokens = scheduler.rate_request(
        request["user_id"], request["group"], request["prompt_tokens"], request["max_output_tokens"],
        choices=request.get("choices", 1), output_ceiling=request.get("output_ceiling"),
    )  # fmt: skip
    if not (_limited(up.limits) or _limited(gpol.limits)):
        return submit()  # no limit applies: no round trip, nothing to hand over
    try:
        res = await limiter.shared.reserve_rate(up.user_id, gpol.name, up.limits, gpol.limits, tokens)
    except RateLimited as e:
        limit = f"{e.unit}_per_minute"
        whose = f"user {up.user_id!r}" if e.scope == "user" else f"group {gpol.name!r} (all its users together)"
        raise Refused(RefusalReason.RATE_LIMITED, e.retry_after_s, f"rate limit exceeded: the {limit} of {whose}", scope=e.scope, limit=limit) from None
    limiter.handed = res
    try:
        return submit()
    except BaseException:
        if limiter.handed is res:  # refused before the scheduler took it
            limiter.shared.refund_rate(res)
        raise
    finally:
        limiter.handed = None


__all__ = ["SharedRateLimiter", "reserve_and_submit"]
