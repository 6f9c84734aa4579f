"""Capacity leases: how many units (requests, or tokens) of a capacity key this replica may
have in flight, granted by Redis so that all replicas together never exceed the capacity.

A *capacity key* names one resource with a capacity C: an engine's request slots, or its
KV-token budget (two keys). Each replica reports, every sync, for each key: C as its config
says, the grant it is acting on (*applied*, A), its units in flight (F), and its demand per
priority class (units in flight and waiting, and a sharing weight). The Lua script
:data:`LEASE_SCRIPT` stores the report, plans a target for every live replica, and issues
this replica a new grant G. The replica then dispatches only while F < G (the hot path
reads :meth:`LeaseTable.grant`, a dict lookup; no Redis).

**The invariant.** Redis keeps each live replica's *claim* = max(A, G, F) from its last
report. Between two of its syncs a replica's true in-flight never exceeds its claim: during
the round trip it still acts on A, after it acts on G, and it never dispatches past either.
A new grant is ``min(target, C - sum of the other live replicas' claims)``, and the new
claim max(A, F, G) fits because A and F are each within the replica's previous claim. So
the sum over live replicas of max(grant, in flight) never exceeds C, although replicas act
on grants up to one interval old. A grant may go below F (the replica then dispatches
nothing until F drains below it); the claim, and so the capacity it holds, falls only as F
falls and once the replica has confirmed the lower grant at its next sync. New room comes
only from units that are truly free.

**The plan** (who should hold what), computed from the reports of the live replicas that
can dispatch to the resource (a report with ``open`` false, an engine this replica has
ejected or is draining, is planned nothing). First the floors: a class with ``min_share``
m > 0 gets up to ceil(m × C) units, divided among the replicas where it has units in
flight or waiting as below (m is the smallest any replica reports for the class; the
floors fit in C because the config keeps their sum at most 1, and when their ceilings
do not, the higher classes' floors come first). Then strict priority as a water-fill
cascade: for class 0 (highest), every replica wants its in-flight plus waiting units of
that class (less what its floor gave); the rest of the capacity is divided in proportion
to the replicas' weights (max-min fair: nobody gets more than it wants, the rest goes to
the others), the remainder goes to class 1, and so on. Whatever is left after every class
is spare, split evenly among the open replicas, so a replica can dispatch a new arrival
without waiting for a sync. Thus a platinum request waiting on replica A shrinks the
targets of replicas that serve only bronze, and the slots they free go to A; and a bronze
class with ``min_share`` 0.3 waiting on B keeps ceil(0.3 × C) units at B while gold fills
the rest from A.

**Liveness.** A replica renews its lease (``{P}:replicas``, score = Redis ``TIME`` +
lease) at every sync; one that stops (SIGKILL) is dropped, with its claims, by the first
sync that sees its lease expired, so its capacity returns to the others after ``lease_s``.
Only Redis's clock is used for expiry.

**Rebuild.** A Redis that lost its keys (restart, flush, or a cold start: Redis cannot
tell them apart) or a replica coming back from its local fallback share
(:mod:`proxy.shared.sync`) opens a *rebuild window* of one lease: replicas that have not
reported yet may hold grants or fallback shares that Redis cannot see, so during the
window no grant grows (a replica keeps at most what it applies; a new replica gets
nothing). After one lease every live replica that can reach Redis has reported, and the
claims are complete again.

Source of the lease idea: Gray & Cheriton, "Leases: an efficient fault-tolerant mechanism
for distributed file cache consistency" (SOSP 1989); the per-class water-fill is the
weighted max-min fair share (Bertsekas & Gallager, *Data Networks*, 6.5.2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable

from .lua import script

LEASE_SCRIPT = script("lease")  # proxy/shared/lua/lease.lua


@dataclass(frozen=True, slots=True)
class ClassDemand:
    """One priority class's demand on a capacity key, on this replica.

    Attributes:
        inflight: units of this class in flight (requests, or tokens for a token key).
        waiting: units of this class waiting in the local queue.
        weight: the class's sharing weight here: the sum of the weights of its users
            with requests waiting on this replica (0 when none wait). Replicas at the
            same class share the capacity in proportion to it.
        min_share: the class's floor (its group's ``min_share``, 0..1): the plan gives
            the class up to ceil(min_share × capacity) units before strict priority
            (every replica should report the same; Redis uses the smallest).
    """

    inflight: int = 0
    waiting: int = 0
    weight: float = 0.0
    min_share: float = 0.0


@dataclass(frozen=True, slots=True)
class CapacityReport:
    """What this replica says about one capacity key at a sync.

    Attributes:
        key: the capacity key (e.g. ``"engine:http://a:8001:slots"``); any string.
        capacity: the units all replicas together may have in flight (this replica's
            config; Redis uses the smallest any live replica reports).
        inflight: this replica's units in flight now (must be exact: the invariant
            rests on it).
        demand: per priority class, highest first (may be empty: no demand).
        open: whether this replica can dispatch to the resource now. False (its engine
            ejected by this replica's health checks, or draining after a reload): the
            plan gives this replica nothing there, so no grant sits idle while other
            replicas wait; what it still has in flight keeps counting in its claim.
    """

    key: str
    capacity: int
    inflight: int
    demand: tuple[ClassDemand, ...] = ()
    open: bool = True


def fallback_share(capacity: int, replicas: int, rank: int | None) -> int:
    """This replica's part of ``capacity`` when it cannot reach Redis: capacity ÷ replicas,
    the remainder going to the lowest ranks (so the parts add up to the capacity exactly);
    ``rank`` None (never synced) gets the floor."""
    replicas = max(1, replicas)
    base, rest = divmod(max(0, capacity), replicas)
    return base + (1 if rank is not None and rank < rest else 0)


class LeaseTable:
    """This replica's grants, read on the hot path, written by the sync loop.

    :meth:`grant` is a dict lookup. The sync loop builds the lease part of a sync with
    :meth:`request` (the *applied* grants reported are exactly what :meth:`grant` returns
    at that moment), stores Redis's answer with :meth:`apply_reply`, and switches to the
    local fallback shares with :meth:`shrink_to_shares` / :meth:`take_shares`.
    """

    def __init__(self) -> None:
        self._grants: dict[str, int] = {}
        self._capacity: dict[str, int] = {}  # from the latest report
        self._reported: set[str] = set()  # keys Redis holds an entry of ours for

    def grant(self, key: str) -> int:
        """Units of ``key`` this replica may have in flight now (0 for a key it has not
        been granted: it is asked for at the next sync)."""
        return self._grants.get(key, 0)

    def grants(self) -> dict[str, int]:
        """A copy of all grants (for status pages and tests)."""
        return dict(self._grants)

    def request(self, reports: Iterable[CapacityReport]) -> tuple[list[str], str]:
        """The capacity keys and the JSON report of one sync.

        Keys reported before but absent now are sent as 0: this replica leaves them (the
        reporter must keep reporting a key while it has units in flight on it).

        Raises:
            ValueError: a key reported twice.
        """
        keys: list[str] = []
        body: list = []
        seen: set[str] = set()
        for r in reports:
            if r.key in seen:
                raise ValueError(f"capacity key {r.key!r} reported twice in one sync")
            seen.add(r.key)
            self._capacity[r.key] = r.capacity
            keys.append(r.key)
            demand = [[d.inflight, d.waiting, d.weight, d.min_share] for d in r.demand]
            body.append([r.capacity, self._grants.get(r.key, 0), r.inflight, demand, 1 if r.open else 0])
        for gone in sorted(self._reported - seen):
            self._capacity.pop(gone, None)
            self._grants[gone] = 0  # nothing new goes there while we leave it
            keys.append(gone)
            body.append(0)
        return keys, json.dumps(body, separators=(",", ":"))

    def apply_reply(self, keys: list[str], grants: list[int]) -> tuple[bool, bool]:
        """Store the grants Redis issued for ``keys`` (those of :meth:`request`, in order).

        Returns:
            (changed, lowered): whether any grant changed, and whether any went down
            (then the sync loop confirms at once, so Redis frees the difference sooner).
        """
        changed = lowered = False
        for key, g in zip(keys, grants):
            if key not in self._capacity:  # left: Redis dropped our entry
                self._reported.discard(key)
                self._grants.pop(key, None)
                continue
            g = int(g)
            old = self._grants.get(key, 0)
            if g != old:
                changed = True
                lowered = lowered or g < old
            self._grants[key] = g
            self._reported.add(key)
        return changed, lowered

    def shrink_to_shares(self, replicas: int, rank: int | None) -> bool:
        """First step of the fallback (a sync failed): each grant becomes
        min(grant, fallback share). Only lowers, so it is always safe. Returns whether
        anything changed."""
        changed = False
        for key, cap in self._capacity.items():
            g = min(self._grants.get(key, 0), fallback_share(cap, replicas, rank))
            if g != self._grants.get(key, 0):
                self._grants[key] = g
                changed = True
        return changed

    def take_shares(self, replicas: int, rank: int | None) -> bool:
        """Second step (no sync for a whole lease): each grant becomes the fallback share.
        The grant is the local cap, not room: a replica whose in flight is still above its
        share dispatches nothing until it drains below it, but the other replicas cannot
        see that, so the total may exceed the capacity by what replicas still run above
        their shares from before the outage (see :mod:`proxy.shared.sync`).
        Returns whether anything changed."""
        changed = False
        for key, cap in self._capacity.items():
            g = fallback_share(cap, replicas, rank)
            if g != self._grants.get(key, 0):
                self._grants[key] = g
                changed = True
        return changed

    def reported_keys(self) -> list[str]:
        """Keys Redis holds an entry of this replica for (for :meth:`SharedState.stop`)."""
        return sorted(self._reported)
