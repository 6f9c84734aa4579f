"""The router's choice of engine and the health state machine, as pure objects with an
injected clock: least headroom, saturation, affinity by rendezvous hashing, round robin,
reservations, reroutes, reloads that drain, and ejection with backoff."""

from __future__ import annotations

import itertools
import random

import pytest
import yaml

from proxy.config.loading import parse_config
from proxy.routing.engine_health import FAILURE_REASONS, EngineHealth, Health, check_path_for
from proxy.config.pools import HealthConfig, PoolSpec
from proxy.routing.placement import affinity_key, rendezvous_order
from proxy.routing.pool_capacity import PoolCapacity
from proxy.routing.router import NoEngineFits, PoolRouter
from qos import GroupPolicy, SchedulerPolicy, Ticket
from tests.conftest import base_config

_seq = itertools.count(1)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def ticket(tokens: int = 10) -> Ticket:
    return Ticket(seq=next(_seq), user_id="u", group="g", prompt_tokens=tokens, max_output_tokens=0, enqueued_at=0, deadline=1)


def pool(*engines: dict, routing: dict | None = None, health: dict | None = None, admission: dict | None = None) -> PoolSpec:
    cfg = base_config("x")
    del cfg["upstream"]["url"]
    cfg["admission"].update(admission or {})
    cfg["pools"] = [{"name": "p", "models": ["m"], "engines": list(engines), "routing": routing or {}, "health": health or {}}]
    (spec,) = parse_config(yaml.safe_dump(cfg)).effective_pools()
    return spec


def eng(i: int, **kw) -> dict:
    return {"url": f"http://10.0.0.{i}:8000", "name": f"e{i}", **kw}


def router(*engines: dict, clock=None, rng=None, **kw) -> PoolRouter:
    return PoolRouter(pool(*engines, **kw), clock=clock or Clock(), rng=rng or random.Random(7).random)


def names(r: PoolRouter, picks) -> list[str]:
    return [e.name for e in picks]


# ------------------------------------------------------------ least headroom


def test_the_engine_with_most_headroom_gets_the_request():
    r = router(eng(1, max_inflight=4), eng(2, max_inflight=4))
    a, b = r.engines.values()
    held = [r.reserve(ticket()) for _ in range(3)]
    # 3 requests on 2 equal engines: they alternate, never stack on one
    assert sorted(names(r, held)) == ["e1", "e1", "e2"] or sorted(names(r, held)) == ["e1", "e2", "e2"]
    assert abs(a.inflight - b.inflight) == 1
    fuller = a if a.inflight > b.inflight else b
    assert r.reserve(ticket()) is not fuller


def test_a_big_engine_is_preferred_to_a_small_one_equally_loaded():
    r = router(eng(1, max_inflight=2), eng(2, max_inflight=8))
    small, big = r.engines.values()
    small.inflight = 1
    big.inflight = 4  # both half full: after placing, the big one is less full
    assert r.choose(10) is big


def test_tokens_and_load_lower_headroom():
    r = router(eng(1, max_inflight=8, max_inflight_tokens=1000), eng(2, max_inflight=8, max_inflight_tokens=1000))
    a, b = r.engines.values()
    a.inflight, a.inflight_tokens = 1, 800  # few requests, but most of its KV budget
    b.inflight, b.inflight_tokens = 3, 300
    assert r.choose(100) is b
    b.set_load(0.9)  # saturated_at 0.95: only 5 % of the cache left
    assert r.choose(100) is a
    assert a.headroom(100) == pytest.approx(0.1)
    assert b.headroom(100) == pytest.approx(1 - 0.9 / 0.95)


def test_a_request_goes_only_to_an_engine_whose_token_capacity_can_hold_it():
    r = router(eng(1, max_inflight=8, max_inflight_tokens=100), eng(2, max_inflight=8, max_inflight_tokens=1000))
    small, large = r.engines.values()
    held = ticket(600)  # keeps most of the large one busy
    assert r.reserve(held) is large
    big = ticket(500)
    # the small engine is idle, but 500 > its 100: never there (no idle exception), so
    # it waits for the large one ...
    assert not small.fits(500) and not r.fits(big)
    assert r.choose(500, over=True) is large  # a reroute with over=True too, never the small one
    large.health.state = Health.EJECTED
    assert r.choose(500, over=True) is None  # rather no engine than one that cannot hold it
    assert r.choose(50, over=True) is small
    large.health.state = Health.HEALTHY
    r.release(held)
    assert r.reserve(big) is large  # ... and goes there once it has room
    assert r.reserve(ticket(50)) is small  # a small request still fits the small one
    # a request no engine could ever hold is refused at submit (400 request_too_large)
    cap = PoolCapacity(r)
    assert cap.admissible(1000) and not cap.admissible(1001)


