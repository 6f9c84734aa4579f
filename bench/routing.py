"""Routing benchmark: ``least_headroom`` against ``round_robin`` over engines of unequal speed.

Three scripted engines (:mod:`bench.scripted_engine`, a process each), two at full speed
and one at half speed (twice the time to first token and between tokens), each with the
same ``max_inflight``, form one pool behind one proxy process (``python -m proxy proxy``,
this checkout). Everything listens on 127.0.0.1, on free ports, and is stopped at the
end. The same closed-loop load (:mod:`bench.loadgen`, in this process) runs once per
policy, each time on a fresh proxy: more clients than the pool has slots, in three groups.

========  ========  ======  =======  ==============
user      group     weight  clients  ``max_tokens``
========  ========  ======  =======  ==============
p-chat    platinum  1       2        32
g-a       gold      2       16       64
g-b       gold      1       12       64
g-c       gold      1       12       128
b-batch   bronze    1       8        128
========  ========  ======  =======  ==============

Bronze has ``min_share: 0.2``. Measured at the clients, over the steady state (after the
warm-up, until the load stops): throughput (requests and output tokens per second of
the requests that ended then), TTFT p50/p99 per group, each gold user's share of gold's
weighted tokens (prompt x1 + output x2, as the scheduler counts them; a request's tokens
spread evenly between its first and last byte) against its weight share, and the worst
error over every window (30 s, sliding by 0.5 s; the single-engine target is 3 pp),
bronze's share of all tokens, and each engine's share of the requests (its ``X-Engine``
header) against its share of the pool's speed.

    .venv/bin/python -m bench.routing                               # about 4 minutes
    .venv/bin/python -m bench.routing --quick                       # about 1 minute (10 s windows)
    .venv/bin/python -m bench.routing --plot docs/img/routing.png   # and the plot

Results and what they mean: ``docs/routing.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from . import harness as h
from .loadgen import LoadSpec, run_load
from .report import Metrics, measure
from .sim import RequestResult, RunResult
from .workload import GROUPS, MIN_SHARE, Scenario, UserSpec, targets

ENGINES = (("fast-a", 1.0), ("fast-b", 1.0), ("slow", 0.5))  # name, speed
TTFT_S, ITL_S = 0.1, 0.02  # at speed 1
MAX_INFLIGHT = 8  # every engine's
PROMPT = 10  # prompt tokens the engines report (the scheduler charges what they report)
POLICIES = ("least_headroom", "round_robin")
STEP_S = 0.5  # service sampled (and windows slid) every STEP_S
# kind and load are the simulation's fields, unused here; the Scenario gives report.measure
# the users, their groups and their targets
SC = Scenario(
    users=(
        UserSpec("p-chat", "platinum", 1.0, "chat", 0.0, 32),
        UserSpec("g-a", "gold", 2.0, "chat", 0.0, 64),
        UserSpec("g-b", "gold", 1.0, "chat", 0.0, 64),
        UserSpec("g-c", "gold", 1.0, "long", 0.0, 128),
        UserSpec("b-batch", "bronze", 1.0, "long", 0.0, 128),
    )
)
CLIENTS = {"p-chat": 2, "g-a": 16, "g-b": 12, "g-c": 12, "b-batch": 8}
GOLD = [u for u in SC.users if u.group == "gold"]


def config(urls: dict[str, str], policy: str) -> dict:
    """One pool of the engines ``urls`` (name -> URL), routed by ``policy``."""
    groups = []
    for g in GROUPS:
        groups.append({"name": g, "users": [{"id": u.user, "weight": u.weight, "api_key": f"sk-{u.user}"} for u in SC.users if u.group == g]})
        if g in MIN_SHARE:
            groups[-1]["min_share"] = MIN_SHARE[g]
    engines = [{"name": n, "url": u, "max_inflight": MAX_INFLIGHT} for n, u in urls.items()]
    return {
        "upstream": {"kind": "openai", "load_signal": {"enabled": False}},
        "admission": {"max_inflight": MAX_INFLIGHT, "max_queue": 1000, "queue_timeout_s": 30},
        "default_group": GROUPS[-1],
        "groups": groups,
        "pools": [{"name": "chat", "models": ["fake-model"], "engines": engines, "routing": {"policy": policy}}],
    }


def run_policy(policy: str, urls: dict[str, str], workdir: Path, duration_s: float) -> tuple[list, float]:
    """A fresh proxy routing by ``policy``, the load for ``duration_s``; returns the
    requests' records (:class:`bench.loadgen.LoadResult`) and the start time."""
    cfg = workdir / f"{policy}.yaml"
    cfg.write_text(yaml.safe_dump(config(urls, policy)))
    port = h.free_port()
    proxy = h.start_proxy(cfg, port, None, workdir)
    try:
        specs = [
            LoadSpec(
                f"http://127.0.0.1:{port}", concurrency=CLIENTS[u.user], duration_s=duration_s,
                requests=4 * CLIENTS[u.user] * math.ceil(duration_s),  # a bound never reached: a request takes >= 0.7 s
                stream=True, max_tokens=u.max_tokens, keys=[(f"sk-{u.user}", 1.0)], fake={"prompt": PROMPT},
                timeout_s=60.0, seed=i, record=True,
            )
            for i, u in enumerate(SC.users)
        ]  # fmt: skip

        async def load() -> list:
            return await asyncio.wait_for(asyncio.gather(*(run_load(s) for s in specs)), duration_s + 90.0)

        t0 = time.perf_counter()
        results = h.run_loop(load())
    finally:
        h.stop(proxy)
    return [rec for r in results for rec in r.records], t0


