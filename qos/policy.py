"""Scheduling policy: the plain, immutable description the scheduler runs under.

The proxy builds a :class:`SchedulerPolicy` from the operator's YAML file; the scheduler
never reads files. Every field is in base units: seconds, tokens, requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


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

    Attributes:
        input_weight: cost of one prompt token.
        output_weight: cost of one generated token.
        default_output_tokens: output tokens assumed at admission when a request names no
            ``max_tokens`` (an estimate only; the real count replaces it when known).
    """

    input_weight: float = 1.0
    output_weight: float = 2.0
    default_output_tokens: int = 256

    def cost(self, prompt_tokens: int, output_tokens: int) -> float:
        """Return the cost in token units of ``prompt_tokens`` in and ``output_tokens`` out."""
        return prompt_tokens * self.input_weight + output_tokens * self.output_weight


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
    """

    name: str
    max_queue: int | None = None
    min_share: float = 0.0
    limits: RateLimit = RateLimit()
    default_user_weight: float = 1.0


@dataclass(frozen=True, slots=True)
class SchedulerPolicy:
    """Everything the scheduler needs to decide admissions.

    Attributes:
        groups: priority classes, highest priority first (index 0 is served first).
        users: known users by id; unknown users join ``default_group`` with its
            ``default_user_weight``.
        default_group: class of users not listed.
        max_inflight: most requests dispatched upstream at once (>= 1).
        max_inflight_tokens: optional cap on the sum of (prompt + max output) tokens of
            dispatched requests; a single request is always admitted when nothing is
            in flight, so an oversize request cannot wait forever.
        max_queue: most requests waiting in all classes together.
        queue_timeout_s: seconds a request may wait before it is refused.
        cost: token cost model.
        share_window_s: time constant (seconds) of the exponentially decayed service
            counters used to enforce ``min_share``.

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
        object.__setattr__(self, "_group_by_name", {g.name: g for g in self.groups})
        for u in self.users.values():
            if u.group not in names:
                raise ValueError(f"user {u.user_id!r} names unknown group {u.group!r}")
            if u.weight < 0:
                raise ValueError(f"user {u.user_id!r} has a negative weight")

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
