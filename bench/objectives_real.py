"""Latency objectives kept on a real vLLM engine (issue 24, "Show it"): three groups with
objectives under 2x, 5x and 10x overload, each load straight to vLLM, through the proxy
with objectives off, and through the proxy with them on.

One vLLM engine (its CPU build, as :mod:`bench.real_engine` starts it) serves
SmolLM2-135M-Instruct for the whole run; two proxy processes stand in front of it, on the
same config but for the objectives (:func:`proxy_config`):

* ``platinum`` (alice): ``ttft_target_s`` :data:`TARGETS` (0.5 s, p95);
* ``gold`` (carol): 2 s, p95;
* ``bronze`` (no key: the default group): 10 s, p95;

and with ``preemption.resume: true`` (``server: vllm``), so that the objective protection's
preempt step may take shown bronze streams and resume them.

**Load.** First the engine's service rate ``C`` is measured: completed requests per
second with :data:`CALIBRATE_STREAMS` closed-loop streams of the request mix, straight to
vLLM. Each row then sends Poisson arrivals at ``k x C`` (k = 2, 5, 10) for ``--duration``
seconds, split :data:`MIX` between the groups, each request a streaming chat completion
of a seeded uniform 16..96 tokens (``ignore_eos``); a client gives up (disconnects) after
:data:`CLIENT_TIMEOUT_S`. The same seeded arrivals go to every path.

**Figures per group and path**: requests sent, served (a first token came), refused (a
429, by its ``code``), given up; TTFT p50/p95 of those served; *attainment*: the fraction
of the requests sent whose first token came within the target (a refused or abandoned
request misses), and of those served; the total tokens per second of all groups over the
row, against direct; from the on path's ``/metrics``, the protection steps taken and the
streams resumed, and for every served stream whether it was whole: exactly as many
content events as asked (``ignore_eos``), one ``finish_reason``, and usage that counts
them all.

Usage::

    .venv/bin/python -m bench.objectives_real                   # 3 loads x 3 paths, 20 s each: about 12 minutes
    .venv/bin/python -m bench.objectives_real --loads 2 --duration 10

Output: a table on stdout, every figure in ``bench/out/objectives_real.json``, a plot in
``docs/img/objectives_real.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

from bench import harness as h
from bench.cpu_engine import PROMPT
from bench.real_engine import STOP_GRACE_S, start_engine, wait_idle

OUT = h.REPO_ROOT / "bench" / "out" / "objectives_real.json"
PLOT = h.REPO_ROOT / "docs" / "img" / "objectives_real.png"
ADMIN_KEY = "bench-objectives-admin"
KEYS = {"platinum": "sk-alice", "gold": "sk-carol", "bronze": None}
TARGETS = {"platinum": 0.5, "gold": 2.0, "bronze": 10.0}  # ttft_target_s, p95
MIX = {"platinum": 0.1, "gold": 0.3, "bronze": 0.6}  # share of the arrivals
TOKENS = (16, 96)  # max_tokens, uniform, seeded
CALIBRATE_STREAMS = 48
CALIBRATE_S = 15.0
CLIENT_TIMEOUT_S = 30.0
GRACE_S = 15.0  # after the last arrival, requests in flight get this long before they are cut
IDLE_GAP_S = 1.5
LOADS = (2, 5, 10)
PATHS = ("direct", "proxy-off", "proxy-on")


def proxy_config(objectives: bool) -> dict:
    """The proxy's config: three groups, their objectives when ``objectives``; resume on."""
    groups = []
    for name, key in KEYS.items():
        g: dict = {"name": name, "users": [{"id": name + "-user", "api_key": key}] if key else []}
        if objectives:
            g.update(ttft_target_s=TARGETS[name], ttft_percentile=95)
        groups.append(g)
    return {
        "upstream": {"url": "http://127.0.0.1:1", "kind": "openai", "server": "vllm"},
        "admission": {"max_queue": 10000, "queue_timeout_s": CLIENT_TIMEOUT_S, "preemption": {"resume": True}},
        "identity": {"require_api_key": False},
        "default_group": "bronze",
        "groups": groups,
    }


