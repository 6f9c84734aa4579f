"""Capacity leases against a real redis-server: the invariant under random interleavings
(Hypothesis, several simulated replicas driving the real Lua script step by step), and
the behaviour of real SharedState objects: priority handover, weighted split, idle spare,
graceful leave, and a SIGKILLed replica's capacity returning after the lease."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time

import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from proxy.shared import CapacityReport, ClassDemand, SharedState
from proxy.shared.keys import Keys
from proxy.shared.leases import LEASE_SCRIPT, LeaseTable
from tests.proc_util import die_with_parent
from tests.proxy_process import REPO_ROOT
from tests.shared_helpers import KEY, SimReplica, claims, config, settled, wait_for, wait_rebuilt

CLASSES = 3


class _Sim:
    """A replica reduced to its lease table, its work per class, and a sync in progress
    split into its three moments: report built, script run in Redis, reply applied."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.table = LeaseTable()
        self.inflight = [0] * CLASSES
        self.waiting = [0] * CLASSES
        self.weight = [1.0] * CLASSES
        self.min_share = [0.0] * CLASSES
        self.open = True
        self.alive = True
        self.pending: list | None = None  # ["built", keys, body] or ["replied", keys, grants]

    def report(self, capacity: int) -> CapacityReport:
        demand = tuple(ClassDemand(f, w, self.weight[c] if w else 0.0, self.min_share[c]) for c, (f, w) in enumerate(zip(self.inflight, self.waiting)))
        return CapacityReport(KEY, capacity, sum(self.inflight), demand if self.open else (), self.open)


def test_lease_invariant_holds_under_random_interleavings(redis_server):
    """Sum over live replicas of max(grant, in flight) <= capacity after every step, while
    replicas dispatch and complete between building a report, Redis running the script,
    and the reply arriving; replies get lost; replicas die; Redis loses every key."""
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    script = client.register_script(LEASE_SCRIPT)
    keys = Keys("inv")

    class Leases(RuleBasedStateMachine):
        @initialize(capacity=st.integers(1, 10), n=st.integers(2, 4))
        def setup(self, capacity, n):
            client.flushall()
            client.hset(keys.epoch, "rebuild_until", 0)  # a settled deployment (no rebuild window)
            self.capacity = capacity
            self.sims = [_Sim(f"r{i}") for i in range(n)]

        def live(self):
            return [s for s in self.sims if s.alive]

        @rule(i=st.integers(0, 3), cls=st.integers(0, CLASSES - 1), k=st.integers(1, 6), w=st.sampled_from([0.0, 0.5, 1.0, 3.0]))
        def arrive(self, i, cls, k, w):
            s = self.sims[i % len(self.sims)]
            s.waiting[cls] += k
            s.weight[cls] = w

        @rule(floors=st.sampled_from([(0.0, 0.0, 0.0), (0.0, 0.3, 0.2), (0.0, 0.0, 0.5), (0.5, 0.0, 0.5), (0.1, 0.1, 0.1)]))
        def set_floors(self, floors):
            """The groups' min_share (every replica's config alike, as after a reload)."""
            for s in self.sims:
                s.min_share = list(floors)

        @rule(i=st.integers(0, 3))
        def toggle_open(self, i):
            """The replica's health checks eject the engine, or a probe readmits it."""
            s = self.sims[i % len(self.sims)]
            s.open = not s.open

        @rule(i=st.integers(0, 3), k=st.integers(1, 4))
        def dispatch(self, i, k):
            s = self.sims[i % len(self.sims)]
            for _ in range(k):
                cls = next((c for c in range(CLASSES) if s.waiting[c]), None)
                if not s.alive or not s.open or cls is None or sum(s.inflight) >= s.table.grant(KEY):
                    return
                s.waiting[cls] -= 1
                s.inflight[cls] += 1

        @rule(i=st.integers(0, 3), cls=st.integers(0, CLASSES - 1), k=st.integers(1, 4))
        def complete(self, i, cls, k):
            s = self.sims[i % len(self.sims)]
            s.inflight[cls] -= min(k, s.inflight[cls])

        @rule(i=st.integers(0, 3))
        def build_report(self, i):
            s = self.sims[i % len(self.sims)]
            if s.alive and s.pending is None:
                ks, body = s.table.request([s.report(self.capacity)])
                s.pending = ["built", ks, body]

        @rule(i=st.integers(0, 3))
        def run_script(self, i):
            s = self.sims[i % len(self.sims)]
            if s.alive and s.pending and s.pending[0] == "built":
                _, ks, body = s.pending
                reply = json.loads(script(keys=[keys.replicas, keys.epoch] + [keys.lease(k) for k in ks], args=[s.rid, 60_000, 600_000, body, "sync"]))
                g = reply["g"] if isinstance(reply["g"], list) else []
                s.pending = ["replied", ks, g]

        @rule(i=st.integers(0, 3))
        def apply_reply(self, i):
            s = self.sims[i % len(self.sims)]
            if s.alive and s.pending and s.pending[0] == "replied":
                s.table.apply_reply(s.pending[1], s.pending[2])
                s.pending = None

        @rule(i=st.integers(0, 3))
        def full_sync(self, i):
            """A whole sync with nothing in between (most syncs)."""
            s = self.sims[i % len(self.sims)]
            if s.alive and s.pending is None:
                self.build_report(i)
                self.run_script(i)
                self.apply_reply(i)

        @rule(i=st.integers(0, 3))
        def lose_sync(self, i):
            """The request or its reply is lost (a timeout): the replica keeps its grant."""
            s = self.sims[i % len(self.sims)]
            s.pending = None

        @precondition(lambda self: len(self.live()) > 1)
        @rule(i=st.integers(0, 3))
        def kill(self, i):
            """SIGKILL: its requests die with it (the engine aborts them); its claim stays
            in Redis until its lease expires."""
            s = self.sims[i % len(self.sims)]
            s.alive = False
            s.inflight = [0] * CLASSES

        @rule()
        def expire_dead(self):
            """The leases of dead replicas run out."""
            for s in self.sims:
                if not s.alive:
                    client.zadd(keys.replicas, {s.rid: 0})

        @rule()
        def redis_loses_everything(self):
            client.flushall()

        @invariant()
        def capacity_never_exceeded(self):
            total = sum(max(s.table.grant(KEY), sum(s.inflight)) for s in self.live())
            assert total <= self.capacity, [(s.rid, s.table.grant(KEY), s.inflight) for s in self.live()]

    run_state_machine_as_test(
        Leases,
        settings=settings(max_examples=300, stateful_step_count=60, deadline=None, suppress_health_check=list(HealthCheck)),
    )


