"""The scheduling core against clients that game it and operators that reload it (issue 10):
absurd max_tokens, reserve-lift-refund, precision, reloads that move users, eviction and
min_share, token-capacity inversion, rate limits that only charge what was served,
bounded per-user state, and the two seams (RateLimiter, Capacity)."""

from __future__ import annotations

import pytest

from qos import (
    CostModel,
    GroupPolicy,
    LocalCapacity,
    RateLimit,
    RateLimiter,
    RefusalReason,
    Refused,
    Scheduler,
    SchedulerPolicy,
    TicketState,
    UserPolicy,
)
from qos.fair_queue import REBASE_AT
from tests.test_qos_scheduler import FLAT, Harness, pol


def served_tokens(tickets) -> dict[str, float]:
    out: dict[str, float] = {}
    for t in tickets:
        out[t.user_id] = out.get(t.user_id, 0.0) + t.confirmed
    return out


def run_pair(h: Harness, sizes: dict[str, int], n: int) -> list:
    """Keep every user of ``sizes`` backlogged with requests of that many prompt tokens
    (no output), serve ``n`` requests one at a time (max_inflight 1), return them."""
    got = []
    for _ in range(n):
        for u, size in sizes.items():
            if not any(t.user_id == u for t in h.s.tickets_waiting()):
                h.submit(u, size, 0)
        t = next(iter(h.s.inflight))
        h.s.release(t, output_tokens=0)
        got.append(t)
    return got


# ------------------------------------------------------------ absurd max_tokens


def test_absurd_max_tokens_touches_no_counter_and_no_virtual_time():
    h = Harness(pol(max_inflight=1, cost=CostModel(1.0, 2.0, 0, max_tokens_ceiling=1000)))
    g = h.submit("G", 10, 2**62)
    assert g.state is TicketState.ADMITTED
    assert g.max_output_tokens == 1000  # the reservation is clamped
    assert h.s.counters()["G"] == 0 and h.s.snapshot()["groups"][0]["virtual_time"] == 0
    h.s.release(g, 0, 0)  # the engine refused it at once: nothing served, nothing charged
    assert h.s.counters()["G"] == 0 and h.s.order_keys()["G"] == 0
    # ordinary costs still count: a short-answer user and a long-answer user split 50/50
    h.submit("warm", 1)
    got = run_pair(h, {"short": 10, "long": 100}, 220)[20:]
    s = served_tokens(got)
    assert abs(s["short"] - s["long"]) <= 2 * 100
    assert 0.45 <= s["short"] / (s["short"] + s["long"]) <= 0.55


def test_absurd_counts_from_anywhere_are_clamped_and_finite():
    h = Harness(pol(max_inflight=1))
    t = h.submit("G", 10**30, 10**400)  # an estimate and a max_tokens no request has
    assert t.state is TicketState.ADMITTED
    h.s.record_output(t, 10**400)
    h.s.release(t, 10**400, 10**400)
    c = h.s.counters()["G"]
    assert c == c and c < float("inf")  # a finite number, no OverflowError on the way


def test_a_huge_charge_never_makes_ordinary_costs_vanish():
    # weight 1e-6 turns a clamped 2**40-token answer into a counter near 2e18, where a
    # float cannot tell 1 unit from 0: the class rebases, and shares still hold
    users = (UserPolicy("G", "g", 1e-6), UserPolicy("short", "g", 1.0), UserPolicy("long", "g", 1.0))
    h = Harness(pol(users=users, max_inflight=1))
    g = h.submit("G", 1, 10)
    h.s.release(g, 1, 2**62)
    assert h.s.counters()["G"] > 1e18
    h.submit("G", 1, 1)  # G alone: picked, the virtual time jumps to its counter
    assert h.s.snapshot()["groups"][0]["virtual_time"] < REBASE_AT  # rebased at once
    got = run_pair(h, {"short": 1, "long": 3}, 400)[10:]
    s = served_tokens(got)
    # with the old accounting both counters sat near 2e18, +1 and +3 rounded to nothing,
    # and the order fell back to arrival: "short" got a quarter of the tokens
    assert 0.45 <= s["short"] / (s["short"] + s["long"]) <= 0.55