def test_a_single_engine_refuses_at_submit_what_its_token_capacity_cannot_hold():
    r = router(eng(1, max_inflight_tokens=100))
    (a,) = r.engines.values()
    cap = PoolCapacity(r)
    assert not cap.admissible(500)  # the scheduler answers 400 request_too_large at once
    assert not r.fits(ticket(500))  # and the router never places it, idle or not
    t = ticket(100)
    assert cap.admissible(100) and r.fits(t)
    r.reserve(t)
    assert not r.fits(ticket(1))  # 100 + 1 > 100
    r.release(t)
    assert r.fits(ticket(1)) and a.inflight == 0 and a.inflight_tokens == 0


def test_exact_ties_rotate_so_sequential_requests_spread():
    r = router(eng(1), eng(2), eng(3))
    seen = []
    for _ in range(6):
        t = ticket()
        seen.append(r.reserve(t).name)
        r.release(t)
    assert seen == ["e1", "e2", "e3", "e1", "e2", "e3"]


def test_the_single_upstream_pool_enforces_what_admission_did():
    spec = parse_config(yaml.safe_dump(base_config("http://127.0.0.1:1", max_inflight=2, max_inflight_tokens=50))).effective_pools()[0]
    r = PoolRouter(spec)
    t1, t2, t3 = ticket(30), ticket(30), ticket(10)
    assert r.fits(t1)
    r.reserve(t1)
    assert not r.fits(t2)  # 60 > 50 tokens
    r.reserve(t3)
    assert not r.fits(ticket(1))  # 2 in flight = max_inflight
    assert r.capacity == 2 and r.inflight == 2


# ---------------------------------------------------------------- saturation


def test_saturated_full_ejected_or_draining_engines_get_nothing_while_another_fits():
    r = router(eng(1, max_inflight=2), eng(2, max_inflight=2), eng(3, max_inflight=2), eng(4, max_inflight=2), eng(5, max_inflight=2))
    sat, full, ejected, draining, spare = r.engines.values()
    sat.set_load(0.97, saturated=True, capacity_limit=1)
    full.inflight = 2
    ejected.health.state = Health.EJECTED
    ejected.health.ejected_until = 10**9
    draining.draining = True
    spare.inflight = 1  # half full, still the only one that may take it
    assert [r.choose(10) for _ in range(3)] == [spare] * 3
    spare.inflight = 2
    # the saturated engine with nothing of ours in flight takes one: the queue never stalls
    # behind an engine kept busy by others (as the single-engine load signal did)
    assert r.choose(10) is sat
    sat.inflight = 1
    assert r.choose(10) is None and not r.fits(ticket())


def test_affinity_never_overrides_saturation_or_fullness():
    r = router(eng(1), eng(2), eng(3), routing={"affinity": {"session_header": "X-S", "tolerance": 1.0}})
    key = "s\x00user-42"
    first = r.choose(10, key)
    assert all(r.choose(10, key) is first for _ in range(5))  # sticky
    first.set_load(0.99, saturated=True, capacity_limit=1)
    assert r.choose(10, key) is not first
    first.set_load(None)
    first.inflight = first.capacity
    assert r.choose(10, key) is not first


def test_affinity_tolerance_bounds_how_much_worse_the_preferred_engine_may_be():
    r = router(eng(1, max_inflight=10), eng(2, max_inflight=10), routing={"affinity": {"prefix_chars": 64, "tolerance": 0.25}})
    key = "p\x00You are a helpful assistant."
    pref = r.choose(10, key)
    other = next(e for e in r.engines.values() if e is not pref)
    pref.inflight = 2  # headroom 0.7 vs 0.9: within 0.25
    assert r.choose(10, key) is pref
    pref.inflight = 5  # 0.4 vs 0.9: beyond, least headroom decides
    assert r.choose(10, key) is other


