"""What admission reports of its pools: every pool's scheduler snapshot summed into one,
with a row per pool and per engine (``/admin/status``, the dashboard).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .pool import Pool


def pools_snapshot(pools: Sequence[Pool], top_users: int = 20) -> dict:
    """:meth:`qos.Scheduler.snapshot` summed over ``pools`` (requests, capacity and
    queue counts added; per group and per user, counts and recent service added, a
    user served by several pools listed once and counted once in ``users_total``),
    with ``pools``: every pool's name,
    queued, in flight, capacity, retired flag, queue per group and requests preempted
    there since start (``preemptions``), its measured drain rate (requests started per
    second while requests waited, ``None`` until measured: :mod:`qos.queue_wait`), and
    ``engines``:
    every engine (:meth:`proxy.routing.engine_state.EngineState.status`)."""
    snaps = [p.scheduler.snapshot(top_users=top_users) for p in pools]
    snap = snaps[0] if len(snaps) == 1 else merge(snaps, top_users)
    if len(snaps) > 1:
        # distinct users: one served by several pools is tracked by each of them
        # (O(users tracked), as each snapshot already is)
        snap["users_total"] = distinct(p.scheduler.user_ids() for p in pools)
    snap["pools"] = [
        {
            "name": p.name,
            "queued": p.scheduler.queued,
            "inflight": len(p.scheduler.inflight),
            "capacity": p.scheduler.capacity,
            "retired": p.retired,
            "groups": p.scheduler.queue_depths(),
            "preemptions": p.preemptions,
            "drain_rate": _rate(p.scheduler.drain_rate(measured=True)),
        }
        for p in pools
    ]
    snap["engines"] = [s for p in pools for s in p.router.snapshot()]
    return snap


def merge(snaps: list[dict], top_users: int) -> dict:
    """Several schedulers' snapshots as one (see :func:`pools_snapshot`)."""
    out = {k: sum(s[k] for s in snaps) for k in ("inflight", "capacity", "inflight_tokens", "queued", "users_total", "users_forgotten", "held_slots", "holds_taken", "holds_expired")}
    groups: dict[str, dict] = {}
    for s in snaps:
        for g in s["groups"]:
            acc = groups.get(g["name"])
            if acc is None:
                groups[g["name"]] = dict(g)
                continue
            for k in ("queued", "inflight", "users", "recent_service", "active_weight"):
                acc[k] += g[k]
    out["groups"] = list(groups.values())
    users: dict[str, dict] = {}
    for s in snaps:
        for u in s["users"]:
            acc = users.get(u["user"])
            if acc is None:
                users[u["user"]] = dict(u)
                continue
            for k in ("queued", "inflight", "recent_service"):
                acc[k] += u[k]
    out["users"] = sorted(users.values(), key=lambda u: (u["recent_service"], u["queued"] + u["inflight"]), reverse=True)[: max(0, top_users)]
    return out


def _rate(r: float | None) -> float | None:
    return None if r is None else round(r, 3)


def distinct(groups: Iterable[Iterable[str]]) -> int:
    """How many distinct ids the collections ``groups`` hold together."""
    seen: set[str] = set()
    for ids in groups:
        seen.update(ids)
    return len(seen)


__all__ = ["distinct", "merge", "pools_snapshot"]
