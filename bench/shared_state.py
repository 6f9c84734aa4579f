"""What the shared state costs: Redis round trips and CPU per call, against a real
``redis-server`` on loopback (started here, no persistence).

    .venv/bin/python -m bench.shared_state [--n 2000]

Prints one table: for each call, the wall time per call (p50, p99) as the caller sees it,
the proxy process's CPU per call, and Redis's own CPU per script run (``INFO
commandstats``). Rows:

- ``grant()``: the hot path's capacity check (a dict lookup, no Redis).
- ``reserve, one at a time``: a rate-limited request's reserve, sequential.
- ``reserve, 64 / 512 concurrent``: bursts of concurrent requests (they share pipelines).
- ``local reserve (standalone)``: the same limit in process, for comparison.
- ``sync, R replicas x K keys``: one sync of a replica (lease script with K capacity keys,
  3 classes, R replicas' entries per key, plus 20 users' service pushed and read back).

A second table times the leases themselves, three replicas at the default settings
(``sync_interval_s`` 0.1, ``lease_s`` 3), capacity 12, median of ``--rounds``:

- ``priority handover``: replica B fills the capacity with bronze; platinum work starts
  waiting on A. *stop*: until B's grant has dropped (B dispatches no more bronze);
  *serve*: from B's requests finishing until A has dispatched its platinum requests.
- ``replica killed``: a replica holding a third of the capacity stops renewing (as under
  SIGKILL); until the others hold all of it.
- ``replica stopped``: the same after a graceful stop (it gives its grants back).
- ``Redis restarted``: until every replica syncs again, and until the rebuild window ends.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import redis

from bench import harness as h
from proxy.config.schema import SharedStateConfig
from proxy.shared import CapacityReport, ClassDemand, RateLimited, SharedState, StandaloneState, SyncReport
from qos import RateLimit
from tests.redis_server import RedisServer

NONE = RateLimit(None, None)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Meter:
    """Wall time per call, proxy CPU per call, Redis CPU per script call."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.rows: list[tuple] = []

    def _redis_usec(self) -> tuple[float, int]:
        s = self.client.info("commandstats").get("cmdstat_evalsha", {})
        return float(s.get("usec", 0)), int(s.get("calls", 0))

    async def run(self, name: str, calls: int, one, concurrent: int = 1) -> None:
        walls: list[float] = []
        u0, c0 = self._redis_usec()
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        if concurrent == 1:
            for i in range(calls):
                t = time.perf_counter()
                await one(i)
                walls.append(time.perf_counter() - t)
        else:
            for start in range(0, calls, concurrent):

                async def timed(i):
                    t = time.perf_counter()
                    await one(i)
                    walls.append(time.perf_counter() - t)

                await asyncio.gather(*(timed(i) for i in range(start, min(calls, start + concurrent))))
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        u1, c1 = self._redis_usec()
        redis_calls = c1 - c0
        self.rows.append(
            (
                name,
                calls,
                _pct(walls, 0.5) * 1e6,
                _pct(walls, 0.99) * 1e6,
                calls / elapsed,
                cpu / calls * 1e6,
                redis_calls / calls,
                (u1 - u0) / redis_calls if redis_calls else 0.0,
            )
        )

    def print(self) -> None:
        print(h.markdown_table(
            ["call", "n", "p50 µs", "p99 µs", "calls/s", "proxy CPU µs/call", "Redis calls/call", "Redis µs/script"],
            [[name, n, f"{p50:.1f}", f"{p99:.1f}", f"{rate:,.0f}", f"{cpu:.1f}", f"{rc:.3f}", f"{ru:.1f}"]
             for name, n, p50, p99, rate, cpu, rc, ru in self.rows],
        ))  # fmt: skip


async def _until(pred, timeout_s: float = 30.0) -> float:
    t0 = time.perf_counter()
    while not pred():
        if time.perf_counter() - t0 > timeout_s:
            raise RuntimeError("timed out")
        await asyncio.sleep(0.002)
    return time.perf_counter() - t0


