"""How much memory one proxy process needs to hold many idle streams.

Starts the fake upstream and the proxy (``max_inflight`` above the stream count, so every
stream is in flight upstream, not queued), then opens ``--streams`` streaming requests
whose upstream waits ``hold`` seconds before its first token (``fake.ttft_s``), in
batches, waiting each time until the fake upstream reports them all active. With all
of them held open it reads the proxy's RSS (VmRSS) and peak RSS (VmHWM) from /proc,
then closes every client connection and checks that the proxy aborted every upstream
request (the fake upstream counts them as aborted).

Each stream costs the proxy two sockets (client and upstream). When the open-files hard
limit is too low for 2 x streams (it is 20 000 on some sandboxes and cannot be raised
without privileges), the run holds as many as fit and also reports the RSS
extrapolated linearly to the requested count.

    python -m bench.idle_streams --streams 10000
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

from . import harness as h


async def _get_json(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url) as r:
        return orjson.loads(await r.read())


async def _hold(proxy_url: str, upstream_url: str, n: int, hold_s: float, batch: int, deadline: float, pid: int) -> dict:
    body = orjson.dumps(
        {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True, "fake": {"ttft_s": hold_s}}
    )
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {h.USERS[0][0]}"}
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    client = aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None), skip_auto_headers=("User-Agent",))
    ctl = aiohttp.ClientSession()
    outcomes = {"ok": 0, "error": 0}

    async def one() -> None:
        try:
            async with client.post(proxy_url + "/v1/chat/completions", data=body, headers=headers) as r:
                await r.read()
                outcomes["ok" if r.status == 200 else "error"] += 1
        except aiohttp.ClientError:
            outcomes["error"] += 1

    tasks: list[asyncio.Task] = []
    result: dict = {}
    try:
        await ctl.post(upstream_url + "/stats/reset")
        t0 = time.monotonic()
        while len(tasks) < n:
            k = min(batch, n - len(tasks))
            tasks += [asyncio.ensure_future(one()) for _ in range(k)]
            while True:
                active = (await _get_json(ctl, upstream_url + "/stats"))["active"]
                if active >= len(tasks):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"only {active} of {len(tasks)} streams reached the upstream in time")
                if outcomes["error"]:
                    raise RuntimeError(f"{outcomes['error']} streams failed while opening")
                await asyncio.sleep(0.05)
        result["open_s"] = round(time.monotonic() - t0, 2)
        await asyncio.sleep(1.0)  # settle
        result["mem_kib"] = h.mem_kib(pid)
        result["fds"] = h.open_fds(pid)
        metrics = (await (await ctl.get(proxy_url + "/metrics")).read()).decode()
        inflight = h.parse_prometheus(metrics, ("llm_qos_inflight_requests",)).get("llm_qos_inflight_requests")
        result["proxy_inflight"] = None if inflight is None else int(inflight)
        result["upstream_active"] = (await _get_json(ctl, upstream_url + "/stats"))["active"]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
        # every upstream request must be aborted once its client is gone
        t1 = time.monotonic()
        stats = await _get_json(ctl, upstream_url + "/stats")
        while stats["active"] and time.monotonic() - t1 < 30:
            await asyncio.sleep(0.1)
            stats = await _get_json(ctl, upstream_url + "/stats")
        result["aborted_upstream"] = stats["aborted"]
        result["still_active_upstream"] = stats["active"]
        result["abort_s"] = round(time.monotonic() - t1, 2)
        await ctl.close()
    return result


def run(
    streams: int = 10000, hold_s: float = 120.0, batch: int = 120, timeout_s: float = 150.0, workdir: Path | None = None, proxy_src: str | None = None
) -> dict:
    """Run the measurement; returns a dict (``rss_mib``, ``rss_mib_at_target``, ...)."""
    limit = h.raise_nofile()
    tmp = tempfile.TemporaryDirectory(prefix="llmqos-idle-") if workdir is None else None
    wd = Path(tmp.name) if tmp else workdir
    up = proxy = None
    try:
        up_port, px_port = h.free_port(), h.free_port()
        upstream_url, proxy_url = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{px_port}"
        up = h.start_fake_upstream(up_port, wd)
        cfg = h.write_proxy_config(wd / "idle.yaml", upstream_url, max_inflight=streams + 100, max_queue=streams + 100)
        proxy = h.start_proxy(cfg, px_port, upstream_url, wd, src=proxy_src)
        # a few ordinary requests first, so the baseline is a warm process
        from .loadgen import LoadSpec, run_load

        h.run_loop(run_load(LoadSpec(url=proxy_url, concurrency=4, requests=200, duration_s=10, keys=h.KEYS)))
        base = h.mem_kib(proxy.pid)
        n = min(streams, (limit - h.open_fds(proxy.pid) - 32) // 2)
        res = h.run_loop(_hold(proxy_url, upstream_url, n, hold_s, batch, time.monotonic() + timeout_s, proxy.pid))
        rss, base_rss = res["mem_kib"]["VmRSS"], base["VmRSS"]
        per_stream = (rss - base_rss) / n if n else 0.0
        out = {
            "streams_requested": streams,
            "streams_held": n,
            "nofile_limit": limit,
            "baseline_rss_mib": round(base_rss / 1024, 1),
            "rss_mib": round(rss / 1024, 1),
            "peak_rss_mib": round(res["mem_kib"]["VmHWM"] / 1024, 1),
            "kib_per_stream": round(per_stream, 1),
            "rss_mib_at_target": round((base_rss + per_stream * streams) / 1024, 1),
            **{k: v for k, v in res.items() if k != "mem_kib"},
        }
        out["healthy_after"] = h.run_loop(run_load(LoadSpec(url=proxy_url, concurrency=2, requests=20, duration_s=10, keys=h.KEYS))).ok == 20
        return out
    finally:
        h.stop(proxy)
        h.stop(up)
        if tmp:
            tmp.cleanup()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=10000)
    ap.add_argument("--hold-s", type=float, default=120.0, help="upstream time to first token (the streams' idle time, at most)")
    ap.add_argument("--batch", type=int, default=120, help="streams opened at once (the fake upstream listens with a backlog of 128)")
    ap.add_argument("--proxy-src", default=None, help="run the proxy from another checkout")
    ap.add_argument("--timeout-s", type=float, default=150.0, help="give up opening streams after this long")
    a = ap.parse_args(argv)
    print(orjson.dumps(run(a.streams, a.hold_s, a.batch, a.timeout_s, proxy_src=a.proxy_src), option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