# ------------------------------------------------------------------ affinity


def _owners(r: PoolRouter, keys: list[str]) -> dict[str, str]:
    return {k: r.choose(1, k, commit=False).name for k in keys}


def test_affinity_spreads_keys_and_a_new_engine_moves_only_its_share():
    keys = [f"s\x00session-{i}" for i in range(2000)]
    r4 = router(eng(1), eng(2), eng(3), eng(4), routing={"affinity": {"session_header": "X-S", "tolerance": 1.0}})
    before = _owners(r4, keys)
    counts = {n: list(before.values()).count(n) for n in ("e1", "e2", "e3", "e4")}
    assert all(350 < c < 650 for c in counts.values()), counts  # 500 each, give or take
    r5 = router(eng(1), eng(2), eng(3), eng(4), eng(5), routing={"affinity": {"session_header": "X-S", "tolerance": 1.0}})
    after = _owners(r5, keys)
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "e5" for k in moved)  # nothing shuffles among the old engines
    assert 250 < len(moved) < 550  # about 1/5 of 2000


def test_affinity_weights_scale_an_engines_share_of_keys():
    keys = [f"p\x00prefix {i}" for i in range(3000)]
    r = router(eng(1, weight=3), eng(2), routing={"affinity": {"prefix_chars": 100, "tolerance": 1.0}})
    share = list(_owners(r, keys).values()).count("e1") / len(keys)
    assert 0.70 < share < 0.80  # 3 / (3 + 1)


def test_rendezvous_order_is_a_stable_function_of_key_and_names():
    r = router(eng(1), eng(2), eng(3))
    es = list(r.engines.values())
    assert rendezvous_order("k", es) == rendezvous_order("k", list(reversed(es)))
    assert len({tuple(e.name for e in rendezvous_order(f"k{i}", es)) for i in range(100)}) > 3


def test_affinity_key_prefers_the_session_and_cuts_the_prefix():
    routing = pool(eng(1), routing={"affinity": {"session_header": "X-S", "prefix_chars": 5}}).routing
    assert affinity_key(routing, "abc", "hello world") == "s\x00abc"
    assert affinity_key(routing, "", "hello world") == "p\x00hello"
    assert affinity_key(routing, None, None) is None
    off = pool(eng(1)).routing
    assert affinity_key(off, "abc", "hello") is None


# ---------------------------------------------------------------- round robin


def test_round_robin_follows_weights_among_engines_that_fit():
    r = router(eng(1, weight=1), eng(2, weight=2), routing={"policy": "round_robin"})
    picks = []
    for _ in range(300):
        t = ticket()
        picks.append(r.reserve(t).name)
        r.release(t)
    assert picks.count("e1") == 100 and picks.count("e2") == 200
    assert picks[:3] in (["e2", "e1", "e2"], ["e2", "e2", "e1"])  # smooth: interleaved, not 2 then 1 in blocks
    a, b = r.engines.values()
    b.inflight = b.capacity
    assert all(r.choose(1) is a for _ in range(5))  # a full engine is skipped


# ------------------------------------------------------------- reservations


def test_reserve_release_and_reroute_keep_counts_exact():
    r = router(eng(1, max_inflight=1), eng(2, max_inflight=1))
    t1, t2, t3 = ticket(7), ticket(9), ticket(1)
    e1 = r.reserve(t1)
    with pytest.raises(ValueError):
        r.reserve(t1)
    e2 = r.reserve(t2)
    assert {e1, e2} == set(r.engines.values())
    with pytest.raises(NoEngineFits):
        r.reserve(t3)
    assert r.release(t1) is e1 and r.release(t1) is None  # a second release changes nothing
    assert e1.inflight == 0 and e1.inflight_tokens == 0
    # t2's connection failed before reaching e2: move it to e1
    assert r.reroute(t2) is e1 and r.engine_of(t2) is e1
    assert (e1.inflight, e1.inflight_tokens, e2.inflight, e2.inflight_tokens) == (1, 9, 0, 0)
    # and if e1 fails too, there is no untried engine left
    assert r.reroute(t2, exclude=[e2]) is None and r.engine_of(t2) is None
    assert r.inflight == 0 and e1.routed == 2 and e2.routed == 1