@dataclass
class Result:
    policy: str
    run: RunResult  # service per user over time, requests (bench.sim's form)
    m: Metrics  # shares, worst window errors, TTFT per group (bench.report)
    req_s: float
    tok_s: float
    engine_share: dict[str, float]


def analyse(policy: str, records: list, t0: float, warmup_s: float, duration_s: float, window_s: float) -> Result:
    """The figures of one run, from the clients' records."""
    groups = {u.user: u.group for u in SC.users}
    times = np.arange(0.0, duration_s + 1e-9, STEP_S)
    service = {u: np.zeros_like(times) for u in groups}
    requests: list[RequestResult] = []
    done: list[tuple[int, str]] = []  # (output tokens, engine) of the requests ended in the steady state
    for key, status, sent, ttft, ended, tokens, engine in records:
        user = key.removeprefix("sk-")
        r = RequestResult(user, groups[user], sent - t0)
        if status == 200:
            a, b = (ended if ttft is None else sent + ttft) - t0, ended - t0
            r.first_token, r.finished = a, b
            service[user] += (PROMPT + 2 * tokens) * np.clip((times - a) / max(b - a, 1e-6), 0.0, 1.0)
            if warmup_s <= b <= duration_s:
                done.append((tokens, engine))
        else:
            r.refused = str(status)
        requests.append(r)
    run = RunResult(policy, list(groups), groups, list(times), {u: list(v) for u, v in service.items()}, requests)
    span = duration_s - warmup_s
    per_engine = Counter(e for _t, e in done)
    return Result(
        policy, run, measure(run, SC, warmup_s, window_s), len(done) / span, sum(t for t, _e in done) / span,
        {name: per_engine[name] / max(1, len(done)) for name, _s in ENGINES},
    )  # fmt: skip


def table(results: list[Result], window_s: float) -> str:
    """The markdown table, one column per policy."""
    tgt = targets(SC)
    speed = sum(s for _n, s in ENGINES)
    pp = lambda x: f"{100 * x:.1f}"  # noqa: E731
    rows: list[tuple[str, str, list[str]]] = [
        ("throughput, requests/s", "", [f"{r.req_s:.1f}" for r in results]),
        ("throughput, output tokens/s", "", [f"{r.tok_s:.0f}" for r in results]),
    ]
    for g in GROUPS:
        rows.append((f"TTFT p50 / p99, {g}, s", "", [f"{r.m.ttft[g][0]:.2f} / {r.m.ttft[g][1]:.2f}" for r in results]))
    for u in GOLD:
        rows.append((f"{u.user} (w={u.weight:g}) share of gold's tokens", f"{pp(tgt[u.user])}%", [f"{pp(r.m.user_share[u.user])}%" for r in results]))
    rows.append((f"gold: worst {window_s:g} s window error, pp", "<= 3.0", [pp(max(r.m.worst_window_err.values())) for r in results]))
    for g, share in MIN_SHARE.items():
        rows.append((f"{g} share of all tokens (worst {window_s:g} s window)", f">= {100 * share:.0f}%", [f"{pp(r.m.group_share[g])}% ({pp(r.m.min_window_group_share[g])}%)" for r in results]))
    for name, s in ENGINES:
        rows.append((f"requests on {name} ({s:g}x speed)", f"{100 * s / speed:.0f}% (speed share)", [f"{pp(r.engine_share[name])}%" for r in results]))
    rows.append(("refused requests (after the warm-up)", "0", [str(sum(r.m.refused.values())) for r in results]))
    return h.markdown_table(["", "reference", *(f"`{r.policy}`" for r in results)], [[name, ref, *vals] for name, ref, vals in rows])


