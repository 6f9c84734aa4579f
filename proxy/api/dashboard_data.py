"""The live dashboard's data (``GET /admin/dashboard.json``), and the sampler that keeps its
history. The page that shows it and the routes are :mod:`proxy.api.dashboard`.

The data is read from the same places as ``/admin/status`` and ``/metrics``: the
scheduler's snapshot (queues, requests in flight: the same figures ``/admin/status``
shows, read when the data is asked for), the Prometheus counters (tokens, refusals,
queue waits: rates over the last :data:`WINDOW_S` seconds), the engines' status (load,
routed and failed requests, the latency the proxy measures there: ``ttft_s``, ``tpot_s``)
and the reload counters.

**History is sampled continuously**, from start-up, whether or not a page is open: a
timer takes a sample every :data:`SAMPLE_INTERVAL_S` seconds (the counters' cumulative
values, for the rates; and one chart point: queued and in-flight requests, tokens per
second per group, each engine's in flight, TTFT and TPOT, each latency objective's
attainment), in two bounded ring buffers:
the samples of the last :data:`WINDOW_S` seconds, and the last :data:`HISTORY_POINTS`
chart points (five minutes). A sample costs one read of the counters and of the engines'
status (no per-user work: about 1 ms with two groups and one engine, measured; most of
it prometheus-client's ``collect()`` of the refusal counters and the queue-wait
histograms, so it grows with groups x reasons and groups x buckets), so a tab opened on a proxy that has been
up for minutes shows full rates and five minutes of charts at once. The page asks for
the points it already has to be left out (``?since=SEQ&history=ID``).

Shape (``version`` 2; times in seconds, shares as fractions 0..1, ``null`` when unknown)::

    {"version", "generated_at" (Unix), "window_s", "covered_s" (history behind the rates:
     the window, or the proxy's age when younger), "config_hash",
     "reload": {"result" ("ok", "error", or "start-up": none yet), "error" (the last
                reload's error while it stands, else null), "loaded_at" (Unix, when the
                active config became active), "ok", "errors" (reloads by result since start)},
     "inflight", "capacity", "queued", "inflight_tokens",
     "cost": {"input_weight", "output_weight"},
     "groups": [{"name", "priority" (0 = highest), "min_share", "queued", "inflight",
                 "oldest_wait_s", "queue_wait_s": {"mean", "p50", "p95", "count"},
                 "tokens_per_s", "service_per_s", "service_share", "refusals"}],
     "users": {"source", "total", "top": [{"id", "group", "weight", "weight_share",
               "service_share", "service_per_s", "queued"}]},
     "engines": [{"id" ("POOL/NAME"), "name", "url", "kind", "inflight", "capacity", "max_inflight",
                  "inflight_tokens", "load", "waiting", "saturated", "load_signal",
                  "ttft_s", "tpot_s" (null until measured), "routed", "failed" (since start),
                  "routed_per_s", "failed_per_s" (over the window), ...}],
     "refusals": {"total", "per_s", "by_reason": {reason: n}, "by_group": {group: {reason: n}}},
     "objectives": {group: {"ttft" | "tpot": {"target_s", "percentile", "met", "overall",
                    "engines"}}} (the groups' latency objectives over their window, as
                    ``/admin/status``: :func:`proxy.telemetry.objectives.objectives_status`),
     "history": {"id" (this process's sampler), "interval_s", "max_points", "full" (every
                 point kept, else only those after ``since``), "points": [{"seq", "t" (Unix),
                 "queued", "inflight", "tokens_per_s": {group: x}, "refusals_per_s",
                 "engines": {id: {"inflight", "ttft_s", "tpot_s"}},
                 "objectives": {group: {"ttft" | "tpot": attainment over all its engines}}}]}}

"Service" is what the scheduler shares out: tokens weighted as it counts them
(``prompt * cost.input_weight + completion * cost.output_weight``). A group's
``service_share`` is its part of all service in the window, to compare with its
``min_share`` (the floor it is guaranteed while it waits); a user's is its part of its
group's service, to compare with its ``weight_share`` (its weight over the weights of its
group's users active in the window), which is what weighted fair sharing promises users
that stay backlogged.

``engines`` lists every engine of every pool (with ``pool``, ``state``, ``routed``, ``ejections``
... as :meth:`proxy.routing.engine_state.EngineState.status`); the single ``upstream`` is named ``upstream``.
``users`` comes from the scheduler's own tally of each user's recent service (decayed
with time constant ``admission.share_window_s``; :meth:`qos.Scheduler.snapshot`): its top
users, and per group the service of all users and the weight of the active ones.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections import deque
from typing import Callable

from ..runtime.load_signal import LoadSignal
from ..runtime.state import ProxyState
from ..telemetry.metrics import RELOAD_ERROR, RELOAD_OK, oldest_waits
from ..telemetry.objectives import objectives_status
from .dashboard_samples import (
    CumulativeHistogram,
    Sample,
    bucket_quantile,
    counter_values,
    difference,
    group_histograms,
    histogram_difference,
    share,
)

log = logging.getLogger("llm_qos.proxy")

WINDOW_S = 30.0  # the window of every rate and share
SAMPLE_INTERVAL_S = 1.0  # the sampler's period
HISTORY_POINTS = 300  # chart points kept: five minutes at one a second
POINT_RATE_S = 5.0  # a chart point's rates are over this many seconds (smoother than one)
TOP_USERS = 10

ENGINE_FIELDS = ("id", "failed", "routed_per_s", "failed_per_s")  # what the dashboard adds to an engine's status row


def engine_id(row: dict) -> str:
    """An engine's id on the dashboard: ``POOL/NAME`` (names are unique per pool)."""
    return f"{row.get('pool')}/{row['name']}"