# ---------------------------------------------------------------- real SharedState objects


@pytest.fixture
async def replicas(redis_server):
    """Factory: ``await make(n, capacity)`` -> started SimReplicas (stopped at the end)."""
    made: list[SimReplica] = []

    async def make(n: int, capacity: int, prefix: str = "t", **cfg) -> list[SimReplica]:
        settled(redis_server.url, prefix)
        out = []
        for i in range(n):
            sim = SimReplica(SharedState(config(redis_server.url, key_prefix=prefix, **cfg), replica_id=f"{prefix}-r{len(made)}"), capacity)
            await sim.state.start()
            made.append(sim)
            out.append(sim)
        await wait_rebuilt([s.state for s in out])
        return out

    yield make
    for sim in made:
        await sim.state.stop()


async def test_idle_capacity_is_split_evenly_so_arrivals_dispatch_without_a_sync(replicas):
    sims = await replicas(3, 8)
    await wait_for(lambda: sorted(s.state.grant(KEY) for s in sims) == [2, 3, 3], 5, "an even split of 8 over 3")
    sims[0].arrive(cls=2, n=2)
    assert sims[0].total_inflight == 2  # dispatched at once, from the spare grant


async def test_platinum_waiting_on_a_beats_bronze_waiting_on_b(replicas):
    a, b = await replicas(2, 8)
    b.arrive(cls=2, n=20)  # bronze: B takes the whole capacity
    await wait_for(lambda: b.total_inflight == 8, 5, "B to fill the engine with bronze", check=lambda: _within(a, b))
    assert a.state.grant(KEY) == 0

    a.arrive(cls=0, n=3)  # platinum arrives on A
    start = time.monotonic()
    # B's grant drops below its in flight (8 - 3 = 5): it dispatches no bronze while
    # its requests finish, and the slots they free go to A's platinum requests
    handover = await wait_for(lambda: b.state.grant(KEY) <= 5, 5, "B's grant to shrink", check=lambda: _within(a, b))
    bronze_before = b.dispatched[2]
    for _ in range(3):
        b.complete(cls=2)
    await wait_for(lambda: a.inflight[0] == 3, 5, "A's platinum requests to be dispatched", check=lambda: _within(a, b))
    assert b.dispatched[2] == bronze_before, "B dispatched bronze while platinum waited on A"
    assert b.waiting[2] == 12 and b.total_inflight == 5
    # within a few sync intervals (0.05 s each), even on a loaded machine
    assert handover < 2.0 and time.monotonic() - start < 4.0


