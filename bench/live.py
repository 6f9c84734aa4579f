"""Live run: the real proxy (``proxy.api.app.create_app``) in front of
:mod:`bench.rate_upstream`, driven by the workload of :mod:`bench.workload`.

The upstream runs in a child process; the proxy and the load generator share this
process's event loop (everything on 127.0.0.1). The live engine is ``speedup`` times faster
than the modelled one and every time of the workload is divided by ``speedup`` (arrivals,
queue timeout, share window, the baselines' window), so it is the same workload in
tokens, compressed in time. Baseline policies replace the proxy's scheduler object
(:mod:`bench.policies` subclasses :class:`qos.Scheduler`, so the proxy runs them as is).

Measured per request: queue wait = time the upstream received it - time the client sent
it; time to first token = first SSE bytes at the client - time sent. Service per user is
recorded by the upstream as it generates.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson
import yaml
from aiohttp import web

from proxy.admission.admission import Admission
from proxy.api.app import create_app
from proxy.config.loading import config_digest, parse_config
from proxy.api.handlers import STATE

from . import harness as h
from .policies import make_scheduler
from .sim import RequestResult, RunResult
from .workload import Request, Scenario, make_requests, proxy_config


def start_upstream(sc: Scenario, speedup: float, max_lifetime_s: float, workdir: Path) -> tuple[subprocess.Popen, str]:
    """Start :mod:`bench.rate_upstream` with the scenario's engine, ``speedup`` times
    faster, in a child process (its log in ``workdir``); return it and its URL."""
    eng = sc.engine.scaled(speedup)
    args = ["--rate", str(eng.rate), "--max-stream-rate", str(eng.max_stream_rate), "--prefill-rate", str(eng.prefill_rate),
            "--max-lifetime-s", str(max_lifetime_s)]  # fmt: skip
    return h.start_rate_upstream(workdir, args)


def _body(r: Request) -> dict:
    # the proxy estimates a prompt at ceil(chars / 4) + 4 tokens per message
    body: dict = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "x" * (4 * max(0, r.prompt - 4))}],
        "stream": True,
        "fake": {"user": r.user, "n": r.output, "prompt": r.prompt, "rid": r.rid},
    }
    if r.max_tokens is not None:
        body["max_tokens"] = r.max_tokens
    return body


async def _client(sc: Scenario, proxy_url: str, upstream_url: str, speedup: float, duration_s: float) -> dict:
    """The load generator (runs in its own process, see :func:`client_main`): sends the
    workload's requests at their arrival times, reads the streams, and at the end fetches
    the upstream's records. Returns everything as plain JSON-ready data."""
    k = speedup
    reqs = [r for r in make_requests(sc) if r.arrival / k < duration_s]
    url = proxy_url + "/v1/chat/completions"
    sent: dict[int, float] = {}
    first: dict[int, float] = {}
    refused: dict[int, str] = {}
    timeout = aiohttp.ClientTimeout(total=duration_s + 30.0)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
        await (await http.post(upstream_url + "/stats/reset")).release()

        async def one(r: Request) -> None:
            sent[r.rid] = time.monotonic()
            try:
                async with http.post(url, json=_body(r), headers={"X-User-Id": r.user}) as resp:
                    if resp.status != 200:
                        err = await resp.json(content_type=None)
                        refused[r.rid] = str((err.get("error") or {}).get("code") or resp.status)
                        return
                    async for _chunk in resp.content.iter_any():
                        if r.rid not in first:
                            first[r.rid] = time.monotonic()
            except (aiohttp.ClientError, TimeoutError) as e:
                refused.setdefault(r.rid, f"client:{type(e).__name__}")

        t0 = time.monotonic() + 0.2
        tasks: list[asyncio.Task] = []
        for r in reqs:  # bounded: one task per request of the workload
            delay = t0 + r.arrival / k - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(r)))
        end = t0 + duration_s
        if end > time.monotonic():
            await asyncio.sleep(end - time.monotonic())
        async with http.get(upstream_url + "/stats") as resp:
            stats = await resp.json()
        for t in tasks:  # the clients still waiting or streaming go away now
            t.cancel()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30.0)
    return {"t0": t0, "end": end, "sent": sent, "first": first, "refused": refused, "stats": stats}


