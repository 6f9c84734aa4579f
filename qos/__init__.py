"""The scheduling core of llm-qos: pure admission control, no I/O.

``Scheduler`` decides which request goes upstream next (strict priority between classes,
weighted token-fair sharing inside a class, capacity, queue bounds, rate limits);
``SchedulerPolicy`` and friends describe what it enforces.
"""

from .policy import CostModel, GroupPolicy, RateLimit, SchedulerPolicy, UserPolicy
from .rate_limit import TokenBucket
from .scheduler import Scheduler
from .ticket import RefusalReason, Refused, Ticket, TicketState

__all__ = [
    "CostModel",
    "GroupPolicy",
    "RateLimit",
    "RefusalReason",
    "Refused",
    "Scheduler",
    "SchedulerPolicy",
    "Ticket",
    "TicketState",
    "TokenBucket",
    "UserPolicy",
]
