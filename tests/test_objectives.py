"""qos/objectives.py: the latency objectives' sliding window (attainment exact, the
percentile within the histogram's relative error, memory fixed whatever the rate), and
the config keys that set them (proxy/config/schema.py)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from proxy.config.schema import Config
from qos.objectives import (
    BINS,
    MAX_S,
    MIN_S,
    RELATIVE_ERROR,
    SLICES,
    TPOT,
    TTFT,
    LatencyWindow,
    Objective,
    ObjectiveTracker,
    bucket_of,
    bucket_value,
)

E1 = ("p", "e1")
E2 = ("p", "e2")


def exact_percentile(values: list[float], p: float) -> float:
    """Nearest rank: the smallest value with at least ceil(p/100 * n) values at or below it."""
    s = sorted(values)
    return s[max(1, math.ceil(p / 100 * len(s) - 1e-9)) - 1]


# ------------------------------------------------------------------ the histogram


@given(st.floats(min_value=MIN_S, max_value=MAX_S))
def test_a_bucket_reads_within_the_relative_error_of_every_value_in_it(v):
    assert abs(bucket_value(bucket_of(v)) - v) <= RELATIVE_ERROR * v * (1 + 1e-9)


def test_out_of_range_values_read_as_the_range_ends():
    assert bucket_value(bucket_of(0.0)) == MIN_S and bucket_value(bucket_of(MIN_S / 10)) == MIN_S
    assert bucket_value(bucket_of(MAX_S * 10)) == MAX_S
    assert 0 <= bucket_of(1e-12) < bucket_of(1.0) < bucket_of(1e12) == BINS - 1


# ------------------------------------------------------------------ one window


def test_attainment_counts_the_values_within_target_exactly():
    w = LatencyWindow(target_s=1.0, window_s=60)
    for v in (0.5, 1.0, 1.0000001, 3.0):  # the target itself is within it
        w.observe(10.0, v)
    r = w.reading(10.0, 95)
    assert (r.requests, r.met, r.attainment) == (4, 2, 0.5)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(min_value=MIN_S, max_value=MAX_S), min_size=1, max_size=300),
    st.floats(min_value=0.5, max_value=99.5),
)
def test_the_measured_percentile_is_within_the_relative_error_of_the_exact_one(values, p):
    w = LatencyWindow(target_s=1.0, window_s=60)
    for v in values:
        w.observe(5.0, v)
    got = w.reading(5.0, p).measured_s
    want = exact_percentile(values, p)
    assert abs(got - want) <= RELATIVE_ERROR * want * (1 + 1e-9), (got, want)


def test_values_leave_the_window_after_window_s():
    w = LatencyWindow(target_s=1.0, window_s=60)  # 60 slices of 1 s
    w.observe(100.2, 0.5)  # slice 100
    w.observe(130.0, 2.0)  # slice 130
    assert w.reading(159.9, 50).requests == 2  # slices 100..159 are the window
    r = w.reading(160.0, 50)  # slice 100 has left
    assert (r.requests, r.met, r.attainment) == (1, 0, 0.0)
    assert r.measured_s == pytest.approx(2.0, rel=RELATIVE_ERROR)
    r = w.reading(190.0, 50)
    assert (r.requests, r.attainment, r.measured_s) == (0, None, None)


def test_a_ring_entry_reused_after_a_gap_forgets_its_old_slice():
    w = LatencyWindow(target_s=1.0, window_s=10, slices=10)
    w.observe(3.0, 5.0)  # slice 3, ring entry 3
    w.observe(13.5, 0.1)  # slice 13, same ring entry: slice 3 is long gone
    r = w.reading(13.5, 50)
    assert (r.requests, r.met) == (1, 1)
    assert sum(w.counts()) == 1


def test_memory_is_fixed_whatever_the_number_of_requests():
    w = LatencyWindow(target_s=1.0, window_s=60)
    sizes = (len(w._ring), len(w._total), [len(a) for a in w._ring][0])
    for i in range(200_000):
        w.observe(i * 0.001, 0.001 * (1 + i % 5000))  # 200 s of 1000 requests/s
    assert (len(w._ring), len(w._total), [len(a) for a in w._ring][0]) == sizes == (SLICES, BINS, BINS)
    # the window holds the last 60 one-second slices, 59 full ones and the current one
    r = w.reading(199.999, 95)
    assert r.requests == 60_000
    assert sum(w.counts()) == r.requests


# ------------------------------------------------------------------ the tracker


def test_the_tracker_reports_per_engine_and_overall():
    t = ObjectiveTracker({"gold": [Objective(TTFT, 1.0, 90)]}, window_s=60)
    for _ in range(9):
        t.observe(1.0, "gold", E1, TTFT, 0.2)
    t.observe(1.0, "gold", E1, TTFT, 4.0)
    for _ in range(10):
        t.observe(1.0, "gold", E2, TTFT, 2.0)
    t.observe(1.0, "gold", E1, TPOT, 0.1)  # no tpot objective: not kept
    t.observe(1.0, "silver", E1, TTFT, 0.1)  # no objectives at all
    rep = t.report(2.0)
    assert set(rep) == {"gold"} and set(rep["gold"]) == {TTFT}
    g = rep["gold"][TTFT]
    assert g.engines[E1].attainment == 0.9 and g.engines[E2].attainment == 0.0
    assert (g.overall.requests, g.overall.met, g.overall.attainment) == (20, 9, 0.45)
    assert g.engines[E1].measured_s == pytest.approx(0.2, rel=RELATIVE_ERROR)  # p90 of nine 0.2 and one 4.0
    assert g.overall.measured_s == pytest.approx(2.0, rel=RELATIVE_ERROR)


def test_an_engine_idle_for_a_window_is_dropped():
    t = ObjectiveTracker({"gold": [Objective(TTFT, 1.0, 95)]}, window_s=10)
    t.observe(0.0, "gold", E1, TTFT, 0.5)
    t.observe(0.0, "gold", E2, TTFT, 0.5)
    t.observe(9.0, "gold", E2, TTFT, 0.5)
    assert t.windows() == 2
    rep = t.report(12.0)
    assert set(rep["gold"][TTFT].engines) == {E2} and t.windows() == 1
    rep = t.report(30.0)
    assert rep["gold"][TTFT].engines == {} and rep["gold"][TTFT].overall.requests == 0 and t.windows() == 0


def test_a_reload_keeps_an_unchanged_target_and_restarts_a_changed_one():
    t = ObjectiveTracker({"gold": [Objective(TTFT, 1.0, 95), Objective(TPOT, 0.05, 95)]}, window_s=60)
    t.observe(1.0, "gold", E1, TTFT, 0.5)
    t.observe(1.0, "gold", E1, TPOT, 0.01)
    t.configure({"gold": [Objective(TTFT, 1.0, 50), Objective(TPOT, 0.02, 95)]}, 60)
    rep = t.report(2.0)["gold"]
    assert rep[TTFT].overall.requests == 1 and rep[TTFT].objective.percentile == 50
    assert rep[TPOT].overall.requests == 0
    t.configure({"gold": [Objective(TTFT, 1.0, 50)]}, 30)  # a new window: everything afresh
    assert t.report(2.0)["gold"][TTFT].overall.requests == 0 and t.windows() == 0
    t.configure({}, 30)
    assert t.report(2.0) == {}


def test_bad_objectives_are_refused():
    for bad in (Objective("latency", 1.0, 95), Objective(TTFT, 0.0, 95), Objective(TTFT, 1.0, 100)):
        with pytest.raises(ValueError):
            ObjectiveTracker({"g": [bad]})
    with pytest.raises(ValueError):
        ObjectiveTracker({}, window_s=0)


# ------------------------------------------------------------------ the config keys


def _config(**group) -> Config:
    return Config.model_validate({"default_group": "a", "groups": [{"name": "a", **group}, {"name": "b"}]})


def test_objectives_in_the_config_with_their_defaults():
    c = _config(ttft_target_s=0.5, tpot_target_s=0.04, tpot_percentile=99)
    assert c.group_objectives() == {"a": (Objective(TTFT, 0.5, 95.0), Objective(TPOT, 0.04, 99.0))}
    assert c.objectives.window_s == 60
    assert _config().group_objectives() == {}  # no objectives: nothing measured
    c = Config.model_validate({"default_group": "a", "groups": [{"name": "a"}], "objectives": {"window_s": 120}})
    assert c.objectives.window_s == 120


def test_a_groups_ttft_objective_reaches_its_tickets_while_protection_is_on():
    """What the late first tokens are judged by (qos.capacity.RecentPeaks.late): each
    ticket carries its class's TTFT target as of its dispatch (none without one, none
    with protection off; a reload that moves its user takes the new class's)."""
    from qos import Scheduler

    groups = [{"name": "a", "ttft_target_s": 0.5}, {"name": "b", "ttft_target_s": 9.0}, {"name": "c"}]
    on = Config.model_validate({"default_group": "c", "groups": groups, "admission": {"max_inflight": 2}})
    s = Scheduler(on.to_policy())
    assert s.submit("u", "a", 10, 10).ttft_target_s == 0.5
    assert s.submit("v", "c", 10, 10).ttft_target_s is None
    waiting = s.submit("w", "a", 10, 10)  # queued: no room
    moved = {"default_group": "c", "groups": [groups[0], {**groups[1], "users": [{"id": "w"}]}, groups[2]], "admission": {"max_inflight": 2}}
    s.update_policy(Config.model_validate(moved).to_policy())
    s.release(next(t for t in s.inflight if t.user_id == "v"))  # room: w goes, now in b
    assert waiting.group == "b" and waiting.ttft_target_s == 9.0
    off = Config.model_validate({"default_group": "c", "groups": groups, "objectives": {"protection": {"enabled": False}}})
    assert Scheduler(off.to_policy()).submit("u", "a", 10, 10).ttft_target_s is None


