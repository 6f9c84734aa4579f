"""Admission control: priority classes, token-fair sharing, capacity, bounds, rate limits.

One :class:`Scheduler` decides, for every request, whether it is refused at once, queued,
or dispatched upstream, and when a queued request is dispatched. It is pure: it does no
I/O, starts no tasks, and reads time only from the clock it is given. Callers learn of
dispatches and evictions through two callbacks, called synchronously from inside the
method that caused them.

Order of service when a slot is free:

1. a class with ``min_share`` > 0 that has work waiting and whose decayed share of
   dispatched cost is below its ``min_share`` (the largest deficit first); that cost is
   counted at dispatch as expected from the user's recent requests, then trued up with
   the real counts, and a class that starts waiting again is credited up to its share
   (no catch-up burst for time it spent idle);
2. otherwise the highest-priority class with work waiting (strict priority);
3. inside the class, the user with the smallest virtual token counter
   (:mod:`qos.fair_queue`).

A request is dispatched only when a slot is free and, if ``max_inflight_tokens`` is set,
its reserved tokens fit (or nothing is in flight). The head of the chosen class waits for
room rather than being overtaken by a lower class, so priority is never inverted.
"""

from __future__ import annotations

import heapq
import time
from typing import Callable, Iterable

from .fair_queue import FairQueue, UserAccount
from .group_shares import GroupShares
from .policy import RateLimit, SchedulerPolicy
from .rate_limit import TokenBucket
from .ticket import RefusalReason, Refused, Ticket, TicketState

Clock = Callable[[], float]
TicketCallback = Callable[[Ticket], None]


def _noop(_t: Ticket) -> None:
    return None


class _Limits:
    """The request and token buckets of one user or one class."""

    __slots__ = ("requests", "tokens")

    def __init__(self) -> None:
        self.requests: TokenBucket | None = None
        self.tokens: TokenBucket | None = None

    def configure(self, limits: RateLimit, now: float) -> None:
        self.requests = _reconfigure(self.requests, limits.requests_per_minute, now)
        self.tokens = _reconfigure(self.tokens, limits.tokens_per_minute, now)


def _reconfigure(bucket: TokenBucket | None, per_minute: float | None, now: float) -> TokenBucket | None:
    if per_minute is None:
        return None
    if bucket is None:
        return TokenBucket.per_minute(per_minute, now)
    bucket.reconfigure(per_minute, now)
    return bucket


