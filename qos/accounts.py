"""The users one scheduler tracks: their fair-share accounts, the class each is in, and
the forgetting of idle ones.

Per-user state is bounded: a user with nothing queued or in flight is forgotten after
``policy.forget_users_after_s`` (at the next new user's submit, or when the caller calls
:meth:`qos.Scheduler.forget_idle` at :meth:`qos.Scheduler.next_forget_at`), and beyond
``policy.max_users`` the users idle longest are forgotten first, so at most
``max(max_users, users with requests queued or in flight)`` are tracked
(:attr:`UserAccounts.forgotten` counts the forgotten). Every idle user is looked at once
when it is forgotten, so forgetting is amortized O(1) per user.

A user is in one class at a time (:class:`qos.fair_queue.FairQueue` membership);
:func:`place` moves it, its queued requests with it, keeping its standing against the
class's virtual time.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from .fair_queue import FairQueue, UserAccount


class UserAccounts(dict[str, UserAccount]):
    """The accounts of the users tracked, by user id (a ``dict``), and which of them are
    idle (nothing queued or in flight) since when.

    Args:
        on_forget: called with each account as it is forgotten (its class drops it, the
            usage model forgets its history).

    Attributes:
        idle: user id -> clock reading (seconds) at which it went idle, the idle longest
            first.
        forgotten: users forgotten since start.
    """

    __slots__ = ("idle", "forgotten", "_on_forget")

    def __init__(self, on_forget: Callable[[UserAccount], None]) -> None:
        super().__init__()
        self.idle: OrderedDict[str, float] = OrderedDict()
        self.forgotten = 0
        self._on_forget = on_forget

    def open(self, user_id: str, weight: float, now: float, *, most: int, forget_after_s: float) -> UserAccount:
        """A new account for ``user_id`` (not tracked), of ``weight``, in no class yet
        (the caller joins it to one). Room is made first: the users idle longer than
        ``forget_after_s`` are forgotten, then the idle longest until at most ``most - 1``
        others are tracked."""
        self.forget_idle(now, forget_after_s)
        self.trim(most - 1)
        acct = self[user_id] = UserAccount(user_id, weight, recent_at=now)
        return acct

    def busy(self, user_id: str) -> None:
        """``user_id`` has a request again: it is no longer idle."""
        self.idle.pop(user_id, None)

    def maybe_idle(self, acct: UserAccount, now: float, most: int) -> None:
        """Mark ``acct`` idle since ``now`` if it has nothing queued or in flight, then
        trim to ``most`` users (:meth:`trim`)."""
        if not acct.queue and acct.inflight == 0:
            self.idle[acct.user_id] = now
            self.idle.move_to_end(acct.user_id)
            self.trim(most)

    def forget_idle(self, now: float, after_s: float) -> int:
        """Forget the users idle longer than ``after_s`` seconds at ``now``. Returns how
        many were forgotten. Amortized O(1): each idle user is looked at once."""
        idle = self.idle
        horizon = now - after_s
        before = self.forgotten
        while idle:
            uid, since = next(iter(idle.items()))
            if since > horizon:
                break
            self.forget(uid)
        return self.forgotten - before

    def next_forget_at(self, after_s: float) -> float | None:
        """Clock reading at which the user idle longest has been idle ``after_s``
        seconds, or ``None`` when no user is idle. O(1)."""
        for since in self.idle.values():  # the oldest first: users go idle in clock order
            return since + after_s
        return None

    def trim(self, most: int) -> None:
        """Forget the users idle longest until at most ``most`` are tracked or no idle
        user is left (users with requests queued or in flight are never forgotten)."""
        while len(self) > most and self.idle:
            self.forget(next(iter(self.idle)))

    def forget(self, user_id: str) -> None:
        """Drop ``user_id``'s account (``on_forget`` is told) and count it forgotten.

        Raises:
            KeyError: ``user_id`` is not tracked.
        """
        acct = self.pop(user_id)
        self.idle.pop(user_id, None)
        self._on_forget(acct)
        self.forgotten += 1

    def by_first_request(self) -> list[UserAccount]:
        """The accounts with queued tickets in arrival order of their first one (so a
        reload re-queues moved tickets in the order they came), idle accounts last."""
        return sorted(self.values(), key=lambda a: next(iter(a.queue)) if a.queue else 1 << 62)


def place(acct: UserAccount, src: FairQueue | None, dst: FairQueue, weight: float) -> bool:
    """Put ``acct`` (a member of ``src``, or of no class) in class ``dst`` with
    ``weight``, its queued tickets with it, keeping its position relative to the class's
    virtual time (scaled by the weight ratio, so its lead or lag in cost is kept; from
    weight 0 there is none to keep: it is placed at the virtual time). Nothing to do when
    both are unchanged.

    Returns:
        Whether queued tickets left ``src`` (its class had work then).
    """
    if src is dst and acct.weight == weight:
        return False
    tickets = []
    relative: float | None = None
    if src is not None:
        tickets, relative = src.leave(acct)
        if acct.weight > 0 and weight > 0:
            relative *= acct.weight / weight
        elif weight > 0:
            relative = None  # from weight 0: no position to keep, placed at the virtual time
    acct.weight = weight
    dst.join(acct, relative)
    for t in tickets:
        t.group = dst.name
        dst.push(t, acct, lift=False)
    return bool(tickets)