@dataclass
class Outcome:
    """One request: its group, when it was sent (s from the row's start), its TTFT (None:
    no token), its status or refusal code, and whether its stream was whole."""

    group: str
    sent_s: float
    asked: int
    ttft_s: float | None = None
    status: str = ""
    events: int = 0
    finishes: int = 0
    usage: int | None = None

    @property
    def whole(self) -> bool:
        return self.events == self.asked and self.finishes == 1 and self.usage == self.asked


def _body(model: str, n: int) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": n, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}).encode()


async def one(session: aiohttp.ClientSession, url: str, model: str, o: Outcome, t0: float, times: list | None = None) -> None:
    """Send ``o``'s request and fill in what happened (cancelled: given up); each content
    event's arrival time is appended to ``times`` when given."""
    headers = {"Content-Type": "application/json"}
    if KEYS[o.group]:
        headers["Authorization"] = f"Bearer {KEYS[o.group]}"
    sent = t0 + o.sent_s
    try:
        async with session.post(f"{url}/v1/chat/completions", data=_body(model, o.asked), headers=headers,
                                timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)) as r:
            if r.status != 200:
                body = await r.read()
                try:
                    o.status = f"{r.status}:{json.loads(body)['error'].get('code')}"
                except (ValueError, KeyError, TypeError, AttributeError):
                    o.status = str(r.status)
                return
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                obj = json.loads(line[6:])
                if obj.get("error"):  # a stream ended by an error event (refused after its 200)
                    o.status = f"error event:{(obj['error'] or {}).get('code')}"
                    return
                for ch in obj.get("choices") or []:
                    if (ch.get("delta") or {}).get("content"):
                        now = time.monotonic()
                        if o.ttft_s is None:
                            o.ttft_s = now - sent
                        o.events += 1
                        if times is not None:
                            times.append(now)
                    if ch.get("finish_reason"):
                        o.finishes += 1
                if obj.get("usage") and not obj.get("choices"):
                    o.usage = obj["usage"].get("completion_tokens")
            o.status = "ok"
    except asyncio.TimeoutError:
        o.status = "gave up"
    except aiohttp.ClientError as e:
        o.status = type(e).__name__
    except asyncio.CancelledError:
        o.status = o.status or "cut"
        raise


def arrivals(rate: float, duration_s: float, seed: str) -> list[tuple[float, str, int]]:
    """Seeded Poisson arrivals at ``rate`` per second: (time, group, max_tokens)."""
    rnd = random.Random(seed)
    out, t = [], 0.0
    groups, weights = list(MIX), list(MIX.values())
    for _ in range(1_000_000):
        t += rnd.expovariate(rate)
        if t >= duration_s:
            break
        out.append((t, rnd.choices(groups, weights)[0], rnd.randint(*TOKENS)))
    return out


async def calibrate(session, url: str, model: str) -> float:
    """The engine's service rate in requests of the mix per second: the tokens per second
    of :data:`CALIBRATE_STREAMS` closed-loop streams straight to the engine (over the last
    two thirds of :data:`CALIBRATE_S`; the streams are cut then) over the mean tokens a
    request asks for."""
    rnd = random.Random("calibrate")
    for n in (8, 32, 64):  # warm-up: a fresh engine's first batches of a size are slow
        await asyncio.gather(*(one(session, url, model, Outcome("bronze", 0.0, 16), time.monotonic()) for _ in range(n)))
    times: list[float] = []
    t0 = time.monotonic()

    async def loop() -> None:
        for _ in range(10_000):
            o = Outcome("bronze", time.monotonic() - t0, rnd.randint(*TOKENS))
            await one(session, url, model, o, t0, times)

    tasks = [asyncio.create_task(loop()) for _ in range(CALIBRATE_STREAMS)]
    await asyncio.sleep(CALIBRATE_S)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    a = t0 + CALIBRATE_S / 3
    tok_s = sum(1 for t in times if t >= a) / (CALIBRATE_S * 2 / 3)
    print(f"calibration: {len(times)} tokens, {tok_s:.0f} tokens/s over the last {CALIBRATE_S * 2 / 3:.0f} s", file=sys.stderr, flush=True)
    return max(0.1, tok_s / (sum(TOKENS) / 2))


