"""Several proxy processes sharing one QoS state through Redis, against the same processes
each on its own (the baseline: every replica standalone, capacity and limits split evenly).

Real processes on loopback: a ``redis-server`` (no persistence), the fake engine
(``bench.fake_upstream``, which counts the requests it runs at once and their start
order), and the proxies (``python -m proxy proxy``). Measured:

1. **Throughput and cost**: requests/s (closed loop, concurrency 64, non-streaming, no
   engine delay) and proxy CPU per request (all proxy processes, ``/proc``), for one
   process standalone, one process with the shared state, and ``--workers 2`` with it;
   p50 latency at concurrency 1 standalone, shared, and shared with a rate limit (one
   reserve round trip per request): the shared state's added latency.
2. **Cross-replica guarantees**, 3 replicas, one engine of capacity 6:
   - capacity: the most requests the engine ran at once when all the load comes to one
     replica (a split gives that replica 2);
   - priority: bronze keeps replicas 1 and 2 busy, 12 platinum requests arrive on replica
     0: how many bronze requests the engine started among the platinum ones, and the
     platinum requests' p50 latency;
   - fairness: users of weights 3 and 1 in one group (the engine the bottleneck), their
     clients spreading requests at random over the replicas, and skewed (the heavy user's
     clients on replica 0 only): the heavy user's share of the tokens served in every
     window of ``--window`` seconds (its weight share is 0.75);
   - rate limits: a user limited to 30 requests per minute sends 150 at once, spread at
     random; then, in a fresh deployment (full buckets), all to one replica: requests
     served. The baseline is shown split (10 per replica) and unsplit (30 each, as peers
     that keep counters per instance do).

    python -m bench.replicas            # about 12 minutes on 2 cores (30 s windows)
    python -m bench.replicas --quick    # about 3 minutes (10 s windows)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench import harness as h
from bench.loadgen import LoadSpec, run_load_procs
from tests.redis_server import RedisServer
from tests.replica_stack import Replicas, replica_config
from tests.shared_helpers import settled

CAPACITY = 6
GROUPS = [
    {"name": "platinum", "users": [{"id": "alice", "weight": 1}]},
    {"name": "gold", "users": [{"id": "heavy", "weight": 3}, {"id": "light", "weight": 1}]},
    {
        "name": "bronze",
        "users": [
            {"id": "carl", "weight": 1, "api_key": "sk-carl"},
            {"id": "lim", "weight": 1, "api_key": "sk-lim", "rate_limit": {"requests_per_minute": 30}},
        ],
    },
]


def _groups(rpm: float) -> list[dict]:
    g = json.loads(json.dumps(GROUPS))
    g[2]["users"][1]["rate_limit"]["requests_per_minute"] = rpm
    return g


class Deployment:
    """N replicas, shared (one Redis) or baseline (standalone, split evenly)."""

    def __init__(self, engine: str, redis: RedisServer | None, n: int = 3, split: bool = True, rpm: float = 30, **admission) -> None:
        self.prefix = f"bench{random.randrange(1 << 30)}"
        if redis is not None:
            settled(redis.url, self.prefix)
            cfgs = [replica_config(engine, redis.url, self.prefix, _groups(rpm), max_inflight=CAPACITY, **admission)] * n
        else:
            cap = CAPACITY // n if split else CAPACITY
            cfgs = [replica_config(engine, None, self.prefix, _groups(rpm / n if split else rpm), max_inflight=cap, **admission)] * n
        self.reps = Replicas().start(cfgs)
        self.urls = self.reps.urls

    def close(self) -> None:
        self.reps.stop()


async def _engine_stats(s: aiohttp.ClientSession, engine: str, reset: bool = False) -> dict:
    async with (s.post if reset else s.get)(f"{engine}/stats/reset" if reset else f"{engine}/stats") as r:
        return await r.json()


async def _post(s, url: str, user: str, tag: str, n: int, **fake) -> tuple[int, float]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": n, "fake": {"tag": tag, **fake}}
    t0 = time.monotonic()
    async with s.post(f"{url}/v1/chat/completions", json=body, headers={"X-User-Id": user}) as r:
        await r.read()
        return r.status, time.monotonic() - t0


async def _wait_synced(s, urls: list[str]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ok = True
        for u in urls:
            async with s.get(f"{u}/admin/status", headers={"Authorization": "Bearer admin-key"}) as r:
                st = (await r.json())["shared_state"]
            ok = ok and st["mode"] in ("shared", "standalone")
        if ok:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("the replicas did not sync")


# ------------------------------------------------------------------ scenarios


async def capacity_one_replica(s, dep: Deployment, engine: str) -> dict:
    await _engine_stats(s, engine, reset=True)

    async def client() -> None:
        for _ in range(4):
            await _post(s, dep.urls[0], "carl", "b", 16)

    t0 = time.monotonic()
    await asyncio.gather(*(client() for _ in range(24)))
    st = await _engine_stats(s, engine)
    return {"max_inflight_seen": st["max_active"], "req_per_s": round(96 / (time.monotonic() - t0), 1)}


async def priority(s, dep: Deployment, engine: str) -> dict:
    await _engine_stats(s, engine, reset=True)
    rng = random.Random(2)
    stop = asyncio.Event()

    async def bronze() -> None:
        while not stop.is_set():
            await _post(s, rng.choice(dep.urls[1:]), "carl", "b", 8)

    load = [asyncio.ensure_future(bronze()) for _ in range(12)]
    await asyncio.sleep(1.0)
    plat = await asyncio.gather(*(_post(s, dep.urls[0], "alice", "p", 8) for _ in range(12)))
    stop.set()
    await asyncio.gather(*load)
    tags = (await _engine_stats(s, engine))["tags"]
    first, last = tags.index("p"), len(tags) - 1 - tags[::-1].index("p")
    return {
        "bronze_started_among_platinum": tags[first:last].count("b"),
        "platinum_p50_ms": round(statistics.median(p[1] for p in plat) * 1000, 1),
        "platinum_max_ms": round(max(p[1] for p in plat) * 1000, 1),
    }


async def fairness(s, dep: Deployment, duration_s: float, window_s: float, skewed: bool) -> dict:
    rng = random.Random(3)
    done: list[tuple[float, str, int]] = []
    t0 = time.monotonic()
    end = t0 + duration_s

    async def client(user: str) -> None:
        urls = dep.urls[:1] if skewed and user == "heavy" else dep.urls
        while time.monotonic() < end:
            code, _ = await _post(s, rng.choice(urls), user, user, 8)
            if code == 200:
                done.append((time.monotonic() - t0, user, 8))

    await asyncio.gather(*(client(u) for u in ("heavy", "light") for _ in range(24)))
    shares = []
    w = 0.0
    while w + window_s <= duration_s + 1e-9:
        tok = {"heavy": 0, "light": 0}
        for t, u, n in done:
            if w <= t < w + window_s:
                tok[u] += n
        total = tok["heavy"] + tok["light"]
        shares.append(round(tok["heavy"] / total, 3) if total else None)
        w += window_s
    valid = [x for x in shares if x is not None]
    return {"windows": shares, "worst_error_pp": round(max(abs(x - 0.75) for x in valid) * 100, 1) if valid else None}


async def rate_limit(s, dep: Deployment, one_replica: bool) -> dict:
    rng = random.Random(4)
    urls = dep.urls[:1] if one_replica else dep.urls
    out = await asyncio.gather(*(_post(s, rng.choice(urls), "lim", "l", 4) for _ in range(150)))
    codes = [c for c, _ in out]
    return {"served": codes.count(200), "refused_429": codes.count(429), "other": len(codes) - codes.count(200) - codes.count(429)}


# ----------------------------------------------------------------- throughput


SETUPS = (
    ("1 process, standalone", False, 1, False),
    ("1 process, shared state", True, 1, False),
    ("1 process, shared state, rate-limited user", True, 1, True),
    ("2 workers, shared state", True, 2, False),
)


def throughput(workdir: Path, redis: RedisServer, quick: bool) -> list[dict]:
    """Each setup ``rounds`` times, alternating (noise from a shared machine hits all
    alike); medians of requests/s, CPU per request and p50/p99 at concurrency 1."""
    port = h.free_port()
    up = h.start_fake_upstream(port, workdir)
    engine = f"http://127.0.0.1:{port}"
    dur = 3.0 if quick else 6.0
    rounds = 2 if quick else 3
    raw: dict[str, list[dict]] = {name: [] for name, *_ in SETUPS}
    try:
        for _ in range(rounds):
            for name, shared, workers, limited in SETUPS:
                prefix = f"tp{random.randrange(1 << 30)}"
                if shared:
                    settled(redis.url, prefix)
                cfg = replica_config(engine, redis.url if shared else None, prefix, _groups(1e9), max_inflight=4096, max_queue=10000)
                if shared:  # the defaults
                    cfg["shared_state"].update(sync_interval_s=0.1, lease_s=3.0, timeout_s=0.1)
                reps = Replicas().start([cfg], ["--workers", str(workers)] if workers > 1 else None)
                try:
                    url = reps.urls[0]
                    keys = [("sk-lim" if limited else "sk-carl", 1.0)]
                    pid = reps.procs[0].pid
                    c0 = h.tree_cpu_s([pid])
                    res = run_load_procs(LoadSpec(url, concurrency=64, duration_s=dur, max_tokens=16, warmup=200, keys=keys), 1).summary()
                    c1 = h.tree_cpu_s([pid])
                    lat = run_load_procs(LoadSpec(url, concurrency=1, duration_s=dur / 2, max_tokens=16, warmup=50, keys=keys), 1).summary()
                    raw[name].append(
                        {"req_per_s": res["req_per_s"], "cpu_ms_per_req": (c1 - c0) * 1000 / max(1, res["ok"]), "p50": lat["p50_ms"], "p99": lat["p99_ms"],
                         "errors": sum(res["errors"].values()) + sum(lat["errors"].values())}
                    )  # fmt: skip
                    print(name, raw[name][-1], file=sys.stderr, flush=True)
                finally:
                    reps.stop()
    finally:
        h.stop(up)
    med = statistics.median
    return [
        {
            "setup": name,
            "req_per_s": round(med(r["req_per_s"] for r in runs), 1),
            "cpu_ms_per_req": round(med(r["cpu_ms_per_req"] for r in runs), 3),
            "p50_ms_c1": round(med(r["p50"] for r in runs), 3),
            "p99_ms_c1": round(med(r["p99"] for r in runs), 3),
            "errors": sum(r["errors"] for r in runs),
        }
        for name, runs in raw.items()
    ]


# ------------------------------------------------------------------------ run


async def guarantees(workdir: Path, redis: RedisServer, quick: bool, window_s: float) -> dict:
    port = h.free_port()
    up = h.start_fake_upstream(port, workdir, itl_s=0.01)
    engine = f"http://127.0.0.1:{port}"
    out: dict = {"shared": {}, "baseline": {}}
    duration = 2 * window_s if quick else 3 * window_s
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            for mode in ("shared", "baseline"):
                dep = Deployment(engine, redis if mode == "shared" else None)
                try:
                    await _wait_synced(s, dep.urls)
                    r = out[mode]
                    r["capacity"] = await capacity_one_replica(s, dep, engine)
                    r["priority"] = await priority(s, dep, engine)
                    r["fairness_random"] = await fairness(s, dep, duration, window_s, skewed=False)
                    r["fairness_skewed"] = await fairness(s, dep, duration, window_s, skewed=True)
                    r["rate_spread"] = await rate_limit(s, dep, one_replica=False)
                finally:
                    dep.close()
                dep = Deployment(engine, redis if mode == "shared" else None)  # fresh buckets
                try:
                    await _wait_synced(s, dep.urls)
                    out[mode]["rate_one_replica"] = await rate_limit(s, dep, one_replica=True)
                finally:
                    dep.close()
                print(mode, json.dumps(out[mode]), file=sys.stderr, flush=True)
            dep = Deployment(engine, None, split=False)  # each replica the whole limit
            try:
                out["unsplit"] = {"rate_spread": await rate_limit(s, dep, one_replica=False)}
            finally:
                dep.close()
    finally:
        h.stop(up)
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = results["guarantees"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    w = results["window_s"]
    for mode, style in (("shared", "-"), ("baseline", "--")):
        for scen, marker in (("fairness_random", "o"), ("fairness_skewed", "s")):
            ys = g[mode][scen]["windows"]
            a.plot([w * (i + 1) for i in range(len(ys))], ys, style, marker=marker, label=f"{mode}, {scen.split('_')[1]}")
    a.axhspan(0.70, 0.80, color="green", alpha=0.1, label="0.75 ± 5 pp")
    a.set_ylim(0.3, 1.0)
    a.set_xlabel(f"end of {w:g} s window")
    a.set_ylabel("heavy user's token share (weight share 0.75)")
    a.set_title("fairness across 3 replicas")
    a.legend(fontsize=7)
    labels = ["spread at random", "all to one replica"]
    xs = range(len(labels))
    for i, (name, vals) in enumerate(
        (
            ("shared (Redis)", [g["shared"]["rate_spread"]["served"], g["shared"]["rate_one_replica"]["served"]]),
            ("baseline, split", [g["baseline"]["rate_spread"]["served"], g["baseline"]["rate_one_replica"]["served"]]),
            ("baseline, unsplit", [g["unsplit"]["rate_spread"]["served"], None]),
        )
    ):
        b.bar([x + (i - 1) * 0.27 for x in xs], [v or 0 for v in vals], width=0.27, label=name)
    b.axhline(30, color="red", lw=1, label="limit: 30 per minute")
    b.set_xticks(list(xs), labels)
    b.set_ylabel("requests served of 150")
    b.set_title("one user's 30 RPM across 3 replicas")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--window", type=float, default=None, help="fairness window (s; default 30, --quick 10)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--plot", type=Path, default=Path("docs/img/replicas.png"))
    ap.add_argument("--only", choices=("throughput", "guarantees"), default=None, help="run one part (no plot)")
    a = ap.parse_args(argv)
    window = a.window or (10.0 if a.quick else 30.0)
    workdir = Path(tempfile.mkdtemp(prefix="bench-replicas-"))
    redis = RedisServer().start()
    try:
        results: dict = {"window_s": window}
        if a.only != "guarantees":
            results["throughput"] = throughput(workdir, redis, a.quick)
        if a.only != "throughput":
            results["guarantees"] = asyncio.run(guarantees(workdir, redis, a.quick, window))
    finally:
        redis.close()
    print(json.dumps(results, indent=1))
    if a.json:
        h.write_json(a.json, results)
    if a.plot and "guarantees" in results and "throughput" in results:
        plot(results, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
