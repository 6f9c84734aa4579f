"""The groups' latency objectives as the proxy measures and reports them: one request's
time per output token from the relay's progress reports (:class:`TokenTimes`), the
Prometheus series (:class:`ObjectivesCollector`) and the JSON of ``/admin/status`` and the
dashboard (:func:`objectives_status`). The window and its histogram:
:mod:`qos.objectives`.

Series (``docs/operations.md``), read from the tracker at scrape time; ``objective`` is
``ttft`` or ``tpot``, ``group`` a configured group, ``pool`` and ``engine`` configured
names. Only groups with objectives have series; attainment and the measured percentile
exist while the window holds requests of that (group, engine):

* ``llm_qos_objective_target_seconds{group,objective}``: the target.
* ``llm_qos_objective_goal_ratio{group,objective}``: the percentile / 100, the
  attainment the objective promises.
* ``llm_qos_objective_attainment_ratio{group,pool,engine,objective}``: the fraction of
  the window's requests within target.
* ``llm_qos_objective_measured_seconds{group,pool,engine,objective}``: the window's
  percentile (the objective's own) of the values, within 5 %.
* ``llm_qos_objective_requests{group,pool,engine,objective}``: requests in the window.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from qos.objectives import ObjectiveReport, ObjectiveTracker, Reading


class TokenTimes:
    """When a stream's output tokens arrived, as the relay reports its count
    (:func:`proxy.relay.relay.relay_stream`'s ``on_progress``: the first token at once,
    then at most every ``PROGRESS_EVERY_S``, 20 ms).

    The time per output token is ``(t_last - t_first) / (n_last - n_first)`` over the
    first and the last report (seconds per token): for a stream of ``n >= 2`` tokens whose
    reports span them all, ``(last token - first token) / (n - 1)``; the tokens after the
    last report (at most 20 ms of them) are left out of both terms. ``None`` with fewer
    than two reports of different counts.

    Args:
        clock: monotonic seconds (the event loop's ``time``).
    """

    __slots__ = ("_clock", "first_at", "first_n", "last_at", "last_n")

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.first_at: float | None = None
        self.first_n = 0
        self.last_at: float | None = None
        self.last_n = 0

    def progress(self, output_tokens: int) -> None:
        """The relay counted ``output_tokens`` so far (called now)."""
        now = self._clock()
        if self.first_at is None:
            self.first_at, self.first_n = now, output_tokens
        self.last_at, self.last_n = now, output_tokens

    def forget(self) -> None:
        """Forget an attempt's tokens (a preempted one: its client saw none of them)."""
        self.first_at = self.last_at = None
        self.first_n = self.last_n = 0

    def tpot_s(self) -> float | None:
        """Seconds per output token (see the class), or ``None``."""
        if self.first_at is None or self.last_at is None or self.last_n <= self.first_n:
            return None
        return (self.last_at - self.first_at) / (self.last_n - self.first_n)


def _reading(r: Reading) -> dict:
    return {
        "requests": r.requests,
        "attainment": None if r.attainment is None else round(r.attainment, 4),
        "measured_s": None if r.measured_s is None else round(r.measured_s, 4),
    }


def objectives_status(report: dict[str, dict[str, ObjectiveReport]]) -> dict:
    """``report`` (:meth:`qos.objectives.ObjectiveTracker.report`) as JSON::

        {group: {objective ("ttft" | "tpot"): {"target_s", "percentile", "met" (bool, or
         null without requests), "overall": {"requests", "attainment" (0..1),
         "measured_s"}, "engines": {"POOL/NAME": {the same three}}}}}

    ``attainment`` and ``measured_s`` are ``null`` without requests in the window.
    """
    out: dict = {}
    for group, objs in report.items():
        g = out[group] = {}
        for name, rep in objs.items():
            o, att = rep.objective, rep.overall.attainment
            g[name] = {
                "target_s": o.target_s,
                "percentile": o.percentile,
                "met": None if att is None else att >= o.percentile / 100,
                "overall": _reading(rep.overall),
                "engines": {f"{pool}/{engine}": _reading(r) for (pool, engine), r in sorted(rep.engines.items())},
            }
    return out


class ObjectivesCollector(Collector):
    """The objectives' series (the module docstring), read from ``tracker`` at scrape
    time. Every family is yielded (its ``# TYPE`` line is there) even without samples.

    Args:
        tracker: the process's tracker (read at each scrape; the attribute may be swapped).
        clock: the tracker's clock (monotonic seconds).
    """

    def __init__(self, tracker: Callable[[], ObjectiveTracker], clock: Callable[[], float]) -> None:
        self._tracker = tracker
        self._clock = clock

    def collect(self):
        report = self._tracker().report(self._clock())
        target = GaugeMetricFamily("llm_qos_objective_target_seconds", "Each group's latency objective's target (objective: ttft, tpot).", labels=["group", "objective"])
        goal = GaugeMetricFamily(
            "llm_qos_objective_goal_ratio", "The fraction of a group's requests its latency objective promises within target (its percentile / 100).", labels=["group", "objective"]
        )
        labels = ["group", "pool", "engine", "objective"]
        attainment = GaugeMetricFamily("llm_qos_objective_attainment_ratio", "Fraction of the group's requests on the engine within the objective's target, over the objectives window.", labels=labels)
        measured = GaugeMetricFamily("llm_qos_objective_measured_seconds", "The objective's percentile of the group's requests on the engine, over the objectives window (within 5 %).", labels=labels)
        requests = GaugeMetricFamily("llm_qos_objective_requests", "Requests of the group on the engine in the objectives window, per objective.", labels=labels)
        for group, objs in report.items():
            for name, rep in objs.items():
                target.add_metric([group, name], rep.objective.target_s)
                goal.add_metric([group, name], rep.objective.percentile / 100)
                for (pool, engine), r in rep.engines.items():
                    attainment.add_metric([group, pool, engine, name], r.attainment)
                    measured.add_metric([group, pool, engine, name], r.measured_s)
                    requests.add_metric([group, pool, engine, name], r.requests)
        yield from (target, goal, attainment, measured, requests)