# ------------------------------------------------------- reserve, lift, refund


def test_newcomer_is_not_lifted_to_a_gamers_refundable_estimate():
    """G sends huge-max_tokens requests that produce nothing and are released (refused
    or disconnected); N arrives while they are in flight. N must not wait behind G's
    next requests: it was placed at the virtual time of confirmed service, which G's
    refunds cannot undercut."""
    h = Harness(pol(max_inflight=2, cost=CostModel(1.0, 2.0, 0, max_tokens_ceiling=30_000)))
    gs = [h.submit("G", 10, 30_000) for _ in range(40)]
    assert sum(t.state is TicketState.ADMITTED for t in gs) == 2
    for _ in range(5):  # G alone: every request disconnects at once
        oldest = min(h.s.inflight, key=lambda t: t.seq)
        h.s.release(oldest, output_tokens=0)
    ns = [h.submit("N", 10, 10) for _ in range(10)]
    for _ in range(10):
        oldest = min(h.s.inflight, key=lambda t: t.seq)
        h.s.release(oldest, output_tokens=0 if oldest.user_id == "G" else 10)
    nxt = [t.user_id for t in h.admitted[-10:]]
    # N gets its turn at once and shares with G by tokens (each of G's requests costs
    # G its prompt, 10; N's cost 30): with the old accounting N was lifted to G's
    # inflated counter and waited behind G's whole backlog
    assert "N" in nxt[:3] and nxt.count("N") >= 2
    assert ns[0].state is not TicketState.QUEUED


# -------------------------------------------------------------------- reloads


def test_reload_moving_a_backlogged_user_places_it_at_the_new_class_virtual_time():
    users = (UserPolicy("A", "gold"), UserPolicy("B", "gold"), UserPolicy("M", "silver"), UserPolicy("S", "silver"))
    h = Harness(pol(("gold", "silver"), users=users, max_inflight=1))
    busy = h.submit("warm", 1, group="gold")
    for _ in range(200):
        h.submit("A", 100)
        h.submit("B", 100)
    h.s.release(busy)
    h.serve(150)  # gold's virtual time is now ~7500; silver's is 0
    for _ in range(20):
        h.submit("M", 100)
    # M moves to gold with its queued requests
    moved = (UserPolicy("A", "gold"), UserPolicy("B", "gold"), UserPolicy("M", "gold"), UserPolicy("S", "silver"))
    h.s.update_policy(pol(("gold", "silver"), users=moved, max_inflight=1))
    assert h.s.queue_depths()["silver"] == 0 and all(t.group == "gold" for t in h.s.tickets_waiting())
    got = [t.user_id for t in h.serve(30)]
    # M gets its third of gold at once: neither 0 of the next dispatches (old counter
    # on silver's scale, far below... or above) nor a burst
    assert 8 <= got.count("M") <= 12


def test_reload_removing_a_user_moves_it_to_the_default_class_at_once_queued_included():
    users = (UserPolicy("P", "platinum"), UserPolicy("Q", "platinum"))
    h = Harness(pol(("platinum", "bronze"), users=users, max_inflight=1))
    busy = h.submit("warm", 1, group="bronze")
    mine = [h.submit("P", 10) for _ in range(5)]
    bronze = [h.submit(f"b{i}", 10) for i in range(3)]
    h.s.update_policy(pol(("platinum", "bronze"), users=(UserPolicy("Q", "platinum"),), max_inflight=1))
    assert all(t.group == "bronze" for t in mine)
    assert h.s.queue_depths() == {"platinum": 0, "bronze": 8}
    q = h.submit("Q", 10)  # a platinum request now goes before all of P's
    h.s.release(busy)
    assert h.admitted[-1] is q
    # and P's new requests go to bronze as well (not the class its old ones waited in)
    assert h.submit("P", 10).group == "bronze"
    assert all(t.state is TicketState.QUEUED for t in bronze)