# ------------------------------------------------------------------- reloads


def test_a_reload_adds_updates_and_drains_engines():
    clock = Clock()
    r = router(eng(1), eng(2), clock=clock)
    e1, e2 = r.engines.values()
    held = [r.reserve(ticket()) for _ in range(2)]
    assert {e.name for e in held} == {"e1", "e2"}
    left = []
    r.on_engine_removed = left.append
    ch = r.reconfigure(pool(eng(1, max_inflight=3), eng(3)))
    assert ch.added == ("e3",) and ch.updated == ("e1",) and ch.draining == ("e2",) and ch.removed == ()
    assert r.engines["e1"] is e1 and e1.spec.max_inflight == 3 and e1.routed == 1  # kept, history too
    assert e2.draining and not e2.in_rotation
    assert all(r.choose(1) is not e2 for _ in range(10))
    t = next(t for t, (e, *_) in r._placed.items() if e is e2)
    r.release(t)
    assert "e2" not in r.engines and left == [e2]
    # an engine removed while idle leaves at once; one re-added while draining comes back
    ch = r.reconfigure(pool(eng(1)))
    assert ch.removed == ("e3",) and left[-1].name == "e3"


def test_a_changed_url_starts_its_health_over():
    r = router(eng(1, max_inflight=1))
    (e,) = r.engines.values()
    for _ in range(2):
        e.health.record_check(False, "refused")  # failed checks (the pool's floor holds only against requests)
    assert not e.in_rotation
    ch = r.reconfigure(pool({"url": "http://10.0.0.9:8000", "name": "e1"}))
    assert ch.reset == ("e1",) and e.in_rotation and e.health.ejections == 1


# -------------------------------------------------------------------- health


def health(clock: Clock, **kw) -> EngineHealth:
    return EngineHealth(HealthConfig(**kw), "e", clock=clock, rng=lambda: 0.5)


def test_consecutive_request_failures_eject_and_a_success_resets_the_count():
    clock = Clock()
    h = health(clock, failures_to_eject=3)
    assert not h.record_request(False, "connect") and not h.record_request(False, "http_5xx")
    h.record_request(True)  # a success (a 4xx too) in between
    assert not h.record_request(False, "reset") and not h.record_request(False, "timeout")
    assert h.record_request(False, "stream_cut") and h.state is Health.EJECTED
    assert h.ejections == 1 and h.failures == {"connect": 1, "reset": 1, "timeout": 1, "http_5xx": 1, "stream_cut": 1}
    assert not h.record_request(False, "reset")  # in-flight ones failing later: counted, no new ejection
    assert h.ejections == 1 and h.failures["reset"] == 2
    with pytest.raises(ValueError):
        h.record_request(False, "whatever")
    assert set(FAILURE_REASONS) == set(h.failures)


def test_ejected_engines_are_probed_after_a_jittered_exponential_backoff():
    clock = Clock()
    h = health(clock, failures_to_eject=1, eject_base_s=2, eject_max_s=10)
    h.record_request(False, "connect")
    # rng 0.5: wait = b/2 + 0.5 * b/2 = 0.75 b
    assert h.check_due_in() == pytest.approx(1.5)  # b = 2
    clock.t += 1.5
    h.record_check(False, "refused")  # probe failed: b = 4
    assert h.state is Health.EJECTED and h.check_due_in() == pytest.approx(3.0)
    clock.t += 3
    h.record_check(False)  # b = 8
    assert h.check_due_in() == pytest.approx(6.0)
    clock.t += 6
    h.record_check(False)  # b = min(10, 16)
    assert h.check_due_in() == pytest.approx(7.5) and h.ejections == 1
    clock.t += 7.5
    h.record_check(True)
    assert h.healthy and h.request_failures == 0 and h.ejected_until is None
    # failing again soon after: a flapping engine keeps backing off
    clock.t += 1
    h.record_request(False, "connect")
    assert h.streak == 5 and h.check_due_in() == pytest.approx(7.5)
    clock.t += 7.5
    h.record_check(True)
    # long healthy afterwards: the next ejection starts over at the base wait
    clock.t += 11
    h.record_request(False, "connect")
    assert h.streak == 1 and h.check_due_in() == pytest.approx(1.5) and h.ejections == 3