def client_main(argv: list[str]) -> None:
    """``python -m bench.live SPEEDUP DURATION SEED PROXY_URL UPSTREAM_URL OUT.json``: the
    load generator process (the default scenario with that seed). Its garbage collector
    is tuned: it is not the thing measured."""
    speedup, duration, seed = float(argv[0]), float(argv[1]), int(argv[2])
    proxy_url, upstream_url, out = argv[3], argv[4], argv[5]
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 50, 1000)
    data = h.run_loop(_client(Scenario(seed=seed, duration_s=duration * speedup), proxy_url, upstream_url, speedup, duration))
    with open(out, "wb") as f:
        f.write(orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS))


async def run_policy(sc: Scenario, policy: str, upstream_url: str, speedup: float, duration_s: float) -> RunResult:
    """One live run of ``policy`` for ``duration_s`` seconds of wall time (the workload's
    first ``duration_s * speedup`` seconds). The proxy runs in this process."""
    wall0 = time.perf_counter()
    k = speedup
    reqs = [r for r in make_requests(sc) if r.arrival / k < duration_s]
    text = yaml.safe_dump(proxy_config(sc, upstream_url, k))
    app = create_app(parse_config(text, "<bench>"), config_digest(text))
    state = app[STATE]
    if policy != "ours":
        adm = state.admission
        adm.scheduler = make_scheduler(
            policy, adm.scheduler.policy, time_scale=k, clock=time.monotonic, on_admit=Admission._wake, on_refuse=Admission._refuse,
            capacity=adm.scheduler.capacity_model, rate_limiter=adm.rate_limiter,
        )
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    # when the clients go away at the end, the proxy logs an error for each stream whose
    # end it can no longer write: expected here, so keep that logger quiet
    server_log = logging.getLogger("aiohttp.server")
    level = server_log.level
    server_log.setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "client.json")
        try:
            client = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bench.live", str(k), str(duration_s), str(sc.seed), f"http://127.0.0.1:{port}", upstream_url, out
            )
            try:
                rc = await asyncio.wait_for(client.wait(), duration_s + 90.0)
            except TimeoutError:
                client.kill()
                await client.wait()
                raise RuntimeError("the load generator did not finish in time") from None
            if rc != 0:
                raise RuntimeError(f"the load generator failed (exit {rc})")
        finally:
            await runner.cleanup()
            server_log.setLevel(level)
        with open(out, "rb") as f:
            data = orjson.loads(f.read())
    t0, end, stats = data["t0"], data["end"], data["stats"]
    sent = {int(a): b for a, b in data["sent"].items()}
    first = {int(a): b for a, b in data["first"].items()}
    refused = {int(a): b for a, b in data["refused"].items()}
    by_rid = {rec["rid"]: rec for rec in stats["records"]}
    results: list[RequestResult] = []
    for r in reqs:
        if r.rid not in sent:
            continue
        res = RequestResult(r.user, r.group, sent[r.rid] - t0)
        rec = by_rid.get(r.rid)
        if rec is not None:
            res.admitted = rec["arrived"] - t0
            if rec["ended"] is not None:
                res.finished = rec["ended"] - t0
        if r.rid in first and rec is not None:
            res.first_token = first[r.rid] - t0
        if rec is None and r.rid in refused:
            res.refused = refused[r.rid]
        results.append(res)
    users = [u.user for u in sc.users]
    times = [t - t0 for t, _ in stats["samples"] if t <= end]
    service = {u: [cum.get(u, 0.0) for t, cum in stats["samples"] if t <= end] for u in users}
    return RunResult(
        policy=policy,
        users=users,
        groups={u.user: u.group for u in sc.users},
        times=times,
        service=service,
        requests=results,
        wall_s=time.perf_counter() - wall0,
        note=f"upstream sent {stats['tokens_sent']} tokens",
    )


async def run_live(sc: Scenario, policies: tuple[str, ...], speedup: float, duration_s: float) -> list[RunResult]:
    """Run each policy live, one after the other, against one upstream process."""
    with tempfile.TemporaryDirectory(prefix="llm-qos-live-") as workdir:
        proc, upstream_url = start_upstream(sc, speedup, len(policies) * (duration_s + 60.0) + 60.0, Path(workdir))
        out = []
        try:
            for p in policies:
                out.append(await run_policy(sc, p, upstream_url, speedup, duration_s))
                await asyncio.sleep(0.5)  # let aborted upstream streams wind down
        finally:
            h.stop(proc)
    return out


if __name__ == "__main__":
    client_main(sys.argv[1:])
