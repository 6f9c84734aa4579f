"""The scheduling core of llm-qos: pure admission control, no I/O.

``Scheduler`` decides which request goes upstream next (strict priority between classes,
weighted token-fair sharing inside a class, queue bounds); it asks a ``RateLimiter``
(reserve, refund, settle) and a ``Capacity`` (room now, and where), either of which a
caller may supply and share. ``SchedulerPolicy`` and friends describe what it enforces.
"""

from .capacity import Capacity, LocalCapacity
from .policy import MAX_CHOICES, MAX_COUNT, CostModel, GroupPolicy, RateLimit, SchedulerPolicy, UserPolicy, clamp_count
from .rate_limit import RateLimiter, RateReservation, TokenBucket
from .scheduler import Scheduler
from .ticket import RefusalReason, Refused, Ticket, TicketState

__all__ = [
    "MAX_CHOICES",
    "MAX_COUNT",
    "Capacity",
    "CostModel",
    "GroupPolicy",
    "LocalCapacity",
    "RateLimit",
    "RateLimiter",
    "RateReservation",
    "RefusalReason",
    "Refused",
    "Scheduler",
    "SchedulerPolicy",
    "Ticket",
    "TicketState",
    "TokenBucket",
    "UserPolicy",
    "clamp_count",
]
