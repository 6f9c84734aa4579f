"""A cheap load generator for OpenAI-compatible endpoints (aiohttp client on uvloop).

Closed loop (``--concurrency C``: C workers, each sends its next request when the last
one ends) or open loop (``--rate R``: requests start on a fixed schedule of R per second,
whatever the server does, up to ``--concurrency`` at once as a safety bound). Streaming or
not; requests carry ``Authorization: Bearer KEY`` drawn from ``--key KEY[:WEIGHT]`` by
weight. Every run is bounded by both ``--duration-s`` and ``--requests``.

Reports requests/s, p50/p99 latency (request sent -> last byte), p50/p99 TTFT (first body
byte, streaming), errors by status (``conn`` for connection errors, ``timeout``), and
tokens per API key (from ``usage`` when the answer carries it, else one per SSE event).
``LoadSpec.record`` also keeps one record per request (key, status, times, tokens, the
engine that served it), for benchmarks that need more than the summary.

``--procs N`` splits the load over N processes (the client must cost less than what it
measures); :func:`run_load_procs` does the same from Python.

Example::

    python -m bench.loadgen --url http://127.0.0.1:8000 --concurrency 8 --duration-s 5 \\
        --stream --max-tokens 64 --key sk-alice:3 --key sk-bob:1
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import random
import time
from dataclasses import asdict, dataclass, field, replace

import aiohttp
import orjson

from . import harness as h


@dataclass
class LoadSpec:
    """One load run.

    Attributes:
        url: base URL (``http://127.0.0.1:8000``).
        path: request path.
        concurrency: closed-loop workers; in open loop, the most requests in flight.
        rate: open-loop arrival rate (requests/s); ``None`` for closed loop.
        duration_s: stop starting requests after this many seconds.
        requests: stop after this many requests (``None``: duration only).
        stream: ask for SSE streaming.
        max_tokens: ``max_tokens`` of each request.
        keys: (api_key, weight) pairs; empty for no Authorization header.
        fake: the fake upstream's per-request ``fake`` overrides, or ``None``.
        timeout_s: per-request total timeout.
        warmup: requests sent (and not counted) before the measured run.
        seed: seed of the key draw.
        prompt: the user message.
        cpus: pin the load process(es) to these CPUs for this run (``None``: leave as is).
        record: keep one record per measured request in :attr:`LoadResult.records`.
    """

    url: str
    path: str = "/v1/chat/completions"
    concurrency: int = 1
    rate: float | None = None
    duration_s: float = 5.0
    requests: int | None = None
    stream: bool = False
    max_tokens: int = 16
    keys: list = field(default_factory=list)
    fake: dict | None = None
    timeout_s: float = 60.0
    warmup: int = 0
    seed: int = 1
    prompt: str = "Say something short."
    cpus: list | None = None
    record: bool = False


@dataclass
class LoadResult:
    """Raw results of one run (mergeable across processes)."""

    elapsed_s: float = 0.0
    latencies: list = field(default_factory=list)  # seconds, successful requests
    ttfts: list = field(default_factory=list)  # seconds, successful streams
    errors: dict = field(default_factory=dict)  # status or kind -> count
    tokens: dict = field(default_factory=dict)  # api key -> output tokens
    chunks: int = 0  # body chunks read from the socket (streams)
    ok: int = 0
    # with LoadSpec.record: [key, status (int, or "timeout" / "conn"), sent, ttft (None
    # unless a stream answered), ended, output tokens, the answer's X-Engine header]; times
    # are time.perf_counter() seconds (CLOCK_MONOTONIC on Linux: one clock for all processes)
    records: list = field(default_factory=list)

    def merge(self, other: "LoadResult") -> "LoadResult":
        self.elapsed_s = max(self.elapsed_s, other.elapsed_s)
        self.latencies += other.latencies
        self.ttfts += other.ttfts
        for k, v in other.errors.items():
            self.errors[k] = self.errors.get(k, 0) + v
        for k, v in other.tokens.items():
            self.tokens[k] = self.tokens.get(k, 0) + v
        self.chunks += other.chunks
        self.ok += other.ok
        self.records += other.records
        return self

    def summary(self) -> dict:
        """req/s, p50/p99 latency and TTFT (ms), errors, tokens per key."""
        n_err = sum(self.errors.values())
        return {
            "requests": self.ok + n_err,
            "ok": self.ok,
            "req_per_s": round(self.ok / self.elapsed_s, 1) if self.elapsed_s else 0.0,
            "p50_ms": _ms(h.percentile(self.latencies, 50)),
            "p99_ms": _ms(h.percentile(self.latencies, 99)),
            "ttft_p50_ms": _ms(h.percentile(self.ttfts, 50)),
            "ttft_p99_ms": _ms(h.percentile(self.ttfts, 99)),
            "errors": dict(self.errors),
            "tokens_by_key": dict(self.tokens),
        }


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 3)


def _usage_tokens(tail: bytes) -> int | None:
    """completion_tokens of the last SSE event in ``tail`` that carries ``usage``."""
    i = tail.rfind(b'"usage"')
    if i < 0:
        return None
    start = tail.rfind(b"data:", 0, i)
    end = tail.find(b"\n\n", i)
    if start < 0:
        return None
    try:
        obj = orjson.loads(tail[start + 5 : end if end >= 0 else len(tail)])
        n = obj["usage"]["completion_tokens"]
        return n if isinstance(n, int) else None
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None


async def run_load(spec: LoadSpec) -> LoadResult:
    """Run ``spec`` in this event loop and return its raw results."""
    rnd = random.Random(spec.seed)
    keys = spec.keys or [("", 1.0)]
    draw = rnd.choices([k for k, _ in keys], weights=[w for _, w in keys], k=4096)
    bodies = {}
    for k in set(draw):
        body = {"model": "fake-model", "messages": [{"role": "user", "content": spec.prompt}], "max_tokens": spec.max_tokens, "stream": spec.stream}
        if spec.fake:
            body["fake"] = spec.fake
        headers = {"Content-Type": "application/json"}
        if k:
            headers["Authorization"] = f"Bearer {k}"
        bodies[k] = (orjson.dumps(body), headers)
    url = spec.url.rstrip("/") + spec.path
    res = LoadResult()
    timeout = aiohttp.ClientTimeout(total=spec.timeout_s)
    conn = aiohttp.TCPConnector(limit=0, force_close=False, keepalive_timeout=30)
    counter = [0]
    recording = [False]

    def record(key: str, status, t0: float, ttft: float | None, tokens: int, engine: str | None) -> None:
        if spec.record:
            res.records.append([key, status, t0, ttft, time.perf_counter(), tokens, engine])

    async def one(i: int) -> None:
        key = draw[i % len(draw)]
        data, headers = bodies[key]
        t0 = time.perf_counter()
        ttft = None
        tokens = None
        engine = None
        try:
            async with session.post(url, data=data, headers=headers) as resp:
                if spec.record:
                    engine = resp.headers.get("X-Engine")
                if resp.status != 200:
                    await resp.read()
                    if recording[0]:
                        res.errors[resp.status] = res.errors.get(resp.status, 0) + 1
                        record(key, resp.status, t0, None, 0, engine)
                    return
                if spec.stream:
                    events = 0
                    tail = b""
                    chunks = 0
                    async for chunk in resp.content.iter_any():
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        chunks += 1
                        events += chunk.count(b"\n\n")
                        tail = (tail + chunk)[-2048:]
                    tokens = _usage_tokens(tail)
                    if tokens is None:
                        tokens = max(0, events - (1 if b"[DONE]" in tail else 0))
                    if recording[0]:
                        res.chunks += chunks
                else:
                    body = await resp.read()
                    try:
                        tokens = orjson.loads(body)["usage"]["completion_tokens"]
                    except (orjson.JSONDecodeError, KeyError, TypeError):
                        tokens = 0
        except asyncio.TimeoutError:
            if recording[0]:
                res.errors["timeout"] = res.errors.get("timeout", 0) + 1
                record(key, "timeout", t0, ttft, 0, engine)
            return
        except aiohttp.ClientError:
            if recording[0]:
                res.errors["conn"] = res.errors.get("conn", 0) + 1
                record(key, "conn", t0, ttft, 0, engine)
            return
        if recording[0]:
            res.latencies.append(time.perf_counter() - t0)
            if ttft is not None:
                res.ttfts.append(ttft)
            res.tokens[key] = res.tokens.get(key, 0) + (tokens or 0)
            res.ok += 1
            record(key, 200, t0, ttft, tokens or 0, engine)

    async with aiohttp.ClientSession(connector=conn, timeout=timeout, skip_auto_headers=("User-Agent",)) as session:
        # warm-up (connections opened, code paths hot), not recorded
        if spec.warmup:
            sem = asyncio.Semaphore(max(1, spec.concurrency))

            async def w(i: int) -> None:
                async with sem:
                    await one(i)

            await asyncio.gather(*(w(i) for i in range(spec.warmup)))
        recording[0] = True
        limit = spec.requests if spec.requests is not None else 1 << 62
        t_start = time.perf_counter()
        deadline = t_start + spec.duration_s

        if spec.rate is None:

            async def worker() -> None:
                while counter[0] < limit and time.perf_counter() < deadline:
                    counter[0] += 1
                    await one(counter[0])

            await asyncio.gather(*(worker() for _ in range(spec.concurrency)))
        else:
            sem = asyncio.Semaphore(spec.concurrency)
            tasks = set()
            interval = 1.0 / spec.rate
            nxt = t_start
            while counter[0] < limit:
                now = time.perf_counter()
                if now >= deadline:
                    break
                if nxt > now:
                    await asyncio.sleep(nxt - now)
                nxt += interval
                counter[0] += 1
                if sem.locked():  # the safety bound: count it as a client-side drop
                    res.errors["dropped"] = res.errors.get("dropped", 0) + 1
                    continue

                async def fire(i: int) -> None:
                    async with sem:
                        await one(i)

                t = asyncio.ensure_future(fire(counter[0]))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)
        res.elapsed_s = time.perf_counter() - t_start
    return res


def _run_in_process(spec: LoadSpec) -> dict:
    if spec.cpus:
        import os

        os.sched_setaffinity(0, set(spec.cpus))
    return asdict(h.run_loop(run_load(spec)))


def split(spec: LoadSpec, procs: int) -> list[LoadSpec]:
    """``spec`` divided over ``procs`` processes (concurrency, rate, requests, warm-up)."""
    out = []
    for i in range(procs):
        def part(total):
            return None if total is None else total // procs + (1 if i < total % procs else 0)

        out.append(
            replace(
                spec,
                concurrency=max(1, part(spec.concurrency)),
                rate=None if spec.rate is None else spec.rate / procs,
                requests=part(spec.requests),
                warmup=part(spec.warmup) or 0,
                seed=spec.seed + i,
            )
        )
    return out


def _pin(cpus) -> None:
    if cpus:
        import os

        os.sched_setaffinity(0, cpus)


class LoadPool:
    """Persistent load-generating worker processes (spawned once, reused per run),
    optionally pinned to ``cpus``."""

    def __init__(self, procs: int = 1, cpus: set | None = None) -> None:
        self.procs = procs
        self._pool = mp.get_context("spawn").Pool(procs, initializer=_pin, initargs=(cpus,))

    def run(self, spec: LoadSpec, procs: int | None = None) -> LoadResult:
        """Run ``spec`` split over the pool's processes; waits at most the run's own
        bounds plus two minutes, then gives up (``RuntimeError``)."""
        parts = split(spec, min(procs or self.procs, self.procs))
        limit = spec.duration_s + spec.timeout_s + 120.0
        try:
            done = self._pool.map_async(_run_in_process, parts).get(timeout=limit)
        except mp.TimeoutError:
            self._pool.terminate()
            raise RuntimeError(f"the load processes did not finish within {limit:g} s") from None
        merged = LoadResult()
        for d in done:
            merged.merge(LoadResult(**d))
        return merged

    def close(self) -> None:
        self._pool.close()
        self._pool.join()

    def __enter__(self) -> "LoadPool":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self._pool.terminate()
            self._pool.join()


def run_load_procs(spec: LoadSpec, procs: int = 1) -> LoadResult:
    """Run ``spec`` split over ``procs`` fresh processes (1: in this process)."""
    if procs <= 1:
        return LoadResult(**_run_in_process(spec))
    with LoadPool(procs) as pool:
        return pool.run(spec)


def _key(s: str) -> tuple[str, float]:
    k, _, w = s.partition(":")
    return k, float(w or 1.0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--path", default="/v1/chat/completions")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--rate", type=float, default=None, help="open loop: requests per second")
    ap.add_argument("--duration-s", type=float, default=5.0)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--key", action="append", default=[], type=_key, help="API key, optionally :WEIGHT (repeatable)")
    ap.add_argument("--fake", default=None, help='JSON object for the fake upstream, e.g. \'{"itl_s": 0.001}\'')
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--procs", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=60.0)
    a = ap.parse_args(argv)
    spec = LoadSpec(
        url=a.url, path=a.path, concurrency=a.concurrency, rate=a.rate, duration_s=min(a.duration_s, 600.0), requests=a.requests,
        stream=a.stream, max_tokens=a.max_tokens, keys=a.key, fake=orjson.loads(a.fake) if a.fake else None,
        timeout_s=a.timeout_s, warmup=a.warmup,
    )
    print(orjson.dumps(run_load_procs(spec, a.procs).summary(), option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode())


if __name__ == "__main__":
    main()