def test_jitter_stays_within_half_to_full_backoff():
    clock = Clock()
    rng = random.Random(3)
    for _ in range(200):
        h = EngineHealth(HealthConfig(failures_to_eject=1, eject_base_s=4), "e", clock=clock, rng=rng.random)
        h.record_request(False, "connect")
        assert 2.0 <= h.check_due_in() <= 4.0


def test_failed_checks_eject_apart_from_request_failures():
    clock = Clock()
    h = health(clock, failures_to_eject=3, checks_to_eject=2, check_interval_s=5)
    assert h.check_due_in() == pytest.approx(5)
    h.record_request(False, "http_5xx")
    h.record_request(False, "http_5xx")
    clock.t += 5
    h.record_check(True)  # a passing check does not clear failing requests
    assert h.request_failures == 2
    assert h.record_request(False, "http_5xx")
    h2 = health(clock, checks_to_eject=2, check_interval_s=5)
    h2.record_check(False, "503")
    h2.record_request(True)  # nor does a successful request clear failing checks
    assert h2.healthy and h2.check_failures == 1 and h2.check_due_in() == pytest.approx(5)
    h2.record_check(False, "503")
    assert h2.state is Health.EJECTED and "503" in h2.last_error


def test_no_periodic_check_when_the_interval_is_zero_but_ejected_engines_are_probed():
    clock = Clock()
    h = health(clock, check_interval_s=0, failures_to_eject=1)
    assert h.check_due_in() is None
    h.record_request(False, "connect")
    assert h.check_due_in() is not None


def test_on_change_fires_when_the_next_check_moves():
    clock = Clock()
    h = health(clock, failures_to_eject=1)
    calls = []
    h.on_change = lambda: calls.append(h.state)
    h.record_request(False, "connect")
    clock.t += 100
    h.record_check(True)
    assert calls == [Health.EJECTED, Health.HEALTHY]


def test_no_engine_in_rotation_gives_retry_after_until_the_first_probe():
    clock = Clock()
    r = router(eng(1), eng(2), clock=clock, health={"checks_to_eject": 1, "eject_base_s": 8, "eject_max_s": 8}, rng=lambda: 0.0)
    a, b = r.engines.values()
    assert r.available
    a.health.record_check(False, "refused")  # failed checks may eject every engine (failed requests may not)
    b.health.record_check(False, "refused")
    assert not r.available and not r.fits(ticket()) and r.capacity == 0
    assert r.retry_after_s() == pytest.approx(4.0)  # b/2 with rng 0
    clock.t += 3.5
    assert r.retry_after_s() == 1.0


def test_check_paths_by_kind():
    assert check_path_for(HealthConfig(), "lightllm") == "/token_load"
    assert check_path_for(HealthConfig(), "openai") == "/v1/models"
    assert check_path_for(HealthConfig(check_path="/health"), "openai") == "/health"


def test_a_cut_below_what_a_lower_class_runs_keeps_the_room_above_it():
    """The engine's capacity is cut while bronze (headroom 0.075) fills its room: bronze's
    excess is counted only up to its room, so platinum (headroom 0) keeps its places and
    bronze gets none until its excess has drained."""
    r = router(eng(1, max_inflight=128))
    (e,) = r.engines.values()
    bronze = [r.reserve(ticket(), headroom=0.075) for _ in range(119)]  # 128 - floor(0.075 * 128)
    assert all(x is e for x in bronze) and r.choose(10, headroom=0.075) is None
    e.capacity_limit = 121  # cut: bronze's room is now 112, it runs 119
    assert e.capacity == 121 and e.occupied() == 112
    top = [r.reserve(ticket()) for _ in range(9)]
    assert all(x is e for x in top) and r.choose(10) is None  # 9 places kept for the top, then full
    assert e.inflight == 128  # over the cut capacity by bronze's draining excess, never more


