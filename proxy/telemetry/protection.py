"""Objective protection's series (``docs/operations.md``; the rule:
:mod:`qos.objective_protection`):

* ``llm_qos_protection_steps_total{pool,group,step}``: times a pool entered a
  protection step (``hold``, ``preempt``, ``shed``) for the protected ``group``.
* ``llm_qos_protection_refusals_total{pool,group,reason}``: requests of
  ``group`` refused by it: ``objective_protection`` (shed from the queue for a higher
  group) or ``objective_unreachable`` (``on_miss: reject``).
* ``llm_qos_protection_step{pool}``: the step in force now (0 none, 1 hold,
  2 preempt, 3 shed).

Preemptions the second step causes are counted with every other preemption
(``llm_qos_preemptions_total``); the refusals also in ``llm_qos_rejections_total``.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


class ProtectionMetrics:
    """The counters, and the gauge read from ``steps`` at scrape time.

    Args:
        registry: the proxy's registry.
        steps: returns pool name -> the step in force (an int, 0..3).
    """

    def __init__(self, registry: CollectorRegistry, steps: Callable[[], dict[str, int]]) -> None:
        self.steps_entered = Counter(
            "llm_qos_protection_steps", "Times a pool entered an objective protection step (hold, preempt, shed), by the group protected.", ["pool", "group", "step"], registry=registry
        )
        self.refusals = Counter(
            "llm_qos_protection_refusals",
            "Requests refused for latency objectives: objective_protection (shed for a higher group), objective_unreachable (on_miss: reject).",
            ["pool", "group", "reason"],
            registry=registry,
        )
        registry.register(_StepCollector(steps))

    def step(self, pool: str, group: str, step: str) -> None:
        """``pool`` entered ``step`` for ``group``."""
        self.steps_entered.labels(pool, group, step).inc()

    def refused(self, pool: str, group: str, reason: str) -> None:
        """A request of ``group`` in ``pool`` was refused for ``reason``."""
        self.refusals.labels(pool, group, reason).inc()


class _StepCollector(Collector):
    def __init__(self, steps: Callable[[], dict[str, int]]) -> None:
        self._steps = steps

    def collect(self):
        g = GaugeMetricFamily("llm_qos_protection_step", "The objective protection step in force per pool (0 none, 1 hold, 2 preempt, 3 shed).", labels=["pool"])
        for pool, step in self._steps().items():
            g.add_metric([pool], step)
        yield g