def test_reload_changing_weight_keeps_the_cost_of_a_lead():
    users = (UserPolicy("A", "g", 1.0), UserPolicy("B", "g", 1.0))
    h = Harness(pol(users=users, max_inflight=1))
    busy = h.submit("x", 1)
    for _ in range(10):
        h.submit("A", 100)
    h.s.release(busy)
    h.serve(5)  # A alone: served 500
    vt = h.s.snapshot()["groups"][0]["virtual_time"]
    lead = h.s.counters()["A"] - vt
    h.s.update_policy(pol(users=(UserPolicy("A", "g", 4.0), UserPolicy("B", "g", 1.0)), max_inflight=1))
    assert h.s.counters()["A"] - vt == pytest.approx(lead / 4)  # same cost, new weight


# ------------------------------------------------------------- eviction, inversion


def test_eviction_spares_a_class_under_its_min_share():
    groups = (GroupPolicy("gold"), GroupPolicy("silver"), GroupPolicy("bronze", min_share=0.3))
    h = Harness(pol(groups, max_inflight=1, max_queue=3, share_window_s=30.0))
    busy = h.submit("g0", 10, group="gold")
    s1 = h.submit("s1", 10, group="silver")
    b1 = h.submit("b1", 10, group="bronze")
    b2 = h.submit("b2", 10, group="bronze")
    # bronze has had no service: it is under its floor, so silver's request goes instead
    h.submit("g1", 10, group="gold")
    assert s1.state is TicketState.REFUSED and s1.refusal.reason is RefusalReason.EVICTED
    assert b1.state is b2.state is TicketState.QUEUED
    # nothing left to evict above the floor: the newcomer is refused, bronze keeps its two
    with pytest.raises(Refused) as e:
        h.submit("g2", 10, group="gold")
    assert e.value.reason is RefusalReason.QUEUE_FULL
    # once bronze is above its floor it is the lowest class and is evicted first again
    h.s.release(busy)
    h.s.release(h.admitted[-1])  # gold's g1
    assert h.admitted[-1] is b1
    h.s.release(b1, output_tokens=10_000)  # a lot of service: far above 30 %
    assert b2.state is TicketState.ADMITTED
    h.submit("b3", 10, group="bronze")
    h.submit("s3", 10, group="silver")
    h.submit("s4", 10, group="silver")
    h.submit("g3", 10, group="gold")
    assert h.refused[-1].user_id == "b3"


def test_a_floor_class_keeps_its_floor_when_higher_classes_keep_the_global_queue_full():
    # gold alone could fill the global queue for good; bronze's own arrivals must still
    # get in (evicting gold's newest, since bronze is owed) and be served at its floor
    groups = (GroupPolicy("gold"), GroupPolicy("bronze", min_share=0.3))
    h = Harness(pol(groups, max_inflight=1, max_queue=8, share_window_s=30.0, queue_timeout_s=1e6))
    busy = h.submit("g-warm", 100, group="gold")
    full = 0
    bronze_refused = 0
    got = []
    for i in range(400):
        h.clock.advance(0.1)
        # gold arrives faster than it is served and keeps the queue full ...
        for j in range(3):
            try:
                h.submit(f"g{j}", 100, group="gold")
            except Refused:
                pass
        full += h.s.queued == 8
        # ... and bronze sends one request a turn, as many as are served
        try:
            h.submit(f"b{i % 4}", 100, group="bronze")
        except Refused as e:
            assert e.reason is RefusalReason.QUEUE_FULL
            bronze_refused += 1
        if i == 0:
            h.s.release(busy)
        else:
            got += h.serve(1)
    assert full > 350  # the global queue was full nearly all the time
    served = {"gold": 0.0, "bronze": 0.0}
    for t in got[50:]:
        served[t.group] += t.charged
    frac = served["bronze"] / (served["gold"] + served["bronze"])
    assert 0.27 <= frac <= 0.4, frac
    # bronze got in while under its floor (evicting gold's newest) and was refused only
    # while above it
    assert 0 < bronze_refused < 400
    evicted = [t for t in h.refused if t.refusal.reason is RefusalReason.EVICTED]
    assert evicted and {t.group for t in evicted} <= {"gold", "bronze"}


