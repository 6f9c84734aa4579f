"""What a scheduler's state looks like from outside: JSON-ready views for status pages
and the demand per class it reports to a shared capacity. Read only; pure functions
over its queues and accounts (:class:`qos.Scheduler`'s inspection methods call them)."""

from __future__ import annotations

import heapq
import math
from typing import Iterable, Mapping, Sequence

from .fair_queue import FairQueue, UserAccount
from .slot_holds import SlotHolds
from .ticket import Ticket

ACTIVE_SERVICE = 1e-3
"""Recent service (token units) below which an idle user counts as inactive."""


def add_recent(a: UserAccount, cost: float, now: float, window_s: float) -> None:
    """Add ``cost`` (token units) to ``a``'s recent service, decayed to ``now`` with time
    constant ``window_s`` (seconds) first."""
    a.recent = a.recent * math.exp(-max(0.0, now - a.recent_at) / window_s) + cost
    a.recent_at = now


def user_state(a: UserAccount) -> dict:
    """One user's fair-share state (JSON-ready): class, weight, counter, pending, key,
    requests queued and in flight."""
    return {
        "user": a.user_id, "group": a.group, "weight": a.weight, "counter": a.counter, "pending": a.pending,
        "key": a.key, "queued": len(a.queue), "inflight": a.inflight,
    }  # fmt: skip


def class_loads(order: Sequence[FairQueue], accounts: Mapping[str, UserAccount]) -> list[tuple[str, int, int, float]]:
    """Per class of ``order`` (priority order): ``(name, requests waiting, their
    reserved tokens, summed weight of the users with requests waiting)``. O(queued)."""
    out = []
    for q in order:
        tickets = q.tickets()
        users = {t.user_id for t in tickets}
        weight = 0.0
        for uid in users:
            acct = accounts.get(uid)
            if acct is not None:
                weight += acct.weight
        out.append((q.name, len(tickets), sum(t.reserved_tokens for t in tickets), weight))
    return out


def snapshot(
    order: Sequence[FairQueue],
    accounts: Mapping[str, UserAccount],
    inflight: Iterable[Ticket],
    holds: SlotHolds,
    *,
    totals: dict,
    now: float,
    window_s: float,
    top_users: int,
) -> dict:
    """A JSON-ready view for status pages: ``totals`` (the scheduler's own figures:
    in flight, capacity, tokens in flight, queued), then per class of ``order`` its
    depth, in flight, virtual time, recent service (token units, decayed to ``now`` with
    time constant ``window_s``) and the summed weight of its active users (served
    lately, waiting or in flight); how many users are tracked and ``totals``'
    ``users_forgotten``; the slots ``holds`` keeps now, and the holds taken or expired
    unused since start; the ``top_users`` users by recent service. O(users tracked)."""
    inflight_by_group: dict[str, int] = {}
    for t in inflight:
        inflight_by_group[t.group] = inflight_by_group.get(t.group, 0) + 1

    def recent(a: UserAccount) -> float:
        return a.recent * math.exp(-max(0.0, now - a.recent_at) / window_s)

    top = heapq.nlargest(max(0, top_users), accounts.values(), key=lambda a: (recent(a), len(a.queue) + a.inflight))
    # per class: the recent service of all its users, and the weight of those active
    # (served lately, waiting or in flight), so a user's share can be read against
    # its weight share without listing every user
    group_recent: dict[str, float] = {}
    group_weight: dict[str, float] = {}
    for a in accounts.values():
        r = recent(a)
        group_recent[a.group] = group_recent.get(a.group, 0.0) + r
        if r > ACTIVE_SERVICE or a.queue or a.inflight:
            group_weight[a.group] = group_weight.get(a.group, 0.0) + a.weight
    return {
        "inflight": totals["inflight"],
        "capacity": totals["capacity"],
        "inflight_tokens": totals["inflight_tokens"],
        "queued": totals["queued"],
        "groups": [
            {
                "name": q.name,
                "queued": len(q),
                "inflight": inflight_by_group.get(q.name, 0),
                "virtual_time": q.vtime,
                "users": len(q.members),
                "recent_service": round(group_recent.get(q.name, 0.0), 3),
                "active_weight": group_weight.get(q.name, 0.0),
            }
            for q in order
        ],
        "users_total": len(accounts),
        "users_forgotten": totals["users_forgotten"],
        "held_slots": len(holds),
        "holds_taken": holds.taken,
        "holds_expired": holds.expired,
        "users": [
            {
                "user": a.user_id,
                "group": a.group,
                "weight": a.weight,
                "counter": a.counter,
                "pending": a.pending,
                "queued": len(a.queue),
                "inflight": a.inflight,
                "recent_service": round(recent(a), 3),
            }
            for a in top
        ],
    }
