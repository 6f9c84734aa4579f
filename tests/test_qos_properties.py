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
        assert t.refusal.reason in (RefusalReason.EVICTED, RefusalReason.TIMEOUT, RefusalReason.SHUTDOWN)
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

req_st = st.tuples(st.integers(1, 2000), st.integers(0, 500))


@SETTINGS
@given(
    w_a=st.floats(0.1, 10, allow_nan=False),
    w_b=st.floats(0.1, 10, allow_nan=False),
    reqs_a=st.lists(req_st, min_size=2, max_size=25),
    reqs_b=st.lists(req_st, min_size=2, max_size=25),
    max_inflight=st.integers(1, 3),
    data=st.data(),
)
def test_backlogged_users_counters_stay_within_vtc_bound(w_a, w_b, reqs_a, reqs_b, max_inflight, data):
    """qos/fair_queue.py: while users a and b are both backlogged, and every request's
    charge is final at dispatch, |c_a - c_b| <= max(C_a / w_a, C_b / w_b)."""
    cost = CostModel()
    users = {"a": UserPolicy("a", "g", w_a), "b": UserPolicy("b", "g", w_b)}
    policy = SchedulerPolicy(groups=(GroupPolicy("g"),), default_group="g", users=users, max_inflight=max_inflight, max_queue=100)
    clock = FakeClock()
    bound = max(
        max(cost.cost(p, o) for p, o in reqs_a) / w_a,
        max(cost.cost(p, o) for p, o in reqs_b) / w_b,
    )
    worst = [0.0]
    s = None

    def check(_t=None):
        waiting = {t.user_id for t in s.tickets_waiting()}
        if waiting == {"a", "b"}:
            c = s.counters()
            gap = abs(c["a"] - c["b"])
            worst[0] = max(worst[0], gap)
            assert gap <= bound * (1 + 1e-9), (gap, bound, c)

    s = Scheduler(policy, clock=clock, on_admit=check)
    order = data.draw(st.permutations(["a"] * len(reqs_a) + ["b"] * len(reqs_b)))
    pending = {"a": list(reqs_a), "b": list(reqs_b)}
    for u in order:
        p, o = pending[u].pop()
        s.submit(u, None, p, o)
        check()
    while s.inflight:
        t = data.draw(st.sampled_from(sorted(s.inflight, key=lambda t: t.seq)))
        assert s.release(t, output_tokens=t.max_output_tokens)  # exact: no true-up
        check()
    assert s.queued == 0