def test_a_class_under_its_floor_evicts_the_lowest_class_above_its_share_first():
    groups = (GroupPolicy("gold"), GroupPolicy("silver"), GroupPolicy("bronze", min_share=0.3), GroupPolicy("guests"))
    h = Harness(pol(groups, max_inflight=1, max_queue=3))
    h.submit("g0", 10, group="gold")
    g1 = h.submit("g1", 10, group="gold")
    s1 = h.submit("s1", 10, group="silver")
    s2 = h.submit("s2", 10, group="silver")
    # bronze has had nothing (under its floor): the newest of the lowest class above it goes
    b1 = h.submit("b1", 10, group="bronze")
    assert h.refused == [s2] and "min_share" in s2.refusal.detail
    assert b1.state is TicketState.QUEUED and s1.state is g1.state is TicketState.QUEUED
    # a guest (no floor, lowest) cannot evict anyone; a second bronze evicts silver's s1
    with pytest.raises(Refused) as e:
        h.submit("x", 10, group="guests")
    assert e.value.reason is RefusalReason.QUEUE_FULL
    h.submit("b2", 10, group="bronze")
    assert h.refused == [s2, s1]
    h.submit("b3", 10, group="bronze")
    assert h.refused == [s2, s1, g1]
    # only bronze, under its floor, is left: nobody evicts it, not even gold
    with pytest.raises(Refused) as e:
        h.submit("g2", 10, group="gold")
    assert e.value.reason is RefusalReason.QUEUE_FULL
    assert h.s.queue_depths() == {"gold": 0, "silver": 0, "bronze": 3, "guests": 0}


def test_a_returning_floor_class_is_credited_its_share_for_the_time_it_was_away():
    from qos.group_shares import GroupShares
    from tests.test_qos_scheduler import FakeClock

    clock = FakeClock()
    for away, lo, hi in ((0.1, 0.0999, 0.101), (300.0, 0.2999, 0.3)):
        shares = GroupShares(30.0, clock)
        shares.configure(("gold", "bronze"), 30.0)
        shares.add("gold", 900.0)
        shares.add("bronze", 100.0)  # bronze at 10 %, under its 30 % floor
        shares.lift("bronze", 0.3, away)
        # a long absence is not banked (lifted to its floor: no burst ahead of gold);
        # a short one (a class turned away for queue room) is not wiped into credit
        assert lo <= shares.share("bronze") <= hi, (away, shares.share("bronze"))
    shares.lift("bronze", 0.3, 0.0)
    shares.add("bronze", 10_000.0)
    before = shares.share("bronze")
    shares.lift("bronze", 0.3)  # above its floor: left alone
    assert shares.share("bronze") == before


def test_an_owed_min_share_head_that_does_not_fit_never_holds_a_higher_class_back():
    groups = (GroupPolicy("gold"), GroupPolicy("bronze", min_share=0.5))
    h = Harness(pol(groups, max_inflight=8, max_inflight_tokens=1000))
    running = h.submit("g0", 600, group="gold")  # holds 600 of the 1000 tokens
    big = h.submit("b", 900, group="bronze")  # owed (bronze has had nothing), does not fit
    small = [h.submit(f"g{i}", 100, group="gold") for i in range(1, 5)]
    # slots are free and gold's requests fit: they go, bronze's head waits for room
    assert [t.state for t in small] == [TicketState.ADMITTED] * 4
    assert big.state is TicketState.QUEUED
    h.s.release(running)
    for t in small:
        h.s.release(t)
    assert big.state is TicketState.ADMITTED