def plot(results: list[Result], warmup_s: float, window_s: float, path: Path) -> None:
    """Per-engine share of the requests, TTFT p99 per group, and each gold user's share of
    gold's tokens per window, one colour per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    colors = ("tab:blue", "tab:orange")
    width = 0.8 / len(results)
    speed = sum(s for _n, s in ENGINES)
    x = np.arange(len(ENGINES))
    for i, r in enumerate(results):
        axes[0].bar(x + (i - 0.5) * width, [100 * r.engine_share[n] for n, _s in ENGINES], width, color=colors[i], label=r.policy)
    axes[0].scatter(x, [100 * s / speed for _n, s in ENGINES], marker="_", s=900, color="black", zorder=3, label="speed share")
    axes[0].set_xticks(x, [f"{n} ({s:g}x)" for n, s in ENGINES])
    axes[0].set_ylabel("% of requests")
    axes[0].set_title("requests per engine")
    x = np.arange(len(GROUPS))
    for i, r in enumerate(results):
        bars = axes[1].bar(x + (i - 0.5) * width, [r.m.ttft[g][1] for g in GROUPS], width, color=colors[i], label=r.policy)
        axes[1].bar_label(bars, fmt="%.2f", fontsize=8)
    axes[1].set_xticks(x, GROUPS)
    axes[1].set_ylabel("seconds")
    axes[1].set_title("TTFT p99 per group")
    tgt = targets(SC)
    for i, r in enumerate(results):
        t = np.asarray(r.run.times)
        starts = np.arange(warmup_s, t[-1] - window_s + 1e-9, STEP_S)
        inc = {u.user: np.interp(starts + window_s, t, r.run.service[u.user]) - np.interp(starts, t, r.run.service[u.user]) for u in GOLD}
        gsum = sum(inc.values())
        for u, ls in zip(GOLD, ("-", "--", ":")):
            axes[2].plot(starts + window_s, 100 * (inc[u.user] / gsum - tgt[u.user]), color=colors[i], ls=ls, label=f"{u.user} (w={u.weight:g}), {r.policy}")
    axes[2].axhspan(-3, 3, color="green", alpha=0.1, label="±3 pp")
    lo, hi = axes[2].get_ylim()
    axes[2].set_ylim(min(lo, -4), max(hi, 4))
    axes[2].set_xlabel("end of the window, s")
    axes[2].set_ylabel("share of gold's tokens - weight share, pp")
    axes[2].set_title(f"gold users' share error per {window_s:g} s window")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Three engines (1x, 1x, 0.5x speed, {MAX_INFLIGHT} slots each) behind one proxy, overloaded: least_headroom against round_robin", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="24 s per policy, 10 s windows (about 1 minute in all)")
    ap.add_argument("--plot", default=None, help="write a PNG comparing the two policies here")
    a = ap.parse_args(argv)
    duration, warmup, window = (24.0, 4.0, 10.0) if a.quick else (110.0, 10.0, 30.0)
    t_start = time.monotonic()
    h.raise_nofile()
    slots = MAX_INFLIGHT * len(ENGINES)
    print(
        f"Engines {', '.join(f'{n} ({s:g}x: TTFT {TTFT_S / s:g} s, {ITL_S / s:g} s/token)' for n, s in ENGINES)}, "
        f"max_inflight {MAX_INFLIGHT} each ({slots} slots); {sum(CLIENTS.values())} closed-loop clients; "
        f"{duration:g} s per policy, the first {warmup:g} s not measured."
    )
    with tempfile.TemporaryDirectory(prefix="llm-qos-routing-") as d:
        wd = Path(d)
        engines = []
        try:
            urls = {}
            for name, speed in ENGINES:
                port = h.free_port()
                engines.append(h.start_fake_upstream(port, wd, TTFT_S / speed, ITL_S / speed, name=name))
                urls[name] = f"http://127.0.0.1:{port}"
            results = [analyse(p, *run_policy(p, urls, wd, duration), warmup, duration, window) for p in POLICIES]
        finally:
            for e in engines:
                h.stop(e)
    print()
    print(table(results, window))
    if a.plot:
        plot(results, warmup, window, Path(a.plot))
        print(f"\nplot: {a.plot}")
    print(f"total {time.monotonic() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