def test_a_late_first_token_makes_the_classes_below_leave_more_of_the_engine_free():
    """Platinum's first token came later than its objective here: bronze and gold (the
    classes below) keep a tenth of the engine more for it at each such step once their
    excess has drained, at most half of it in all; platinum itself is not limited; a
    window without a late first token of platinum gives its places back one a step."""
    r = router(eng(1, max_inflight=40))
    (e,) = r.engines.values()
    bronze = [ticket() for _ in range(38)]  # 40 - floor(0.05 * 40)
    assert all(r.reserve(t, headroom=0.05) is e for t in bronze) and r.choose(10, headroom=0.05) is None
    for t in bronze[-4:]:
        r.release(t)
    e.note_late(1.0, {0.0})  # platinum (headroom 0) late: 4 more kept
    assert e.room_for(0.05) == 34 and e.room_for(0.025) == 35 and e.room_for(0.0) == 40
    assert r.choose(10, headroom=0.05) is None  # bronze runs 34: at its room
    assert r.choose(10) is e  # platinum places at once
    e.note_late(1.5, {0.0})
    assert e.room_for(0.05) == 30  # bronze ran no more than its room: another step
    e.note_late(2.0, {0.0})
    assert e.room_for(0.05) == 30  # bronze runs 34 against 30: draining, no further step
    for t in bronze[:20]:
        r.release(t)  # bronze's streams end: 14 run
    for i in range(10):
        e.note_late(2.5 + i * 0.5, {0.0})
    assert e.room_for(0.05) == 20  # at most half the engine kept, the fixed fraction inside it
    for i in range(20):  # 10 s without a late first token, then a place a step
        e.note_late(7.5 + i * 0.5, ())
    assert e.room_for(0.05) == 20
    e.note_late(17.5, ())
    e.note_late(18.0, ())
    assert e.room_for(0.05) == 21 and e.status()["late_kept"] == {"0.0": 17}
    for i in range(40):
        e.note_late(18.5 + i * 0.5, ())
    assert e.room_for(0.05) == 38 and e.peaks.late_kept() == {}


def test_each_late_class_keeps_its_own_places():
    """Gold's lateness is kept for gold: it limits bronze, never gold itself, and does not
    hold platinum's places; platinum's places are given back on platinum's own clock."""
    r = router(eng(1, max_inflight=40))
    (e,) = r.engines.values()
    e.note_late(0.0, {0.0})  # platinum late once: 4 kept by gold and bronze
    for i in range(1, 41):  # gold late every step for 20 s
        e.note_late(i * 0.5, {0.025})
    assert e.peaks.late_kept()[0.025] == 20  # bronze keeps half the engine for gold
    assert e.room_for(0.025) == 40 - 1 - 0  # gold keeps for platinum only: platinum's places are back
    assert 0.0 not in e.peaks.late_kept()
    assert e.room_for(0.05) == 20 and e.room_for(0.0) == 40
    e.note_late(21.0, {0.0})  # platinum late again: a tenth, not a jump to gold's half
    assert e.room_for(0.025) == 40 - 1 - 4


def test_a_reload_that_moves_the_classes_levels_forgets_their_late_places():
    r = router(eng(1, max_inflight=40))
    (e,) = r.engines.values()
    cap = PoolCapacity(r)
    policy = lambda h: SchedulerPolicy(groups=(GroupPolicy("platinum"), GroupPolicy("gold", headroom=h)), default_group="gold")  # noqa: E731
    cap.configure(policy(0.025))
    e.note_late(0.0, {0.025})
    assert e.peaks.late_kept() == {0.025: 4}
    cap.configure(policy(0.025))  # the same levels: kept
    assert e.peaks.late_kept() == {0.025: 4}
    cap.configure(policy(0.05))
    assert e.peaks.late_kept() == {}


def test_a_control_step_dispatches_what_waits_when_a_room_grew():
    """The places kept for a late class are given back at a control step, not at a
    release: the step dispatches the pool's queue while requests wait for it, and only
    then (nothing to do otherwise)."""
    from proxy.runtime.load_poller import EnginePoller

    r = router(eng(1, max_inflight=40))
    (e,) = r.engines.values()
    calls, waiting = [], [True]
    poller = EnginePoller(e, calls.append, {}, clock=lambda: 100.0, demand=lambda: waiting[0])
    for _ in range(5):
        e.note_late(0.0, {0.0})  # platinum late: 20 kept
    poller._control(None, e.spec.upstream.load_signal)  # no late first token for the window: one place back
    assert e.peaks.late_kept() == {0.0: 19} and calls == [e]
    waiting[0] = False
    poller._control(None, e.spec.upstream.load_signal)
    assert e.peaks.late_kept() == {0.0: 18} and calls == [e]  # nothing waits: no dispatch