def _within(*sims: SimReplica) -> None:
    assert claims(list(sims)) <= sims[0].capacity, [(s.state.grant(KEY), s.total_inflight) for s in sims]


async def test_replicas_at_one_priority_share_in_proportion_to_their_weights(replicas):
    a, b = await replicas(2, 8)
    await wait_for(lambda: (a.state.grant(KEY), b.state.grant(KEY)) == (4, 4), 5, "the idle split")
    a.arrive(cls=1, n=200, weight=3.0)
    b.arrive(cls=1, n=200, weight=1.0)
    # both dispatched 4 from the idle split; B's grant drops to its share of 2 (below its
    # 4 in flight), A's grows only as B's requests finish
    await wait_for(lambda: b.state.grant(KEY) == 2, 5, "B's grant to drop to 2", check=lambda: _within(a, b))
    assert a.state.grant(KEY) == 4
    for _ in range(40):
        for s in (a, b):
            if s.total_inflight:
                s.complete(cls=1)
        await wait_for(lambda: claims([a, b]) <= 8, 1, "claims")
    await wait_for(lambda: (a.total_inflight, b.total_inflight) == (6, 2), 5, "6 and 2 in flight", check=lambda: _within(a, b))
    assert (a.state.grant(KEY), b.state.grant(KEY)) == (6, 2)


async def test_a_min_share_floor_holds_across_replicas(replicas):
    """Issue 21.1: bronze (min_share 0.3) waits on B only while gold keeps A busy: the
    plan holds ceil(0.3 x 10) = 3 units of the engine for B's bronze, before strict
    priority; gold gets the other 7 (was: bronze got nothing while gold waited)."""
    a, b = await replicas(2, 10)
    for s in (a, b):
        s.min_share[2] = 0.3
    a.arrive(cls=1, n=500)  # gold: more than the engine holds
    await wait_for(lambda: a.total_inflight == 10, 5, "A to fill the engine with gold", check=lambda: _within(a, b))
    b.arrive(cls=2, n=100)  # bronze arrives on B
    await wait_for(lambda: a.state.grant(KEY) == 7, 5, "A's grant to leave bronze its floor", check=lambda: _within(a, b))
    for _ in range(20):  # A's gold requests finish one by one, B's bronze ones too
        a.complete(cls=1)
        b.complete(cls=2)
        await wait_for(lambda: claims([a, b]) <= 10, 1, "claims")
    await wait_for(lambda: (a.total_inflight, b.total_inflight) == (7, 3), 5, "7 gold and 3 bronze in flight", check=lambda: _within(a, b))
    assert (a.state.grant(KEY), b.state.grant(KEY)) == (7, 3)
    assert a.waiting[1] > 0 and b.waiting[2] > 0  # both still backlogged: the floor, not spare
    # no floor: strict priority as before, bronze gets nothing while gold waits
    for s in (a, b):
        s.min_share[2] = 0.0
    await wait_for(lambda: b.state.grant(KEY) == 0, 5, "bronze's grant to go without a floor", check=lambda: _within(a, b))


async def test_a_floor_rounds_up_and_the_higher_floors_come_first(replicas):
    """ceil(m x C) units: two floors of 0.5 on 3 slots want 2 + 2 > 3: the higher class's
    floor first (2: 0.5 x 3 rounded up), the lower gets the 1 left (not 0 as strict
    priority would give it)."""
    a, b = await replicas(2, 3)
    for s in (a, b):
        s.min_share[1] = 0.5
        s.min_share[2] = 0.5
    a.arrive(cls=1, n=50)
    b.arrive(cls=2, n=50)
    for _ in range(10):  # requests finish one by one on both; the plan holds 2 and 1
        synced = a.state.syncs + 2
        await wait_for(lambda: a.state.syncs >= synced, 5, "two syncs", check=lambda: _within(a, b))
        a.complete(cls=1)
        b.complete(cls=2)
    await wait_for(lambda: (a.total_inflight, b.total_inflight) == (2, 1), 5, "2 and 1 in flight", check=lambda: _within(a, b))
    assert (a.state.grant(KEY), b.state.grant(KEY)) == (2, 1)