class Scheduler:
    """The admission controller's state machine.

    Args:
        policy: the policy to start with (:meth:`update_policy` swaps it later).
        clock: returns the current time in seconds (monotonic); injectable for tests
            and simulations.
        on_admit: called with each ticket the moment it is dispatched (also for a ticket
            dispatched inside :meth:`submit`).
        on_refuse: called with each *queued* ticket that is refused later (evicted,
            timed out through :meth:`expire`, or drained at shutdown); ``ticket.refusal``
            says why. Refusals at submit time raise instead.
    """

    def __init__(
        self,
        policy: SchedulerPolicy,
        clock: Clock = time.monotonic,
        on_admit: TicketCallback = _noop,
        on_refuse: TicketCallback = _noop,
    ) -> None:
        self.policy = policy
        self._clock = clock
        self._on_admit = on_admit
        self._on_refuse = on_refuse
        self._seq = 0
        self._queues: dict[str, FairQueue] = {}
        self._order: list[FairQueue] = []
        self._accounts: dict[str, UserAccount] = {}
        self._user_limits: dict[str, _Limits] = {}
        self._group_limits: dict[str, _Limits] = {}
        self._shares = GroupShares(policy.share_window_s, clock)  # for min_share
        self._deadlines: list[tuple[float, int, Ticket]] = []
        self.inflight: set[Ticket] = set()
        self.inflight_tokens = 0
        self.queued = 0
        self.closed = False
        self._capacity_limit: int | None = None
        self._apply(policy)

    # ----------------------------------------------------------------- policy

    def _apply(self, policy: SchedulerPolicy) -> None:
        now = self._clock()
        self.policy = policy
        old = self._queues
        # (an empty FairQueue is falsy: test membership, or an idle class loses its vtime)
        self._queues = {g.name: old[g.name] if g.name in old else FairQueue(g.name) for g in policy.groups}
        self._order = [self._queues[g.name] for g in policy.groups]
        for g in policy.groups:
            self._group_limits.setdefault(g.name, _Limits()).configure(g.limits, now)
        for name in list(self._group_limits):
            if name not in self._queues:
                del self._group_limits[name]
        self._shares.configure(self._queues, policy.share_window_s)
        for uid, lim in self._user_limits.items():
            lim.configure(policy.user(uid).limits, now)
        # queued tickets of removed classes, or of users now in another class or with
        # another weight, are re-queued under the new policy (counters kept)
        requeue: list[Ticket] = []
        for name, q in old.items():
            for t in q.tickets():
                acct = self._accounts[t.user_id]
                up = policy.user(t.user_id, t.group if t.group in self._queues else None)
                if name not in self._queues or up.group != name or up.weight != acct.weight:
                    q.remove(t, acct)
                    requeue.append(t)
        for uid, acct in self._accounts.items():
            up = policy.user(uid, acct.group if acct.group in self._queues else None)
            acct.weight, acct.group = up.weight, up.group
        for t in sorted(requeue, key=lambda t: t.seq):
            acct = self._accounts[t.user_id]
            t.group = acct.group
            self._queues[t.group].push(t, acct)

    def update_policy(self, policy: SchedulerPolicy) -> None:
        """Swap in a new policy atomically.

        Counters and rate-limit buckets of users and classes that still exist carry over;
        queued requests of a removed class move to the default class (users listed in the
        new policy move to their new class); requests in flight are untouched. A larger
        ``max_inflight`` dispatches waiting requests at once; a smaller one lets the
        surplus in flight finish. Nothing is refused by a policy change.
        """
        self._apply(policy)
        self._dispatch()

    @property
    def capacity(self) -> int:
        """Requests allowed in flight now: ``policy.max_inflight``, or the limit set by
        :meth:`set_capacity_limit` when that is lower."""
        limit = self._capacity_limit
        return self.policy.max_inflight if limit is None else min(limit, self.policy.max_inflight)

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
        if limit is not None and limit < 1:
            raise ValueError(f"a capacity limit must be at least 1, got {limit}")
        self._capacity_limit = limit
        self._dispatch()

    # ---------------------------------------------------------------- accounts

    def _account(self, user_id: str, group: str, weight: float) -> UserAccount:
        acct = self._accounts.get(user_id)
        if acct is None:
            acct = self._accounts[user_id] = UserAccount(user_id, weight, group)
        elif not acct.queue:
            acct.weight, acct.group = weight, group
        return acct

    def _limits_of(self, user_id: str, limits: RateLimit) -> _Limits:
        lim = self._user_limits.get(user_id)
        if lim is None:
            lim = self._user_limits[user_id] = _Limits()
            lim.configure(limits, self._clock())
        return lim

    # ------------------------------------------------------------------ submit

    def submit(self, user_id: str, group: str | None, prompt_tokens: int, max_output_tokens: int | None) -> Ticket:
        """Ask for admission of one request.

        Args:
            user_id: the user (from identity resolution).
            group: a class chosen by a trusted source, or ``None`` for the user's own.
            prompt_tokens: estimated prompt length (tokens, >= 0).
            max_output_tokens: the request's ``max_tokens``, or ``None`` for the cost
                model's default.

        Returns:
            The ticket, in state ADMITTED (``on_admit`` has been called) or QUEUED.

        Raises:
            Refused: rate limited (RATE_LIMITED; ``scope`` and ``limit`` name the
                bucket that needs the longest wait), queues full (QUEUE_FULL,
                GROUP_QUEUE_FULL), or the scheduler is closed (SHUTDOWN).
        """
        policy = self.policy
        now = self._clock()
        if self.closed:
            raise Refused(RefusalReason.SHUTDOWN, 1.0, "the server is shutting down")
        up = policy.user(user_id, group)
        acct = self._accounts.get(user_id)
        if acct is not None and acct.queue and acct.group != up.group:
            # one fair-share account per user: while it has requests waiting, new ones
            # join the class those wait in (an account cannot be queued in two classes)
            up = policy.user(user_id, acct.group)
        gpol = policy.groups[policy.group_index(up.group)]
        out = policy.cost.default_output_tokens if max_output_tokens is None else max_output_tokens
        self._check_rate(user_id, up.limits, gpol.name, prompt_tokens + out, now)

        queue = self._queues[up.group]
        if gpol.max_queue is not None and len(queue) >= gpol.max_queue and not self._can_dispatch_now(queue, prompt_tokens + out):
            raise Refused(
                RefusalReason.GROUP_QUEUE_FULL,
                self._retry_hint(),
                f"the queue of group {gpol.name!r} is full ({gpol.max_queue} waiting)",
            )
        if self.queued >= policy.max_queue and not self._can_dispatch_now(queue, prompt_tokens + out):
            self._evict_for(policy.group_index(up.group))

        self._seq += 1
        ticket = Ticket(
            seq=self._seq,
            user_id=user_id,
            group=up.group,
            prompt_tokens=prompt_tokens,
            max_output_tokens=out,
            enqueued_at=now,
            deadline=now + policy.queue_timeout_s,
        )
        self._take_rate(user_id, gpol.name, ticket.reserved_tokens, now)
        acct = self._account(user_id, up.group, up.weight)
        if gpol.min_share > 0 and not len(queue):
            self._shares.lift(gpol.name, gpol.min_share)
        queue.push(ticket, acct)
        self.queued += 1
        dl = self._deadlines
        heapq.heappush(dl, (ticket.deadline, ticket.seq, ticket))
        if len(dl) > 2 * self.queued + 1024:
            # entries of tickets no longer queued are dropped lazily from the top only;
            # compact now and then so they cannot pile up (amortized O(1) per submit)
            self._deadlines = [e for e in dl if e[2].state is TicketState.QUEUED]
            heapq.heapify(self._deadlines)
        self._dispatch()
        return ticket

    def _can_dispatch_now(self, queue: FairQueue, tokens: int) -> bool:
        """Whether a new request for ``queue`` would be dispatched immediately (then queue
        bounds do not apply: it never waits)."""
        if self.queued > 0 or len(self.inflight) >= self.capacity:
            return False
        cap = self.policy.max_inflight_tokens
        return cap is None or not self.inflight or self.inflight_tokens + tokens <= cap

    def _check_rate(self, user_id: str, limits: RateLimit, group: str, tokens: int, now: float) -> None:
        buckets = ("user", self._limits_of(user_id, limits)), ("group", self._group_limits[group])
        wait, tripped = 0.0, ("", "")
        for scope, lim in buckets:  # the bucket that needs the longest wait is named
            if lim.requests is not None and (w := lim.requests.wait_time(1, now)) > wait:
                wait, tripped = w, (scope, "requests_per_minute")
            if lim.tokens is not None and (w := lim.tokens.wait_time(tokens, now)) > wait:
                wait, tripped = w, (scope, "tokens_per_minute")
        if wait > 0:
            scope, limit = tripped
            whose = f"user {user_id!r}" if scope == "user" else f"group {group!r} (all its users together)"
            raise Refused(RefusalReason.RATE_LIMITED, wait, f"rate limit exceeded: the {limit} of {whose}", scope=scope, limit=limit)

    def _take_rate(self, user_id: str, group: str, tokens: int, now: float) -> None:
        for lim in (self._user_limits[user_id], self._group_limits[group]):
            if lim.requests is not None:
                lim.requests.take(1, now)
            if lim.tokens is not None:
                lim.tokens.take(tokens, now)

    def _evict_for(self, priority: int) -> None:
        """Make room for a request of class index ``priority`` by evicting the newest
        waiting request of the lowest class below it; raise QUEUE_FULL if there is none."""
        for idx in range(len(self._order) - 1, priority, -1):
            victim = self._order[idx].newest()
            if victim is not None:
                self._refuse_queued(
                    victim,
                    Refused(
                        RefusalReason.EVICTED,
                        self._retry_hint(),
                        f"evicted from the queue by a request of higher priority (group {victim.group!r})",
                    ),
                )
                self._refund_rate(victim)  # never served: give its tokens back, as on timeout
                return
        raise Refused(
            RefusalReason.QUEUE_FULL,
            self._retry_hint(),
            f"the admission queue is full ({self.policy.max_queue} waiting)",
        )

    def _retry_hint(self) -> float:
        """A Retry-After guess (seconds): the queue timeout scaled by how full the queue is,
        at least 1 s."""
        return max(1.0, min(self.policy.queue_timeout_s, 1.0 + self.queued / max(1, self.policy.max_inflight)))

    # ---------------------------------------------------------------- dispatch

    def _pick_queue(self) -> FairQueue | None:
        owed = [(g.name, g.min_share) for g in self.policy.groups if g.min_share > 0 and len(self._queues[g.name])]
        if owed:
            name = self._shares.most_owed(owed)
            if name is not None:
                return self._queues[name]
        for q in self._order:
            if len(q):
                return q
        return None

    def _dispatch(self) -> None:
        policy = self.policy
        cap = policy.max_inflight_tokens
        while self.queued and len(self.inflight) < self.capacity:
            queue = self._pick_queue()
            if queue is None:
                return
            head = queue.peek(self._accounts)
            assert head is not None
            ticket, acct = head
            if cap is not None and self.inflight and self.inflight_tokens + ticket.reserved_tokens > cap:
                return
            queue.pop(self._accounts)
            self.queued -= 1
            cost = policy.cost.cost(ticket.prompt_tokens, ticket.max_output_tokens)
            queue.charge(acct, cost)
            ticket.charged = cost
            ticket.state = TicketState.ADMITTED
            ticket.admitted_at = self._clock()
            self.inflight.add(ticket)
            self.inflight_tokens += ticket.reserved_tokens
            share_cost = policy.cost.cost(ticket.prompt_tokens, self._shares.expected_output(ticket.user_id, ticket.max_output_tokens))
            ticket.share_charged = share_cost
            self._shares.add(ticket.group, share_cost)
            self._on_admit(ticket)

    # ------------------------------------------------------------- lifecycle

    def _refuse_queued(self, ticket: Ticket, refusal: Refused) -> None:
        self._queues[ticket.group].remove(ticket, self._accounts[ticket.user_id])
        self.queued -= 1
        ticket.state = TicketState.REFUSED
        ticket.refusal = refusal
        self._on_refuse(ticket)

    def cancel(self, ticket: Ticket, reason: RefusalReason = RefusalReason.CANCELLED) -> bool:
        """Withdraw a QUEUED ticket (client gone, or the caller's own timeout).

        Returns True if it was waiting and is now REFUSED (``on_refuse`` is *not* called:
        the caller already knows); False if it was not waiting (then, if ADMITTED, the
        caller must :meth:`release` it).
        """
        if ticket.state is not TicketState.QUEUED:
            return False
        self._queues[ticket.group].remove(ticket, self._accounts[ticket.user_id])
        self.queued -= 1
        ticket.state = TicketState.REFUSED
        wait = self._clock() - ticket.enqueued_at
        ticket.refusal = Refused(reason, self._retry_hint(), f"{reason.value} after {wait:.3f} s in the queue")
        self._refund_rate(ticket)
        self._dispatch()  # the head of a blocked class may have changed
        return True

    def _refund_rate(self, ticket: Ticket) -> None:
        now = self._clock()
        for lim in (self._user_limits.get(ticket.user_id), self._group_limits.get(ticket.group)):
            if lim is not None and lim.tokens is not None:
                lim.tokens.adjust(-ticket.reserved_tokens, now)

    def record_output(self, ticket: Ticket, output_tokens: int) -> None:
        """Report that ``ticket`` has produced ``output_tokens`` so far (cumulative).

        Charges the user's counter for output beyond what was charged at dispatch, so a
        request that outruns its estimate pays as it streams.
        """
        if ticket.state is not TicketState.ADMITTED or output_tokens <= ticket.output_tokens:
            return
        ticket.output_tokens = output_tokens
        cost = self.policy.cost.cost(ticket.prompt_tokens, output_tokens)
        if cost > ticket.charged:
            acct = self._accounts[ticket.user_id]
            self._queue_of(ticket).charge(acct, cost - ticket.charged)
            ticket.charged = cost
        if cost > ticket.share_charged:
            self._shares.add(ticket.group, cost - ticket.share_charged)
            ticket.share_charged = cost

    def _queue_of(self, ticket: Ticket) -> FairQueue:
        # the class the user's account queues in now (where its heap entry lives), which
        # differs from ticket.group when a reload or a later submit moved the user
        return self._queues[self._accounts[ticket.user_id].group]

    def release(self, ticket: Ticket, prompt_tokens: int | None = None, output_tokens: int | None = None) -> bool:
        """Free ``ticket``'s slot and true up its cost with the real token counts.

        Args:
            ticket: an ADMITTED ticket.
            prompt_tokens: real prompt tokens if the upstream reported them.
            output_tokens: real output tokens; defaults to the last :meth:`record_output`.

        Returns:
            True the first time; False (and nothing changes) for a ticket that is not
            ADMITTED, so a second release can never free a slot twice.
        """
        if ticket.state is not TicketState.ADMITTED:
            return False
        ticket.state = TicketState.RELEASED
        self.inflight.discard(ticket)
        self.inflight_tokens -= ticket.reserved_tokens
        prompt = ticket.prompt_tokens if prompt_tokens is None else prompt_tokens
        out = ticket.output_tokens if output_tokens is None else output_tokens
        ticket.output_tokens = out
        actual = self.policy.cost.cost(prompt, out)
        acct = self._accounts[ticket.user_id]
        self._queue_of(ticket).charge(acct, actual - ticket.charged)
        ticket.charged = actual
        # the class's share (min_share) is trued up too, or an error of the estimate at
        # dispatch would count as service the class never got (or did not pay for)
        self._shares.add(ticket.group, actual - ticket.share_charged, ticket.admitted_at)
        ticket.share_charged = actual
        self._shares.learn_output(ticket.user_id, ticket.max_output_tokens, out)
        now = self._clock()
        tokens_delta = prompt + out - ticket.reserved_tokens
        for lim in (self._user_limits.get(ticket.user_id), self._group_limits.get(ticket.group)):
            if lim is not None and lim.tokens is not None:
                lim.tokens.adjust(tokens_delta, now)
        self._dispatch()
        return True

    def expire(self) -> list[Ticket]:
        """Refuse every queued ticket whose deadline has passed (reason TIMEOUT).

        Returns them; ``on_refuse`` is called for each. O(k log n) for k expired.
        """
        now = self._clock()
        out: list[Ticket] = []
        dl = self._deadlines
        while dl and (dl[0][2].state is not TicketState.QUEUED or dl[0][0] <= now):
            _d, _s, t = heapq.heappop(dl)
            if t.state is TicketState.QUEUED:
                self._refuse_queued(
                    t,
                    Refused(RefusalReason.TIMEOUT, self._retry_hint(), f"waited {now - t.enqueued_at:.1f} s in the queue"),
                )
                self._refund_rate(t)
                out.append(t)
        if out:
            self._dispatch()
        return out

    def next_deadline(self) -> float | None:
        """Clock reading of the earliest queued deadline, or ``None`` when nothing waits."""
        dl = self._deadlines
        while dl and dl[0][2].state is not TicketState.QUEUED:
            heapq.heappop(dl)
        return dl[0][0] if dl else None

    def close(self) -> list[Ticket]:
        """Stop admitting: refuse every queued ticket (SHUTDOWN) and every later submit.

        Tickets in flight stay ADMITTED until released. Returns the refused tickets.
        """
        self.closed = True
        out: list[Ticket] = []
        for q in self._order:
            for t in q.tickets():
                self._refuse_queued(t, Refused(RefusalReason.SHUTDOWN, 1.0, "the server is shutting down"))
                out.append(t)
        return out

    # ------------------------------------------------------------- inspection

    def queue_depths(self) -> dict[str, int]:
        """Waiting requests per class, in priority order."""
        return {q.name: len(q) for q in self._order}

    def counters(self) -> dict[str, float]:
        """Virtual token counter of every user seen (token units / weight)."""
        return {uid: a.counter for uid, a in self._accounts.items()}

    def snapshot(self) -> dict:
        """A JSON-ready view for status pages: per class depth and in-flight, per user
        counter and weight."""
        inflight_by_group: dict[str, int] = {}
        for t in self.inflight:
            inflight_by_group[t.group] = inflight_by_group.get(t.group, 0) + 1
        return {
            "inflight": len(self.inflight),
            "capacity": self.capacity,
            "inflight_tokens": self.inflight_tokens,
            "queued": self.queued,
            "groups": [
                {
                    "name": q.name,
                    "queued": len(q),
                    "inflight": inflight_by_group.get(q.name, 0),
                    "virtual_time": q.vtime,
                }
                for q in self._order
            ],
            "users": {uid: {"counter": a.counter, "weight": a.weight, "queued": len(a.queue)} for uid, a in self._accounts.items()},
        }

    def tickets_waiting(self) -> Iterable[Ticket]:
        """All queued tickets, highest class first, arrival order within a class."""
        for q in self._order:
            yield from q.tickets()
