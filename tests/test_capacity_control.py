"""The capacity controller (qos/capacity_control.py), the latency meter
(proxy/routing/engine_meter.py) and the classes' headroom (qos.capacity.room_for): the rules, and
convergence against a simulated continuously-batching engine."""

from __future__ import annotations

import math

import pytest
import yaml

from proxy.config.loading import parse_config
from proxy.routing.engine_meter import EngineMeter
from qos import GroupPolicy, Scheduler, SchedulerPolicy, TicketState
from qos.capacity import LocalCapacity
from qos.capacity import RecentPeaks, room_for
from qos.capacity_control import (
    REASON_CEILING,
    REASON_ENGINE_QUEUE,
    REASON_KV_CACHE,
    REASON_LATENCY,
    REASON_RESTART,
    REASON_STEADY,
    CapacityController,
    ControlSettings,
    Observation,
    fixed,
)


def obs(now: float, **kw) -> Observation:
    kw.setdefault("inflight", 0)
    kw.setdefault("demand", False)
    return Observation(now=now, **kw)


# ---------------------------------------------------------------- the rule


def test_grows_under_demand_to_the_ceiling_and_holds_without_it():
    c = CapacityController(ControlSettings(initial=16, ceiling=128))
    steps = 0
    while c.value < 128:
        c.step(obs(steps * 0.5, inflight=c.value, demand=True))
        steps += 1
        assert steps < 30, "growth from 16 to 128 takes about a dozen steps"
    assert steps <= 16
    c.step(obs(100, inflight=128, demand=True))
    assert c.value == 128 and c.reason == REASON_CEILING
    for i in range(10):  # a quarter in flight, nothing waiting: no reason to grow
        c.step(obs(101 + i, inflight=30))
    assert c.value == 128 and c.reason == REASON_STEADY


def test_growth_is_clocked_by_answers():
    """A load arrives at once and its first tokens take several steps (the prefill of a
    whole batch on a CPU): the limit does not grow on requests whose fate is unknown,
    and grows by at most the requests answered in a step once answers come (TCP's slow
    start grows the window by what was acknowledged). Measured on vLLM's CPU build
    without it: 16 to 61 in eight steps before the first 28 had a first token."""
    c = CapacityController(ControlSettings(initial=16, ceiling=128))
    for i in range(8):
        c.step(obs(i * 0.5, inflight=16, demand=True, answered=0, awaiting=16))
    assert c.value == 16
    c.step(obs(4.0, inflight=16, demand=True, answered=2, awaiting=14))
    assert c.value == 18 and c.reason == "growing"
    c.step(obs(4.5, inflight=18, demand=True, answered=16, awaiting=2))
    assert c.value == 18 + 4  # answers allow 16, the rule's own step (sqrt) is smaller
    c.step(obs(5.0, inflight=22, demand=True, answered=0, awaiting=0))  # no stream awaits: not clocked
    assert c.value == 26  # (non-streaming requests say nothing until they end)


def test_the_engines_queue_stops_dispatch_at_once_and_backs_off():
    c = CapacityController(ControlSettings(initial=100, ceiling=200, probe_after_s=30))
    c.step(obs(1, inflight=100, demand=True, engine_waiting=12))
    assert c.value == 100  # one report of a queue: maybe a request that arrived mid-step
    c.step(obs(1.5, inflight=100, demand=True, engine_waiting=12))
    assert c.value == 88 and c.reason == REASON_ENGINE_QUEUE  # what the engine really runs
    c.step(obs(2, inflight=88, demand=True, engine_waiting=1))
    assert c.value == 88  # 87 run and 1 waits: within the 88 it ran, an arrival, no queue
    c.step(obs(2.5, inflight=88, demand=True, engine_waiting=0))
    c.step(obs(3, inflight=40, demand=True, engine_waiting=100, engine_running=2))  # someone else fills it
    c.step(obs(3.5, inflight=40, demand=True, engine_waiting=100, engine_running=2))
    assert c.value == 79  # 10 %: the engine ran 88 moments ago (a low reading is no batch)
    for i in range(3):  # ours still above the limit (sent before the cut): they drain, nothing more is cut
        c.step(obs(4 + i, inflight=90, demand=True, engine_waiting=100, engine_running=2))
    assert c.value == 79
    seen = []
    for i in range(70):  # ours ended down to the limit, the engine still full for 35 s
        c.step(obs(8 + i * 0.5, inflight=c.value, demand=True, engine_waiting=100, engine_running=2))
        seen.append(c.value)
    assert seen[:2] == [71, 64]  # 10 % a step while the window remembers 88
    assert c.value <= 2  # once that is older than probe_after_s: what the engine runs, and less while it stays full


def test_one_cut_per_round_trip_while_the_excess_drains():
    """Requests sent before a cut stay queued inside the engine until slots free (a whole
    generation on a CPU): the queue they cause is no reason to cut again and again (the
    capacity fell from 158 to 17 that way on a real vLLM with 160 streams)."""
    c = CapacityController(ControlSettings(initial=158, ceiling=1024))
    inflight = 158
    for i in range(40):  # vLLM runs 128, the rest of ours wait inside it and drain slowly
        waiting = max(0, inflight - 128)
        c.step(obs(i * 0.5, inflight=inflight, demand=True, engine_waiting=waiting, engine_running=min(inflight, 128)))
        inflight = max(c.value, inflight - 1)
    assert min(c.value, 128) >= 115, c.value


