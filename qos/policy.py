"""Scheduling policy: the plain, immutable description the scheduler runs under.

The proxy builds a :class:`SchedulerPolicy` from the operator's YAML file; the scheduler
never reads files. Every field is in base units: seconds, tokens, requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

MAX_COUNT = 2**40
"""Largest token count the scheduler takes from anyone (an estimate, a client's
``max_tokens``, an upstream's ``usage``): far above any real request, small enough that
every cost stays an exact, finite float. Larger counts are clamped to it."""

MAX_CHOICES = 128
"""Largest output multiplier (``n`` / ``best_of``) a reservation counts (OpenAI's own
limit for ``n``); the real usage trues up anything beyond it."""


def clamp_count(n: int | float | None) -> int:
    """``n`` as a token count in ``[0, MAX_COUNT]`` (``None`` and negatives: 0)."""
    if n is None or n <= 0:
        return 0
    return MAX_COUNT if n >= MAX_COUNT else int(n)


@dataclass(frozen=True, slots=True)
class RateLimit:
    """Token-bucket limits; ``None`` means unlimited.

    Attributes:
        requests_per_minute: sustained request rate; the bucket holds one minute's worth.
        tokens_per_minute: sustained token rate (prompt + output tokens); one minute's burst.
    """

    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None


@dataclass(frozen=True, slots=True)
class CostModel:
    """How a request's cost in tokens is counted for fair sharing.

    ``cost = prompt_tokens * input_weight + output_tokens * output_weight`` (token units),
    the weighting of the Virtual Token Counter (Sheng et al., "Fairness in Serving Large
    Language Models", OSDI 2024, section 4), which charges output tokens more because each
    one costs a decode step.

    A request's ``max_tokens`` is never a cost: fair-share counters are charged the
    prompt and the output as it is produced (VTC's rule). ``max_tokens`` only sizes the
    request's *reservation* (capacity in flight, rate-limit tokens, and the refundable
    estimate that orders a user while its requests run), clamped to
    ``max_tokens_ceiling``.

    Attributes:
        input_weight: cost of one prompt token.
        output_weight: cost of one generated token.
        default_output_tokens: output tokens reserved when a request names no
            ``max_tokens`` (an estimate only; the real count replaces it when known).
        max_tokens_ceiling: the most output tokens one choice of a request reserves,
            whatever ``max_tokens`` it names (tokens, >= 1).
    """

    input_weight: float = 1.0
    output_weight: float = 2.0
    default_output_tokens: int = 256
    max_tokens_ceiling: int = 32768

    def __post_init__(self) -> None:
        for name in ("input_weight", "output_weight"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v}")
        if self.max_tokens_ceiling < 1:
            raise ValueError("max_tokens_ceiling must be >= 1")
        if self.default_output_tokens < 0:
            raise ValueError("default_output_tokens must be >= 0")

    def cost(self, prompt_tokens: int, output_tokens: int) -> float:
        """Return the cost in token units of ``prompt_tokens`` in and ``output_tokens`` out."""
        return prompt_tokens * self.input_weight + output_tokens * self.output_weight

    def reserve_output(self, max_tokens: int | None, choices: int = 1, ceiling: int | None = None) -> int:
        """Output tokens one request reserves (tokens, >= 0).

        Args:
            max_tokens: the request's ``max_tokens`` (per choice), or ``None`` for
                ``default_output_tokens``.
            choices: the output multiplier (``max(n, best_of)``), clamped to
                ``[1, MAX_CHOICES]``.
            ceiling: a tighter per-request ceiling (the serving engine's context
                length, when the caller knows it), or ``None``.

        Returns:
            ``min(max_tokens, max_tokens_ceiling, ceiling) * choices``.
        """
        per = self.default_output_tokens if max_tokens is None else clamp_count(max_tokens)
        per = min(per, self.max_tokens_ceiling)
        if ceiling is not None:
            per = min(per, max(0, int(ceiling)))
        return per * max(1, min(int(choices), MAX_CHOICES))


@dataclass(frozen=True, slots=True)
class UserPolicy:
    """One user (tenant) of a priority class.

    Attributes:
        user_id: stable identifier; fairness counters are kept under it.
        group: name of the priority class the user belongs to.
        weight: share of the group's capacity, relative to the other users of the group.
            ``0`` means "served only when no user of positive weight in the group waits".
        limits: the user's own rate limits.
    """

    user_id: str
    group: str
    weight: float = 1.0
    limits: RateLimit = RateLimit()


@dataclass(frozen=True, slots=True)
class GroupPolicy:
    """One priority class.

    Attributes:
        name: unique name.
        max_queue: most requests of this class that may wait at once (``None``: only the
            global bound applies).
        min_share: fraction of dispatched cost (0..1) this class receives whenever it has
            work waiting, even when higher classes are backlogged; 0 means strict priority.
        limits: rate limits on the whole class (all its users together).
        default_user_weight: weight of a user of this class not listed in the config.
        headroom: fraction (0 <= h < 1) of an engine's capacity this class may not fill,
            kept for the classes above it: its requests are dispatched only while fewer
            than :func:`qos.capacity.room_for` ``(capacity, headroom)`` requests run
            there. 0 for the top class.
        ttft_target_s: its time-to-first-token objective (seconds), or ``None``: a
            dispatched request's first token later than this after dispatch makes the
            classes below it leave more of that engine free
            (:attr:`qos.Ticket.ttft_target_s`, :meth:`qos.capacity.RecentPeaks.late`).
    """

    name: str
    max_queue: int | None = None
    min_share: float = 0.0
    limits: RateLimit = RateLimit()
    default_user_weight: float = 1.0
    headroom: float = 0.0
    ttft_target_s: float | None = None


@dataclass(frozen=True, slots=True)
class SchedulerPolicy:
    """Everything the scheduler needs to decide admissions.

    Attributes:
        groups: priority classes, highest priority first (index 0 is served first).
        users: known users by id; unknown users join ``default_group`` with its
            ``default_user_weight``.
        default_group: class of users not listed.
        max_inflight: most requests dispatched upstream at once (>= 1).
        max_inflight_tokens: optional cap on the sum of the reservations (prompt +
            reserved output, :meth:`CostModel.reserve_output`) of dispatched requests;
            a request whose reservation exceeds it is refused at once
            (``REQUEST_TOO_LARGE``), never admitted to block others.
        max_queue: most requests waiting in all classes together.
        queue_timeout_s: seconds a request may wait before it is refused.
        cost: token cost model.
        share_window_s: time constant (seconds) of the exponentially decayed service
            counters used to enforce ``min_share``.
        max_users: most users whose fair-share state is kept; beyond it, the state of
            the user idle longest is forgotten (users with requests queued or in flight
            are never forgotten, so up to ``max_queue + max_inflight`` more may exist).
        forget_users_after_s: a user with nothing queued or in flight for this long
            (seconds) is forgotten; its counter would be lifted to the class's virtual
            time anyway when it returns.
        hold_slot_s: seconds a freed slot is kept for its user's next request (that
            user with nothing waiting, nobody of its class waiting), or, when users of
            its class wait, for the most owed user of the class with nothing waiting if
            it ranks before them (:meth:`qos.Scheduler.release`); 0 turns holds off
            (the default here; the proxy's ``admission.hold_slot_s`` is 0.05;
            :mod:`qos.slot_holds`).

    Raises:
        ValueError: from ``__post_init__`` when the policy is inconsistent.
    """

    groups: tuple[GroupPolicy, ...]
    default_group: str
    users: Mapping[str, UserPolicy] = field(default_factory=dict)
    max_inflight: int = 8
    max_inflight_tokens: int | None = None
    max_queue: int = 1000
    queue_timeout_s: float = 30.0
    cost: CostModel = CostModel()
    share_window_s: float = 30.0
    max_users: int = 20000
    forget_users_after_s: float = 300.0
    hold_slot_s: float = 0.0
    _group_by_name: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = [g.name for g in self.groups]
        if not names:
            raise ValueError("at least one group is required")
        if len(set(names)) != len(names):
            raise ValueError(f"group names must be unique: {names}")
        if self.default_group not in names:
            raise ValueError(f"default_group {self.default_group!r} is not one of {names}")
        if self.max_inflight < 1:
            raise ValueError("max_inflight must be >= 1")
        if self.max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        if sum(g.min_share for g in self.groups) > 1.0:
            raise ValueError("the min_share of all groups must add up to at most 1")
        if self.max_inflight_tokens is not None and self.max_inflight_tokens < 1:
            raise ValueError("max_inflight_tokens must be >= 1")
        if self.max_users < 1:
            raise ValueError("max_users must be >= 1")
        if not self.forget_users_after_s > 0:
            raise ValueError("forget_users_after_s must be > 0")
        if not (math.isfinite(self.hold_slot_s) and self.hold_slot_s >= 0):
            raise ValueError("hold_slot_s must be a finite number >= 0")
        for g in self.groups:
            if not (math.isfinite(g.default_user_weight) and g.default_user_weight >= 0):
                raise ValueError(f"group {g.name!r} has a default_user_weight that is not a finite number >= 0")
            if not (0.0 <= g.headroom < 1.0):
                raise ValueError(f"group {g.name!r} has a headroom outside [0, 1)")
        object.__setattr__(self, "_group_by_name", {g.name: g for g in self.groups})
        for u in self.users.values():
            if u.group not in names:
                raise ValueError(f"user {u.user_id!r} names unknown group {u.group!r}")
            if not (math.isfinite(u.weight) and u.weight >= 0):
                raise ValueError(f"user {u.user_id!r} has a weight that is not a finite number >= 0")

    def headroom_of(self, group: str) -> float:
        """The ``headroom`` of class ``group`` (0 for a class the policy does not know)."""
        g = self._group_by_name.get(group)
        return 0.0 if g is None else g.headroom

    def group_index(self, name: str) -> int:
        """Return the priority index of group ``name`` (0 = highest). Raises KeyError."""
        for i, g in enumerate(self.groups):
            if g.name == name:
                return i
        raise KeyError(name)

    def user(self, user_id: str, group: str | None = None) -> UserPolicy:
        """Return the policy of ``user_id``; an unlisted user gets a default one in
        ``group`` (or the default group) with that group's default weight."""
        found = self.users.get(user_id)
        if found is not None:
            return found
        gpol = self._group_by_name.get(group) if group is not None else None
        if gpol is None:
            gpol = self._group_by_name[self.default_group]
        return UserPolicy(user_id=user_id, group=gpol.name, weight=gpol.default_user_weight)