def test_a_request_that_can_never_fit_is_refused_at_once_and_consumes_nothing():
    users = (UserPolicy("u", "g", limits=RateLimit(requests_per_minute=1, tokens_per_minute=10_000)),)
    h = Harness(pol(users=users, max_inflight=4, max_inflight_tokens=1000))
    with pytest.raises(Refused) as e:
        h.submit("u", 10, 2000)
    assert e.value.reason is RefusalReason.TOO_LARGE
    assert h.submit("u", 10, 500).state is TicketState.ADMITTED  # its one request per minute is intact


def test_a_reload_lowering_token_capacity_refuses_what_can_no_longer_fit():
    h = Harness(pol(max_inflight=1, max_inflight_tokens=5000))
    h.submit("a", 10)
    big = h.submit("b", 3000)
    small = h.submit("c", 10)
    h.s.update_policy(pol(max_inflight=1, max_inflight_tokens=1000))
    assert big.state is TicketState.REFUSED and big.refusal.reason is RefusalReason.TOO_LARGE
    assert h.refused == [big] and small.state is TicketState.QUEUED


# ---------------------------------------------------------------- rate limits


@pytest.mark.parametrize("how", ["cancel", "timeout", "evicted", "shutdown"])
def test_a_request_never_dispatched_consumes_no_request_or_token_budget(how):
    users = (UserPolicy("u", "bronze", limits=RateLimit(requests_per_minute=2, tokens_per_minute=1000)),)
    h = Harness(pol(("gold", "bronze"), users=users, max_inflight=1, max_queue=1, queue_timeout_s=5))
    x = h.submit("x", 1, group="bronze")
    first = h.submit("u", 400)  # queued: one request and 400 tokens reserved
    if how == "cancel":
        assert h.s.cancel(first)
    elif how == "timeout":
        h.clock.advance(5)
        assert h.s.expire() == [first]
    elif how == "evicted":
        g = h.submit("g", 1, group="gold")
        assert first.refusal.reason is RefusalReason.EVICTED
        h.s.cancel(g)
    else:
        h.s.close()
        h.s.closed = False  # (reopen to look at the buckets)
    assert first.state is TicketState.REFUSED
    h.s.update_policy(pol(("gold", "bronze"), users=users, max_inflight=1, max_queue=10))  # (buckets kept)
    h.s.release(x)
    # both requests of the minute and all 1000 tokens are still there
    assert h.submit("u", 900).state is TicketState.ADMITTED
    assert h.submit("u", 100).state is TicketState.QUEUED
    with pytest.raises(Refused) as e:
        h.submit("u", 1)  # a third request in the minute
    assert e.value.reason is RefusalReason.RATE_LIMITED


def test_a_dispatched_request_keeps_its_request_and_settles_its_tokens_to_real_usage():
    users = (UserPolicy("u", "g", limits=RateLimit(requests_per_minute=2, tokens_per_minute=1000)),)
    h = Harness(pol(users=users, max_inflight=4))
    t = h.submit("u", 100, 800)  # 900 reserved
    h.s.release(t, 100, 50)  # 150 used
    h.submit("u", 800)  # 850 left: fits
    with pytest.raises(Refused):
        h.submit("u", 1)  # but the two requests of the minute are spent


def test_n_and_best_of_scale_reservation_and_rate_tokens():
    users = (UserPolicy("u", "g", limits=RateLimit(tokens_per_minute=3000)),)
    h = Harness(pol(users=users, max_inflight=4))
    t = h.s.submit("u", None, 100, 500, choices=4)
    assert t.max_output_tokens == 2000 and t.reserved_tokens == 2100
    with pytest.raises(Refused) as e:
        h.s.submit("u", None, 100, 500, choices=2)  # 1100 more: over the 3000 a minute
    assert e.value.reason is RefusalReason.RATE_LIMITED
    assert h.s.submit("v", None, 1, 10, choices=10**9).max_output_tokens == 10 * 128  # clamped multiplier