def test_after_the_engine_queued_the_limit_stays_at_its_batch_for_a_while():
    """A request sent past the engine's batch waits inside it, blind to priority: once the
    engine showed its batch (128), growth stops there for probe_after_s, then probes."""
    c = CapacityController(ControlSettings(initial=140, ceiling=1024, probe_after_s=30))
    for now in (0.0, 0.5):
        c.step(obs(now, inflight=128, demand=True, engine_waiting=12, engine_running=128))
    assert c.value == 126  # 140 x 0.9
    for i in range(40):  # 20 s of demand, no queue inside the engine
        c.step(obs(1 + i * 0.5, inflight=c.value, demand=True, engine_waiting=0, engine_running=c.value))
    assert c.value == 128
    for i in range(30):  # past probe_after_s: it probes above again
        c.step(obs(31 + i * 0.5, inflight=c.value, demand=True, engine_waiting=0, engine_running=128))
    assert c.value > 128


def test_after_someone_else_filled_the_engine_the_limit_returns_to_its_batch_at_once():
    """Another client's requests fill the engine (it runs 128 and queues the rest) while
    none of ours runs: each step cuts, down to the floor. When that load is gone the
    engine can run its batch again: the limit goes back there by doubling (TCP's slow
    start to ssthresh), not one request a step (64 s at 2 steps a second: measured on a
    real vLLM, where that ramp cost a third of the throughput of a 40-s run)."""
    c = CapacityController(ControlSettings(initial=128, ceiling=1024))
    for i in range(60):
        c.step(obs(i * 0.5, inflight=0, engine_waiting=58, engine_running=128))
    assert c.value == 1
    steps = 0
    while c.value < 128:
        c.step(obs(40 + steps * 0.5, inflight=c.value, demand=True, engine_waiting=0, engine_running=c.value))
        steps += 1
        assert steps <= 8, c.value
    for i in range(20):  # within probe_after_s of the queue: held at the batch
        c.step(obs(45 + i * 0.5, inflight=128, demand=True, engine_waiting=0, engine_running=128))
    assert c.value == 128
    before = c.value
    for i in range(10):  # the engine runs all the limit allows and queues nothing: not held
        c.step(obs(80 + i * 0.5, inflight=c.value, demand=True, engine_waiting=0, engine_running=c.value))
    assert c.value == before + 10  # it probes above, one request a step
    for i in range(10):  # the engine runs fewer than the limit (a lower group's headroom, say): no proof it takes more
        c.step(obs(90 + i * 0.5, inflight=c.value - 10, demand=True, engine_waiting=0, engine_running=c.value - 10))
    assert c.value == before + 10


def test_a_latency_cut_does_not_slow_later_growth():
    """Slow tokens at a small limit (a fresh engine's first, compiling requests) cut it;
    once tokens are fast again the limit grows as fast as before (sqrt(limit) a step),
    not one request a step: measured on a real vLLM, that ramp cost a tenth of a
    64-stream row's throughput."""
    c = CapacityController(ControlSettings(initial=16, ceiling=1024))
    c.step(obs(0, inflight=4, tpot_s=0.04, streams=4))  # the baseline
    for i in range(3):
        c.step(obs(1 + i, inflight=16, demand=True, tpot_s=0.5, streams=16))
    assert c.value == 14 and c.reason == REASON_LATENCY
    steps = 0
    while c.value < 75:
        c.step(obs(10 + steps * 0.5, inflight=c.value, demand=True, tpot_s=0.05, streams=c.value))
        steps += 1
    # 14 -> 75 by sqrt steps once the slow readings have left rule 2's window (their
    # mean holds growth for three steps); one request a step would take 61
    assert steps <= 15


def test_growth_never_jumps_past_a_batch_the_engine_showed():
    """Long after the engine last queued at 128, the limit grows fast below 128, stops
    at it, and probes above one request a step (a request past the batch waits inside
    the engine, first come first served)."""
    c = CapacityController(ControlSettings(initial=128, ceiling=1024, probe_after_s=30))
    for now in (0.0, 0.5):
        c.step(obs(now, inflight=128, demand=True, engine_waiting=3, engine_running=128))
    c.step(obs(1, inflight=0))  # the load went away
    c.limit = 100.0  # as if cut by something else since
    seen = []
    for i in range(10):
        c.step(obs(60 + i * 0.5, inflight=c.value, demand=True, engine_waiting=0, engine_running=c.value))
        seen.append(c.value)
    assert 128 in seen and seen[-1] == 128 + (len(seen) - 1 - seen.index(128))