@pytest.mark.parametrize(
    "group, where",
    [
        ({"ttft_target_s": 0}, "ttft_target_s"),
        ({"ttft_target_s": -1}, "ttft_target_s"),
        ({"tpot_target_s": "fast"}, "tpot_target_s"),
        ({"ttft_target_s": 1, "ttft_percentile": 100}, "ttft_percentile"),
        ({"ttft_target_s": 1, "ttft_percentile": 0}, "ttft_percentile"),
        ({"tpot_percentile": 90}, "tpot_percentile is set without tpot_target_s"),
        ({"ttft_target": 1}, "ttft_target"),  # an unknown key
    ],
)
def test_bad_objective_keys_are_refused_with_their_name(group, where):
    with pytest.raises(ValidationError) as e:
        _config(**group)
    assert where in str(e.value)


def test_a_bad_window_and_an_unknown_objectives_key_are_refused():
    for objectives in ({"window_s": 1}, {"window_s": 0}, {"window": 60}):
        with pytest.raises(ValidationError):
            Config.model_validate({"default_group": "a", "groups": [{"name": "a"}], "objectives": objectives})


def test_a_config_read_back_from_its_dump_is_the_same_config():
    """``--upstream`` rebuilds the config from its dump (every key then written): a group
    without objectives must still read (it was refused: "ttft_percentile is set without
    ttft_target_s", and the proxy would not start)."""
    for c in (_config(), _config(ttft_target_s=0.5, ttft_percentile=99)):
        again = Config.model_validate(c.model_dump())
        assert again == c
