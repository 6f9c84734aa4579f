"""Metrics of a :class:`bench.sim.RunResult`: shares against targets, worst window error,
latency percentiles, slot turnover; and the side-by-side table."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from . import harness as h
from .sim import RunResult
from .workload import MIN_SHARE, Scenario, targets


def pct(xs: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``xs`` (nearest rank), NaN when empty."""
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


@dataclass
class Metrics:
    """What the table shows for one run (times in the run's own seconds)."""

    group_share: dict[str, float] = field(default_factory=dict)  # group -> share of all
    user_share: dict[str, float] = field(default_factory=dict)  # user -> share of its group
    worst_window_err: dict[str, float] = field(default_factory=dict)  # user -> max |share - target|
    min_window_group_share: dict[str, float] = field(default_factory=dict)  # min_share groups
    wait: dict[str, tuple[float, float]] = field(default_factory=dict)  # group -> p50, p99
    ttft: dict[str, tuple[float, float]] = field(default_factory=dict)
    served: dict[str, int] = field(default_factory=dict)  # group -> requests admitted
    refused: dict[str, int] = field(default_factory=dict)
    turnover: float = math.nan  # mean seconds a request holds a slot
    windows: int = 0


def measure(run: RunResult, sc: Scenario, warmup: float, window: float) -> Metrics:
    """Metrics of ``run`` over its steady state (after ``warmup``), with share windows of
    ``window`` seconds sliding by the sample step. Times are in the run's own seconds."""
    m = Metrics()
    t = np.asarray(run.times)
    tgt = targets(sc)
    groups = sorted(set(run.groups.values()), key=lambda g: [u.group for u in sc.users].index(g))
    if len(t) >= 2:
        end = t[-1]
        cum = {u: np.asarray(run.service[u]) for u in run.users}
        at = lambda u, x: np.interp(x, t, cum[u])  # noqa: E731
        tot = {u: at(u, end) - at(u, warmup) for u in run.users}
        all_ = sum(tot.values()) or 1.0
        for g in groups:
            members = [u for u in run.users if run.groups[u] == g]
            gsum = sum(tot[u] for u in members) or 1.0
            m.group_share[g] = sum(tot[u] for u in members) / all_
            for u in members:
                m.user_share[u] = tot[u] / gsum
        step = float(np.median(np.diff(t)))
        starts = np.arange(warmup, end - window + 1e-9, step)
        m.windows = len(starts)
        if len(starts):
            inc = {u: at(u, starts + window) - at(u, starts) for u in run.users}
            total = sum(inc.values())
            for g in groups:
                members = [u for u in run.users if run.groups[u] == g]
                gsum = sum(inc[u] for u in members)
                if len(members) > 1:
                    with np.errstate(invalid="ignore", divide="ignore"):
                        for u in members:
                            share = np.where(gsum > 0, inc[u] / np.where(gsum > 0, gsum, 1), tgt[u])
                            m.worst_window_err[u] = float(np.max(np.abs(share - tgt[u])))
                if MIN_SHARE.get(g):
                    with np.errstate(invalid="ignore", divide="ignore"):
                        share = np.where(total > 0, gsum / np.where(total > 0, total, 1), 0.0)
                    m.min_window_group_share[g] = float(np.min(share))
    for g in groups:
        rs = [r for r in run.requests if r.group == g and r.arrival >= warmup]
        waits = [r.admitted - r.arrival for r in rs if r.admitted is not None]
        ttfts = [r.first_token - r.arrival for r in rs if r.first_token is not None]
        m.wait[g] = (pct(waits, 0.5), pct(waits, 0.99))
        m.ttft[g] = (pct(ttfts, 0.5), pct(ttfts, 0.99))
        m.served[g] = len(waits)
        m.refused[g] = sum(1 for r in rs if r.refused is not None)
    hold = [r.finished - r.admitted for r in run.requests if r.finished is not None and r.admitted is not None and r.admitted >= warmup]
    m.turnover = float(np.mean(hold)) if hold else math.nan
    return m


def _f(x: float, spec: str) -> str:
    return h.fmt(x, spec, "-")


def table(title: str, sc: Scenario, labels: list[str], ms: list[Metrics], window_label: str, time_unit: str = "s") -> str:
    """The side-by-side table of several runs of the same workload."""
    tgt = targets(sc)
    rows: list[tuple[str, str, list[str]]] = []
    for u in sc.users:
        if sum(1 for v in sc.users if v.group == u.group) > 1:
            rows.append((f"share of {u.group}: {u.user} (w={u.weight:g})", f"{100 * tgt[u.user]:.1f}%", [_f(100 * m.user_share.get(u.user, math.nan), ".1f") + "%" for m in ms]))
    gold_users = [u.user for u in sc.users if sum(1 for v in sc.users if v.group == u.group) > 1]
    rows.append((f"worst {window_label} window error, pp", "<= 3.0", [_f(100 * max((m.worst_window_err.get(u, math.nan) for u in gold_users), default=math.nan), ".1f") for m in ms]))
    for g, share in MIN_SHARE.items():
        rows.append((f"{g} share of all (min_share)", f">= {100 * share:.0f}%", [_f(100 * m.group_share.get(g, math.nan), ".1f") + "%" for m in ms]))
        rows.append((f"{g} worst {window_label} window share", f">= {100 * share:.0f}%", [_f(100 * m.min_window_group_share.get(g, math.nan), ".1f") + "%" for m in ms]))
    groups = list(dict.fromkeys(u.group for u in sc.users))
    for g in groups:
        tgt_w = f"<= {_f(ms[0].turnover, '.2f')}" if g == groups[0] else ""
        rows.append((f"queue wait p50/p99 {g}, {time_unit}", tgt_w, [f"{_f(m.wait[g][0], '.2f')}/{_f(m.wait[g][1], '.2f')}" for m in ms]))
    for g in groups:
        rows.append((f"TTFT p50/p99 {g}, {time_unit}", "", [f"{_f(m.ttft[g][0], '.2f')}/{_f(m.ttft[g][1], '.2f')}" for m in ms]))
    rows.append((f"slot turnover (mean hold), {time_unit}", "", [_f(m.turnover, ".2f") for m in ms]))
    rows.append(("served / refused requests", "", [f"{sum(m.served.values())}/{sum(m.refused.values())}" for m in ms]))
    return h.target_table(labels, rows, title)