def test_requests_waiting_within_the_batch_are_arrivals_not_a_queue():
    """Closed-loop requests of one length end in the same engine step and their
    replacements arrive together, or a burst arrives during one long engine step (vLLM's
    CPU build at a full batch steps more slowly than the 0.5 s between readings): the
    readings show some waiting while fewer than the batch run (87 and 14, with 128 of
    ours in flight, all run a step later). That is no queue: a cut there kept platinum
    out for a whole generation, the lower groups' streams holding every slot."""
    c = CapacityController(ControlSettings(initial=128, ceiling=128, probe_after_s=30))
    for i in range(10):
        c.step(obs(i * 0.5, inflight=128, demand=True, engine_waiting=0, engine_running=128))
    for i in range(6):
        c.step(obs(5 + i * 0.5, inflight=128, demand=True, engine_waiting=14, engine_running=87))
    assert c.value == 128 and not c.decreases
    for now in (10.0, 10.5, 11.0):  # past its batch, and not growing from the second on: a queue
        c.step(obs(now, inflight=128, demand=True, engine_waiting=14, engine_running=128))
    assert c.value == 115 and c.reason == REASON_ENGINE_QUEUE
    for i in range(4):  # the queue gone: straight back to the batch, held there
        c.step(obs(11.5 + i * 0.5, inflight=115, demand=True, engine_waiting=0, engine_running=115))
    assert c.value == 128


def test_a_load_ramping_up_is_no_queue_while_the_engine_takes_it_in():
    """A new load's requests wait inside the engine while it takes them in over several
    steps (prefills share a step's token budget): each report shows some waiting, and
    more running than the last. That is no queue: read as one, it set the engine's batch
    at 48 and held a load of 64 streams there for probe_after_s (53 % of going direct).
    Once the batch stops growing with requests still waiting, it is one."""
    c = CapacityController(ControlSettings(initial=64, ceiling=128, probe_after_s=30))
    for i, running in enumerate((16, 28, 40, 48, 56, 64)):
        c.step(obs(i * 0.5, inflight=64 + 8, demand=True, engine_waiting=72 - running, engine_running=running))
    assert not c.decreases and c.reason != REASON_ENGINE_QUEUE
    for now in (3.0, 3.5):  # the batch stopped at 64 with 8 still waiting: the engine is full
        c.step(obs(now, inflight=72, demand=True, engine_waiting=8, engine_running=64))
    assert c.decreases == {REASON_ENGINE_QUEUE: 1} and c.value == 64


def test_a_request_arriving_mid_step_is_no_queue():
    """vLLM counts a request that arrived during its step as waiting until the next step:
    readings of waiting 1 and 0 alternating are arrivals, not a full batch."""
    c = CapacityController(ControlSettings(initial=50, ceiling=50))
    for i in range(20):
        c.step(obs(i, inflight=50, demand=True, engine_waiting=i % 2, engine_running=50 - i % 2))
    assert c.value == 50


def test_reports_that_stop_do_not_break_a_run_of_queue_reports():
    c = CapacityController(ControlSettings(initial=20, ceiling=20))
    c.step(obs(0, inflight=20, demand=True, engine_waiting=5, engine_running=15))
    c.step(obs(1, inflight=20, demand=True))  # no fresh report this step
    c.step(obs(2, inflight=20, demand=True, engine_waiting=5, engine_running=15))
    assert c.value == 15


def test_queue_at_zero_ignores_the_waiting_count():
    c = CapacityController(ControlSettings(initial=10, ceiling=10))
    c.step(obs(1, inflight=10, demand=True, engine_waiting=50, queue_at=0))
    assert c.value == 10


def test_a_full_kv_cache_holds_at_what_runs_at_once():
    c = CapacityController(ControlSettings(initial=64, ceiling=64))
    c.step(obs(1, inflight=20, demand=True, kv_usage=0.97, saturated_at=0.95))
    assert c.value == 20 and c.reason == REASON_KV_CACHE
    c.step(obs(2, inflight=20, demand=True, kv_usage=0.5))
    assert c.value > 20  # room again


def test_no_report_never_lowers_the_limit():
    """A slow or dead /metrics is an absent report: latency alone steers, nothing collapses."""
    c = CapacityController(ControlSettings(initial=32, ceiling=64))
    for i in range(50):
        c.step(obs(i, inflight=32, demand=True, engine_waiting=None, kv_usage=None))
    assert c.value == 64


def _settle_baseline(c: CapacityController, tpot: float = 0.05) -> None:
    c.step(obs(0, inflight=1, tpot_s=tpot, streams=1))  # one stream: the unloaded figure


def test_tokens_slowed_beyond_the_bound_back_off_after_a_sustained_run():
    c = CapacityController(ControlSettings(initial=100, ceiling=100, tpot_slowdown=4.0, slow_steps=3))
    _settle_baseline(c, 0.05)
    assert c.baseline_tpot_s == pytest.approx(0.05)
    c.step(obs(1, inflight=100, demand=True, tpot_s=0.19, streams=50))  # 3.8x: within the bound
    assert c.value == 100
    c.step(obs(2, inflight=100, demand=True, tpot_s=0.3, streams=50))
    c.step(obs(3, inflight=100, demand=True, tpot_s=0.3, streams=50))
    assert c.value == 100  # two slow steps: a moment's jitter
    c.step(obs(4, inflight=100, demand=True, tpot_s=0.3, streams=50))
    assert c.value == 90 and c.reason == REASON_LATENCY