class Dashboard:
    """Builds the dashboard's data for one proxy process, and samples its history.

    Args:
        state: the proxy state.
        load_signal: the engine load poller (for the engine's load and saturation).
        clock: the scheduler's clock (monotonic seconds).
        window_s: the window of rates and shares (seconds; default :data:`WINDOW_S`).
        interval_s: the sampler's period (seconds; default :data:`SAMPLE_INTERVAL_S`).
        history_points: chart points kept (default :data:`HISTORY_POINTS`).

    Memory is bounded: at most ``window_s / interval_s + 2`` cumulative samples (each a
    few numbers per group and reason and per engine) and ``history_points`` chart points.
    """

    def __init__(
        self,
        state: ProxyState,
        load_signal: LoadSignal,
        clock: Callable[[], float] = time.monotonic,
        window_s: float | None = None,
        interval_s: float | None = None,
        history_points: int | None = None,
    ) -> None:
        self._state = state
        self._signal = load_signal
        self._clock = clock
        self.window_s = WINDOW_S if window_s is None else window_s
        self.interval_s = SAMPLE_INTERVAL_S if interval_s is None else interval_s
        self._since = clock()
        self._samples: deque[Sample] = deque()
        self._points: deque[dict] = deque(maxlen=HISTORY_POINTS if history_points is None else history_points)
        self._seq = 0
        self.history_id = secrets.token_hex(4)  # a new page history per process
        self._timer: asyncio.TimerHandle | None = None

    # ----------------------------------------------------------------- sampler

    def start(self) -> None:
        """Take the first sample and sample every ``interval_s`` from now on (inside the
        running loop, at start-up)."""
        if self._timer is None:
            self._tick()

    def stop(self) -> None:
        """Stop sampling (at cleanup)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(loop.time() + self.interval_s, self._tick)  # a fixed period, whatever this one costs
        try:
            self.sample()
        except Exception:  # a broken sample must not stop the sampler
            log.exception("dashboard sample failed")

    def sample(self) -> None:
        """Take one sample now: keep its cumulative figures for the rates (those of the
        last ``window_s`` and one before), and append one chart point."""
        now = self._clock()
        rows = self._engine_rows()
        current = self._cumulative(now, rows)
        samples = self._samples
        samples.append(current)
        # keep exactly one sample at or before the window's start
        while len(samples) >= 2 and samples[1].t <= now - self.window_s:
            samples.popleft()
        base = self._at_or_before(now - POINT_RATE_S)
        dt = now - base.t
        tokens: dict[str, float] = {}
        for (group, _direction), v in current.tokens.items():
            tokens[group] = tokens.get(group, 0.0) + v - base.tokens.get((group, _direction), 0.0)
        refused = sum(current.refusals.values()) - sum(base.refusals.values())
        queued = inflight = 0
        for pool in self._state.admission.all_pools():
            queued += pool.scheduler.queued
            inflight += len(pool.scheduler.inflight)
        self._seq += 1
        self._points.append(
            {
                "seq": self._seq,
                "t": round(time.time(), 3),
                "queued": queued,
                "inflight": inflight,
                "tokens_per_s": {g: (round(v / dt, 3) if dt > 0 else None) for g, v in tokens.items()},
                "refusals_per_s": round(refused / dt, 3) if dt > 0 else None,
                "engines": {engine_id(r): {"inflight": r["inflight"], "ttft_s": r.get("ttft_s"), "tpot_s": r.get("tpot_s")} for r in rows},
                "objectives": {
                    group: {name: rep.overall.attainment for name, rep in objs.items()}
                    for group, objs in self._state.objectives.report(time.monotonic()).items()
                },
            }
        )

    def _at_or_before(self, t: float) -> Sample:
        """The newest kept sample taken at or before ``t``, else the oldest kept."""
        best = self._samples[0]
        for s in self._samples:
            if s.t > t:
                break
            best = s
        return best

    def _engine_rows(self) -> list[dict]:
        """Every engine's status row (:meth:`proxy.routing.engine_state.EngineState.status`)."""
        return [row for r in self._state.admission.routers() for row in r.snapshot()]

    def _cumulative(self, now: float, rows: list[dict]) -> Sample:
        met = self._state.metrics
        return Sample(
            now,
            counter_values(met.tokens.metric, "group", "direction"),
            counter_values(met.rejections.metric, "group", "reason"),
            group_histograms(met.queue_wait.metric),
            {engine_id(r): float(r.get("routed", 0)) for r in rows},
            {engine_id(r): float(sum(r.get("failures", {}).values())) for r in rows},
        )

    def history(self, since: int | None = None, history_id: str | None = None) -> dict:
        """The chart points: all of them, or only those after ``since`` when the caller
        holds this sampler's (``history_id``) points up to ``since``."""
        points = self._points
        first = points[0]["seq"] if points else self._seq + 1
        full = since is None or history_id != self.history_id or since < first - 1 or since > self._seq
        out = list(points) if full else [p for p in points if p["seq"] > since]
        return {"id": self.history_id, "interval_s": self.interval_s, "max_points": points.maxlen, "full": full, "points": out}

    # -------------------------------------------------------------------- data

    def data(self, since: int | None = None, history_id: str | None = None) -> dict:
        """The dashboard's JSON document (shape in the module docstring); ``since`` and
        ``history_id``: see :meth:`history`."""
        state = self._state
        sched = state.admission.scheduler
        snap = state.admission.snapshot()
        now = self._clock()
        rows = self._engine_rows()
        current = self._cumulative(now, rows)
        if not self._samples:  # before start(): this is the first sample
            self._samples.append(current)
        base = self._samples[0] if self._samples[0] is not current else None
        covered = current.t - base.t if base is not None else 0.0
        cost = sched.policy.cost
        tokens = difference(current.tokens, base.tokens if base is not None else None)
        refusals = difference(current.refusals, base.refusals if base is not None else None)

        def rate(x: float) -> float | None:
            return x / covered if covered > 0 else None

        names = [g["name"] for g in snap["groups"]]
        served = {n: tokens.get((n, "prompt"), 0.0) * cost.input_weight + tokens.get((n, "completion"), 0.0) * cost.output_weight for n in names}
        total_served = sum(served.values())
        by_reason: dict[str, float] = {}
        by_group: dict[str, dict[str, float]] = {}
        for (group, reason), n in refusals.items():
            if n > 0:
                by_reason[reason] = by_reason.get(reason, 0.0) + n
                by_group.setdefault(group, {})[reason] = n
        oldest: dict[str, float] = {}
        for pool in state.admission.all_pools():
            for name, age in oldest_waits(pool.scheduler, now).items():
                oldest[name] = max(oldest.get(name, 0.0), age)
        min_shares = {g.name: g.min_share for g in sched.policy.groups}
        groups = []
        for i, g in enumerate(snap["groups"]):
            name = g["name"]
            wait = histogram_difference(current.waits.get(name, CumulativeHistogram()), base.waits.get(name, CumulativeHistogram()) if base is not None else None)
            groups.append(
                {
                    "name": name,
                    "priority": i,
                    "min_share": min_shares.get(name, 0.0),
                    "queued": g["queued"],
                    "inflight": g["inflight"],
                    "oldest_wait_s": round(oldest.get(name, 0.0), 3),
                    "queue_wait_s": {
                        "mean": wait.total / wait.count if wait.count > 0 else None,
                        "p50": bucket_quantile(0.5, wait.buckets),
                        "p95": bucket_quantile(0.95, wait.buckets),
                        "count": wait.count,
                    },
                    "tokens_per_s": rate(tokens.get((name, "prompt"), 0.0) + tokens.get((name, "completion"), 0.0)),
                    "service_per_s": rate(served[name]),
                    "service_share": share(served[name], total_served),
                    "refusals": sum(by_group.get(name, {}).values()),
                }
            )
        total_refusals = sum(by_reason.values())
        return {
            "version": 2,
            "generated_at": time.time(),
            "window_s": self.window_s,
            "covered_s": round(covered, 3),
            "config_hash": state.active.digest,
            "reload": self.reload(),
            "inflight": snap["inflight"],
            "capacity": snap["capacity"],
            "queued": snap["queued"],
            "inflight_tokens": snap["inflight_tokens"],
            "cost": {"input_weight": cost.input_weight, "output_weight": cost.output_weight},
            "groups": groups,
            "users": self.users(snap, now),
            "engines": self.engines(rows, current, base),
            "refusals": {"total": total_refusals, "per_s": rate(total_refusals), "by_reason": by_reason, "by_group": by_group},
            "objectives": objectives_status(state.objectives.report(time.monotonic())),
            "history": self.history(since, history_id),
        }

    def reload(self) -> dict:
        """The last reload's result: ``error`` while the last reload's error stands (the
        previous config stays active), ``ok`` once the file reads good again (reloaded,
        or a bad edit undone), ``start-up`` before any reload;
        with the active config's load time and the reloads counted by result."""
        state = self._state
        counts = counter_values(state.metrics.config_reloads.metric, "result")
        ok, errors = counts.get((RELOAD_OK,), 0.0), counts.get((RELOAD_ERROR,), 0.0)
        # a failed reload's error stands until the file reads good again (reloaded, or undone)
        result = RELOAD_ERROR if state.last_error is not None else (RELOAD_OK if ok + errors > 0 else "start-up")
        return {"result": result, "error": state.last_error, "loaded_at": state.active.loaded_at, "ok": ok, "errors": errors}

    def users(self, snap: dict, now: float, top: int = TOP_USERS) -> dict:
        """The ``top`` users by recent service (from the scheduler's snapshot ``snap``),
        with their share of their group's service and their weight share among the
        group's active users."""
        groups = {g["name"]: g for g in snap["groups"]}
        window = self._state.admission.scheduler.policy.share_window_s
        # a decayed sum of a steady rate r is r * window * (1 - exp(-age / window))
        age = max(1e-9, now - self._since)
        span = window * -math.expm1(-age / window)
        rows = []
        for u in snap["users"][:top]:
            g = groups.get(u["group"], {})
            v = u["recent_service"]
            rows.append(
                {
                    "id": u["user"],
                    "group": u["group"],
                    "weight": u["weight"],
                    "weight_share": share(u["weight"], g.get("active_weight", 0.0)),
                    "service_share": share(v, g.get("recent_service", 0.0)),
                    "service_per_s": v / span,
                    "queued": u["queued"],
                }
            )
        return {"source": "scheduler", "total": snap["users_total"], "top": rows}

    def engines(self, rows: list[dict], current: Sample, base: Sample | None) -> list[dict]:
        """One entry per engine of every pool (:meth:`proxy.routing.engine_state.EngineState.status`;
        the single ``upstream`` is named ``upstream``), with ``id``, ``pool`` and
        ``state``, the latency the proxy measures there (``ttft_s``, ``tpot_s``; ``null``
        until measured), and its routed and failed requests, since start and per second
        over the window (``current`` minus ``base``)."""
        single = self._state.active.models.single_upstream
        covered = current.t - base.t if base is not None else 0.0
        out = []
        for row in rows:
            eid = engine_id(row)
            row = dict(row)
            row["id"] = eid
            if single:
                row["name"] = "upstream"
            row.setdefault("ttft_s", None)
            row.setdefault("tpot_s", None)
            row["failed"] = current.failed.get(eid, 0.0)
            for key, now_v in (("routed", current.routed), ("failed", current.failed)):
                before = getattr(base, key).get(eid, 0.0) if base is not None else None
                row[f"{key}_per_s"] = round((now_v.get(eid, 0.0) - before) / covered, 3) if before is not None and covered > 0 else None
            out.append(row)
        return out
