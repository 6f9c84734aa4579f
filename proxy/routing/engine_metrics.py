"""Per-engine metrics and status: every series about the engines of the pools, defined once.

Read from the routers at scrape time (no counters kept here). Labels are bounded: ``pool``
and ``engine`` take configured names (an engine's ``name``, else its URL), ``state`` and
``reason`` / ``result`` fixed vocabularies. Series (``docs/operations.md``):

* ``llm_qos_engine_state{pool,engine,state}``: 1 for the engine's state (``healthy``,
  ``ejected``, ``draining``), 0 for the others.
* ``llm_qos_engine_inflight_requests``, ``llm_qos_engine_inflight_tokens``: requests placed
  on it and their reserved tokens.
* ``llm_qos_engine_capacity_requests``: requests it may run now: the capacity its
  controller found (:mod:`qos.capacity_control`; ``max_inflight`` when fixed), lowered by a
  fixed engine's load-signal hold and this replica's lease.
* ``llm_qos_engine_capacity_found_requests``: the capacity found, all replicas together
  (before the lease).
* ``llm_qos_engine_capacity_reason{reason}``: 1 for why the limit is what it is now
  (:data:`REASONS`), 0 for the others.
* ``llm_qos_engine_capacity_decreases_total{reason}``: control steps that lowered it.
* ``llm_qos_engine_tpot_seconds`` / ``llm_qos_engine_tpot_baseline_seconds``: the median
  time per output token of its streams at the last step, and the unloaded figure the
  bound is taken against; ``llm_qos_engine_ttft_seconds`` /
  ``llm_qos_engine_ttft_baseline_seconds``: time to first token from dispatch (a moving
  average) and its unloaded figure. Absent until measured.
* ``llm_qos_engine_load``: its last fresh KV-cache load (fraction); absent without one.
* ``llm_qos_engine_saturated``: 1 while its load signal says it is saturated (new work
  held back from it), else 0 (also without a load signal).
* ``llm_qos_engine_headroom``: the router's headroom (fraction free; see
  :mod:`proxy.routing.router`).
* ``llm_qos_engine_routed_requests_total``: requests placed on it.
* ``llm_qos_engine_ejections_total``: times it was taken out of rotation.
* ``llm_qos_engine_ejections_refused_total``: passive ejections (failed requests)
  refused because the pool was at its floor (``health.max_ejection_percent``).
* ``llm_qos_engine_failures_total{reason}``: failed requests, by
  :data:`proxy.routing.engine_health.FAILURE_REASONS`.
* ``llm_qos_engine_health_checks_total{result}``: checks and probes, ``ok`` / ``failed``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from qos.capacity_control import (
    REASON_CEILING,
    REASON_ENGINE_QUEUE,
    REASON_FIXED,
    REASON_GROWING,
    REASON_KV_CACHE,
    REASON_LATENCY,
    REASON_RESTART,
    REASON_START,
    REASON_STEADY,
)

from .router import PoolRouter

STATES = ("healthy", "ejected", "draining")
REASONS = (
    REASON_START, REASON_GROWING, REASON_STEADY, REASON_CEILING, REASON_ENGINE_QUEUE, REASON_KV_CACHE, REASON_LATENCY, REASON_RESTART,
    REASON_FIXED,
)  # fmt: skip


class EngineCollector(Collector):
    """The per-engine series of the module docstring.

    Args:
        routers: returns the live routers (read at every scrape, so reloads show at once).
    """

    def __init__(self, routers: Callable[[], Iterable[PoolRouter]]) -> None:
        self._routers = routers

    def collect(self):
        labels = ["pool", "engine"]
        state = GaugeMetricFamily("llm_qos_engine_state", "1 for the engine's state (healthy, ejected, draining), 0 for the others.", labels=[*labels, "state"])
        inflight = GaugeMetricFamily("llm_qos_engine_inflight_requests", "Requests placed on the engine and not finished.", labels=labels)
        tokens = GaugeMetricFamily("llm_qos_engine_inflight_tokens", "Reserved tokens (prompt + max output) of the requests placed on the engine.", labels=labels)
        capacity = GaugeMetricFamily(
            "llm_qos_engine_capacity_requests", "Requests the engine may run now: the capacity found (max_inflight when fixed), less a load-signal hold and this replica's lease.", labels=labels
        )
        found = GaugeMetricFamily("llm_qos_engine_capacity_found_requests", "Requests the engine may run, all replicas together, as its capacity controller found.", labels=labels)
        why = GaugeMetricFamily("llm_qos_engine_capacity_reason", "1 for why the engine's capacity is what it is now, 0 for the other reasons.", labels=[*labels, "reason"])
        decreases = CounterMetricFamily("llm_qos_engine_capacity_decreases", "Control steps that lowered the engine's capacity, by reason.", labels=[*labels, "reason"])
        tpot = GaugeMetricFamily("llm_qos_engine_tpot_seconds", "Median time per output token of the proxy's streams on the engine at the last control step.", labels=labels)
        tpot_base = GaugeMetricFamily("llm_qos_engine_tpot_baseline_seconds", "The engine's time per output token with little load (the slowdown bound's reference).", labels=labels)
        ttft = GaugeMetricFamily("llm_qos_engine_ttft_seconds", "Time to first token from dispatch on the engine (a moving average).", labels=labels)
        ttft_base = GaugeMetricFamily("llm_qos_engine_ttft_baseline_seconds", "The engine's time to first token with little load.", labels=labels)
        load = GaugeMetricFamily("llm_qos_engine_load", "The engine's last fresh KV-cache load (fraction).", labels=labels)
        saturated = GaugeMetricFamily("llm_qos_engine_saturated", "1 while the engine's load signal says it is saturated (new work held back from it).", labels=labels)
        headroom = GaugeMetricFamily("llm_qos_engine_headroom", "Fraction of the engine still free (requests, tokens and load; the router's measure).", labels=labels)
        routed = CounterMetricFamily("llm_qos_engine_routed_requests", "Requests placed on the engine.", labels=labels)
        ejections = CounterMetricFamily("llm_qos_engine_ejections", "Times the engine was taken out of rotation by its health.", labels=labels)
        refused = CounterMetricFamily(
            "llm_qos_engine_ejections_refused",
            "Ejections by failed requests refused because the pool was at its floor (health.max_ejection_percent; one engine always stays in rotation).",
            labels=labels,
        )
        failures = CounterMetricFamily("llm_qos_engine_failures", "Failed requests to the engine, by reason.", labels=[*labels, "reason"])
        checks = CounterMetricFamily("llm_qos_engine_health_checks", "Health checks and probes of the engine, by result.", labels=[*labels, "result"])
        for router in self._routers():
            for e in router.engines.values():
                key = [router.name, e.name]
                current = "draining" if e.draining else e.health.state.value
                for s in STATES:
                    state.add_metric([*key, s], 1.0 if s == current else 0.0)
                inflight.add_metric(key, e.inflight)
                tokens.add_metric(key, e.inflight_tokens)
                capacity.add_metric(key, e.capacity)
                c = e.control
                found.add_metric(key, e.found_capacity)
                for r in REASONS:
                    why.add_metric([*key, r], 1.0 if r == c.reason else 0.0)
                for r, n in c.decreases.items():
                    decreases.add_metric([*key, r], n)
                for family, v in ((tpot, c.tpot_s), (tpot_base, c.baseline_tpot_s), (ttft, c.ttft_s), (ttft_base, c.baseline_ttft_s)):
                    if v is not None:
                        family.add_metric(key, v)
                if e.load is not None:
                    load.add_metric(key, e.load)
                saturated.add_metric(key, 1.0 if e.saturated else 0.0)
                headroom.add_metric(key, e.headroom(placed=0))
                routed.add_metric(key, e.routed)
                ejections.add_metric(key, e.health.ejections)
                refused.add_metric(key, e.health.ejections_refused)
                for reason, n in e.health.failures.items():
                    failures.add_metric([*key, reason], n)
                for result, n in e.health.checks.items():
                    checks.add_metric([*key, result], n)
        yield from (state, inflight, tokens, capacity, found, why, decreases, tpot, tpot_base, ttft, ttft_base)
        yield from (load, saturated, headroom, routed, ejections, refused, failures, checks)


def register(registry: CollectorRegistry, routers: Callable[[], Iterable[PoolRouter]]) -> EngineCollector:
    """Add the per-engine series to ``registry`` (the proxy's :class:`proxy.telemetry.metrics.Metrics`
    registry); returns the collector."""
    collector = EngineCollector(routers)
    registry.register(collector)
    return collector


def engines_status(routers: Iterable[PoolRouter]) -> list[dict]:
    """Every engine of every pool, as :meth:`proxy.routing.engine_state.EngineState.status` describes it:
    the ``engines`` list of ``/admin/status`` and of the dashboard (:mod:`proxy.api.dashboard_data`)."""
    return [s for r in routers for s in r.snapshot()]