def test_tokens_slow_every_other_step_back_off_too():
    """Prefill stalls make the per-token medians alternate (measured on vLLM's CPU build
    with a few arrivals a second: 0.25 and 0.7 s against a bound of 0.29): slow steps
    never come three in a row, yet tokens are beyond the bound on average. They count
    within a window, and a fast step between slow ones grows nothing."""
    c = CapacityController(ControlSettings(initial=40, ceiling=1024, slow_steps=3))
    _settle_baseline(c, 0.1)  # bound 0.3
    seen = []
    for i in range(20):
        c.step(obs(1 + i * 0.5, inflight=c.value, demand=True, tpot_s=0.25 if i % 2 else 0.7, streams=30))
        seen.append(c.value)
    assert max(seen) <= 40, seen
    assert c.value < 30 and c.decreases.get(REASON_LATENCY, 0) >= 3, seen
    # jitter, one slow step in four, is no reason to back off
    j = CapacityController(ControlSettings(initial=40, ceiling=40, slow_steps=3))
    _settle_baseline(j, 0.1)
    for i in range(20):
        j.step(obs(1 + i * 0.5, inflight=40, demand=True, tpot_s=0.7 if i % 4 == 0 else 0.15, streams=30))
    assert j.value == 40


def test_the_unloaded_per_token_time_is_learnt_only_from_an_unloaded_engine():
    """A batch whose steps outlast the control interval shows one or two streams advancing
    in a step, at seconds a token: that is the loaded figure, not the unloaded one (taken
    as the unloaded one, it lifted the baseline from 0.06 to 1.25 s on vLLM's CPU build
    and the latency bound with it: the limit grew past 500)."""
    c = CapacityController(ControlSettings(initial=64, ceiling=1024))
    c.step(obs(0, inflight=1, tpot_s=0.06, streams=1))
    assert c.baseline_tpot_s == pytest.approx(0.06)
    c.step(obs(0.5, inflight=51, tpot_s=2.4, streams=1, demand=True))
    c.step(obs(1.0, inflight=1, peak_inflight=40, tpot_s=2.4, streams=1))
    c.step(obs(1.5, inflight=2, tpot_s=2.4, streams=1, engine_running=90))  # others' load
    assert c.baseline_tpot_s < 0.07
    c.step(obs(2.0, inflight=2, tpot_s=0.08, streams=2, engine_running=2))  # unloaded: averaged in
    assert c.baseline_tpot_s == pytest.approx(0.07, rel=0.01)


def test_latency_alone_never_takes_more_than_half_the_capacity_found():
    """The stated bound against clients that slow the engine (huge prompts, streams they stop
    reading): latency lowers the limit to no less than latency_floor x the limit of the last
    step within the bound, however long it lasts."""
    c = CapacityController(ControlSettings(initial=120, ceiling=120, latency_floor_fraction=0.5))
    _settle_baseline(c)
    for i in range(1, 200):
        c.step(obs(i * 0.5, inflight=c.value, demand=True, tpot_s=10.0, streams=100))
    assert c.value == 60
    # the engine's own queue is not bounded that way: it is the engine saying it is full
    c.step(obs(101, inflight=60, demand=True, engine_waiting=30))
    c.step(obs(102, inflight=60, demand=True, engine_waiting=30))
    assert c.value == 30


def test_a_few_streams_are_no_latency_signal():
    c = CapacityController(ControlSettings(initial=50, ceiling=50, min_streams=4))
    _settle_baseline(c)
    for i in range(10):
        c.step(obs(i + 1, inflight=50, demand=True, tpot_s=5.0, streams=3))
    assert c.value == 50


def test_a_limit_too_low_to_measure_latency_grows_again():
    """A limit latency took below min_streams cannot be measured any more: those steps say
    nothing of latency, and demand grows it (it was held at 1 for good on a real vLLM)."""
    c = CapacityController(ControlSettings(initial=8, ceiling=64, min_streams=4, latency_floor_fraction=0.0))
    _settle_baseline(c)
    for i in range(60):  # the engine busy with others' work too: no unloaded figure
        c.step(obs(i + 1, inflight=c.value, demand=True, tpot_s=5.0, streams=8, engine_running=50))
    assert c.value == 1
    c.step(obs(100, inflight=1, demand=True, tpot_s=5.0, streams=1, engine_running=50))
    assert c.value > 1


def test_fixed_measures_but_never_moves():
    c = fixed(8)
    c.step(obs(1, inflight=8, demand=True, engine_waiting=5, tpot_s=0.1, streams=1))
    assert c.value == 8 and c.reason == "fixed" and c.baseline_tpot_s == 0.1


def test_settings_are_validated():
    with pytest.raises(ValueError):
        ControlSettings(floor=0)
    with pytest.raises(ValueError):
        ControlSettings(tpot_slowdown=1.0)
    with pytest.raises(ValueError):
        ControlSettings(backoff=1.0)


# ------------------------------------ convergence on a simulated batching engine


def _simulate(c: CapacityController, batch: int, steps: int, arrivals: int = 10_000) -> list[int]:
    """A continuously-batching engine of ``batch`` sequences that queues the rest (as vLLM
    at ``--max-num-seqs``), per-token time growing with the batch (CPU-like: t1 * (1 + n /
    16)); a closed-loop load that always keeps the proxy's queue non-empty."""
    limits = []
    for i in range(steps):
        inflight = c.value
        running = min(inflight, batch)
        waiting = inflight - running
        tpot = 0.045 * (1 + running / 16)
        c.step(obs(i * 0.5, inflight=inflight, demand=True, engine_waiting=waiting, tpot_s=tpot, streams=running))
        limits.append(c.value)
    return limits


