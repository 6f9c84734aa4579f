"""Who gives way to a request of higher rank: the queued request a full queue evicts,
and the request in flight a waiting head preempts. Pure functions over a scheduler's
queues; :class:`qos.Scheduler` applies what they name.

**Eviction.** A full global queue makes room by evicting the newest request of the class
served last in the dispatch order (a class under its ``min_share`` floor first of all,
the others by priority), if it ranks below the newcomer's: a class under its floor is
never evicted, and its own newcomers may evict from higher classes that are not under
theirs (:func:`evictee`).

**Preemption** (:meth:`qos.Scheduler.preempt`, driven by the caller's timer at
:meth:`qos.Scheduler.preempt_at`): a head that has waited a bound and does not fit
(:func:`blocked_head`) may take the room of one request in flight of a lower class that
has shown its client nothing (:attr:`qos.Ticket.shown`), the lowest class's newest
first, at most a bound of times per request (:func:`victim`); that request goes back to
the head of its queue with every charge refunded (:meth:`qos.Scheduler.requeue`), as a
fresh attempt (:func:`restart`).
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

from .capacity import Capacity
from .fair_queue import FairQueue, UserAccount
from .ticket import Ticket, TicketState


def evictee(order: Sequence[FairQueue], rank: int, under_floor: Callable[[int], bool]) -> tuple[int, Ticket] | None:
    """The queued request to evict for a newcomer of class index ``rank`` when the
    queue is full, with its class index; ``None`` when there is none (the newcomer is
    refused instead).

    It is the newest waiting request of the class that would be served last, if that
    class ranks below the newcomer's in the order of service. The order is the dispatch
    order: a class at or under its ``min_share`` floor (``under_floor(index)``) ranks
    first (it is owed), the others by priority. So a newcomer evicts from the lowest
    class below it that is not under its floor, and a newcomer whose own class is under
    its floor may also evict from the lowest class above it that is not (a floor class
    cannot be kept below its floor by higher classes filling the queue). A class under
    its floor is never evicted, nor a request waiting to be resumed
    (:attr:`qos.Ticket.resuming`: evicting it would cut a stream its client is reading).

    Args:
        order: the classes' queues in priority order (index 0 highest).
        rank: the newcomer's class index in ``order``.
        under_floor: whether the class of an index is at or under its floor.
    """
    indices: Sequence[int] = range(len(order) - 1, rank, -1)
    if under_floor(rank):
        indices = [*indices, *range(rank - 1, -1, -1)]
    for idx in indices:
        q = order[idx]
        if not len(q) or under_floor(idx):
            continue  # a class at or under its floor keeps its requests
        newest = q.newest(evictable=True)  # never a stream its client is reading (resume)
        if newest is not None:
            return idx, newest
    return None


def blocked_head(
    order: Sequence[FairQueue], accounts: dict[str, UserAccount], capacity: Capacity
) -> tuple[int, FairQueue, Ticket, UserAccount] | None:
    """The head strict priority serves next (of the highest class in ``order`` with work
    waiting), with its class index, queue and account, when it does not fit
    ``capacity`` now; else ``None``. ``accounts``: every user tracked, by id."""
    for rank, queue in enumerate(order):
        if len(queue):
            head = queue.peek(accounts)
            assert head is not None
            if capacity.fits(head[0].reserved_tokens):
                return None
            return rank, queue, head[0], head[1]
    return None


def victim(
    rank: int,
    head: Ticket,
    inflight: Iterable[Ticket],
    ranks: Mapping[str, int],
    accounts: Mapping[str, UserAccount],
    under_floor: Callable[[int], bool],
    capacity: Capacity,
    max_preemptions: int,
    eligible: Callable[[Ticket], bool] | None,
) -> Ticket | None:
    """The request in flight to preempt for the head ``head`` of class index ``rank``:
    of a class ranked below ``rank`` and not under its ``min_share`` floor, never shown
    to its client, preempted fewer than ``max_preemptions`` times, accepted by
    ``eligible`` (the caller's own test), and whose room alone lets the head fit; the
    lowest class first, then the newest admitted. ``None`` when there is none, or when
    ``capacity`` cannot tell whether a request's room is enough (it has no
    ``fits_without``). O(in flight log in flight).

    Args:
        ranks: class name -> priority index (0 highest).
        accounts: every user tracked, by id.
        under_floor: whether the class of an index is at or under its floor.
    """
    fits_without = getattr(capacity, "fits_without", None)
    if fits_without is None:
        return None
    floors: dict[int, bool] = {}
    cands = []
    for t in inflight:
        if t.shown or t.preemptions >= max_preemptions or (eligible is not None and not eligible(t)):
            continue
        # its class, and the one its user's queue is in now (a reload may have moved
        # the user): both below the head's, so it never goes back ahead of the head
        r = ranks.get(t.group)
        acct = accounts.get(t.user_id)
        if r is None or r <= rank or acct is None or ranks.get(acct.group, -1) <= rank:
            continue
        if r not in floors:
            floors[r] = under_floor(r)
        if not floors[r]:
            cands.append((r, t.admitted_at or 0.0, t.seq, t))
    cands.sort(key=lambda c: (c[0], c[1], c[2]), reverse=True)
    for *_k, t in cands:
        if fits_without(head, t):
            return t
    return None


def restart(ticket: Ticket, group: str, now: float, deadline: float) -> None:
    """Make a preempted ``ticket`` a fresh attempt waiting in ``group`` since ``now``
    until ``deadline`` (clock seconds): nothing charged, expected or produced, no
    placement, QUEUED, with one more preemption counted. Its rate-limit reservation and
    whether it was shown are kept."""
    ticket.confirmed = ticket.pending = ticket.share_charged = 0.0
    ticket.expected_prompt = ticket.expected_output = 0.0
    ticket.speculative = False
    ticket.output_tokens = 0
    ticket.admitted_at = None
    ticket.placement = None
    ticket.group = group
    ticket.state = TicketState.QUEUED
    ticket.preemptions += 1
    ticket.enqueued_at = now
    ticket.deadline = deadline