async def lease_timings(server: RedisServer, rounds: int) -> None:
    """The lease scenarios of the module docstring; prints a table of medians."""
    from tests.shared_helpers import KEY, SimReplica

    results: dict[str, list[float]] = {}

    def add(name: str, v: float) -> None:
        results.setdefault(name, []).append(v)

    for r in range(rounds):
        prefix = f"lease{r}"
        redis.Redis.from_url(server.url).hset("{" + prefix + "}:epoch", "rebuild_until", 0)
        cfg = SharedStateConfig(url=server.url, key_prefix=prefix)
        sims = [SimReplica(SharedState(cfg, replica_id=f"{prefix}-{i}"), 12) for i in range(3)]
        for sim in sims:
            await sim.state.start()
        a, b, c = sims
        await _until(lambda: sorted(s.state.grant(KEY) for s in sims) == [4, 4, 4])
        b.arrive(cls=2, n=100)
        await _until(lambda: b.total_inflight == 12 - a.state.grant(KEY) - c.state.grant(KEY) and b.state.grant(KEY) >= 12 - 1)
        await _until(lambda: b.total_inflight == 12)
        a.arrive(cls=0, n=4)
        add("priority handover: stop", await _until(lambda: b.state.grant(KEY) <= 8))
        b.complete(cls=2, n=4)
        add("priority handover: serve", await _until(lambda: a.inflight[0] == 4))
        b.waiting[2] = 0
        a.complete(cls=0, n=4)
        b.complete(cls=2, n=100)
        await _until(lambda: sorted(s.state.grant(KEY) for s in sims) == [4, 4, 4])

        # a crash: c stops renewing and never leaves
        await c.state.stop(give_back=False)  # no leave: what SIGKILL does, for Redis
        a.arrive(cls=1, n=100)
        add("replica killed: capacity back", await _until(lambda: a.state.grant(KEY) + b.state.grant(KEY) == 12))
        a.waiting[1] = 0
        a.complete(cls=1, n=100)

        d = SimReplica(SharedState(cfg, replica_id=f"{prefix}-3"), 12)
        await d.state.start()
        await _until(lambda: d.state.grant(KEY) >= 3)
        a.arrive(cls=1, n=100)
        await d.state.stop()
        add("replica stopped: capacity back", await _until(lambda: a.state.grant(KEY) + b.state.grant(KEY) == 12))
        a.waiting[1] = 0
        a.complete(cls=1, n=100)

        server.restart()
        t0 = time.perf_counter()
        await _until(lambda: all(s.state.syncs and s.state.mode == "shared" and s.state.rebuilding for s in (a, b)))
        add("Redis restarted: synced again", time.perf_counter() - t0)
        await _until(lambda: not a.state.rebuilding and not b.state.rebuilding)
        add("Redis restarted: rebuild over", time.perf_counter() - t0)
        for s in (a, b):
            await s.state.stop()

    print(h.markdown_table(
        ["lease scenario (3 replicas, interval 0.1 s, lease 3 s)", "median s", "max s"],
        [[name, f"{statistics.median(xs):.3f}", f"{max(xs):.3f}"] for name, xs in results.items()],
    ))


async def main(n: int, rounds: int) -> None:
    server = RedisServer().start()
    client = redis.Redis.from_url(server.url)
    try:
        cfg = SharedStateConfig(url=server.url, key_prefix="bench", sync_interval_s=2.0, lease_s=30.0, timeout_s=1.0)
        client.hset("{bench}:epoch", "rebuild_until", 0)
        meter = Meter(client)
        state = SharedState(cfg, replica_id="bench-0")
        await state.start(background=False)  # the bench drives the syncs itself

        key = "engine:a:slots"
        x = 0

        async def grant(i):
            nonlocal x
            for _ in range(100):
                x += state.grant(key)

        await meter.run("grant() x100", n, grant)
        limit = RateLimit(1e12, 1e15)  # never refuses: every call takes

        async def reserve(i):
            r = await state.reserve_rate(f"user{i % 50}", "gold", limit, limit, 300)
            state.settle_rate(r, 250)

        await meter.run("reserve, one at a time", n, reserve)
        await meter.run("reserve, 64 concurrent", n, reserve, concurrent=64)
        await meter.run("reserve, 512 concurrent", n * 2, reserve, concurrent=512)

        exhausted = RateLimit(1, None)
        try:
            await state.reserve_rate("hammer", "gold", exhausted, NONE, 1)
        except RateLimited:
            pass

        async def refused(i):
            try:
                await state.reserve_rate("hammer", "gold", exhausted, NONE, 1)
            except RateLimited:
                pass

        await meter.run("reserve refused (exhausted limit)", n, refused)

        local = StandaloneState()

        async def local_reserve(i):
            r = await local.reserve_rate(f"user{i % 50}", "gold", limit, limit, 300)
            local.settle_rate(r, 250)

        await meter.run("local reserve (standalone)", n, local_reserve)

        for replicas, keys in ((3, 2), (10, 2), (3, 16)):
            others = [SharedState(cfg, replica_id=f"bench-{i}") for i in range(1, replicas)]
            report = SyncReport(
                tuple(CapacityReport(f"engine:{k}:slots", 64, 10, (ClassDemand(2, 5, 3.0), ClassDemand(4, 20, 2.0), ClassDemand(4, 50, 1.0))) for k in range(keys)),
                {"pool": [f"user{u}" for u in range(20)]},
            )
            for s in [state, *others]:
                s.set_reporter(lambda report=report: report)
            for s in others:
                await s.start(background=False)
            for s in others:  # every replica has an entry on every key
                await s.sync_once()

            async def sync(i):
                state.report_service("pool", f"user{i % 20}", 123.0)
                await state.sync_once()

            await meter.run(f"sync, {replicas} replicas x {keys} keys", max(200, n // 10), sync)
            for s in others:
                await s.stop()
        await state.stop()
        meter.print()
        print()
        await lease_timings(server, rounds)
    finally:
        client.close()
        server.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="calls per row")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the lease scenarios")
    args = ap.parse_args()
    h.run_loop(main(args.n, args.rounds))