@pytest.mark.parametrize("start", [4, 16, 400])
def test_capacity_converges_to_the_engines_batch_from_a_wrong_start(start):
    c = CapacityController(ControlSettings(initial=start, ceiling=1024, tpot_slowdown=100))
    c.step(obs(-1, inflight=1, tpot_s=0.045, streams=1))
    limits = _simulate(c, batch=48, steps=200)
    tail = limits[-100:]
    assert max(tail) <= 48 + 8, tail  # at most one growth step past the batch
    assert min(tail) >= 0.8 * 48, tail  # and never far below it
    assert sum(tail) / len(tail) >= 0.9 * 48


def test_capacity_stops_where_tokens_slow_past_the_bound():
    """Without an engine queue, the bound on slowing tokens decides: tpot = t1 (1 + n/16) is
    4 x t1 at n = 48."""
    c = CapacityController(ControlSettings(initial=16, ceiling=1024, tpot_slowdown=4.0))
    c.step(obs(-1, inflight=1, tpot_s=0.045, streams=1))
    limits = _simulate(c, batch=10_000, steps=400)
    tail = limits[-100:]
    assert 0.7 * 48 <= sum(tail) / len(tail) <= 1.25 * 48, tail



def test_capacity_holds_near_the_knee_where_tokens_reach_the_bound():
    """Near the bound (tokens slower than NEAR of it) the limit grows by one request a
    step, so it saws close under the knee instead of doubling past it and being cut back
    three steps later: tpot = t1 (1 + n/16) is 4 x t1 at n = 48."""
    c = CapacityController(ControlSettings(initial=16, ceiling=1024, tpot_slowdown=4.0))
    c.step(obs(-1, inflight=1, tpot_s=0.045, streams=1))
    limits = _simulate(c, batch=10_000, steps=400)
    tail = limits[-200:]
    assert max(tail) <= 48 + 5, tail  # never more than a few requests past the knee (the baseline drifts up a little)
    assert 0.9 * 48 <= sum(tail) / len(tail) <= 48 + 2, tail


def test_growth_stops_where_tokens_would_reach_the_bound():
    """A doubling back to a batch the engine ran (someone else's queue cut the limit to
    1) stops where the per-token time, grown in proportion to what runs, would reach the
    bound (the gradient of Gradient2 and Vegas). Measured on vLLM's CPU build without it:
    from 17 at 2.5 times the baseline (bound 3) the limit doubled to 34, the 13 prefills
    sent at once stalled every stream for 1.4-2.4 s a token, and platinum's first tokens
    took 1-3 s for the next 8 s."""
    c = CapacityController(ControlSettings(initial=16, ceiling=1024))
    c.step(obs(0, inflight=1, tpot_s=0.08, streams=1, engine_running=1, engine_waiting=0))
    assert c.baseline_tpot_s == 0.08
    for i in range(1, 30):  # another client's 128 running and 90 waiting: cut to the floor
        c.step(obs(i * 0.5, inflight=0, engine_waiting=90, engine_running=128))
    assert c.value == 1
    t = 15.0
    c.step(obs(t, inflight=0, engine_waiting=0, engine_running=0))
    while c.value < 17:  # our load, tokens at the baseline: doubles back
        t += 0.5
        before = c.value
        c.step(obs(t, inflight=before, demand=True, engine_waiting=0, engine_running=before, tpot_s=0.08, streams=max(4, before), answered=before, awaiting=0))
        assert c.value <= 2 * before + 1
    n = c.value
    assert n < 60
    # at 2.5 x the baseline: room for n x (3 / 2.5 - 1) = n / 5 more, not a doubling
    c.step(obs(t + 0.5, inflight=n, demand=True, engine_waiting=0, engine_running=n, tpot_s=0.2, streams=n, answered=n, awaiting=0))
    assert n < c.value <= n + math.ceil(n / 5) + 1, (n, c.value)
    # far within the bound the gradient does not slow slow start
    m = c.value
    c.step(obs(t + 1.0, inflight=m, demand=True, engine_waiting=0, engine_running=m, tpot_s=0.08, streams=m, answered=m, awaiting=0))
    assert c.value == 2 * m
    # at the bound itself, still one request a step (never stuck below a bound not reached)
    k = c.value
    c.step(obs(t + 1.5, inflight=k, demand=True, engine_waiting=0, engine_running=k, tpot_s=0.239, streams=k, answered=k, awaiting=0))
    assert c.value == k + 1