async def scrape(session, url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sums of the proxy's ``/metrics`` series whose names start with ``names``."""
    async with session.get(f"{url}/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        for n in names:
            if line.startswith(n):
                try:
                    out[n] = out.get(n, 0.0) + float(line.rsplit(" ", 1)[1])
                except ValueError:
                    pass
    return out


COUNTERS = ("llm_qos_resumes_total", "llm_qos_preemptions_total", "llm_qos_protection_steps_total", "llm_qos_protection_refusals_total")


async def run_row(session, url: str, engine_url: str, model: str, k: int, rate: float, duration_s: float, path: str) -> dict:
    """One load on one path; returns its figures."""
    plan = arrivals(rate, duration_s, f"{k}")
    before = await scrape(session, url, COUNTERS) if path != "direct" else {}
    t0 = time.monotonic()
    outcomes: list[Outcome] = []
    tasks: list[asyncio.Task] = []
    for at, group, n in plan:
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        o = Outcome(group, at, n)
        outcomes.append(o)
        tasks.append(asyncio.create_task(one(session, url, model, o, t0)))
    if tasks:
        await asyncio.wait(tasks, timeout=GRACE_S)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    wall = time.monotonic() - t0
    after = await scrape(session, url, COUNTERS) if path != "direct" else {}
    await wait_idle(session, engine_url)
    await asyncio.sleep(IDLE_GAP_S)
    row: dict = {"load": k, "path": path, "rate_per_s": round(rate, 2), "sent": len(outcomes), "wall_s": round(wall, 1),
                 "tok_s": round(sum(o.events for o in outcomes) / wall, 1), "groups": {}}
    for g in MIX:
        mine = [o for o in outcomes if o.group == g]
        served = [o for o in mine if o.ttft_s is not None]
        ttfts = [o.ttft_s for o in served]
        within = sum(1 for t in ttfts if t <= TARGETS[g])
        statuses: dict[str, int] = {}
        for o in mine:
            if o.ttft_s is None:
                statuses[o.status or "cut"] = statuses.get(o.status or "cut", 0) + 1
        complete = [o for o in served if o.status == "ok"]
        row["groups"][g] = {
            "sent": len(mine), "served": len(served), "not_served": statuses,
            "ttft_p50_s": _r(h.percentile(ttfts, 50)), "ttft_p95_s": _r(h.percentile(ttfts, 95)),
            "attainment_sent": _r(within / len(mine)) if mine else None,
            "attainment_served": _r(within / len(served)) if served else None,
            "completed": len(complete), "whole": sum(o.whole for o in complete),
            "not_whole": [{"asked": o.asked, "events": o.events, "finishes": o.finishes, "usage": o.usage}
                          for o in complete if not o.whole][:10],
        }
    row["counters"] = {n: after.get(n, 0.0) - before.get(n, 0.0) for n in COUNTERS} if path != "direct" else {}
    return row


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def table(rows: list[dict]) -> str:
    lines = ["| load | path | tok/s (vs direct) | platinum att. sent / served, p95 | gold att. sent / served, p95 | bronze att. sent / served, p95 | bronze refused | resumed, whole |",
             "| ---: | --- | ---: | --- | --- | --- | ---: | --- |"]
    direct = {r["load"]: r["tok_s"] for r in rows if r["path"] == "direct"}
    for r in rows:
        cells = []
        for g in MIX:
            s = r["groups"][g]
            cells.append(f"{_pct(s['attainment_sent'])} / {_pct(s['attainment_served'])}, {h.fmt(s['ttft_p95_s'])} s")
        b = r["groups"]["bronze"]["not_served"]
        refused = sum(v for k, v in b.items() if k.startswith("429"))
        whole = sum(s["whole"] for s in r["groups"].values())
        done = sum(s["completed"] for s in r["groups"].values())
        resumed = int(r["counters"].get("llm_qos_resumes_total", 0)) if r["counters"] else "-"
        ratio = f" ({r['tok_s'] / direct[r['load']] * 100:.0f} %)" if direct.get(r["load"]) else ""
        lines.append(f"| {r['load']}x | {r['path']} | {r['tok_s']:.0f}{ratio} | {' | '.join(cells)} | {refused} | {resumed}, {whole}/{done} |")
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.0f} %"


def plot(rows: list[dict], path: Path) -> None:
    """Attainment (of requests sent) per group, load and path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MIX), figsize=(12, 3.6), sharey=True)
    loads = sorted({r["load"] for r in rows})
    for ax, g in zip(axes, MIX):
        for i, p in enumerate(PATHS):
            ys = [next((r["groups"][g]["attainment_sent"] or 0 for r in rows if r["load"] == k and r["path"] == p), 0) for k in loads]
            ax.bar([j + (i - 1) * 0.27 for j in range(len(loads))], ys, 0.27, label=p)
        ax.set_xticks(range(len(loads)), [f"{k}x" for k in loads])
        ax.set_title(f"{g}: TTFT <= {TARGETS[g]:g} s")
        ax.axhline(0.95, color="grey", lw=0.8, ls="--")
    axes[0].set_ylabel("attainment (of requests sent)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


async def measure(engine_url: str, urls: dict[str, str], model: str, loads: list[int], duration_s: float) -> dict:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        rate = await calibrate(session, engine_url, model)
        await wait_idle(session, engine_url)
        print(f"service rate C = {rate:.2f} requests/s (direct, {CALIBRATE_STREAMS} closed-loop streams)", file=sys.stderr, flush=True)
        rows = []
        for k in loads:
            for p in PATHS:
                r = await run_row(session, urls[p], engine_url, model, k, k * rate, duration_s, p)
                print(f"  {k}x {p}: {json.dumps({g: (s['attainment_sent'], s['ttft_p95_s']) for g, s in r['groups'].items()})} tok/s {r['tok_s']}",
                      file=sys.stderr, flush=True)
                rows.append(r)
    return {"service_rate_per_s": round(rate, 3), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per row (default 20)")
    ap.add_argument("--loads", default=",".join(map(str, LOADS)), help="overload factors, comma-separated (default 2,5,10)")
    ap.add_argument("--json", type=Path, default=OUT)
    ap.add_argument("--plot", type=Path, default=PLOT)
    a = ap.parse_args(argv)
    loads = [int(x) for x in a.loads.split(",")]
    if not 5 <= a.duration <= 300 or not all(1 <= k <= 20 for k in loads):
        ap.error("--duration in 5..300 s, loads in 1..20")
    h.raise_nofile()
    workdir = Path(tempfile.mkdtemp(prefix="bench-objectives-"))
    os.environ["LLM_QOS_ADMIN_KEY"] = ADMIN_KEY
    procs: list = []

    load_before = os.getloadavg()
    try:
        print(f"starting vLLM (logs in {workdir}) ...", file=sys.stderr, flush=True)
        engine, engine_url, model, how = start_engine(h.free_port(), workdir)
        procs.append(engine)
        urls = {"direct": engine_url}
        for p, objectives in (("proxy-off", False), ("proxy-on", True)):
            cfg = workdir / f"{p}.yaml"
            cfg.write_text(yaml.safe_dump(proxy_config(objectives)))
            port = h.free_port()
            procs.append(h.start_proxy(cfg, port, engine_url, workdir))
            urls[p] = f"http://127.0.0.1:{port}"
        data = asyncio.run(measure(engine_url, urls, model, loads, a.duration))
    finally:
        for p in reversed(procs):
            h.stop(p, STOP_GRACE_S)
    meta = {"engine": how, "model": model, "cpus": os.cpu_count(), "load_before": [round(x, 2) for x in load_before],
            "duration_s": a.duration, "targets_s": TARGETS, "mix": MIX, "tokens": TOKENS, "client_timeout_s": CLIENT_TIMEOUT_S,
            "workdir": str(workdir)}
    h.write_json(a.json, {**meta, **data})
    plot(data["rows"], a.plot)
    print(f"vLLM 0.32 CPU build, {model}; service rate C = {data['service_rate_per_s']} requests/s; {a.duration:g} s of Poisson arrivals per row; "
          f"load average before {load_before[0]:.2f}\n")
    print(table(data["rows"]))
    return 0


if __name__ == "__main__":
    h.run_script(main, "engine and proxies stopped")
