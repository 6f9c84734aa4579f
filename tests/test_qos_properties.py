"""Property tests of the scheduling core: random operation sequences keep its invariants."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from qos import (
    CostModel,
    GroupPolicy,
    RateLimit,
    RefusalReason,
    Refused,
    Scheduler,
    SchedulerPolicy,
    TicketState,
    UserPolicy,
)

SETTINGS = settings(max_examples=200, deadline=None)

GROUPS = ("gold", "silver", "bronze")
USERS = ("u0", "u1", "u2", "u3", "u4", "u5")  # u0..u3 listed, u4/u5 unlisted


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_policy(
    weights=(2.0, 1.0, 0.0, 1.0), max_inflight=2, max_tokens=None, drop_silver=False, min_share=0.0, max_queue=5
):
    groups = [
        GroupPolicy("gold", max_queue=3),
        GroupPolicy("silver", min_share=min_share),
        GroupPolicy("bronze", default_user_weight=1.0),
    ]
    if drop_silver:
        del groups[1]
    silver = "bronze" if drop_silver else "silver"
    users = (
        UserPolicy("u0", "gold", weights[0]),
        UserPolicy("u1", silver, weights[1], RateLimit(requests_per_minute=3)),
        UserPolicy("u2", "bronze", weights[2]),
        UserPolicy("u3", "bronze", weights[3], RateLimit(tokens_per_minute=2000)),
    )
    return SchedulerPolicy(
        groups=tuple(groups),
        default_group="bronze",
        users={u.user_id: u for u in users},
        max_inflight=max_inflight,
        max_inflight_tokens=max_tokens,
        max_queue=max_queue,
        queue_timeout_s=10.0,
    )


weight_st = st.sampled_from([0.0, 0.5, 1.0, 3.0])
policy_st = st.builds(
    make_policy,
    weights=st.tuples(weight_st, weight_st, weight_st, weight_st),
    max_inflight=st.integers(1, 4),
    max_tokens=st.one_of(st.none(), st.integers(300, 3000)),
    drop_silver=st.booleans(),
    max_queue=st.integers(0, 6),
)
idx = st.integers(0, 1000)
submit_st = st.tuples(
    st.just("submit"),
    st.sampled_from(USERS),
    st.sampled_from([None, *GROUPS]),
    st.integers(0, 1500),
    st.one_of(st.none(), st.integers(0, 500)),
)
release_st = st.tuples(st.just("release"), idx, st.one_of(st.none(), st.integers(0, 2000)), st.integers(0, 1000))
op_st = st.one_of(
    submit_st,
    submit_st,
    submit_st,
    submit_st,
    submit_st,
    release_st,
    release_st,
    st.tuples(st.just("release_any"), idx),
    st.tuples(st.just("record"), idx, st.integers(0, 1000)),
    st.tuples(st.just("cancel"), idx),
    st.tuples(st.just("tick"), st.floats(0, 6, allow_nan=False)),
    st.tuples(st.just("policy"), policy_st),
)


class Model:
    """Drives a Scheduler and checks its invariants at every callback and step."""

    def __init__(self, policy: SchedulerPolicy, check_priority: bool = True) -> None:
        self.clock = FakeClock()
        self.check_priority = check_priority
        self.tickets: list = []
        self.admits: Counter = Counter()
        self.releases: Counter = Counter()
        self.late_refusals: list = []
        self.s = Scheduler(policy, clock=self.clock, on_admit=self.on_admit, on_refuse=self.on_refuse)
        self.surplus = 0  # in flight above max_inflight left by a lowered limit

    def rank(self, group: str) -> int:
        return self.s.policy.group_index(group)

    def on_admit(self, t) -> None:
        s = self.s
        self.admits[id(t)] += 1
        assert self.admits[id(t)] == 1, "admitted twice"
        assert t.state is TicketState.ADMITTED and t in s.inflight
        assert len(s.inflight) <= s.policy.max_inflight
        cap = s.policy.max_inflight_tokens
        if cap is not None and len(s.inflight) > 1:
            assert s.inflight_tokens <= cap
        if self.check_priority:
            mine = self.rank(t.group)
            for w in s.tickets_waiting():
                assert self.rank(w.group) >= mine, f"{t} admitted while higher {w} waits"

    def on_refuse(self, t) -> None:
        assert t.state is TicketState.REFUSED
        # TOO_LARGE: a reload lowered max_inflight_tokens below its reservation
        assert t.refusal.reason in (RefusalReason.EVICTED, RefusalReason.TIMEOUT, RefusalReason.SHUTDOWN, RefusalReason.TOO_LARGE)
        assert self.admits[id(t)] == 0
        self.late_refusals.append(t)

    def pick(self, pool, i):
        pool = sorted(pool, key=lambda t: t.seq)
        return pool[i % len(pool)] if pool else None

    def step(self, op) -> None:
        s = self.s
        kind = op[0]
        if kind == "submit":
            _, user, group, prompt, out = op
            before = len(self.late_refusals)
            try:
                t = s.submit(user, group, prompt, out)
            except Refused as e:
                assert e.retry_after_s > 0
                if e.reason is RefusalReason.TOO_LARGE:
                    cap = s.policy.max_inflight_tokens
                    assert cap is not None and prompt + s.policy.cost.reserve_output(out) > cap
                if e.reason is not RefusalReason.RATE_LIMITED:
                    assert e.retry_after_s >= 1
                assert len(self.late_refusals) == before  # a refused submit evicts nobody
                return
            self.tickets.append(t)
            for victim in self.late_refusals[before:]:
                assert victim.refusal.reason is RefusalReason.EVICTED
                assert self.rank(victim.group) > self.rank(t.group)
        elif kind == "release":
            _, i, prompt, out = op
            t = self.pick(s.inflight, i)
            if t is not None:
                assert s.release(t, prompt, out) is True
                self.releases[id(t)] += 1
        elif kind == "release_any":
            t = self.pick(self.tickets, op[1])
            if t is not None:
                was = t.state
                n = len(s.inflight)
                ok = s.release(t)
                assert ok is (was is TicketState.ADMITTED)
                if ok:
                    self.releases[id(t)] += 1
                else:
                    assert len(s.inflight) == n and t.state is was
        elif kind == "record":
            t = self.pick(s.inflight, op[1])
            if t is not None:
                s.record_output(t, op[2])
        elif kind == "cancel":
            t = self.pick(self.tickets, op[1])
            if t is not None:
                was = t.state
                q = s.queued
                ok = s.cancel(t)
                assert ok is (was is TicketState.QUEUED)
                if ok:
                    assert t.state is TicketState.REFUSED and s.queued <= q - 1  # dropped at once
        elif kind == "tick":
            self.clock.t += op[1]
            expired = s.expire()
            for t in expired:
                assert t.deadline <= self.clock.t and t.refusal.reason is RefusalReason.TIMEOUT
            nd = s.next_deadline()
            assert nd is None or nd > self.clock.t
        elif kind == "policy":
            s.update_policy(op[1])
            self.surplus = max(0, len(s.inflight) - s.policy.max_inflight)
        self.check()

    def check(self) -> None:
        s = self.s
        assert all(v <= 1 for v in self.releases.values())
        queued = [t for t in self.tickets if t.state is TicketState.QUEUED]
        admitted = {t for t in self.tickets if t.state is TicketState.ADMITTED}
        assert s.queued == sum(s.queue_depths().values()) == len(queued)
        assert set(s.tickets_waiting()) == set(queued)
        assert s.inflight == admitted
        assert s.inflight_tokens == sum(t.reserved_tokens for t in admitted)
        self.surplus = min(self.surplus, max(0, len(s.inflight) - s.policy.max_inflight))
        assert len(s.inflight) <= s.policy.max_inflight + self.surplus
        names = {g.name for g in s.policy.groups}
        assert all(t.group in names for t in queued)
        if queued:
            # work conserving: something waits only when capacity is really used
            assert s.inflight
            if len(s.inflight) < s.policy.max_inflight:
                assert s.policy.max_inflight_tokens is not None
        for t in self.tickets:
            assert self.admits[id(t)] == (1 if t.state in (TicketState.ADMITTED, TicketState.RELEASED) else 0)

    def drain(self) -> None:
        """Release everything in flight until nothing waits; no ticket may be left over."""
        s = self.s
        for _ in range(len(self.tickets) + 1):
            if not s.inflight:
                break
            t = min(s.inflight, key=lambda t: t.seq)
            assert s.release(t, output_tokens=0)
            self.releases[id(t)] += 1
            self.check()
        assert not s.inflight and s.queued == 0 and s.inflight_tokens == 0
        assert sum(s.queue_depths().values()) == 0
        for t in self.tickets:
            assert t.state in (TicketState.RELEASED, TicketState.REFUSED)
        assert s.close() == []


@SETTINGS
@given(policy=policy_st, ops=st.lists(op_st, min_size=40, max_size=100))
def test_random_operations_keep_invariants(policy, ops):
    m = Model(policy)
    for op in ops:
        m.step(op)
    m.drain()


@SETTINGS
@given(
    min_share=st.sampled_from([0.1, 0.3, 0.5]),
    max_inflight=st.integers(1, 3),
    max_tokens=st.one_of(st.none(), st.integers(300, 3000)),
    jobs=st.lists(
        st.tuples(st.sampled_from(USERS), st.sampled_from([None, *GROUPS]), st.integers(0, 1500), st.integers(0, 300)),
        max_size=40,
    ),
    dts=st.lists(st.floats(0, 3, allow_nan=False), max_size=40),
)
def test_finite_workload_never_starves(min_share, max_inflight, max_tokens, jobs, dts):
    """With min_share in play too: every request is eventually admitted or refused, and
    serving alone (no timeouts) admits everything that was queued."""
    policy = make_policy(max_inflight=max_inflight, max_tokens=max_tokens, min_share=min_share, max_queue=100)
    m = Model(policy, check_priority=False)
    for user, group, prompt, out in jobs:
        m.step(("submit", user, group, prompt, out))
    for dt in dts:
        m.clock.t += dt / 10  # never reaches a timeout
        m.step(("release", 0, None, 0))
    m.drain()
    assert not m.late_refusals  # nothing timed out or was evicted with a queue of 100
    for t in m.tickets:
        assert t.state is TicketState.RELEASED


# ------------------------------------------------------------------ fairness
#
# The bound of docs/scheduling.md ("The fairness bound"): for two users a and b of one
# class, both backlogged throughout an interval, with fixed weights,
#
#     |W_a - W_b| <= sum over u in {a, b} of (C_u + 2 eps_u + 2 lam_u) / w_u
#
# where W_u is u's confirmed service over the interval divided by w_u, C_u the largest
# real cost of one request of u, eps_u the largest total estimate error of u's requests
# in flight at one time (|what orders u - the real cost|), lam_u the largest service of
# u in flight not yet confirmed. Only a's and b's own requests appear in it: nothing
# another user does (gamers, churn, reloads of other users) widens it.

HONEST = ("a", "b")
COST = CostModel(input_weight=1.0, output_weight=2.0, default_output_tokens=64, max_tokens_ceiling=1000)


def _bound_policy(w_a, w_b, x_weight=1.0, x_group="g", x_limits=RateLimit(), max_inflight=3, max_inflight_tokens=None, max_users=6, hold_slot_s=0.0):
    users = {"a": UserPolicy("a", "g", w_a), "b": UserPolicy("b", "g", w_b)}
    if x_group is not None:
        users["x"] = UserPolicy("x", x_group, x_weight, x_limits)
    return SchedulerPolicy(
        groups=(GroupPolicy("hi"), GroupPolicy("g"), GroupPolicy("lo", max_queue=2)),
        default_group="g",
        users=users,
        max_inflight=max_inflight,
        max_inflight_tokens=max_inflight_tokens,
        max_queue=1000,
        queue_timeout_s=1e9,
        cost=COST,
        max_users=max_users,
        forget_users_after_s=5.0,
        hold_slot_s=hold_slot_s,
    )


reload_st = st.fixed_dictionaries(
    {
        "x_weight": st.sampled_from([0.0, 0.001, 1.0, 7.0]),
        "x_group": st.sampled_from(["g", "hi", "lo", None]),
        "x_limits": st.sampled_from([RateLimit(), RateLimit(requests_per_minute=2), RateLimit(tokens_per_minute=500)]),
        "max_inflight": st.integers(1, 4),
        "max_inflight_tokens": st.sampled_from([None, 5000, 100_000]),
        "max_users": st.integers(3, 8),
    }
)
big = st.sampled_from([0, 1, 7, 300, 5000, 2**62])
gamer_op = st.one_of(
    st.tuples(st.just("x_submit"), st.sampled_from([None, "hi", "lo"]), big, st.one_of(st.none(), big), st.sampled_from([1, 3, 10_000])),
    st.tuples(st.just("churn"), st.integers(0, 2000), st.one_of(st.none(), big)),
    st.tuples(st.just("x_release"), idx, st.sampled_from(["refused", "disconnect", "huge", "real"])),
    st.tuples(st.just("x_record"), idx, big),
    st.tuples(st.just("x_cancel"), idx),
    st.tuples(st.just("reload"), reload_st),
    st.tuples(st.just("tick"), st.floats(0, 4, allow_nan=False)),
)
honest_op = st.one_of(
    st.tuples(st.just("h_release"), idx),
    st.tuples(st.just("h_record"), idx, st.floats(0, 1, allow_nan=False)),
    st.tuples(st.just("h_serve"), st.integers(1, 6)),
    st.tuples(st.just("h_serve"), st.integers(1, 6)),
    st.tuples(st.just("h_pause"), st.sampled_from(HONEST), st.integers(1, 40)),  # goes idle, comes back (lifted)
)
honest_req = st.tuples(
    st.integers(1, 300),  # prompt estimate
    st.one_of(st.none(), st.integers(1, 200)),  # max_tokens
    st.floats(0.5, 1.5, allow_nan=False),  # real prompt / estimate
    st.floats(0, 1.2, allow_nan=False),  # real output / reservation (beyond 1: overrun)
)


class BoundModel:
    """Drives a scheduler with two honest users kept backlogged (but for pauses) and a
    gamer and churning identities doing anything; checks the bound over every interval
    in which both honest users stay backlogged.

    The terms of the bound (``C``, ``eps``, ``lam``) are the largest over the run, not
    only inside the interval, as the bound states them: a user that comes back ahead of
    the virtual time keeps the lead it had when it left (it is not lifted), and that lead
    is bounded by the terms of the time it was built, before the interval. (Measured
    inside the interval only, the inequality fails: a user served 600 ahead pauses and
    comes back with cheap requests in flight; the other then catches up by more than the
    interval's own terms.)"""

    def __init__(self, w_a: float, w_b: float, data, hold_slot_s: float = 0.0) -> None:
        self.w = {"a": w_a, "b": w_b}
        self.data = data
        self.t = 0.0
        self.hold = hold_slot_s
        self.next_actual = (0, 0)
        self.s = Scheduler(_bound_policy(w_a, w_b, hold_slot_s=hold_slot_s), clock=lambda: self.t, on_admit=self.on_admit)
        self.actual: dict[int, tuple[int, int]] = {}  # ticket seq -> real (prompt, output)
        self.tickets: list = []
        self.churn = 0
        self.paused = dict.fromkeys(HONEST, 0)  # steps an honest user sends nothing new
        self.worst_ratio = 0.0
        self.checked = 0
        self.active = False  # a and b both continuously backlogged since the interval began
        self.C = dict.fromkeys(HONEST, 0.0)  # the bound's terms, the largest over the run
        self.eps = dict.fromkeys(HONEST, 0.0)
        self.lam = dict.fromkeys(HONEST, 0.0)
        self.start_interval()

    # --- the honest users' interval of continuous backlog
    def start_interval(self) -> None:
        self.deltas: list[float] = []

    def end_interval(self) -> None:
        if self.active:
            self.check()
        self.active = False

    def on_admit(self, t) -> None:
        if t.user_id in HONEST:
            p, o = self.actual.setdefault(t.seq, self.next_actual)  # (admitted inside submit)
            self.C[t.user_id] = max(self.C[t.user_id], COST.cost(p, o))
            if self.active:
                if not any(w.user_id == t.user_id for w in self.s.tickets_waiting()):
                    self.sample()
                    self.end_interval()  # its last queued request just left: backlog broken
        self.sample()

    def sample(self) -> None:
        s = self.s
        for u in HONEST:
            eps = lam = 0.0
            for t in s.inflight:
                if t.user_id == u:
                    real = COST.cost(*self.actual[t.seq])
                    eps += abs(t.charged - real)
                    lam += real - t.confirmed
            self.eps[u] = max(self.eps[u], eps)
            self.lam[u] = max(self.lam[u], lam)
        if self.active:
            c = s.counters()
            self.deltas.append(c["a"] - c["b"])

    def check(self) -> None:
        if len(self.deltas) < 2:
            return
        gap = max(self.deltas) - min(self.deltas)
        bound = sum((self.C[u] + 2 * self.eps[u] + 2 * self.lam[u]) / self.w[u] for u in HONEST)
        assert gap <= bound * (1 + 1e-9) + 1e-6, (gap, bound, self.C, self.eps, self.lam)
        if bound > 0:
            self.worst_ratio = max(self.worst_ratio, gap / bound)
        self.checked += 1

    # --- keep a and b backlogged
    def top_up(self) -> None:
        skipped = False
        for u in HONEST:
            if self.paused[u]:
                self.paused[u] -= 1
                self.end_interval()  # (it may still have requests queued: the interval ends anyway)
                skipped = True
                continue
            while sum(1 for w in self.s.tickets_waiting() if w.user_id == u) < 8:
                p, mt, rp, ro = self.data.draw(honest_req)
                res = COST.reserve_output(mt)
                out = int(ro * res) if mt is None else min(mt, int(ro * res))  # an engine honours max_tokens
                self.next_actual = (max(0, int(rp * p)), out)
                t = self.s.submit(u, None, p, mt)
                self.actual.setdefault(t.seq, self.next_actual)
                self.tickets.append(t)
        if not skipped and not self.active:
            self.start_interval()
            self.active = True
        self.sample()

    def pick(self, pool, i, who):
        pool = sorted((t for t in pool if (t.user_id in HONEST) == (who == "h")), key=lambda t: t.seq)
        return pool[i % len(pool)] if pool else None

    def step(self, op) -> None:
        s = self.s
        kind = op[0]
        try:
            if kind == "x_submit":
                _, group, prompt, mt, choices = op
                self.tickets.append(s.submit("x", group, prompt, mt, choices=choices))
            elif kind == "churn":
                self.churn += 1
                self.tickets.append(s.submit(f"n{self.churn}", None, op[1], op[2]))
        except Refused:
            pass
        if kind == "x_release":
            t = self.pick(s.inflight, op[1], "x")
            if t is not None:
                mode = op[2]
                if mode == "refused":
                    s.release(t, 0, 0)
                elif mode == "disconnect":
                    s.release(t)
                elif mode == "huge":
                    s.release(t, 2**62, 2**62)
                else:
                    s.release(t, t.prompt_tokens, t.max_output_tokens // 2)
        elif kind == "x_record":
            t = self.pick(s.inflight, op[1], "x")
            if t is not None:
                s.record_output(t, op[2])
        elif kind == "x_cancel":
            t = self.pick([t for t in self.tickets if t.state is TicketState.QUEUED], op[1], "x")
            if t is not None:
                assert s.cancel(t)
        elif kind == "reload":
            s.update_policy(_bound_policy(self.w["a"], self.w["b"], hold_slot_s=self.hold, **op[1]))
        elif kind == "tick":
            self.t += op[1]
            s.expire()
            s.dispatch()  # the proxy's timer at a slot hold's end
        elif kind == "h_release":
            t = self.pick(s.inflight, op[1], "h")
            if t is not None:
                p, o = self.actual[t.seq]
                s.release(t, p, o)
        elif kind == "h_serve":
            for _ in range(op[1]):
                t = self.pick(s.inflight, 0, "h")
                if t is not None:
                    s.release(t, *self.actual[t.seq])
        elif kind == "h_pause":  # the user goes away (its queued requests cancelled) for a while
            self.end_interval()
            self.paused[op[1]] = op[2]
            for t in list(s.tickets_waiting()):
                if t.user_id == op[1] and t.state is TicketState.QUEUED:  # (a cancel may dispatch the next)
                    assert s.cancel(t)
        elif kind == "h_record":
            t = self.pick(s.inflight, op[1], "h")
            if t is not None:
                s.record_output(t, int(op[2] * self.actual[t.seq][1]))
        self.top_up()
        active = {t.user_id for t in s.tickets_waiting()} | {t.user_id for t in s.inflight}
        assert s.users_tracked <= max(s.policy.max_users, len(active))


@settings(max_examples=300, deadline=None)
@given(
    w_a=st.sampled_from([0.5, 1.0, 3.0]),
    w_b=st.sampled_from([1.0, 2.0]),
    hold=st.sampled_from([0.0, 0.5]),
    ops=st.lists(st.one_of(gamer_op, honest_op, honest_op, honest_op), min_size=60, max_size=250),
    data=st.data(),
)
def test_honest_backlogged_users_stay_within_the_stated_bound(w_a, w_b, hold, ops, data):
    """Submit, cancel, refusals (rate limit, group queue full, too large), reloads of
    another user's class and weight and of capacity, absurd max_tokens and usage, and
    identity churn, interleaved at random, with freed slots held for owed users or not
    (``hold_slot_s``; a tick is the proxy's timer): the service gap of the two honest
    users never leaves the bound."""
    m = BoundModel(w_a, w_b, data, hold)
    m.top_up()
    for op in ops:
        m.step(op)
    # a closing stretch of honest service (past any pause, then a few dispatches), so
    # that every example checks at least one interval: pauses drawn back to back can
    # otherwise keep the two users from ever being backlogged together, and such an
    # example would check nothing
    while any(m.paused.values()):
        m.step(("h_serve", 1))
    m.step(("tick", 1.0))  # past any slot hold (hold_slot_s <= 0.5)
    for _ in range(3):
        m.step(("h_serve", 1))
    m.end_interval()
    assert m.checked > 0
    assert m.worst_ratio <= 1.0