def test_after_idle_the_load_uses_the_capacity_found_by_doubling_per_step():
    """Restart after idle (RFC 5681 4.1, RFC 7661): with the engine idle, a new load may
    use the initial limit, then twice what was in flight at the last step, not the whole
    capacity found at once (measured on vLLM's CPU build: the first 119 requests of a new
    load, one user's, took every place of a 128 batch and the other user waited a whole
    generation). The capacity found itself (what replicas share out) stays."""
    c = CapacityController(ControlSettings(initial=16, ceiling=1024))
    for i in range(20):
        c.step(obs(i * 0.5, inflight=c.value, demand=True, engine_waiting=0, engine_running=c.value))
    found = c.value
    assert found >= 100 and c.usable == found  # in use: all of it may be used
    c.step(obs(20, inflight=0))
    assert c.usable == found  # one idle step is a gap between requests, not idleness
    c.step(obs(20.5, inflight=0))
    assert c.usable == 16 and c.value == found  # the restart window: the initial limit
    usable = []
    for i in range(6):
        c.step(obs(21 + i * 0.5, inflight=c.usable, demand=True, engine_waiting=0, engine_running=c.usable))
        usable.append(c.usable)
    assert usable[:3] == [32, 64, 128] and usable[-1] == c.value >= found
    # what counts is the most in flight between steps, not the instant of a step
    c.step(obs(25, inflight=0, peak_inflight=60))
    c.step(obs(25.5, inflight=0, peak_inflight=60))
    assert c.usable == 120
    # while requests wait for the pace, the reason says so
    c.step(obs(30, inflight=0))
    c.step(obs(30.5, inflight=0))
    c.step(obs(31, inflight=16, demand=True, engine_waiting=0, engine_running=16))
    assert c.reason == REASON_RESTART and c.usable == 32
    # a fixed limit has no pace
    f = fixed(50)
    f.step(obs(0, inflight=0))
    f.step(obs(1, inflight=0))
    assert f.usable == 50


# --------------------------------------------------------------- the meter


class _T:
    def __init__(self, admitted_at=0.0, ttft_target_s=None, resuming=False, headroom=0.0):
        self.admitted_at = admitted_at
        self.state = TicketState.ADMITTED
        self.ttft_target_s = ttft_target_s
        self.resuming = resuming
        self.headroom = headroom


def test_meter_takes_the_median_of_the_streams_there_all_step():
    m = EngineMeter()
    fast = [_T() for _ in range(5)]
    stalled = [_T() for _ in range(4)]  # clients that stopped reading
    for t in fast + stalled:
        m.progress(t, 1, 0.5)
    first = m.sample(0.5)
    assert first.tpot_s is None and len(first.ttft_s) == 9 and first.ttft_s[0] == pytest.approx(0.5)
    for i in range(2, 12):  # 10 tokens each in the next 0.5 s step
        for t in fast:
            m.progress(t, i, 0.5 + 0.05 * (i - 1))
    s = m.sample(1.0)
    assert s.streams == 9 and s.tpot_s == pytest.approx(0.05)  # the stalled four, a minority, move no median
    slow = _T()
    m.progress(slow, 1, 1.1)
    for i in range(12, 22):
        for t in fast:
            m.progress(t, i, 1.0 + 0.05 * (i - 11))
    m.progress(slow, 2, 1.5)
    s = m.sample(1.5)
    assert s.streams == 9 and s.tpot_s == pytest.approx(0.05)  # a stream new in the step waits a step
    for t in stalled:  # their clients gave up
        m.finished(t)
    m.progress(slow, 3, 1.9)
    for i in range(22, 32):
        for t in fast:
            m.progress(t, i, 1.5 + 0.05 * (i - 21))
    s = m.sample(2.0)
    assert s.streams == 6 and s.tpot_s == pytest.approx(0.05)  # one slow stream moves no median


def test_a_step_in_which_no_stream_advanced_still_reads_slow():
    """An engine whose batch steps outlast the 0.5-s interval (vLLM's CPU build at 64
    streams on an AVX2 host: about 2.5 s a step) shows no stream advancing in most steps:
    each such stream's next token is at least the time since its last one away. Counting
    only the streams that advanced left most steps without a median, and the limit grew
    through them to 187."""
    m = EngineMeter()
    streams = [_T() for _ in range(8)]
    for t in streams:
        m.progress(t, 1, 0.0)
    m.sample(0.1)
    for t in streams:
        m.progress(t, 2, 0.2)
    m.sample(0.6)  # one token each since the last step
    s = m.sample(1.1)  # none in this step: 0.9 s since their last token at least
    assert s.streams == 8 and s.tpot_s == pytest.approx(0.9)


def test_a_stream_shorter_than_two_steps_is_timed_when_it_ends():
    """An idle engine's probes are short (16 tokens at 0.05 s: 0.8 s, under two 0.5-s
    steps): timed only over whole steps they were never measured, and the first figure
    the latency bound got was a loaded one. The tokens since the last step of a stream
    that ended count in the next step, from its last token before that step."""
    m = EngineMeter()
    t = _T()
    m.progress(t, 1, 0.2)
    for i in range(2, 7):
        m.progress(t, i, 0.2 + 0.05 * (i - 1))  # to 0.45
    assert m.sample(0.5).tpot_s is None  # started within the step: not timed yet
    for i in range(7, 17):
        m.progress(t, i, 0.45 + 0.05 * (i - 6))  # to 0.95
    m.finished(t)
    s = m.sample(1.0)
    assert s.streams == 1 and s.tpot_s == pytest.approx(0.05)
    assert m.sample(1.5).tpot_s is None  # counted once
    quick = _T()  # ended before any step: nothing to time it from
    m.progress(quick, 1, 1.6)
    m.progress(quick, 3, 1.7)
    m.finished(quick)
    assert m.sample(2.0).tpot_s is None


