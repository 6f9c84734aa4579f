"""Bounded soak: 10 000 requests with random client cancels and random upstream failures.

Afterwards nothing may be left behind: no request in flight, nothing queued, no upstream
stream still open, no extra asyncio tasks, no extra file descriptors.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import aiohttp

from tests.conftest import wait_until

REQUESTS = 10_000
CONCURRENCY = 48
TIME_LIMIT_S = 240


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_soak_random_cancels_and_upstream_failures(make_stack):
    st = await make_stack(max_inflight=8, max_queue=64, queue_timeout_s=5)
    sched = st.state.admission.scheduler
    rng = random.Random(20261130)
    outcomes: dict[str, int] = {}
    counter = iter(range(REQUESTS))
    deadline = time.monotonic() + TIME_LIMIT_S

    tasks_before, fds_before = len(asyncio.all_tasks()), _fds()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CONCURRENCY)) as http:

        async def one() -> str:
            kind = rng.random()
            fake: dict = {"itl_s": rng.choice([0, 0, 0.001, 0.003])}
            if kind < 0.10:
                fake["status"] = rng.choice([500, 503, 400])
            elif kind < 0.20:
                fake["fail_after"] = rng.randint(0, 5)
            body = st.chat_body(rng.randint(1, 12), stream=rng.random() < 0.7, **fake)
            cancel_after = rng.uniform(0, 0.02) if rng.random() < 0.25 else None

            async def call() -> str:
                async with http.post(st.proxy_url + "/v1/chat/completions", json=body) as r:
                    await r.read()
                    return str(r.status)

            try:
                if cancel_after is None:
                    return await call()
                return await asyncio.wait_for(call(), cancel_after)
            except TimeoutError:
                return "client_cancel"
            except aiohttp.ClientError as e:
                return type(e).__name__

        async def worker() -> None:
            for _ in counter:
                if time.monotonic() > deadline:
                    return
                o = await one()
                outcomes[o] = outcomes.get(o, 0) + 1

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        done = sum(outcomes.values())
        assert done == REQUESTS, f"only {done} requests within {TIME_LIMIT_S} s"
        await wait_until(lambda: not sched.inflight and sched.queued == 0 and st.stats.active == 0, timeout=10, what="everything drained")
        assert sched.inflight_tokens == 0
    # idle keep-alive connections (ours to the proxy, the proxy's pool to the upstream,
    # which expires after upstream.keepalive_timeout_s) close; then every task and file
    # descriptor opened for the soak must be gone
    await wait_until(lambda: len(asyncio.all_tasks()) <= tasks_before, timeout=15, what=f"tasks back to {tasks_before}")
    await wait_until(lambda: _fds() <= fds_before, timeout=15, what=f"file descriptors back to {fds_before}")
    print("soak outcomes:", dict(sorted(outcomes.items())))
    assert outcomes.get("200", 0) > REQUESTS * 0.4
    assert outcomes.get("client_cancel", 0) > REQUESTS * 0.1
    assert st.stats.aborted > 0  # cancels reached the upstream