async def test_a_replica_that_cannot_use_the_engine_is_planned_nothing(replicas):
    """Issue 21.2: a replica reporting the engine closed (ejected by its own health checks,
    or draining) gets no grant there, not even spare, while its in flight still counts;
    the other replica gets the rest at once and all of it once that in flight is done."""
    a, b = await replicas(2, 2)
    await wait_for(lambda: (a.state.grant(KEY), b.state.grant(KEY)) == (1, 1), 5, "the idle split")
    a.arrive(cls=2, n=1)
    assert a.total_inflight == 1
    a.open = False  # A's health checks eject the engine; its request still runs there
    a.arrive(cls=2, n=10)  # more waits on A (for another engine)
    b.arrive(cls=2, n=1)
    await wait_for(lambda: a.state.grant(KEY) == 0, 5, "A's grant to go", check=lambda: _within(a, b))
    a.complete(cls=2)  # A's last request there finishes: the spare goes to B, not to A
    await wait_for(lambda: b.state.grant(KEY) == 2, 5, "B to get the whole engine", check=lambda: _within(a, b))
    assert a.state.grant(KEY) == 0
    b.arrive(cls=2, n=1)
    assert b.total_inflight == 2  # at once, from the spare
    a.open = True  # back in rotation: A's demand counts again
    await wait_for(lambda: b.state.grant(KEY) < 2, 5, "A's demand to count again", check=lambda: _within(a, b))


async def test_a_stopped_replica_gives_its_capacity_back_at_once(replicas):
    a, b = await replicas(2, 8, lease_s=30.0)  # a long lease: only the leave can explain a fast return
    b.arrive(cls=1, n=4)
    await wait_for(lambda: b.total_inflight == 4, 5, "B dispatching")
    await b.state.stop()
    a.arrive(cls=1, n=8)
    waited = await wait_for(lambda: a.total_inflight == 8, 5, "A to get all 8")
    assert waited < 5


def test_a_sigkilled_replica_loses_its_grant_after_the_lease(redis_server):
    """A replica in its own process holds the whole capacity; after SIGKILL, the survivor
    gets it back within the lease (plus a few sync intervals), never before the lease."""
    import asyncio

    lease_s = 1.5
    victim = subprocess.Popen(
        [sys.executable, "-m", "tests.shared_replica", redis_server.url, "kill", "victim", "8", "100", str(lease_s)],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent,
    )
    lines: queue.Queue = queue.Queue()

    def read() -> None:  # in a thread: a victim that hangs silent cannot hang the test
        for line in victim.stdout:
            lines.put(line)
        lines.put("")  # EOF

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 20
        while True:  # the victim's own report: it holds all 8 once the rebuild window closed
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            assert line, "victim did not get its grant within 20 s" if line is None else "victim exited before its grant"
            if line.strip() == "grant 8 inflight 8":
                break

        async def survivor() -> tuple[float, int]:
            sim = SimReplica(SharedState(config(redis_server.url, key_prefix="kill", lease_s=lease_s), replica_id="survivor"), 8)
            await sim.state.start()
            try:
                sim.arrive(cls=0, n=8)
                await asyncio.sleep(0.5)
                assert sim.state.grant(KEY) == 0  # the victim holds everything while alive
                victim.kill()
                victim.wait()
                killed = time.monotonic()
                await wait_for(lambda: sim.total_inflight == 8, lease_s + 5, "the victim's capacity to return")
                return time.monotonic() - killed, sim.total_inflight
            finally:
                await sim.state.stop()

        waited, inflight = asyncio.run(survivor())
        assert inflight == 8
        # not before the lease ran out (counted from the victim's last renewal, at most one
        # interval before the kill), and within it plus a few syncs
        assert lease_s - 0.1 <= waited <= lease_s + 3.0
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
        reader.join(5)  # the victim is dead: its output ends
        victim.stdout.close()