def test_a_burst_of_tokens_does_not_look_fast():
    """Tokens delivered together (one read, a proxy's buffer) count by how many came since
    the stream's last token, not by their spacing: a burst is no 0.1 ms per token."""
    m = EngineMeter()
    t = _T()
    m.progress(t, 1, 0.0)
    m.sample(0.1)
    m.progress(t, 6, 0.6)  # five tokens in one chunk, 0.6 s after the last
    s = m.sample(0.6)
    assert s.tpot_s == pytest.approx(0.12)


def test_a_slow_engines_tokens_are_timed_token_to_token():
    """On a slow engine a stream gets two to four tokens per 0.5-s step: the step's length
    divided by a whole count read 0.125, 0.167 or 0.25 s and nothing between (measured on
    vLLM's CPU build, where the latency bound sat between two of them and flipped). Timed
    from token to token, 0.2 s a token reads 0.2 s in every step."""
    m = EngineMeter()
    streams = [_T() for _ in range(8)]
    tpot, t0 = 0.2, 0.0
    samples = []
    for k, st in enumerate(streams):  # staggered starts, each a token every 0.2 s
        m.progress(st, 1, t0 + 0.025 * k)
    n = {st: 1 for st in streams}
    now = 0.0
    for step in range(1, 9):
        end = 0.5 * step
        while True:
            due = [(0.025 * k + n[st] * tpot, st) for k, st in enumerate(streams)]
            at, st = min(due, key=lambda x: x[0])
            if at > end:
                break
            n[st] += 1
            m.progress(st, n[st], at)
        s = m.sample(end)
        if s.tpot_s is not None:
            samples.append(s.tpot_s)
    assert samples and all(x == pytest.approx(tpot) for x in samples), samples


def test_meter_counts_answers_first_tokens_and_ends_without_one():
    m = EngineMeter()
    a, b, c = _T(), _T(), _T()
    m.progress(a, 1, 0.2)
    m.progress(a, 5, 0.4)  # more tokens of a stream already answered: not again
    m.finished(b)  # a non-streaming answer (or a failure): no token seen, ended
    m.progress(c, 0, 0.3)  # no token yet: not answered
    m.awaiting(c)
    m.awaiting(a)  # already answered: not awaited
    first = m.sample(0.5)
    assert first.answered == 2 and first.awaiting == 1
    assert m.sample(1.0).answered == 0
    m.finished(a)  # an answered stream's end is no new answer
    m.progress(c, 1, 1.2)
    second = m.sample(1.5)
    assert second.answered == 1 and second.awaiting == 0


def test_meter_counts_first_tokens_later_than_their_objective():
    """The input of the classes' late headroom (qos.capacity.RecentPeaks.late): first
    tokens of requests with a TTFT objective, timed from dispatch, how many came later
    than it, and the classes (headrooms) of the late ones. Not judged: a request without
    an objective, a resumed stream's later part (its client's first token was the first
    part's), and a request moved here from another engine (its time since dispatch holds
    that engine's failure)."""
    m = EngineMeter()
    fast = _T(1.0, 0.5, headroom=0.0)
    late_gold, late_bronze = _T(1.0, 2.0, headroom=0.025), _T(1.0, 2.0, headroom=0.05)
    free, resumed, moved = _T(1.0), _T(1.0, 0.5, resuming=True), _T(1.0, 0.5)
    m.moved(moved)
    m.progress(fast, 1, 1.3)
    m.progress(late_bronze, 1, 3.5)
    m.progress(late_gold, 1, 3.6)
    m.progress(free, 1, 9.0)  # no objective: timed, not judged
    m.progress(resumed, 1, 9.0)
    m.progress(moved, 1, 9.0)
    m.progress(late_gold, 4, 3.9)  # later tokens are no first token
    s = m.sample(4.0)
    assert s.late_levels == {0.025, 0.05} and len(s.ttft_s) == 6  # the resumed and moved ones (level 0.0) were late, unjudged
    s = m.sample(4.5)
    assert s.late_levels == frozenset()


def test_meter_forgets_ended_requests():
    m = EngineMeter()
    a, b = _T(), _T()
    m.progress(a, 3, 1.0)
    m.progress(b, 3, 1.0)
    m.finished(a)
    b.state = TicketState.RELEASED  # an end never reported: dropped at the next sample
    m.sample(2.0)
    assert m.streams == 0


# --------------------------------------------------------------- headroom


def test_room_for():
    assert room_for(128, 0.15) == 109
    assert room_for(128, 0.0) == 128
    assert room_for(6, 0.15) == 6  # 0.9 rounds down: a small engine keeps nothing back
    assert room_for(1, 0.5) == 1  # never starved
    assert room_for(0, 0.5) == 0  # a lease of 0
    assert room_for(33, 0.075, vacant=4) == 27  # 2 by the fraction + 4 the classes above ran recently
    assert room_for(33, 0.0, vacant=4) == 33  # the top class (or a class set to keep nothing) keeps nothing
    assert room_for(33, 0.075, vacant=40) == 17  # the measured part keeps at most half
    assert room_for(128, 0.6, vacant=40) == 52  # ... unless the fraction alone keeps more


