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
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import redis

from proxy.config import SharedStateConfig
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
        head = ("call", "n", "p50 µs", "p99 µs", "calls/s", "proxy CPU µs/call", "Redis calls/call", "Redis µs/script")
        print("| " + " | ".join(head) + " |")
        print("|" + "|".join(["---"] * len(head)) + "|")
        for name, n, p50, p99, rate, cpu, rc, ru in self.rows:
            print(f"| {name} | {n} | {p50:.1f} | {p99:.1f} | {rate:,.0f} | {cpu:.1f} | {rc:.3f} | {ru:.1f} |")


async def main(n: int) -> None:
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
    finally:
        client.close()
        server.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="calls per row")
    args = ap.parse_args()
    try:
        import uvloop

        uvloop.run(main(args.n))
    except ImportError:
        asyncio.run(main(args.n))