def _peaked(capacity: int, ran: int, still: int):
    """A one-engine pool of ``capacity`` where platinum (headroom 0) ran ``ran`` requests
    at once in the load poller's last step and runs ``still`` of them now."""
    r = router(eng(1, max_inflight=capacity))
    (e,) = r.engines.values()
    plat = [ticket() for _ in range(ran)]
    for t in plat:
        r.reserve(t)
    e.peaks.roll(0.0, e.held)
    for t in plat[still:]:
        r.release(t)
    return r, e


def _fill(r, headroom: float = 0.0, most: int = 200) -> int:
    """Reserve requests of a class with ``headroom`` while one fits; how many did."""
    n = 0
    while n < most and r.choose(10, headroom=headroom) is not None:
        r.reserve(ticket(), headroom=headroom)
        n += 1
    return n


def test_lower_classes_leave_the_room_higher_classes_ran_recently():
    """Capacity 33: platinum ran 6 at once, then 4 of them ended. Bronze (headroom 0.075,
    2 places by the fraction) may not take the 4 platinum left: the next platinum
    requests are dispatched at once, as they were measured to wait up to 18 s behind
    128-token bronze streams when bronze took every place they gave back. Once the window
    has passed without platinum coming back, bronze gets the room."""
    r, e = _peaked(33, ran=6, still=2)
    bronze = _fill(r, 0.075)
    assert bronze == 33 - 2 - 6  # the fraction (2) and platinum's recent 6 kept
    assert [r.reserve(ticket()) for _ in range(6)] == [e] * 6  # 4 back to its peak and the 2 of margin, at once
    assert r.choose(10) is None
    top = [t for t, (eng_, _, level) in list(r._placed.items()) if level == 0.0]
    for t in top:
        r.release(t)  # platinum's load is gone
    assert r.choose(10, headroom=0.075) is None  # ... but within the window its room is kept
    e.peaks.roll(1.0, e.held)
    e.peaks.roll(e.peaks.window_s + 2.0, e.held)
    assert bronze + _fill(r, 0.075) == 33 - 2  # the window passed: only the fraction is kept


def test_after_a_cut_the_classes_above_get_back_their_recent_load_while_a_lower_class_drains():
    """Capacity 33; platinum ran 5 at once in the last step, 2 now; bronze filled its room.
    The capacity is cut to 25 (tokens slowed): bronze's 26 streams are now its excess,
    draining as they end. Platinum still gets its recent 5 back and the fraction's one
    place more, at once; before, it got none until bronze had drained below 24 (on vLLM's
    CPU build bronze's 128-token streams took 25-50 s to drain, platinum's first token
    waited that long)."""
    r, e = _peaked(33, ran=5, still=2)
    assert _fill(r, 0.075) == 33 - 2 - 5
    e.capacity_limit = 25
    assert _fill(r) == 3 + 1  # its recent 5 (3 of them back) and 1 place by the fraction (0.075 x 25)
    assert r.choose(10, headroom=0.075) is None and e.inflight == 26 + 6


def test_while_a_lower_class_drains_the_classes_above_get_more_than_a_quarter_back():
    """Capacity 17 (an engine found small) with platinum's load at 6 at once, more than a
    quarter of it: after a cut that leaves bronze above its room, platinum still runs its
    recent 6 and the fraction's place (measured on vLLM's CPU build with a quarter as
    the bound: probes ran 4 at a time and queued up to 14 s)."""
    r, e = _peaked(17, ran=6, still=0)
    _fill(r, 0.075)
    assert e.inflight == 17 - 1 - 6  # the fraction (1) and platinum's recent 6 left free
    e.capacity_limit = 14  # a cut below what bronze runs
    assert _fill(r) == 6 + 1


def test_a_class_with_a_floor_keeps_only_the_fraction_for_the_classes_above():
    """A class with ``min_share`` (its level in ``fixed_levels``, as PoolCapacity sets it)
    is not held back by the recent load of the classes above: its floor is service
    promised while they are busy (with the measured part, bronze at min_share 0.3 got 1 %
    of an engine of 2 that gold kept full)."""
    r, e = _peaked(33, ran=6, still=0)
    r.fixed_levels.add(0.075)
    assert _fill(r, 0.075) == 33 - 2  # the fraction only
