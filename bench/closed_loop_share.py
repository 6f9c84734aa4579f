"""Closed-loop streams per user through the proxy: each user's share of the output tokens.

The short confirmation run of docs/scheduling.md ("Fairness in front of a batching
engine"): ``--streams`` streams per user (alice, then bob, as an asyncio client creates
its tasks), each sending its next streamed chat request (``max_tokens``, ``ignore_eos``)
as soon as its last one ends, for ``--duration`` seconds; the output tokens each user
received after ``--warmup`` (one per content chunk, as vLLM streams them), overall and
per 10 s window, and every 10 s the two users' requests in flight and queued and the
slot holds from ``/admin/status``.

    .venv/bin/python -m bench.closed_loop_share --base http://127.0.0.1:8080 \\
        --model NAME --streams 24 --duration 90 --warmup 20 --max-tokens 32 --admin-key KEY

The users are the shipped config's (config/config.standalone.yaml): alice (``sk-alice``,
weight 3) and bob (``sk-bob``, weight 1), both in platinum.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp

USERS = (("alice", "sk-alice"), ("bob", "sk-bob"))
PROMPT = "Count from one to one thousand in words."


async def _stream(session: aiohttp.ClientSession, url: str, key: str, model: str, max_tokens: int, user: str, log: list, stop_at: float) -> None:
    """One closed-loop stream: request after request until ``stop_at``; appends
    ``(monotonic time, user)`` to ``log`` for every content chunk."""
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {key}"}
    while time.monotonic() < stop_at:
        try:
            async with session.post(url, json=body, headers=headers) as r:
                if r.status != 200:
                    await r.read()
                    await asyncio.sleep(0.1)  # a refusal (queue timeout): back off, bounded by stop_at
                    continue
                buf = b""
                async for chunk in r.content.iter_any():
                    buf += chunk
                    while b"\n\n" in buf:
                        event, buf = buf.split(b"\n\n", 1)
                        for line in event.split(b"\n"):
                            if not line.startswith(b"data: ") or line[6:] == b"[DONE]":
                                continue
                            for c in json.loads(line[6:]).get("choices") or []:
                                if (c.get("delta") or {}).get("content"):
                                    log.append((time.monotonic(), user))
        except (aiohttp.ClientError, asyncio.TimeoutError):
            await asyncio.sleep(0.1)


async def _poll(session: aiohttp.ClientSession, base: str, admin_key: str, t0: float, stop_at: float, out: list) -> None:
    """``/admin/status`` every 10 s until ``stop_at``: ``(seconds since t0, status)``."""
    while time.monotonic() + 10 < stop_at:
        await asyncio.sleep(10)
        async with session.get(base + "/admin/status", headers={"Authorization": f"Bearer {admin_key}"}) as r:
            out.append((time.monotonic() - t0, await r.json()))


async def run(base: str, model: str, streams: int, duration: float, warmup: float, max_tokens: int, admin_key: str | None) -> dict:
    """Run the load; returns ``{"tokens": {user: n}, "windows": [(start s, alice's share)],
    "status": [(s, {user: (in flight, queued)}, holds taken, holds expired)]}``."""
    log: list = []
    statuses: list = []
    t0 = time.monotonic()
    stop_at = t0 + duration
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)) as s:
        tasks = [
            asyncio.create_task(_stream(s, base + "/v1/chat/completions", key, model, max_tokens, user, log, stop_at))
            for user, key in USERS
            for _ in range(streams)
        ]
        if admin_key:
            tasks.append(asyncio.create_task(_poll(s, base, admin_key, t0, stop_at, statuses)))
        await asyncio.sleep(duration)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    tokens = {u: sum(1 for t, uu in log if uu == u and t - t0 >= warmup) for u, _k in USERS}
    windows = []
    for w0 in range(int(warmup), int(duration), 10):
        c = {u: sum(1 for t, uu in log if uu == u and w0 <= t - t0 < w0 + 10) for u, _k in USERS}
        windows.append((w0, c["alice"] / max(1, sum(c.values())), sum(c.values()) / 10))
    status = []
    for at, j in statuses:
        users = {x["user"]: (x["inflight"], x["queued"]) for x in j.get("users", []) if x.get("user") in dict(USERS)}
        status.append((at, users, j.get("holds_taken"), j.get("holds_expired")))
    return {"tokens": tokens, "windows": windows, "status": status}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the proxy's base URL")
    ap.add_argument("--model", required=True, help="the model name the engine serves")
    ap.add_argument("--streams", type=int, default=24, help="closed-loop streams per user (default 24)")
    ap.add_argument("--duration", type=float, default=90.0, help="seconds of load (default 90)")
    ap.add_argument("--warmup", type=float, default=20.0, help="seconds not measured at the start (default 20)")
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (default 128)")
    ap.add_argument("--admin-key", help="admin key, to sample /admin/status")
    a = ap.parse_args()
    r = asyncio.run(run(a.base, a.model, a.streams, a.duration, a.warmup, a.max_tokens, a.admin_key))
    tok = r["tokens"]
    total = max(1, sum(tok.values()))
    print(f"{a.streams} streams each, {a.warmup:g}-{a.duration:g} s: " + ", ".join(f"{u} {n} tokens ({100 * n / total:.1f} %)" for u, n in tok.items()) + f", {total / (a.duration - a.warmup):.0f} tokens/s")
    for w0, share, rate in r["windows"]:
        print(f"  {w0:4d}-{w0 + 10:<4d} s: alice {100 * share:.1f} %  ({rate:.0f} tokens/s)")
    for at, users, taken, expired in r["status"]:
        print(f"  @{at:.0f} s: " + "; ".join(f"{u} {fl} in flight, {q} queued" for u, (fl, q) in users.items()) + f"; holds taken {taken}, expired {expired}")


if __name__ == "__main__":
    main()
