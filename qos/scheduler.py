"""Admission control: priority classes, token-fair sharing, capacity, bounds, rate limits.

(Over 400 lines, one concept: this module is :class:`Scheduler`, the one object callers
hold, with every method of its public surface and its contract; each part with a job of
its own is a module of its own, listed below. The core policy, the dispatch order and
the counter update, is the first section of the class, :meth:`Scheduler._candidates`
to :meth:`Scheduler.release`.)

One :class:`Scheduler` decides, for every request, whether it is refused at once, queued,
or dispatched upstream, and when a queued request is dispatched. It is pure: it does no
I/O, starts no tasks, and reads time only from the clock it is given. Callers learn of
dispatches and late refusals through two callbacks, called synchronously from inside the
method that caused them.

It is assembled from parts with one job each, two of them replaceable:

* :class:`qos.fair_queue.FairQueue`, one per class: the order of users inside a class
  (weighted Virtual Token Counters, charged for service rendered, never ``max_tokens``);
* :class:`qos.group_shares.GroupShares`: the classes' decayed shares, for ``min_share``;
* a :class:`qos.rate_limit.RateLimiter` (given, or a private one): reserve at submit,
  refund in full when never dispatched, settle to real usage at the end;
* a :class:`qos.capacity.Capacity` (given, or a :class:`qos.capacity.LocalCapacity` of
  the policy's ``max_inflight`` / ``max_inflight_tokens``): whether the chosen request
  has room now, and where;
* :class:`qos.accounts.UserAccounts`: the users tracked, and the forgetting of idle ones
  (per-user state is bounded by ``max_users``);
* :mod:`qos.preemption`: who gives way (the queued request a full queue evicts, the
  request in flight a waiting head preempts); :mod:`qos.slot_holds`: freed slots kept
  for the user they are owed to (``hold_slot_s``); :mod:`qos.deadlines`: queue
  timeouts; :mod:`qos.refusals`: the refusals' words; :mod:`qos.scheduler_status`: the
  views for status pages.

Order of service when there is room (:meth:`Scheduler._candidates`,
:meth:`Scheduler._dispatch`):

1. a class with ``min_share`` > 0 that has work waiting and whose decayed share of
   dispatched cost is below its ``min_share`` (the largest deficit first);
2. otherwise the highest-priority class with work waiting (strict priority);
3. inside the class, the backlogged user with the smallest key (:mod:`qos.fair_queue`).

A head that does not fit the capacity waits for room and holds back the classes *below*
its own (so priority is never inverted), never those above it: a ``min_share`` class
whose head does not fit lets a higher class's head go if that one fits. A request whose
reservation could never fit is refused at submit (``TOO_LARGE``).

What a request costs its user (the counter update, :mod:`qos.fair_queue`): at dispatch
its expected cost is charged as *pending* (:meth:`Scheduler._admit`); output is
*confirmed* as it streams, the pending part shrinking by as much
(:meth:`Scheduler.record_output`); at the end the real counts replace the estimate and
nothing stays pending (:meth:`Scheduler.release`).
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterable, KeysView

from . import refusals, scheduler_status
from .accounts import UserAccounts, place
from .capacity import Capacity, LocalCapacity
from .deadlines import Deadlines
from .fair_queue import FairQueue, UserAccount
from .group_shares import GroupShares
from .policy import MAX_CHOICES, GroupPolicy, SchedulerPolicy, UserPolicy, clamp_count
from .preemption import blocked_head, evictee, restart, victim
from .queue_wait import QueueWait, starts_needed
from .rate_limit import RateLimiter
from .slot_holds import SlotHolds, held_before, owed_slot
from .ticket import RefusalReason, Refused, Ticket, TicketState
from .usage_model import UsageModel

Clock = Callable[[], float]
TicketCallback = Callable[[Ticket], None]
ServiceCallback = Callable[[str, float], None]


def _noop(_t: Ticket) -> None:
    return None


class Scheduler:
    """The admission controller's state machine.

    Args:
        policy: the policy to start with (:meth:`update_policy` swaps it later).
        clock: returns the current time in seconds (monotonic); injectable for tests
            and simulations.
        on_admit: called with each ticket the moment it is dispatched (also for a ticket
            dispatched inside :meth:`submit`).
        on_refuse: called with each *queued* ticket that is refused later (evicted,
            timed out through :meth:`expire`, too large for a reloaded capacity, or
            drained at shutdown); ``ticket.refusal`` says why. Refusals at submit time
            raise instead.
        rate_limiter: the rate limits to reserve from; several schedulers (one per
            engine pool) may share one (its owner bounds it). Default: a private
            :class:`RateLimiter` of ``2 * policy.max_users + 64`` buckets.
        capacity: the capacity model to ask at dispatch. Default: a
            :class:`LocalCapacity` following the policy's ``max_inflight`` and
            ``max_inflight_tokens``. Its :meth:`~qos.capacity.Capacity.configure` is
            called with every policy.
        on_service: called with ``(user_id, cost)`` each time a user's confirmed
            counter is charged for service rendered here (token units, before division
            by the weight; the same amount the counter is charged, so its sum per user
            is the service this scheduler rendered). For sharing service with other
            schedulers (:meth:`charge_remote` is the other end). Also settable later as
            the attribute ``on_service``.
    """

    def __init__(
        self,
        policy: SchedulerPolicy,
        clock: Clock = time.monotonic,
        on_admit: TicketCallback = _noop,
        on_refuse: TicketCallback = _noop,
        *,
        rate_limiter: RateLimiter | None = None,
        capacity: Capacity | None = None,
        on_service: ServiceCallback | None = None,
    ) -> None:
        self.policy = policy
        self.on_service = on_service
        self._clock = clock
        self._on_admit = on_admit
        self._on_refuse = on_refuse
        self._owns_limiter = rate_limiter is None
        self.rate_limiter = rate_limiter if rate_limiter is not None else RateLimiter(max_buckets=2 * policy.max_users + 64)
        self.capacity_model: Capacity = capacity if capacity is not None else LocalCapacity(policy.max_inflight, policy.max_inflight_tokens)
        self._seq = 0
        self._queues: dict[str, FairQueue] = {}
        self._order: list[FairQueue] = []
        self._accounts = UserAccounts(self._forgotten)
        self._shares = GroupShares(policy.share_window_s, clock)  # for min_share
        self._usage = UsageModel()  # what each user's requests are expected to cost
        self._holds = SlotHolds()  # freed slots kept for the user they are owed to (hold_slot_s)
        self._rank: dict[str, int] = {}  # class -> priority index
        self._deadlines = Deadlines()
        self.inflight: set[Ticket] = set()
        self._inflight_by_group: dict[str, int] = {}  # requests in flight per class (ticket.group)
        self._busy_at: dict[str, float] = {}  # class -> when it last had work or was turned away
        self.queued = 0
        self.closed = False
        self.hold_below: int | None = None  # objective protection: classes ranked after it get no new dispatch (:meth:`hold_back`)
        self.waits = QueueWait()  # the drain rate, for Retry-After and waiting requests' estimates
        self._apply(policy)

    # ------------------------------------------- the core: who goes next, what it costs

    def _candidates(self) -> list[FairQueue]:
        """The classes whose head may go next, in the order to try: the ``min_share``
        class most owed (if any), then the highest class with work. A head that does
        not fit holds back only the classes after it in this list that rank below it."""
        top = next((q for q in self._order if len(q)), None)
        if top is None:
            return []
        owed = [(g.name, g.min_share) for g in self.policy.groups if g.min_share > 0 and len(self._queues[g.name])]
        if owed:
            name = self._shares.most_owed(owed)
            if name is not None and self._queues[name] is not top:
                return [self._queues[name], top]
        return [top]

    def _dispatch(self) -> None:
        """Admit heads while there is room, trying :meth:`_candidates` in order; a head
        waits while the free slots are held for users who rank before it."""
        cap, holds = self.capacity_model, self._holds
        if holds:
            holds.prune(self._clock())
        # occupied, not inflight: a higher class may have room while the engines hold
        # more than their capacity (a lower class's excess after a cut counts only up to
        # its own room: qos.capacity.occupied)
        while self.queued and cap.occupied < (slots := cap.slots):
            for queue in self._candidates():
                if self._held(self._rank[queue.name]):
                    continue  # objective protection holds its new work back
                head = queue.peek(self._accounts)
                assert head is not None
                free = slots - cap.inflight  # <= 0 while a lower class's excess drains: no slot to keep
                if holds and free > 0 and held_before(holds, head[1], self._rank, self._accounts) >= free:
                    continue  # the free slots are kept for users who rank before it
                if cap.reserve(head[0]):
                    self._admit(queue, *head)
                    break
            else:
                return

    def _admit(self, queue: FairQueue, ticket: Ticket, acct: UserAccount) -> None:
        """Dispatch ``queue``'s head ``ticket`` (room reserved): its user is charged its
        expected cost as pending, and its class's share as much."""
        cost = self.policy.cost
        queue.pop(self._accounts)
        self.queued -= 1
        ticket.state = TicketState.ADMITTED
        ticket.admitted_at = self._clock()
        ticket.ttft_target_s = self.policy.groups[self._rank[queue.name]].ttft_target_s  # its class's now (a reload may have moved it)
        self.waits.drain.started(ticket.admitted_at, self.queued)
        self.inflight.add(ticket)
        self._inflight_by_group[ticket.group] = self._inflight_by_group.get(ticket.group, 0) + 1
        ticket.expected_prompt, ticket.expected_output = self._usage.expected(ticket.user_id, ticket.prompt_tokens, ticket.max_output_tokens)
        ticket.speculative = not self._usage.knows(ticket.user_id)
        ticket.confirmed = 0.0
        ticket.pending = cost.input_weight * ticket.expected_prompt + cost.output_weight * ticket.expected_output
        acct.inflight += 1
        self._holds.take(acct.user_id)  # a slot kept for it, if any, is the one it takes
        queue.charge(acct, 0.0, ticket.pending, ticket.pending if ticket.speculative else 0.0)
        ticket.share_charged = ticket.pending
        self._shares.add(ticket.group, ticket.pending)
        self._on_admit(ticket)

    def record_output(self, ticket: Ticket, output_tokens: int) -> None:
        """Report that ``ticket`` has produced ``output_tokens`` so far (cumulative).

        The output is confirmed service: the user's counter is charged for it now (and
        the pending expectation shrinks by as much while within it), so a request pays
        as it streams, whatever its ``max_tokens``.
        """
        if ticket.state is not TicketState.ADMITTED or output_tokens <= ticket.output_tokens:
            return
        out = clamp_count(output_tokens)
        if out <= ticket.output_tokens:
            return
        cost = self.policy.cost
        confirmed = cost.output_weight * (out - ticket.output_tokens)
        ticket.output_tokens = out
        pending = cost.input_weight * ticket.expected_prompt + cost.output_weight * max(0.0, ticket.expected_output - out)
        delta, ticket.pending = pending - ticket.pending, pending
        ticket.confirmed += confirmed
        acct = self._accounts[ticket.user_id]
        self._queues[acct.group].charge(acct, confirmed, delta, delta if ticket.speculative else 0.0)
        if self.on_service is not None:
            self.on_service(ticket.user_id, confirmed)
        total = cost.cost(ticket.prompt_tokens, out)
        if total > ticket.share_charged:
            self._shares.add(ticket.group, total - ticket.share_charged)
            ticket.share_charged = total

    def release(self, ticket: Ticket, prompt_tokens: int | None = None, output_tokens: int | None = None) -> bool:
        """Free ``ticket``'s room and true its cost up to the real token counts.

        Args:
            ticket: an ADMITTED ticket.
            prompt_tokens: real prompt tokens if the upstream reported them (else the
                estimate); 0 when the upstream refused it before serving anything.
            output_tokens: real output tokens; defaults to the last :meth:`record_output`.

        Returns:
            True the first time; False (and nothing changes) for a ticket that is not
            ADMITTED, so a second release can never free room twice.
        """
        if ticket.state is not TicketState.ADMITTED:
            return False
        now = self._clock()
        ticket.state = TicketState.RELEASED
        self._leave_flight(ticket, now)
        prompt = ticket.prompt_tokens if prompt_tokens is None else clamp_count(prompt_tokens)
        out = ticket.output_tokens if output_tokens is None else clamp_count(output_tokens)
        ticket.output_tokens = out
        actual = self.policy.cost.cost(prompt, out)
        confirmed, pending = actual - ticket.confirmed, -ticket.pending
        ticket.confirmed, ticket.pending = actual, 0.0
        acct = self._accounts[ticket.user_id]
        acct.inflight -= 1
        self._queues[acct.group].charge(acct, confirmed, pending, pending if ticket.speculative else 0.0)
        if confirmed and self.on_service is not None:
            self.on_service(ticket.user_id, confirmed)
        scheduler_status.add_recent(acct, actual, now, self.policy.share_window_s)
        # the class's share (min_share) is trued up too, or an error of the estimate at
        # dispatch would count as service the class never got (or did not pay for)
        self._shares.add(ticket.group, actual - ticket.share_charged, ticket.admitted_at)
        ticket.share_charged = actual
        self._usage.learn(ticket.user_id, ticket.prompt_tokens, prompt, ticket.max_output_tokens, out)
        self.rate_limiter.settle(ticket.rate, prompt + out, now)
        self._accounts.maybe_idle(acct, now, self.policy.max_users)
        self._hold_freed_slot(acct, now)
        self._dispatch()
        return True

    # ------------------------------------------------------------------ submit

    def submit(
        self,
        user_id: str,
        group: str | None,
        prompt_tokens: int,
        max_output_tokens: int | None,
        *,
        choices: int = 1,
        output_ceiling: int | None = None,
    ) -> Ticket:
        """Ask for admission of one request.

        Args:
            user_id: the user (from identity resolution).
            group: a class chosen per request by a trusted source, or ``None`` for the
                one the policy gives the user (a listed user's own class always wins).
                The user's account, queued requests included, moves to the class of
                its latest request.
            prompt_tokens: estimated prompt length (tokens, >= 0).
            max_output_tokens: the request's ``max_tokens`` (per choice), or ``None``
                for the cost model's default. Only a reservation: clamped to the cost
                model's ``max_tokens_ceiling`` (and ``output_ceiling``), never a cost.
            choices: the output multiplier (``max(n, best_of)``), clamped to
                ``[1, MAX_CHOICES]``.
            output_ceiling: a tighter per-request output ceiling (tokens per choice),
                e.g. the serving engine's context length when the caller knows it.

        Returns:
            The ticket, in state ADMITTED (``on_admit`` has been called) or QUEUED.

        Raises:
            Refused: its reservation can never fit the capacity (TOO_LARGE), rate limited
                (RATE_LIMITED; ``scope`` and ``limit`` name the bucket that needs the
                longest wait), queues full (QUEUE_FULL, GROUP_QUEUE_FULL), or the
                scheduler is closed (SHUTDOWN). A refused request consumes nothing.
        """
        policy = self.policy
        now = self._clock()
        if self.closed:
            raise refusals.shutdown()
        up, rank, prompt, choices, out = self._size(user_id, group, prompt_tokens, max_output_tokens, choices, output_ceiling)
        gpol = policy.groups[rank]
        reserved = prompt + out
        if not self.capacity_model.admissible(reserved):
            raise self._too_large(reserved)
        wait, scope, limit = self.rate_limiter.tripped(user_id, up.limits, gpol.name, gpol.limits, reserved, now)
        if wait > 0:
            raise refusals.rate_limited(user_id, gpol.name, wait, scope, limit)
        queue = self._queues[up.group]
        if gpol.max_queue is not None and len(queue) >= gpol.max_queue and not self._can_dispatch_now(reserved):
            self._busy_at[gpol.name] = now
            raise refusals.group_queue_full(gpol.name, gpol.max_queue, self._retry_hint(gpol.name))
        if self.queued >= policy.max_queue and not self._can_dispatch_now(reserved):
            found = evictee(self._order, rank, self._under_floor)
            if found is None:
                self._busy_at[gpol.name] = now  # turned away for room: demand, not absence
                raise refusals.queue_full(policy.max_queue, self._retry_hint(gpol.name))
            idx, evicted = found
            self._refuse_queued(evicted, refusals.evicted(evicted.group, idx > rank, self._retry_hint(evicted.group)))

        self._seq += 1
        ticket = Ticket(
            seq=self._seq, user_id=user_id, group=up.group, prompt_tokens=prompt, max_output_tokens=out,
            enqueued_at=now, deadline=now + policy.queue_timeout_s, choices=choices,
        )  # fmt: skip
        ticket.rate = self.rate_limiter.reserve(user_id, up.limits, gpol.name, gpol.limits, reserved, now)
        acct = self._account(user_id, group, up, now)
        if gpol.min_share > 0 and not len(queue) and not self._inflight_by_group.get(gpol.name):
            # it starts waiting again after an absence: credited its share for the time
            # away (no banked credit). A class with requests in flight, or turned away
            # for want of queue room, has not been away.
            self._shares.lift(gpol.name, gpol.min_share, now - self._busy_at.get(gpol.name, -math.inf))
        queue.push(ticket, acct)
        self.queued += 1
        self._deadlines.add(ticket, self.queued)
        self._dispatch()
        self.waits.drain.observe(now, self.queued)
        return ticket

    def _size(
        self, user_id: str, group: str | None, prompt_tokens: int, max_output_tokens: int | None, choices: int, output_ceiling: int | None
    ) -> tuple[UserPolicy, int, int, int, int]:
        """A request's user policy, class index, prompt tokens, output multiplier and
        reserved output tokens (:meth:`submit`'s arguments, clamped)."""
        policy = self.policy
        up = policy.user(user_id, group)
        choices = max(1, min(int(choices), MAX_CHOICES))
        out = policy.cost.reserve_output(max_output_tokens, choices, output_ceiling)
        return up, policy.group_index(up.group), clamp_count(prompt_tokens), choices, out

    def _can_dispatch_now(self, tokens: int) -> bool:
        """Whether a new request would be dispatched immediately (then queue bounds do
        not apply: it never waits)."""
        return self.queued == 0 and self.capacity_model.fits(tokens)

    def _too_large(self, reserved: int) -> Refused:
        return refusals.too_large(reserved, getattr(self.capacity_model, "max_inflight_tokens", None))

    def _retry_hint(self, group: str, promise: bool = True) -> float:
        """The ``Retry-After`` (seconds) for a request of ``group`` refused now: the
        starts it needs before it would be admitted at the measured drain rate
        (:mod:`qos.queue_wait`); ``promise``: it goes to a client, who is counted as
        coming back then."""
        now = self._clock()
        rate = self.waits.rate(now, self.capacity_model.slots)
        return self.waits.retry_after_s(now, group, self._starts_needed(group, rate), rate, promise)

    def _starts_needed(self, group: str, rate: float) -> float:
        rank = self._rank.get(group, len(self._order) - 1)
        above = sum(len(q) for q in self._order[:rank])
        gpol = self.policy.groups[rank]
        return starts_needed(self.queued, self.policy.max_queue, above, len(self._order[rank]), gpol.max_queue, rate, self.policy.queue_timeout_s)

    def hold_back(self, below: int | None) -> None:
        """Objective protection's first step (:mod:`qos.objective_protection`): while
        ``below`` (a class index) is set, the classes ranked after it get no new dispatch
        (their heads neither go nor preempt; what runs finishes), except a class under
        its ``min_share`` floor. ``None`` lifts it and dispatches what fits."""
        lifted = self.hold_below is not None and (below is None or below > self.hold_below)
        self.hold_below = below
        if lifted:
            self._dispatch()

    def _held(self, idx: int) -> bool:
        """Whether class index ``idx`` is held back by :meth:`hold_back` now."""
        return self.hold_below is not None and idx > self.hold_below and not self._under_floor(idx)

    def under_floor(self, group: str) -> bool:
        """Whether ``group`` has a ``min_share`` and is at or under it (owed service)."""
        idx = self._rank.get(group)
        return idx is not None and self._under_floor(idx)

    def _under_floor(self, idx: int) -> bool:
        """Whether class index ``idx`` has a ``min_share`` and its decayed share is at or
        below it (then it is owed: it ranks first, for dispatch and for eviction)."""
        gpol = self.policy.groups[idx]
        return gpol.min_share > 0 and self._shares.share(gpol.name) < gpol.min_share * (1 + 1e-9)

    def cancel(self, ticket: Ticket, reason: RefusalReason = RefusalReason.CANCELLED) -> bool:
        """Withdraw a QUEUED ticket (client gone, or the caller's own timeout); its rate
        limit reservation is refunded in full.

        Returns True if it was waiting and is now REFUSED (``on_refuse`` is *not* called:
        the caller already knows); False if it was not waiting (then, if ADMITTED, the
        caller must :meth:`release` it).
        """
        if ticket.state is not TicketState.QUEUED:
            return False
        waited = self._clock() - ticket.enqueued_at
        self._refuse_queued(ticket, refusals.withdrawn(reason, waited, self._retry_hint(ticket.group, promise=False)), notify=False)
        self._dispatch()  # the head of a blocked class may have changed
        return True

    # ------------------------------------------------------------------ policy

    def _apply(self, policy: SchedulerPolicy) -> None:
        self.policy = policy
        old = self._queues
        # (an empty FairQueue is falsy: test membership, or an idle class loses its vtime)
        self._queues = {g.name: old[g.name] if g.name in old else FairQueue(g.name) for g in policy.groups}
        self._order = [self._queues[g.name] for g in policy.groups]
        self._rank = {g.name: i for i, g in enumerate(policy.groups)}
        self.waits.forget(self._rank.keys())
        if policy.hold_slot_s <= 0:
            self._holds.clear()
        self.capacity_model.configure(policy)
        if self._owns_limiter:
            self.rate_limiter.max_buckets = 2 * policy.max_users + 64
        self._shares.configure(self._queues, policy.share_window_s)
        self._busy_at = {k: v for k, v in self._busy_at.items() if k in self._queues}
        # every user takes the class and weight the new policy gives it, at once, its
        # queued requests included (one rule for moved, re-weighted and removed users)
        for acct in self._accounts.by_first_request():
            requested = acct.requested_group if acct.requested_group in self._queues else None
            self._place(acct, old.get(acct.group), policy.user(acct.user_id, requested))
        self._accounts.trim(policy.max_users)
        # a queued request that can no longer ever fit (max_inflight_tokens lowered)
        # would block its class's head for good: refuse it now
        for q in self._order:
            for t in q.tickets():
                if not self.capacity_model.admissible(t.reserved_tokens):
                    self._refuse_queued(t, self._too_large(t.reserved_tokens))

    def update_policy(self, policy: SchedulerPolicy) -> None:
        """Swap in a new policy atomically.

        Counters and rate-limit buckets carry over. Every user takes the class and
        weight the new policy gives it at once, its queued requests with it, placed at
        the same position relative to the new class's virtual time (a weight change
        scales that position so its cost is kept); a user no longer listed takes its
        new class (the default one) the same way. Requests in flight are untouched. A
        larger ``max_inflight`` dispatches waiting requests at once; a smaller one lets
        the surplus in flight finish. A queued request whose reservation can no longer
        fit a lowered ``max_inflight_tokens`` is refused (``TOO_LARGE``); nothing else
        is refused by a policy change.
        """
        self._apply(policy)
        self._dispatch()

    @property
    def capacity(self) -> int:
        """Requests allowed in flight now (the capacity model's slots)."""
        return self.capacity_model.slots

    @property
    def inflight_tokens(self) -> int:
        """Sum of the reservations of the requests in flight (tokens)."""
        return self.capacity_model.inflight_tokens

    def set_capacity_limit(self, limit: int | None) -> None:
        """Lower the requests allowed in flight below ``policy.max_inflight`` for as long
        as an outside signal says so (the engine reporting itself saturated), or lift the
        limit with ``None``. The limit survives :meth:`update_policy`.

        Nothing is refused or preempted: requests in flight finish, queued ones wait
        (their queue timeout still runs). A limit of 1 dispatches one request whenever
        nothing is in flight, so no limit can stall the queue for good. Raising or lifting
        the limit dispatches waiting requests at once.

        Raises:
            ValueError: ``limit`` is below 1.
        """
        self.capacity_model.set_limit(limit)
        self._dispatch()

    def dispatch(self) -> None:
        """Dispatch what fits now; for a capacity model whose room grew outside the
        scheduler's own calls (a lease granted, an engine back)."""
        self._dispatch()

    # ------------------------------------------------------------------- users

    def _account(self, user_id: str, requested: str | None, up: UserPolicy, now: float) -> UserAccount:
        """``user_id``'s account, opened in (or moved to) the class and weight ``up``
        gives it; ``requested``: the class its request named, kept for reloads."""
        acct = self._accounts.get(user_id)
        if acct is None:
            acct = self._accounts.open(user_id, up.weight, now, most=self.policy.max_users, forget_after_s=self.policy.forget_users_after_s)
            self._queues[up.group].join(acct)
        else:
            self._accounts.busy(user_id)
            self._place(acct, self._queues[acct.group], up)
        acct.requested_group = requested
        return acct

    def _place(self, acct: UserAccount, src: FairQueue | None, up: UserPolicy) -> None:
        if place(acct, src, self._queues[up.group], up.weight) and src is not None:
            self._busy_at[src.name] = self._clock()  # its class had work until now

    def _forgotten(self, acct: UserAccount) -> None:
        q = self._queues.get(acct.group)
        if q is not None:
            q.members.pop(acct.user_id, None)
        self._usage.forget(acct.user_id)

    def forget_idle(self) -> int:
        """Forget now every user idle longer than ``policy.forget_users_after_s`` (a
        caller's timer, armed for :meth:`next_forget_at`, calls this so idle users go on
        time without waiting for a new user's submit). Returns how many were forgotten.
        Amortized O(1) per forgotten user."""
        return self._accounts.forget_idle(self._clock(), self.policy.forget_users_after_s)

    def next_forget_at(self) -> float | None:
        """Clock reading at which the user idle longest is due to be forgotten
        (:meth:`forget_idle`), or ``None`` when no user is idle. O(1)."""
        return self._accounts.next_forget_at(self.policy.forget_users_after_s)

    @property
    def users_forgotten(self) -> int:
        """Users forgotten since start (idle too long, or beyond ``max_users``)."""
        return self._accounts.forgotten

    # -------------------------------------------------------------- slot holds

    def _hold_freed_slot(self, released: UserAccount, now: float) -> None:
        """Keep the slot a request of ``released`` just freed for ``policy.hold_slot_s``,
        for the user :func:`qos.slot_holds.owed_slot` names."""
        hold_s = self.policy.hold_slot_s
        queue = self._queues.get(released.group)
        if hold_s > 0 and not self.closed and queue is not None:
            owed = owed_slot(queue, released, self._accounts)
            if owed is not None:
                self._holds.hold(owed.user_id, now + hold_s)

    def next_hold_end(self) -> float | None:
        """Clock reading at which the earliest slot hold ends (then :meth:`dispatch`
        gives its slot to the queue if its user has not taken it), or ``None`` when no
        slot is held. For the caller's timer; O(1)."""
        return self._holds.next_end()

    @property
    def held_slots(self) -> int:
        """Slots kept now for a user's next request (``policy.hold_slot_s``)."""
        return len(self._holds)

    # -------------------------------------------------------------- preemption

    def requeue(self, ticket: Ticket) -> bool:
        """Take an ADMITTED ticket back out of flight and queue it again at the head of
        its user's queue (a preempted request: its upstream work is being aborted).

        Everything its dispatch charged is refunded exactly: its user's confirmed and
        pending cost (the counter is where it was before the dispatch, less nothing),
        its class's share (``min_share``), and its room in the capacity model. The
        class's virtual time is not moved back. Its rate-limit reservation is kept as
        it was reserved at submit (it is settled to the real usage of the attempt that
        is served, or refunded in full if it never is). Nothing is learned from the
        aborted attempt. It waits again with a fresh deadline (``queue_timeout_s`` from
        now) and ``preemptions`` counted; no dispatch follows (the caller's).

        Confirmed cost refunded is not reported to ``on_service`` (it is always 0 for a
        request whose client was shown nothing: output is confirmed as it is relayed).

        Returns:
            True if it was ADMITTED and is now QUEUED; False (nothing changes) otherwise.
        """
        if ticket.state is not TicketState.ADMITTED:
            return False
        now = self._clock()
        self._leave_flight(ticket, now)
        acct = self._accounts[ticket.user_id]
        acct.inflight -= 1
        queue = self._queues[acct.group]
        queue.charge(acct, -ticket.confirmed, -ticket.pending, -ticket.pending if ticket.speculative else 0.0)
        self._shares.add(ticket.group, -ticket.share_charged, ticket.admitted_at)
        restart(ticket, acct.group, now, now + self.policy.queue_timeout_s)
        queue.push_front(ticket, acct)
        self.queued += 1
        self.waits.drain.observe(now, self.queued)
        self._deadlines.add(ticket, self.queued)
        return True

    def preempt_at(self, after_s: float) -> float | None:
        """Clock reading at which the head strict priority serves next will have waited
        ``after_s`` seconds, when it does not fit now and some class below its own has
        requests in flight (so :meth:`preempt` may find a victim then); else ``None``.
        O(classes). For a caller that arms a timer instead of polling."""
        if self.closed:
            return None
        blocked = blocked_head(self._order, self._accounts, self.capacity_model)
        if blocked is None:
            return None
        rank, _q, head, _a = blocked
        if self._held(rank):
            return None
        if not any(self._inflight_by_group.get(g.name) for g in self.policy.groups[rank + 1 :]):
            return None
        return head.enqueued_at + after_s

    def preempt(self, after_s: float, max_preemptions: int, eligible: Callable[[Ticket], bool] | None = None) -> list[Ticket]:
        """Preempt lower-class work for a waiting head of higher priority.

        While the head strict priority serves next has waited at least ``after_s``
        seconds and does not fit, the request :func:`qos.preemption.victim` names
        (lower class, shown nothing, preempted fewer than ``max_preemptions`` times,
        accepted by ``eligible`` when given, its room enough) is requeued
        (:meth:`requeue`) and the head is dispatched into its room at once; then
        whatever else fits is dispatched. Stops at the first head with no victim.

        Returns:
            The preempted tickets, now QUEUED again (the caller aborts their upstream
            work and lets them wait); ``on_admit`` has been called for the heads.
        """
        out: list[Ticket] = []
        if self.closed or max_preemptions <= 0:
            return out
        while True:
            blocked = blocked_head(self._order, self._accounts, self.capacity_model)
            if blocked is None:
                break
            rank, queue, head, acct = blocked
            if self._clock() - head.enqueued_at < after_s or self._held(rank):
                break
            found = victim(
                rank, head, self.inflight, self._rank, self._accounts, self._under_floor, self.capacity_model, max_preemptions, eligible
            )  # fmt: skip
            if found is None:
                break
            self.requeue(found)
            out.append(found)
            if self.capacity_model.reserve(head):
                self._admit(queue, head, acct)  # strict priority: the room is the head's
            else:  # pragma: no cover - fits_without said it would fit
                break
        if out:
            self._dispatch()
        return out

    # ------------------------------------------------- leaving the queue or flight

    def _refuse_queued(self, ticket: Ticket, refusal: Refused, notify: bool = True) -> None:
        acct = self._accounts[ticket.user_id]
        now = self._clock()
        self._queues[acct.group].remove(ticket, acct)
        self._busy_at[acct.group] = now
        self.queued -= 1
        self.waits.drain.observe(now, self.queued)
        ticket.state = TicketState.REFUSED
        ticket.refusal = refusal
        self.rate_limiter.refund(ticket.rate, now)  # never served: consumes nothing
        self._accounts.maybe_idle(acct, now, self.policy.max_users)
        if notify:
            self._on_refuse(ticket)

    def _leave_flight(self, ticket: Ticket, now: float) -> None:
        """Take ``ticket`` out of the requests in flight and give its room back (a
        release, or a requeue for preemption); its class has work at ``now``."""
        self.inflight.discard(ticket)
        self._busy_at[ticket.group] = now
        left = self._inflight_by_group.get(ticket.group, 1) - 1
        if left > 0:
            self._inflight_by_group[ticket.group] = left
        else:
            self._inflight_by_group.pop(ticket.group, None)
        self.capacity_model.release(ticket)

    def expire(self) -> list[Ticket]:
        """Refuse every queued ticket whose deadline has passed (reason TIMEOUT); their
        rate-limit reservations are refunded in full.

        Returns them; ``on_refuse`` is called for each. O(k log n) for k expired.
        """
        now = self._clock()
        out: list[Ticket] = []
        for t in self._deadlines.due(now):
            self._refuse_queued(t, refusals.timed_out(now - t.enqueued_at, self._retry_hint(t.group)))
            out.append(t)
        if out:
            self._dispatch()
        return out

    def next_deadline(self) -> float | None:
        """Clock reading of the earliest queued deadline, or ``None`` when nothing waits."""
        return self._deadlines.earliest()

    def close(self) -> list[Ticket]:
        """Stop admitting: refuse every queued ticket (SHUTDOWN) and every later submit.

        Tickets in flight stay ADMITTED until released. Returns the refused tickets.
        """
        self.closed = True
        out: list[Ticket] = []
        for q in self._order:
            for t in q.tickets():
                self._refuse_queued(t, refusals.shutdown())
                out.append(t)
        return out

    # ------------------------------------------------------ several schedulers

    def charge_remote(self, user_id: str, cost: float) -> bool:
        """Charge ``user_id``'s fair-share counter with ``cost`` token units of service
        rendered *elsewhere* (by another scheduler sharing its users: another replica of
        the deployment), exactly as local confirmed service is charged: ``cost / weight``
        added to its counter, which is relative to its class's virtual time (so the
        charge keeps its meaning whatever that class's rebases). The virtual time does
        not move (it is where the users served *here* stand), and the user's recent
        service (a status figure of this scheduler) does not change.

        Returns False, changing nothing, for a user not tracked here (an idle user's
        counter is lifted to the virtual time when it returns anyway), a weight-0 user,
        or a ``cost`` that is not a positive finite number.
        """
        acct = self._accounts.get(user_id)
        if acct is None or acct.weight <= 0 or not (0.0 < cost < math.inf):
            return False
        self._queues[acct.group].charge(acct, cost, 0.0)
        return True

    def rate_request(
        self, user_id: str, group: str | None, prompt_tokens: int, max_output_tokens: int | None, *, choices: int = 1, output_ceiling: int | None = None
    ) -> tuple[UserPolicy, GroupPolicy, int]:
        """What :meth:`submit` would charge to the rate limits for this request, without
        submitting it: the user's policy, its class's policy, and the tokens reserved
        (prompt + reserved output, as :attr:`Ticket.reserved_tokens`). For a caller that
        reserves the limits elsewhere (a store shared by several processes) before
        submitting. Same arguments as :meth:`submit`; changes nothing."""
        up, rank, prompt, _choices, out = self._size(user_id, group, prompt_tokens, max_output_tokens, choices, output_ceiling)
        return up, self.policy.groups[rank], prompt + out

    def class_loads(self) -> list[tuple[str, int, int, float]]:
        """Per class in priority order (highest first): ``(name, requests waiting,
        their reserved tokens, summed weight of the users with requests waiting)``.
        O(queued). For a capacity shared by several schedulers, which splits it by
        the demand each reports."""
        return scheduler_status.class_loads(self._order, self._accounts)

    def waiting_users(self) -> set[str]:
        """The users with requests waiting now. O(queued)."""
        return {t.user_id for q in self._order for t in q.tickets()}

    # -------------------------------------------------------------- inspection

    def queue_depths(self) -> dict[str, int]:
        """Waiting requests per class, in priority order."""
        return {q.name: len(q) for q in self._order}

    def drain_rate(self, measured: bool = False) -> float | None:
        """The rate this queue starts requests at (requests/s): measured while work
        waited (:class:`qos.queue_wait.DrainRate`), else one per second per slot
        (``measured``: ``None`` instead)."""
        if measured:
            return self.waits.drain.rate(self._clock())
        return self.waits.rate(self._clock(), self.capacity_model.slots)

    def queue_position(self, ticket: Ticket) -> tuple[int, float] | None:
        """A QUEUED ``ticket``'s estimated position (1: it starts next) and wait
        (seconds, ``position / drain rate``), or ``None`` when it is not waiting. The
        position counts the requests waiting in the classes above its own and those of
        its class that arrived before it (users' fair order inside a class is not
        modelled: :mod:`qos.queue_wait`). O(queued)."""
        if ticket.state is not TicketState.QUEUED or ticket.group not in self._rank:
            return None
        rank = self._rank[ticket.group]
        ahead = sum(len(q) for q in self._order[:rank]) + sum(1 for t in self._order[rank].tickets() if t.seq < ticket.seq)
        return ahead + 1, (ahead + 1) / self.drain_rate()

    def would_wait(self, group: str | None) -> tuple[int, float]:
        """The position a request of ``group`` (``None``: the default class) arriving now
        would take at the back of its class (waiting in its class and the classes above,
        plus one) and its estimated wait (seconds) at the drain rate. O(classes)."""
        rank = self._rank.get(group if group is not None else "", self._rank.get(self.policy.default_group, len(self._order) - 1))
        position = sum(len(q) for q in self._order[: rank + 1]) + 1
        return position, position / self.drain_rate()

    def counters(self) -> dict[str, float]:
        """Confirmed counter of every user tracked: service rendered (token units /
        weight), relative to its class's virtual time base."""
        return {uid: a.counter for uid, a in self._accounts.items()}

    def order_keys(self) -> dict[str, float]:
        """The key that orders every user tracked: confirmed counter plus the pending
        estimate of its requests in flight, per weight."""
        return {uid: a.key for uid, a in self._accounts.items()}

    def user_state(self, user_id: str) -> dict | None:
        """One user's fair-share state (JSON-ready), or ``None`` if not tracked:
        class, weight, counter, pending, key, requests queued and in flight."""
        a = self._accounts.get(user_id)
        return None if a is None else scheduler_status.user_state(a)

    @property
    def users_tracked(self) -> int:
        """Users whose fair-share state is kept now."""
        return len(self._accounts)

    def user_ids(self) -> KeysView[str]:
        """The ids of the users tracked now (a live view: do not keep it across calls
        that submit or release)."""
        return self._accounts.keys()

    def snapshot(self, top_users: int = 20) -> dict:
        """A JSON-ready view for status pages: per class depth, in flight, virtual time,
        recent service (token units, decayed with time constant ``share_window_s``) and
        the summed weight of its active users (served lately, waiting or in flight); the
        ``top_users`` users by recent service, and how many users are tracked in all;
        the slots held for a user's next request now, and the holds taken by it or
        expired unused since start (``hold_slot_s``). O(users tracked)."""
        totals = {
            "inflight": len(self.inflight), "capacity": self.capacity, "inflight_tokens": self.inflight_tokens,
            "queued": self.queued, "users_forgotten": self.users_forgotten,
        }  # fmt: skip
        return scheduler_status.snapshot(
            self._order, self._accounts, self.inflight, self._holds,
            totals=totals, now=self._clock(), window_s=self.policy.share_window_s, top_users=top_users,
        )  # fmt: skip

    def tickets_waiting(self) -> Iterable[Ticket]:
        """All queued tickets, highest class first, arrival order within a class."""
        for q in self._order:
            yield from q.tickets()