def test_recent_peaks_keep_the_room_the_classes_above_come_back_to_for_a_window():
    """Platinum (level 0) ran 6 at once, now 2: bronze (0.075) counts the 4 it left as
    kept until the step that saw the 6 is older than the window; gold (0.025) counts for
    bronze, not bronze for gold."""
    p = RecentPeaks(window_s=10.0)
    for n in range(1, 7):
        p.note(0.0, n)
    p.note(0.025, 3)
    p.note(0.075, 20)
    held = {0.0: 2, 0.025: 1, 0.075: 20}
    assert p.vacant(0.075, held) == 0  # the step is not over: nothing counts yet
    p.roll(0.0, held)  # the step that saw the peaks ends at t=0; the next starts at what runs now
    assert p.vacant(0.075, held) == 4 + 2 and p.above(0.075) == 6 + 3
    assert p.vacant(0.025, held) == 4 and p.vacant(0.0, held) == 0 and p.above(0.0) == 0
    p.note(0.0, 9)  # platinum grows within the step: its peak counts from the step's end
    assert p.above(0.075) == 9
    p.roll(9.5, held)
    assert p.vacant(0.075, held) == 7 + 2 and p.above(0.075) == 12  # the 6 still within the window, the 9 now ended
    p.roll(20.0, held)  # both steps ended more than 10 s ago; the one ending now saw what ran at 9.5
    assert p.vacant(0.075, held) == 0 and p.peaks() == {0.0: 2, 0.025: 1, 0.075: 20}
    assert p.vacant(0.075, {0.0: 0}) == 3  # what ran at the roll stays a peak for the window


def test_lower_classes_leave_the_headroom_to_higher_ones():
    policy = SchedulerPolicy(
        groups=(GroupPolicy("platinum"), GroupPolicy("bronze", headroom=0.25)), default_group="bronze", max_inflight=8, queue_timeout_s=60
    )
    s = Scheduler(policy, clock=lambda: 0.0)
    bronze = [s.submit(f"b{i}", None, 10, 10) for i in range(10)]
    assert sum(t.state is TicketState.ADMITTED for t in bronze) == 6  # 8 - floor(0.25 * 8)
    top = s.submit("alice", "platinum", 10, 10)
    assert top.state is TicketState.ADMITTED  # at once: the room was kept for it
    s.release(top)
    assert sum(t.state is TicketState.ADMITTED for t in bronze) == 6  # bronze never takes it


def test_a_cut_below_what_a_lower_class_runs_keeps_the_room_above_it():
    """The capacity cut while bronze fills its room (the engine queued): bronze's excess
    drains as its requests end, but platinum keeps the room kept for it. Measured on
    vLLM before: a 10 % cut left platinum 2 slots beside bronze's 119 streams, and its
    requests waited up to 15 s."""
    policy = SchedulerPolicy(
        groups=(GroupPolicy("platinum"), GroupPolicy("bronze", headroom=0.075)), default_group="bronze", max_inflight=128, queue_timeout_s=60
    )
    cap = LocalCapacity()
    s = Scheduler(policy, capacity=cap, clock=lambda: 0.0)
    bronze = [s.submit(f"b{i}", None, 10, 10) for i in range(130)]
    assert sum(t.state is TicketState.ADMITTED for t in bronze) == 119  # 128 - floor(0.075 * 128)
    cap.set_limit(121)  # the engine queued: cut by 5 %
    top = [s.submit("alice", "platinum", 10, 10) for _ in range(10)]
    assert sum(t.state is TicketState.ADMITTED for t in top) == 9  # 121 - floor(0.075 * 121) = 112 counted for bronze
    b_waiting = [t for t in bronze if t.state is TicketState.QUEUED]
    for t in [t for t in bronze if t.state is TicketState.ADMITTED][:8]:
        s.release(t)  # bronze's excess drains: nothing of bronze goes until it is below its room
    assert all(t.state is TicketState.QUEUED for t in b_waiting)
    assert sum(t.state is TicketState.ADMITTED for t in top) == 10  # a freed place goes to the top first


def test_default_headroom_grows_with_rank_and_is_configurable():
    cfg = parse_config(
        yaml.safe_dump(
            {
                "default_group": "bronze",
                "groups": [{"name": "platinum"}, {"name": "gold"}, {"name": "silver", "headroom": 0.3}, {"name": "bronze"}, {"name": "free"}, {"name": "x"}, {"name": "y"}],
            }
        )
    )
    assert [g.headroom for g in cfg.to_policy().groups] == pytest.approx([0.0, 0.025, 0.3, 0.075, 0.1, 0.1, 0.1])


def test_max_inflight_is_an_optional_ceiling():
    base = {"default_group": "g", "groups": [{"name": "g"}]}
    spec = parse_config(yaml.safe_dump(base)).effective_pools()[0].engines[0]
    assert spec.control is not None and spec.control.initial == 16 and spec.max_inflight == 1024
    spec = parse_config(yaml.safe_dump({**base, "admission": {"max_inflight": 32}})).effective_pools()[0].engines[0]
    assert spec.control.initial == 32 and spec.control.ceiling == 32 and spec.max_inflight == 32
    spec = parse_config(yaml.safe_dump({**base, "admission": {"capacity": {"mode": "fixed"}}})).effective_pools()[0].engines[0]
    assert spec.control is None and spec.max_inflight == 8
    assert math.isclose(parse_config(yaml.safe_dump(base)).to_policy().groups[0].headroom, 0.0)
