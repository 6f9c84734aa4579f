"""Fairness benchmark: the same 3x-overload workload under our scheduler, plain FCFS and
request-count ratio sharing (the LMDeploy-QoS way), side by side:

(a) a discrete-event simulation of the real :class:`qos.Scheduler` (injected clock)
    against a modelled continuous-batching engine (:mod:`bench.sim`);
(b) a live run of the real proxy in front of :mod:`bench.rate_upstream`, a fake upstream
    whose aggregate token rate is fixed and shared among its streams (:mod:`bench.live`);
(c) a micro-benchmark of the scheduler: enqueue and dequeue with 10 000 requests queued.

It prints, per policy: each user's share of weighted tokens against its target, the worst
window share error, the ``min_share`` group's share, p50/p99 queue wait and time to first
token per group; checks the targets; and saves a plot of cumulative weighted tokens per
user over time (``docs/img/fairness.png``).

    .venv/bin/python -m bench.fairness            # about 2 minutes
    .venv/bin/python -m bench.fairness --quick    # about 30 seconds, shorter runs (plot in /tmp)
    .venv/bin/python -m bench.fairness --adversarial   # gamers vs honest users, live (bench/adversarial.py)

The workload and engine model are described in :mod:`bench.workload`; the results and
what they mean in ``docs/scheduling.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import statistics
import sys
import tempfile
import time
from collections import deque
from dataclasses import replace
from pathlib import Path

from qos import GroupPolicy, Scheduler, SchedulerPolicy, UserPolicy

from . import harness as h
from .policies import LABELS, POLICIES
from .report import Metrics, measure, pct, table
from .sim import RunResult, simulate
from .workload import MIN_SHARE, Scenario, targets

PLOT = h.REPO_ROOT / "docs" / "img" / "fairness.png"
ADVERSARIAL_PLOT = h.REPO_ROOT / "docs" / "img" / "fairness_adversarial.png"
QUICK_PLOT = Path(tempfile.gettempdir()) / "llm-qos-fairness-quick.png"  # not the documented one
MAX_WINDOW_ERR = 0.03
MICRO_LIMIT_US = 20.0


# ------------------------------------------------------------------ micro-benchmark


def micro(queued: int = 10_000, ops: int = 20_000, users: int = 1_000) -> dict[str, tuple[float, float]]:
    """Mean and p99 microseconds of one enqueue (a ``submit`` that queues) and of one
    dequeue (a ``release`` that dispatches the next queued request) with ``queued``
    requests waiting from ``users`` users in 3 classes (one with ``min_share``)."""
    groups = (GroupPolicy("platinum"), GroupPolicy("gold"), GroupPolicy("bronze", min_share=0.2))
    upol = {f"u{i}": UserPolicy(f"u{i}", groups[i % 3].name, 1.0 + i % 4) for i in range(users)}
    policy = SchedulerPolicy(groups=groups, default_group="bronze", users=upol, max_inflight=32, max_queue=queued * 2, queue_timeout_s=3600)
    inflight: deque = deque()
    s = Scheduler(policy, on_admit=inflight.append)
    n = 0

    def submit() -> None:
        nonlocal n
        n += 1
        s.submit(f"u{(n * 7919) % users}", None, 50 + n % 500, 20 + (n * 31) % 1000)

    while s.queued < queued:  # bounded: the loop adds one request per turn
        submit()
    enq: list[float] = []
    deq: list[float] = []
    clock = time.perf_counter
    gc.collect()
    gc.disable()
    try:
        for i in range(ops):
            t0 = clock()
            submit()
            t1 = clock()
            t = inflight.popleft()
            t2 = clock()
            s.release(t, output_tokens=t.max_output_tokens // 2)
            t3 = clock()
            enq.append(t1 - t0)
            deq.append(t3 - t2)
    finally:
        gc.enable()
    assert s.queued == queued
    return {"enqueue": (1e6 * statistics.fmean(enq), 1e6 * pct(enq, 0.99)), "dequeue": (1e6 * statistics.fmean(deq), 1e6 * pct(deq, 0.99))}


# ------------------------------------------------------------------------ plot


def plot(sim_runs: list[RunResult], live_runs: list[RunResult], sc: Scenario, speedup: float, live_warmup: float, path: Path) -> None:
    """Cumulative weighted tokens per user over the measured period (after the warm-up):
    one column per policy, the simulation on top and the live run below; dotted lines are
    the targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [("simulation", sim_runs, 1.0, sc.warmup_s)] + ([("live proxy", live_runs, speedup, live_warmup)] if live_runs else [])
    fig, axes = plt.subplots(len(rows), len(POLICIES), figsize=(15, 4.2 * len(rows)), squeeze=False, sharey="row")
    colors = {"p-chat": "tab:purple", "g-long": "tab:blue", "g-chat": "tab:orange", "g-mixed": "tab:green", "b-batch": "tab:brown"}
    tgt = targets(sc)
    for r, (title, runs, k, warm) in enumerate(rows):
        for c, run in enumerate(runs):
            ax = axes[r][c]
            i0 = next((i for i, x in enumerate(run.times) if x >= warm), 0)
            t = run.times[i0:]
            svc = {u: [v - run.service[u][i0] for v in run.service[u][i0:]] for u in run.users}
            for u in run.users:
                spec = next(x for x in sc.users if x.user == u)
                ax.plot(t, [v / 1e6 for v in svc[u]], color=colors.get(u), lw=1.8, label=f"{u} ({spec.group}, w={spec.weight:g})")
            gold = [u for u in run.users if run.groups[u] == "gold"]
            gsum = [sum(svc[u][i] for u in gold) for i in range(len(t))]
            for u in gold:
                ax.plot(t, [tgt[u] * g / 1e6 for g in gsum], color=colors.get(u), lw=0.9, ls=":")
            for g, share in MIN_SHARE.items():
                tot = [sum(svc[u][i] for u in run.users) for i in range(len(t))]
                ax.plot(t, [share * v / 1e6 for v in tot], color="black", lw=0.9, ls=":", label=f"{g} min_share ({share:.0%} of all)" if c == 0 else None)
            unit = "s" if k == 1.0 else f"s, engine {k:g}x faster"
            ax.set_title(f"{title}: {LABELS[run.policy]}")
            ax.set_xlabel(f"time ({unit})")
            if c == 0:
                ax.set_ylabel(f"weighted tokens since t={warm:g} s (millions)")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="upper left")
    fig.suptitle(
        "Cumulative weighted tokens per user at 3x overload, after the warm-up "
        "(dotted: each gold user's weight share of gold's tokens, and 20% of all tokens)",
        fontsize=11,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---------------------------------------------------------------------- checks


def check(label: str, ms: Metrics, window_label: str, window_ok: bool = True) -> list[tuple[str, bool | None, str]]:
    """The targets, for our scheduler's metrics ``ms`` (``None``: not a test of the target,
    as when a quick run's window is shorter than the target's)."""
    out: list[tuple[str, bool | None, str]] = []
    err = max(ms.worst_window_err.values(), default=math.nan)
    ok = err <= MAX_WINDOW_ERR
    out.append((f"{label}: gold users' share within 3 pp of target over any {window_label} window", ok if ok or window_ok else None, f"worst {100 * err:.1f} pp"))
    p99 = ms.wait["platinum"][1]
    out.append((f"{label}: platinum p99 queue wait <= one slot turnover", p99 <= ms.turnover, f"{p99:.3f} s vs {ms.turnover:.3f} s"))
    for g, share in MIN_SHARE.items():
        got = ms.group_share.get(g, math.nan)
        out.append((f"{label}: {g} gets at least its min_share {share:.0%}", got >= share, f"{100 * got:.1f}% (worst {window_label} window {100 * ms.min_window_group_share.get(g, math.nan):.1f}%)"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Fairness benchmark: our scheduler vs FCFS vs request-count sharing, simulated and live.")
    ap.add_argument("--quick", action="store_true", help="shorter runs (about 30 s in all)")
    ap.add_argument("--no-live", action="store_true", help="skip the live run")
    ap.add_argument("--plot", default=None, help=f"where to save the plot (PNG; default {PLOT.relative_to(h.REPO_ROOT)}, with --quick {QUICK_PLOT})")
    ap.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    ap.add_argument("--adversarial", action="store_true", help="run the adversarial scenario instead (bench/adversarial.py): one gamer per attack, live through the proxy process")
    ap.add_argument("--duration", type=float, default=110.0, help="--adversarial: seconds per run (default 110)")
    ap.add_argument("--churn", type=int, default=100_000, help="--adversarial: distinct identities (default 100 000)")
    ap.add_argument("--old-ref", default=None, help="--adversarial: git ref of the old accounting to compare (default: the commit before issue 10)")
    ap.add_argument("--no-old", action="store_true", help="--adversarial: skip the old accounting")
    ap.add_argument("--max-inflight", type=int, default=48, help="--adversarial: admission.max_inflight (default 48)")
    a = ap.parse_args(argv)
    t_start = time.monotonic()
    if a.adversarial:
        return adversarial(a, t_start)

    sc = Scenario(duration_s=400.0 if a.quick else 1200.0)
    speedup = 4.0 if a.quick else 2.0
    live_s = 8.0 if a.quick else 28.0
    live_warmup = 2.0 if a.quick else 8.0
    live_window = min(sc.fairness_window_s / speedup, (live_s - live_warmup) / 2)

    print(__doc__.split("\n\n")[0].replace("\n", " "))
    print(
        f"\nWorkload: 5 users in 3 groups at 3x overload (bench/workload.py); engine {sc.engine.rate:g} tok/s shared, "
        f"max_inflight {sc.max_inflight}, queue timeout {sc.queue_timeout_s:g} s. Shares are of weighted tokens "
        "(prompt x1 + output x2) as the engine produced them; gold users' targets are their weight shares of gold."
    )

    # (a) simulation
    sim_runs = [simulate(sc, p) for p in POLICIES]
    sim_ms = [measure(r, sc, sc.warmup_s, sc.fairness_window_s) for r in sim_runs]
    print()
    print(
        table(
            f"(a) simulation: {sc.duration_s:g} s simulated, first {sc.warmup_s:g} s not measured "
            f"({sum(r.wall_s for r in sim_runs):.1f} s of CPU)",
            sc, [LABELS[p] for p in POLICIES], sim_ms, f"{sc.fairness_window_s:g} s",
        )
    )  # fmt: skip

    # (b) live
    live_runs: list[RunResult] = []
    live_ms: list[Metrics] = []
    if not a.no_live:
        from .live import run_live

        gc.collect()
        gc.freeze()  # the simulation's objects are not the proxy's: keep them out of its GC
        live_sc = replace(sc, duration_s=live_s * speedup)
        live_runs = h.run_loop(run_live(live_sc, POLICIES, speedup, live_s))
        gc.unfreeze()
        live_ms = [measure(r, sc, live_warmup, live_window) for r in live_runs]
        live_label = f"{live_window:g} s (= {live_window * speedup:g} s at the model's speed)"
        print()
        print(
            table(
                f"(b) live proxy + rate upstream: engine {speedup:g}x faster ({sc.engine.rate * speedup:g} tok/s), all times / {speedup:g}; "
                f"{live_s:g} s per policy, first {live_warmup:g} s not measured",
                sc, [LABELS[p] for p in POLICIES], live_ms, f"{live_window:g} s",
            )
        )  # fmt: skip

    # (c) micro-benchmark
    mb = micro()
    print(
        f"\n(c) micro-benchmark, 10 000 requests queued (1 000 users, 3 classes): "
        f"enqueue {mb['enqueue'][0]:.1f} us mean ({mb['enqueue'][1]:.1f} us p99), "
        f"dequeue {mb['dequeue'][0]:.1f} us mean ({mb['dequeue'][1]:.1f} us p99)"
    )

    checks = check("simulation", sim_ms[0], f"{sc.fairness_window_s:g} s")
    if live_ms:
        checks += check("live", live_ms[0], live_label, window_ok=live_window * speedup >= sc.fairness_window_s - 1e-9)
    worst_us = max(mb["enqueue"][0], mb["dequeue"][0])
    checks.append(("enqueue and dequeue at 10 000 queued <= 20 us each (mean)", worst_us <= MICRO_LIMIT_US, f"{worst_us:.1f} us"))
    print("\nTargets (our scheduler):")
    for name, ok, detail in checks:
        mark = "info" if ok is None else "met " if ok else "MISS"
        print(f"  [{mark}] {name}: {detail}" + (" (quick run: window shorter than the target's)" if ok is None else ""))

    path = Path(a.plot) if a.plot else QUICK_PLOT if a.quick else PLOT
    plot(sim_runs, live_runs, sc, speedup, live_warmup, path)
    print(f"\nplot: {path}\ntotal {time.monotonic() - t_start:.0f} s")
    return 1 if a.check and any(ok is False for _n, ok, _d in checks) else 0


def adversarial(a: argparse.Namespace, t_start: float) -> int:
    """``--adversarial``: the scenario of :mod:`bench.adversarial`, printed as a table."""
    from .adversarial import OLD_REF, main_async

    print((__import__("bench.adversarial", fromlist=["x"]).__doc__ or "").split("\n\n")[0].replace("\n", " "))
    warmup = min(15.0, a.duration / 4)
    window = 30.0 if a.duration - warmup >= 30.0 else (a.duration - warmup) / 2
    path = Path(a.plot) if a.plot else ADVERSARIAL_PLOT
    report, ok = asyncio.run(
        main_async(a.duration, warmup, window, a.churn, None if a.no_old else (a.old_ref or OLD_REF), path, rate=6000.0, max_inflight=a.max_inflight)
    )
    print(f"\n{a.duration:g} s per run, first {warmup:g} s not measured, windows of {window:g} s sliding by 1 s\n")
    print(report)
    print(f"\ntargets (new accounting): {'met' if ok else 'MISSED'}\nplot: {path}\ntotal {time.monotonic() - t_start:.0f} s")
    return 1 if a.check and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