def test_a_per_request_output_ceiling_clamps_the_reservation():
    h = Harness(pol(max_inflight=4, cost=CostModel(1, 1, 256, max_tokens_ceiling=32768)))
    assert h.s.submit("u", None, 10, 100_000).max_output_tokens == 32768
    assert h.s.submit("u", None, 10, 100_000, output_ceiling=4096).max_output_tokens == 4096
    assert h.s.submit("u", None, 10, None, output_ceiling=100).max_output_tokens == 100


def test_one_rate_limiter_shared_by_two_schedulers_limits_across_both():
    limiter = RateLimiter()
    users = {"u": UserPolicy("u", "g", limits=RateLimit(requests_per_minute=3))}
    policy = SchedulerPolicy(groups=(GroupPolicy("g"),), default_group="g", users=users, cost=FLAT)
    t = [0.0]
    pools = [Scheduler(policy, clock=lambda: t[0], rate_limiter=limiter) for _ in range(2)]
    pools[0].submit("u", None, 1, 1)
    pools[1].submit("u", None, 1, 1)
    pools[0].submit("u", None, 1, 1)
    with pytest.raises(Refused):
        pools[1].submit("u", None, 1, 1)


def test_rate_limit_buckets_are_bounded():
    limiter = RateLimiter(max_buckets=100)
    lim = RateLimit(requests_per_minute=60)
    for i in range(1000):
        r = limiter.reserve(f"u{i}", lim, "g", RateLimit(), 1, float(i))
        limiter.settle(r, 1, float(i))
    assert len(limiter) <= 100
    # a refilled bucket is dropped as it comes to the front (nothing lost: it was full)
    limiter2 = RateLimiter()
    for i in range(1000):
        limiter2.reserve(f"u{i}", lim, "g", RateLimit(), 1, 10.0 * i)  # each refills before the next
    assert len(limiter2) < 10


# -------------------------------------------------------------- bounded state


def test_identity_churn_keeps_per_user_state_bounded():
    h = Harness(pol(max_inflight=4, max_users=50, forget_users_after_s=60))
    for i in range(5000):
        t = h.submit(f"id-{i}", 5, 5)
        if t.state is TicketState.ADMITTED:
            h.s.release(t, 5, 5)
        h.clock.advance(0.01)
    assert h.s.users_tracked <= 50
    assert h.s.users_forgotten >= 4950
    snap = h.s.snapshot(top_users=10)
    assert snap["users_total"] == h.s.users_tracked and len(snap["users"]) == 10


def test_idle_users_are_forgotten_after_the_window_and_come_back_at_virtual_time():
    h = Harness(pol(max_inflight=1, forget_users_after_s=60))
    h.release_exact(h.submit("old", 100))
    h.clock.advance(61)
    h.release_exact(h.submit("new", 100))  # a submit sweeps the idle users
    assert "old" not in h.s.counters() and h.s.users_forgotten == 1
    vt = h.s.snapshot()["groups"][0]["virtual_time"]
    h.submit("old", 1)
    assert h.s.counters()["old"] >= vt  # no credit from the reset


def test_forget_idle_forgets_on_time_without_new_traffic():
    """``next_forget_at`` says when the user idle longest is due; ``forget_idle`` at that
    moment forgets exactly the users due, with no submit needed."""
    h = Harness(pol(max_inflight=4, forget_users_after_s=3))
    assert h.s.next_forget_at() is None
    t0 = h.clock()
    for i in range(20):
        h.release_exact(h.submit(f"u{i}", 5))
        h.clock.advance(0.1)
    busy = h.submit("busy", 5)  # in flight: never forgotten
    assert h.s.next_forget_at() == pytest.approx(t0 + 3)
    h.clock.advance(t0 + 3 - h.clock())
    assert h.s.forget_idle() == 1 and h.s.users_tracked == 20  # u0 only
    assert h.s.next_forget_at() == pytest.approx(t0 + 3.1)
    h.clock.advance(6)
    assert h.s.forget_idle() == 19 and h.s.users_tracked == 1
    assert h.s.next_forget_at() is None
    h.release_exact(busy)
    assert h.s.next_forget_at() == pytest.approx(h.clock() + 3)


