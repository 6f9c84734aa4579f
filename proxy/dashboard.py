"""The live dashboard: its data (``GET /admin/dashboard.json``) and its page.

The page (``GET /admin/dashboard``, with ``dashboard.js`` and ``dashboard.css``; package
data under ``proxy/static/``) is the same static text for everyone and holds no data: a
browser cannot attach a bearer header to a page it navigates to, and gating the page
would mean a cookie session (open to cross-site requests) or the key in the URL (kept in
history, logs and ``Referer``). The page asks for the admin key, keeps it in the tab's
``sessionStorage`` and sends it as ``Authorization: Bearer`` on every ``fetch`` of the
data, which, like every ``/admin/*`` route, answers 401 without it (403 when no admin key
is configured). A strict Content-Security-Policy lets the page run only its own script
and talk only to its own origin; every figure is written with ``textContent``.

The data is read, at request time, from the same places as ``/admin/status`` and
``/metrics``: the scheduler's snapshot (queues, requests in flight: the same figures
``/admin/status`` shows), the Prometheus counters (tokens, refusals, queue waits: rates
over the last :data:`WINDOW_S` seconds, from samples this module keeps, at most one per
:data:`SAMPLE_INTERVAL_S`, taken when the data is asked for; nothing runs while nobody
looks), and the load signal (engine load).

Shape (``version`` 1; times in seconds, shares as fractions 0..1, ``null`` when unknown)::

    {"version", "generated_at" (Unix), "window_s", "covered_s" (history behind the rates),
     "config_hash", "inflight", "capacity", "queued", "inflight_tokens",
     "cost": {"input_weight", "output_weight"},
     "groups": [{"name", "priority" (0 = highest), "min_share", "queued", "inflight",
                 "oldest_wait_s", "queue_wait_s": {"mean", "p50", "p95", "count"},
                 "tokens_per_s", "service_per_s", "service_share", "refusals"}],
     "users": {"source", "total", "top": [{"id", "group", "weight", "weight_share",
               "service_share", "service_per_s", "queued"}]},
     "engines": [{"name", "url", "kind", "inflight", "capacity", "max_inflight",
                  "inflight_tokens", "load", "waiting", "saturated", "load_signal"}],
     "refusals": {"total", "per_s", "by_reason": {reason: n}, "by_group": {group: {reason: n}}}}

"Service" is what the scheduler shares out: tokens weighted as it counts them
(``prompt * cost.input_weight + completion * cost.output_weight``). A group's
``service_share`` is its part of all service in the window, to compare with its
``min_share`` (the floor it is guaranteed while it waits); a user's is its part of its
group's service, to compare with its ``weight_share`` (its weight over the weights of its
group's users active in the window), which is what weighted fair sharing promises users
that stay backlogged.

``engines`` lists every engine of every pool (with ``pool``, ``state``, ``routed``, ``ejections``
... as :meth:`proxy.router.EngineState.status`); the single ``upstream`` is named ``upstream``.
``users`` comes from the scheduler's own tally of each user's recent service (decayed
with time constant ``admission.share_window_s``; :meth:`qos.Scheduler.snapshot`): its top
users, and per group the service of all users and the weight of the active ones.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from importlib import resources
from typing import Callable

from aiohttp import web


from .admin import check_admin
from .handlers import STATE
from .load_signal import LOAD_SIGNAL, LoadSignal
from .metrics import oldest_waits
from .state import ProxyState

WINDOW_S = 30.0  # the window of every rate and share
SAMPLE_INTERVAL_S = 0.5  # at most one sample of the counters per this many seconds
TOP_USERS = 10

# the page's security headers: its own script, style and origin only; never framed
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
_STATIC = {"dashboard": ("dashboard.html", "text/html"), "dashboard.js": ("dashboard.js", "text/javascript"), "dashboard.css": ("dashboard.css", "text/css")}


@dataclass(slots=True)
class _Hist:
    """A cumulative histogram: (upper bound, cumulative count) pairs, count and sum."""

    buckets: list[tuple[float, float]] = field(default_factory=list)
    count: float = 0.0
    total: float = 0.0


@dataclass(slots=True)
class _Sample:
    t: float  # the scheduler's clock
    tokens: dict[tuple[str, str], float]  # (group, direction) -> cumulative tokens
    refusals: dict[tuple[str, str], float]  # (group, reason) -> cumulative refusals
    waits: dict[str, _Hist]  # group -> cumulative queue-wait histogram


def _counter(metric, *labels: str) -> dict[tuple[str, ...], float]:
    """``{label values: value}`` of a labelled counter, through the public ``collect()``."""
    out = {}
    for fam in metric.collect():
        for s in fam.samples:
            if s.name.endswith("_total"):
                out[tuple(s.labels[k] for k in labels)] = s.value
    return out


def _histograms(metric) -> dict[str, _Hist]:
    """``{group: _Hist}`` of a histogram labelled by ``group``."""
    out: dict[str, _Hist] = {}
    for fam in metric.collect():
        for s in fam.samples:
            h = out.setdefault(s.labels["group"], _Hist())
            if s.name.endswith("_bucket"):
                h.buckets.append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_count"):
                h.count = s.value
            elif s.name.endswith("_sum"):
                h.total = s.value
    return out


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The ``q``-quantile (0..1) of a cumulative histogram, interpolated linearly inside
    the bucket it falls in, as Prometheus's ``histogram_quantile`` does (the lowest
    bucket starts at 0; a quantile in the ``+Inf`` bucket is the highest finite bound).
    ``None`` when the histogram is empty."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def _minus(now: dict, base: dict | None) -> dict:
    """``now - base`` key by key (a key missing from ``base`` counts from 0); all zeros
    when there is no ``base`` yet."""
    if base is None:
        return dict.fromkeys(now, 0.0)
    return {k: v - base.get(k, 0.0) for k, v in now.items()}


def _minus_hist(now: _Hist, base: _Hist | None) -> _Hist:
    """``now - base`` of two cumulative histograms; empty when there is no ``base``."""
    if base is None:
        return _Hist([(le, 0.0) for le, _ in now.buckets])
    before = dict(base.buckets)
    return _Hist([(le, c - before.get(le, 0.0)) for le, c in now.buckets], now.count - base.count, now.total - base.total)


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


class Dashboard:
    """Builds the dashboard's data for one proxy process.

    Args:
        state: the proxy state.
        load_signal: the engine load poller (for the engine's load and saturation).
        clock: the scheduler's clock (monotonic seconds).
        window_s: the window of rates and shares (seconds).
    """

    def __init__(self, state: ProxyState, load_signal: LoadSignal, clock: Callable[[], float] = time.monotonic, window_s: float = WINDOW_S) -> None:
        self._state = state
        self._signal = load_signal
        self._clock = clock
        self.window_s = window_s
        self._since = clock()
        self._samples: deque[_Sample] = deque()

    # ----------------------------------------------------------------- samples

    def _sample(self, now: float) -> _Sample:
        met = self._state.metrics
        return _Sample(
            now,
            _counter(met.tokens.metric, "group", "direction"),
            _counter(met.rejections.metric, "group", "reason"),
            _histograms(met.queue_wait.metric),
        )

    def _base(self, current: _Sample) -> _Sample | None:
        """Keep ``current`` if the last sample is old enough, drop samples the window no
        longer needs, and return the oldest (the base of every rate), or ``None``."""
        samples = self._samples
        if not samples or current.t - samples[-1].t >= SAMPLE_INTERVAL_S:
            samples.append(current)
        # keep exactly one sample at or before the window's start
        while len(samples) >= 2 and samples[1].t <= current.t - self.window_s:
            samples.popleft()
        base = samples[0]
        return None if base is current else base

    # -------------------------------------------------------------------- data

    def data(self) -> dict:
        """The dashboard's JSON document (shape in the module docstring)."""
        state = self._state
        sched = state.admission.scheduler
        snap = state.admission.snapshot()
        now = self._clock()
        current = self._sample(now)
        base = self._base(current)
        covered = current.t - base.t if base is not None else 0.0
        cost = sched.policy.cost
        tokens = _minus(current.tokens, base.tokens if base is not None else None)
        refusals = _minus(current.refusals, base.refusals if base is not None else None)

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
            wait = _minus_hist(current.waits.get(name, _Hist()), base.waits.get(name, _Hist()) if base is not None else None)
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
                    "service_share": _share(served[name], total_served),
                    "refusals": sum(by_group.get(name, {}).values()),
                }
            )
        total_refusals = sum(by_reason.values())
        return {
            "version": 1,
            "generated_at": time.time(),
            "window_s": self.window_s,
            "covered_s": round(covered, 3),
            "config_hash": state.active.digest,
            "inflight": snap["inflight"],
            "capacity": snap["capacity"],
            "queued": snap["queued"],
            "inflight_tokens": snap["inflight_tokens"],
            "cost": {"input_weight": cost.input_weight, "output_weight": cost.output_weight},
            "groups": groups,
            "users": self.users(snap, now),
            "engines": self.engines(now),
            "refusals": {"total": total_refusals, "per_s": rate(total_refusals), "by_reason": by_reason, "by_group": by_group},
        }

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
                    "weight_share": _share(u["weight"], g.get("active_weight", 0.0)),
                    "service_share": _share(v, g.get("recent_service", 0.0)),
                    "service_per_s": v / span,
                    "queued": u["queued"],
                }
            )
        return {"source": "scheduler", "total": snap["users_total"], "top": rows}

    def engines(self, now: float) -> list[dict]:
        """One entry per engine of every pool (:meth:`proxy.router.EngineState.status`;
        the single ``upstream`` is named ``upstream``), with ``pool`` and ``state``."""
        state = self._state
        single = state.active.models.single_upstream
        out = []
        for r in state.admission.routers():
            for row in r.snapshot():
                if single:
                    row["name"] = "upstream"
                out.append(row)
        return out


