"""A request's handle inside the scheduler, and the reasons a request is refused."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class TicketState(enum.Enum):
    """Life of a ticket: QUEUED -> ADMITTED -> RELEASED, or QUEUED -> REFUSED; a
    preempted ticket goes ADMITTED -> QUEUED again (:meth:`qos.Scheduler.requeue`)."""

    QUEUED = "queued"
    ADMITTED = "admitted"
    RELEASED = "released"
    REFUSED = "refused"


class RefusalReason(enum.Enum):
    """Why a request was not (or no longer) served. The value is the wire-level code."""

    QUEUE_FULL = "queue_full"
    GROUP_QUEUE_FULL = "group_queue_full"
    TIMEOUT = "queue_timeout"
    RATE_LIMITED = "rate_limited"
    EVICTED = "evicted"
    CANCELLED = "client_cancelled"
    SHUTDOWN = "shutting_down"
    TOO_LARGE = "request_too_large"  # its reservation can never fit max_inflight_tokens
    NO_ENGINE = "no_healthy_engine"  # no engine of its pool is in rotation (raised by the capacity's owner)
    OBJECTIVE_PROTECTION = "objective_protection"  # shed for a higher group missing its objective (qos.objective_protection)
    OBJECTIVE_UNREACHABLE = "objective_unreachable"  # its group's TTFT objective cannot be met (on_miss: reject)


class Refused(Exception):
    """A request was refused admission.

    Attributes:
        reason: the :class:`RefusalReason`.
        retry_after_s: seconds after which a retry may succeed (for ``Retry-After``).
        detail: a human-readable sentence for the error body.
        scope: for RATE_LIMITED, whose bucket tripped: ``"user"`` or ``"group"``;
            ``None`` otherwise.
        limit: for RATE_LIMITED, which limit: ``"requests_per_minute"`` or
            ``"tokens_per_minute"`` (the config key); ``None`` otherwise.
    """

    def __init__(
        self, reason: RefusalReason, retry_after_s: float, detail: str, scope: str | None = None, limit: str | None = None
    ) -> None:
        super().__init__(detail)
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.detail = detail
        self.scope = scope
        self.limit = limit


@dataclass(eq=False, slots=True)
class Ticket:
    """One request as the scheduler sees it. Identity-compared; created by the scheduler.

    Attributes:
        seq: arrival order, unique per scheduler.
        user_id, group: who asked, and the priority class it is queued in.
        prompt_tokens: estimated prompt length (tokens).
        max_output_tokens: output tokens *reserved* (all choices): the request's
            ``max_tokens`` or the cost model's default, clamped to the ceiling, times
            its output multiplier (:meth:`qos.CostModel.reserve_output`). A capacity
            and rate-limit reservation only, never a fair-share cost.
        choices: the output multiplier (``max(n, best_of)``) the reservation counts.
        enqueued_at, admitted_at: clock readings (seconds); ``enqueued_at`` is when it
            last started waiting (a preempted ticket's requeue).
        deadline: clock reading after which a queued ticket times out.
        confirmed: cost (token units, before division by the user's weight) of the
            service this request has been seen to receive: output as it is produced,
            and at the end the real prompt and output counts. Confirmed cost is what a
            user's fair-share counter holds.
        pending: the expected cost of the rest while in flight (token units): the
            expected prompt plus the expected output not produced yet
            (:class:`qos.usage_model.UsageModel`). It orders the user, so requests in
            flight throttle it; it is 0 once the ticket is released.
        expected_prompt, expected_output: what the usage model expected at dispatch
            (tokens).
        speculative: its user had no finished request when it was dispatched, so its
            expectation is the request's own claim (it never moves a virtual time).
        share_charged: cost counted so far toward its class's share (``min_share``): an
            estimate from the user's past output at dispatch, real counts later.
        output_tokens: output tokens reported so far.
        state: see :class:`TicketState`.
        refusal: set when the state is REFUSED.
        rate: the rate-limit reservation (:class:`qos.rate_limit.RateReservation`).
        placement: set by the capacity model at dispatch (where the request was given
            room; an engine, for a pool), handed back to it at release.
        shown: its client has been sent something of the answer (a status line, a
            header, a byte); set by the caller. A shown request is never preempted.
        preemptions: times it was preempted and requeued (:meth:`qos.Scheduler.requeue`).
        context: free slot for the caller (the proxy keeps its wake-up future here).
        stream: its answer is streamed, so its client waits for a first token (what a
            time-to-first-token objective times); set by the caller. While it is in
            flight with no ``output_tokens`` yet, objective protection counts its wait
            (:mod:`qos.objective_protection`).
        resuming: its client has been shown part of a streamed answer and it waits to
            be resumed where it stopped (``preemption.resume``); set by the caller.
            Objective protection never sheds it (:func:`qos.objective_protection.shed_victims`):
            refusing it would cut a stream its client is reading.
        ttft_target_s: its class's time-to-first-token objective (seconds) when it was
            dispatched (:attr:`qos.GroupPolicy.ttft_target_s`), or ``None``.
        headroom: the headroom level its engine holds it at, set by the capacity model
            that places it (its class's :attr:`qos.GroupPolicy.headroom` then).
    """

    seq: int
    user_id: str
    group: str
    prompt_tokens: int
    max_output_tokens: int
    enqueued_at: float
    deadline: float
    choices: int = 1
    admitted_at: float | None = None
    confirmed: float = 0.0
    pending: float = 0.0
    expected_prompt: float = 0.0
    expected_output: float = 0.0
    speculative: bool = False
    share_charged: float = 0.0
    output_tokens: int = 0
    state: TicketState = TicketState.QUEUED
    refusal: Refused | None = None
    rate: Any = field(default=None, repr=False)
    placement: Any = field(default=None, repr=False)
    shown: bool = False
    preemptions: int = 0
    context: Any = field(default=None, repr=False)
    stream: bool = False
    resuming: bool = False
    ttft_target_s: float | None = None
    headroom: float = 0.0

    @property
    def reserved_tokens(self) -> int:
        """Tokens this request may occupy upstream (prompt + reserved output)."""
        return self.prompt_tokens + self.max_output_tokens

    @property
    def charged(self) -> float:
        """What the request weighs in its user's order now (token units): confirmed
        plus pending; after release, the real cost."""
        return self.confirmed + self.pending