def test_users_with_requests_queued_or_in_flight_are_never_forgotten():
    h = Harness(pol(max_inflight=1, max_users=3, forget_users_after_s=1))
    keep = h.submit("busy", 10)
    waiting = h.submit("waiting", 10)
    for i in range(20):
        h.clock.advance(5)
        h.s.cancel(h.submit(f"c{i}", 1))
    assert {"busy", "waiting"} <= set(h.s.counters())
    assert h.s.release(keep) and waiting.state is TicketState.ADMITTED


def test_snapshot_lists_the_top_users_by_recent_service():
    h = Harness(pol(max_inflight=1))
    for i in range(30):
        h.release_exact(h.submit(f"u{i}", 10 * (i + 1)))
    snap = h.s.snapshot(top_users=3)
    assert [u["user"] for u in snap["users"]] == ["u29", "u28", "u27"]
    assert snap["users_total"] == 30


# ------------------------------------------------------------------- capacity


class TwoEngines:
    """A pool of two engines with their own token budgets: a request is bound at
    dispatch to the engine with the most headroom (the seam issue 12 builds on)."""

    def __init__(self, budgets: dict[str, int]) -> None:
        self.budget = dict(budgets)
        self.used = dict.fromkeys(budgets, 0)
        self.count = 0

    def configure(self, policy) -> None:
        pass

    def set_limit(self, limit) -> None:
        pass

    @property
    def slots(self) -> int:
        return 100

    @property
    def inflight(self) -> int:
        return self.count

    @property
    def occupied(self) -> int:
        return self.count  # no class headroom here

    @property
    def inflight_tokens(self) -> int:
        return sum(self.used.values())

    def admissible(self, tokens: int) -> bool:
        return tokens <= max(self.budget.values())

    def _best(self, tokens: int):
        room = {e: self.budget[e] - self.used[e] for e in self.budget}
        best = max(room, key=room.get)
        return best if room[best] >= tokens else None

    def fits(self, tokens: int) -> bool:
        return self._best(tokens) is not None

    def reserve(self, ticket) -> bool:
        e = self._best(ticket.reserved_tokens)
        if e is None:
            return False
        self.used[e] += ticket.reserved_tokens
        self.count += 1
        ticket.placement = e
        return True

    def release(self, ticket) -> None:
        self.used[ticket.placement] -= ticket.reserved_tokens
        self.count -= 1


def test_a_capacity_model_binds_each_request_late_to_the_engine_with_most_headroom():
    pool = TwoEngines({"e1": 1000, "e2": 600})
    admitted: list = []
    s = Scheduler(pol(max_inflight=100), clock=lambda: 0.0, on_admit=admitted.append, capacity=pool)
    a = s.submit("a", None, 500, 0)  # e1 (1000 free) over e2 (600)
    b = s.submit("b", None, 500, 0)  # e2 (600 free) over e1 (500)
    c = s.submit("c", None, 500, 0)  # e1 (500 free)
    d = s.submit("d", None, 500, 0)  # e1 0, e2 100: no room anywhere
    assert [t.placement for t in (a, b, c)] == ["e1", "e2", "e1"] and d.state is TicketState.QUEUED
    with pytest.raises(Refused) as e:
        s.submit("x", None, 1500, 0)  # fits no engine, ever
    assert e.value.reason is RefusalReason.TOO_LARGE
    s.release(b)
    assert d.state is TicketState.ADMITTED and d.placement == "e2"
    assert s.inflight_tokens == 1500 and admitted == [a, b, c, d]
    assert isinstance(Scheduler(pol()).capacity_model, LocalCapacity)
