"""The scheduler's refusals in words: the :class:`qos.Refused` it raises at submit, or
records on a queued ticket it turns away later, for each :class:`qos.RefusalReason`,
with its message (the error body's sentence) and its ``Retry-After`` hint (seconds; a
queue's, from its measured drain rate: :mod:`qos.queue_wait`)."""

from __future__ import annotations

from .ticket import RefusalReason, Refused


def shutdown() -> Refused:
    """SHUTDOWN: the scheduler is closed."""
    return Refused(RefusalReason.SHUTDOWN, 1.0, "the server is shutting down")


def too_large(reserved: int, max_inflight_tokens: int | None) -> Refused:
    """TOO_LARGE: a reservation of ``reserved`` tokens can never be in flight
    (``max_inflight_tokens``: the capacity's token bound, when it has one)."""
    limit = f" (admission.max_inflight_tokens is {max_inflight_tokens})" if max_inflight_tokens is not None else ""
    return Refused(
        RefusalReason.TOO_LARGE,
        1.0,
        f"the request reserves {reserved} tokens (prompt + max_tokens x choices), more than can ever be in flight{limit}; lower max_tokens",
    )


def rate_limited(user_id: str, group: str, wait: float, scope: str, limit: str) -> Refused:
    """RATE_LIMITED: the bucket ``limit`` (a config key) of ``scope`` (``"user"``: the
    user's own; else the group's, all its users together) needs ``wait`` seconds."""
    whose = f"user {user_id!r}" if scope == "user" else f"group {group!r} (all its users together)"
    return Refused(RefusalReason.RATE_LIMITED, wait, f"rate limit exceeded: the {limit} of {whose}", scope=scope, limit=limit)


def group_queue_full(group: str, max_queue: int, hint: float) -> Refused:
    """GROUP_QUEUE_FULL: ``group`` has its ``max_queue`` requests waiting."""
    return Refused(RefusalReason.GROUP_QUEUE_FULL, hint, f"the queue of group {group!r} is full ({max_queue} waiting)")


def queue_full(max_queue: int, hint: float) -> Refused:
    """QUEUE_FULL: the global queue is full and nothing may be evicted for the newcomer."""
    return Refused(RefusalReason.QUEUE_FULL, hint, f"the admission queue is full ({max_queue} waiting)")


def evicted(group: str, by_higher: bool, hint: float) -> Refused:
    """EVICTED: a request of ``group`` made room for a newcomer of a higher class
    (``by_higher``) or of a class below its ``min_share`` (:func:`qos.preemption.evictee`)."""
    if by_higher:
        why = f"evicted from the queue by a request of higher priority (group {group!r})"
    else:
        why = f"evicted from the queue by a request of a group below its min_share (group {group!r})"
    return Refused(RefusalReason.EVICTED, hint, why)


def timed_out(waited: float, hint: float) -> Refused:
    """TIMEOUT: the request waited ``waited`` seconds, its queue timeout."""
    return Refused(RefusalReason.TIMEOUT, hint, f"waited {waited:.1f} s in the queue")


def withdrawn(reason: RefusalReason, waited: float, hint: float) -> Refused:
    """``reason`` (the caller's: the client left, its own timeout) after ``waited``
    seconds in the queue."""
    return Refused(reason, hint, f"{reason.value} after {waited:.3f} s in the queue")