DASHBOARD = web.AppKey("llm_qos_dashboard", Dashboard)


def _static(name: str) -> tuple[bytes, str]:
    filename, content_type = _STATIC[name]
    return resources.files("proxy").joinpath("static", filename).read_bytes(), content_type


def add_routes(app: web.Application) -> None:
    """Register ``GET /admin/dashboard`` (the page), its script and style (no key: static
    text, no data) and ``GET /admin/dashboard.json`` (admin key), and create the
    :class:`Dashboard`."""
    state = app[STATE]
    dashboard = app[DASHBOARD] = Dashboard(state, app[LOAD_SIGNAL], state.admission.clock)
    for route in _STATIC:
        body, content_type = _static(route)

        async def page(request: web.Request, body: bytes = body, content_type: str = content_type) -> web.Response:
            return web.Response(body=body, content_type=content_type, charset="utf-8", headers=PAGE_HEADERS)

        app.router.add_get(f"/admin/{route}", page)

    async def data(request: web.Request) -> web.Response:
        """``GET /admin/dashboard.json``: the dashboard's data (admin key)."""
        if (denied := check_admin(request)) is not None:
            return denied
        return web.json_response(request.app[DASHBOARD].data(), headers={"Cache-Control": "no-store"})

    app.router.add_get("/admin/dashboard.json", data)
