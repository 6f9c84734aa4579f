"""Prometheus metrics: every name defined here, once.

Labels are bounded: ``group`` takes the configured group names, ``outcome`` and ``reason``
fixed vocabularies; user ids are never labels (their number is unbounded).
Queue depths and in-flight counts are read from the scheduler at scrape time.
"""

from __future__ import annotations

from typing import Callable

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from qos import Scheduler

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

# request outcomes (label ``outcome``)
OUTCOME_OK = "ok"
OUTCOME_CLIENT_GONE = "client_disconnected"
OUTCOME_REFUSED = "refused"
OUTCOME_UPSTREAM_ERROR = "upstream_error"
OUTCOME_BAD_REQUEST = "bad_request"


class _FastLabels:
    """``labels(...)`` that finds an existing child with one dict lookup (the stock one
    re-validates and str()-converts the values and takes a lock on every call: a few µs,
    several times per request). New label values take the stock path."""

    def labels(self, *labelvalues, **labelkwargs):
        if not labelkwargs:
            child = self._metrics.get(labelvalues)  # type: ignore[attr-defined]
            if child is not None:
                return child
        return super().labels(*labelvalues, **labelkwargs)  # type: ignore[misc]


class Counter(_FastLabels, prometheus_client.Counter):
    pass


class Histogram(_FastLabels, prometheus_client.Histogram):
    pass


class _SchedulerCollector(Collector):
    def __init__(self, scheduler: Callable[[], Scheduler]) -> None:
        self._scheduler = scheduler

    def collect(self):
        s = self._scheduler()
        depth = GaugeMetricFamily("llm_qos_queue_depth", "Requests waiting for admission, per group.", labels=["group"])
        for name, n in s.queue_depths().items():
            depth.add_metric([name], n)
        yield depth
        yield GaugeMetricFamily("llm_qos_inflight_requests", "Requests dispatched upstream and not yet finished.", value=len(s.inflight))
        yield GaugeMetricFamily("llm_qos_inflight_tokens", "Reserved tokens (prompt + reserved output) of requests in flight.", value=s.inflight_tokens)
        yield GaugeMetricFamily("llm_qos_users_tracked", "Users whose fair-share state the scheduler keeps now.", value=s.users_tracked)
        yield CounterMetricFamily(
            "llm_qos_users_forgotten", "Users whose fair-share state was forgotten (idle past admission.forget_users_after_s, or beyond admission.max_users).", value=s.users_forgotten
        )


class Metrics:
    """The proxy's metrics in their own registry (so several apps can live in one process).

    Args:
        scheduler: returns the live scheduler (read at scrape time).
    """

    def __init__(self, scheduler: Callable[[], Scheduler]) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("llm_qos_requests", "Requests finished, by group and outcome.", ["group", "outcome"], registry=r)
        self.rejections = Counter("llm_qos_rejections", "Requests refused admission, by group and reason.", ["group", "reason"], registry=r)
        self.queue_wait = Histogram("llm_qos_queue_wait_seconds", "Time from arrival to dispatch upstream.", ["group"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("llm_qos_time_to_first_token_seconds", "Time from arrival to the first byte of the answer relayed to the client.", ["group"], buckets=LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("llm_qos_tokens", "Tokens served, by group and direction (prompt, completion).", ["group", "direction"], registry=r)
        self.upstream_aborts = Counter("llm_qos_upstream_aborts", "Upstream requests aborted by closing their connection.", ["reason"], registry=r)
        self.config_reloads = Counter("llm_qos_config_reloads", "Config reload attempts by result (ok, error).", ["result"], registry=r)
        r.register(_SchedulerCollector(scheduler))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
