"""Prometheus metrics: every name defined here, once.

Labels are bounded: ``group`` takes the configured group names, ``outcome``, ``reason``,
``result`` and ``direction`` fixed vocabularies (the tuples below); user ids are never
labels (their number is unbounded). Queue depths and in-flight counts are read from the
scheduler at scrape time.

Every labelled counter an operator alerts on exists at 0 from start-up (every group times
every outcome, refusal reason and token direction; every reload result; every abort
reason), so ``rate()``, ``increase()`` and alerts work before the first event. A reload
that adds a group adds its zero series (:meth:`Metrics.add_groups`). Series of a group a
reload removes are kept, frozen at their last value, until the process restarts: a
counter must never go backwards, and requests admitted in that group before the reload
are still counted under it when they finish.

Under ``llm-qos proxy --workers N`` every series also carries ``worker`` (the worker's
index, 0..N-1): each worker renders its own registry with that label, and a scrape of
``/metrics`` on the shared port answers with every worker's series
(:func:`proxy.runtime.workers.whole_server_metrics`, merged by :func:`merge_expositions`).

Only ``prometheus_client``'s public API is used. Its ``labels()`` validates and converts
its arguments and takes a lock on every call (about 1 µs); :class:`LabelCache` keeps the
child objects that public call returns, so the hot path pays one dict lookup
(``bench/public_api.py`` measures both).
"""

from __future__ import annotations

import time
from typing import Callable, Generic, Iterable, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from qos import RefusalReason, Scheduler

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

# request outcomes (label ``outcome``)
OUTCOME_OK = "ok"
OUTCOME_CLIENT_GONE = "client_disconnected"
OUTCOME_REFUSED = "refused"
OUTCOME_UPSTREAM_ERROR = "upstream_error"
OUTCOME_BAD_REQUEST = "bad_request"
OUTCOMES = (OUTCOME_OK, OUTCOME_CLIENT_GONE, OUTCOME_REFUSED, OUTCOME_UPSTREAM_ERROR, OUTCOME_BAD_REQUEST)

# why an upstream request was aborted (label ``reason`` of llm_qos_upstream_aborts_total):
# the request's outcome, or ABORT_UNKNOWN when the relay ended without one
ABORT_UNKNOWN = "error"
ABORT_PREEMPTED = "preempted"  # a lower group's request preempted for a higher one's (proxy.admission.admission)
ABORT_REASONS = (OUTCOME_CLIENT_GONE, OUTCOME_UPSTREAM_ERROR, ABORT_UNKNOWN, ABORT_PREEMPTED)

# admission refusals (label ``reason``): every wire code but the client's own cancel,
# which is counted as outcome client_disconnected, never as a refusal
REFUSAL_REASONS = tuple(r.value for r in RefusalReason if r is not RefusalReason.CANCELLED)

RELOAD_OK = "ok"
RELOAD_ERROR = "error"
RELOAD_RESULTS = (RELOAD_OK, RELOAD_ERROR)

DIRECTIONS = ("prompt", "completion")

M = TypeVar("M", Counter, Histogram)


class LabelCache(Generic[M]):
    """The children of one labelled metric, by label values.

    ``labels(*values)`` calls the metric's public ``labels()`` once per distinct tuple of
    values and returns the same child object afterwards from a dict. The child stays the
    one exported as long as nobody calls ``remove()`` or ``clear()`` on the metric, which
    nothing in the proxy does. Positional label values only, as ``str``.

    Args:
        metric: a labelled ``prometheus_client`` metric (``metric`` attribute).
    """

    __slots__ = ("metric", "_children")

    def __init__(self, metric: M) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], object] = {}

    def labels(self, *values: str):
        """The child of ``values`` (created at 0 on first use)."""
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child


class _SchedulerCollector(Collector):
    """The schedulers' state, summed over the pools (one scheduler per pool)."""

    def __init__(self, schedulers: Callable[[], Scheduler | Iterable[Scheduler]], clock: Callable[[], float]) -> None:
        self._schedulers = schedulers
        self._clock = clock

    def collect(self):
        got = self._schedulers()
        scheds = [got] if isinstance(got, Scheduler) else list(got)
        s = scheds[0]
        now = self._clock()
        depths: dict[str, int] = {}
        oldest_by: dict[str, float] = {}
        for x in scheds:
            for name, n in x.queue_depths().items():
                depths[name] = depths.get(name, 0) + n
            for name, age in oldest_waits(x, now).items():
                oldest_by[name] = max(oldest_by.get(name, 0.0), age)
        depth = GaugeMetricFamily("llm_qos_queue_depth", "Requests waiting for admission, per group.", labels=["group"])
        for name, n in depths.items():
            depth.add_metric([name], n)
        yield depth
        oldest = GaugeMetricFamily(
            "llm_qos_queue_oldest_wait_seconds", "How long the oldest request waiting in each group has waited (0 when none waits).", labels=["group"]
        )
        for name, age in oldest_by.items():
            oldest.add_metric([name], age)
        yield oldest
        floor = GaugeMetricFamily("llm_qos_group_min_share", "Each group's configured min_share (fraction of dispatched cost it is guaranteed while it waits).", labels=["group"])
        for g in s.policy.groups:
            floor.add_metric([g.name], g.min_share)
        yield floor
        weight = GaugeMetricFamily(
            "llm_qos_cost_weight", "Cost of one token by direction (cost.input_weight, cost.output_weight): service = tokens weighted by this.", labels=["direction"]
        )
        weight.add_metric(["prompt"], s.policy.cost.input_weight)
        weight.add_metric(["completion"], s.policy.cost.output_weight)
        yield weight
        yield GaugeMetricFamily("llm_qos_inflight_requests", "Requests dispatched upstream and not yet finished.", value=sum(len(x.inflight) for x in scheds))
        yield GaugeMetricFamily("llm_qos_inflight_tokens", "Reserved tokens (prompt + reserved output) of requests in flight.", value=sum(x.inflight_tokens for x in scheds))
        yield GaugeMetricFamily("llm_qos_users_tracked", "Users whose fair-share state the scheduler keeps now (summed over pools).", value=sum(x.users_tracked for x in scheds))
        yield CounterMetricFamily(
            "llm_qos_users_forgotten",
            "Users whose fair-share state was forgotten (idle past admission.forget_users_after_s, or beyond admission.max_users).",
            value=sum(x.users_forgotten for x in scheds),
        )


SHARED_MODES = ("shared", "degraded", "fallback", "standalone")


class SharedStateCollector(Collector):
    """The shared state's health (``docs/scaling.md``), every series present from
    start-up: the mode (one series per mode, 1 for the current one), the seconds since
    the last successful sync, the live replicas, syncs by result, the last round trip,
    and this process's grant on every capacity key it leases (0 until granted).

    Args:
        shared: a :class:`proxy.shared.SharedState` or :class:`proxy.shared.StandaloneState`.
        keys: returns the capacity keys this process leases now.
    """

    def __init__(self, shared, keys: Callable[[], Iterable[str]]) -> None:
        self._shared = shared
        self._keys = keys

    def collect(self):
        s = self._shared
        mode = GaugeMetricFamily(
            "llm_qos_shared_state_mode",
            "1 for the shared state's current mode: shared (Redis in sync), degraded (Redis failed; grants shrunk to the local share), "
            "fallback (no sync for a lease: local shares taken), standalone (no shared_state).",
            labels=["mode"],
        )
        for m in SHARED_MODES:
            mode.add_metric([m], 1 if s.mode == m else 0)
        yield mode
        yield GaugeMetricFamily("llm_qos_shared_state_connected", "1 while the last call to Redis succeeded (mode shared).", value=1 if s.mode == "shared" else 0)
        yield GaugeMetricFamily(
            "llm_qos_shared_state_fallback", "1 while this replica enforces its local share of capacity and limits (mode degraded or fallback).",
            value=1 if s.mode in ("degraded", "fallback") else 0,
        )
        age = getattr(s, "last_sync_age_s", None)
        age_v = age() if age is not None else None
        yield GaugeMetricFamily(
            "llm_qos_shared_state_last_sync_age_seconds", "Seconds since the last successful sync with Redis (0 standalone; -1 never synced).",
            value=(-1.0 if age is not None else 0.0) if age_v is None else age_v,
        )
        yield GaugeMetricFamily("llm_qos_shared_state_live_replicas", "Replicas with a live lease, as Redis last said (1 standalone).", value=s.live_replicas)
        syncs = CounterMetricFamily("llm_qos_shared_state_syncs", "Syncs with Redis by result (ok, error).", labels=["result"])
        syncs.add_metric(["ok"], getattr(s, "syncs", 0))
        syncs.add_metric(["error"], getattr(s, "sync_failures", 0))
        yield syncs
        yield GaugeMetricFamily("llm_qos_shared_state_sync_rtt_seconds", "Round trip of the last successful sync.", value=getattr(s, "last_sync_rtt_s", 0.0))
        grants = GaugeMetricFamily("llm_qos_shared_state_grant", "Units of each capacity key (engine slots or tokens) this replica may have in flight now.", labels=["key"])
        for key in self._keys():
            grants.add_metric([key], s.grant(key) or 0)
        yield grants


def oldest_waits(scheduler: Scheduler, now: float) -> dict[str, float]:
    """Seconds the oldest waiting request of each group has waited (0.0 when none waits),
    by group in priority order. ``now`` is a reading of the scheduler's clock. O(queued)."""
    out = {name: 0.0 for name in scheduler.queue_depths()}
    for t in scheduler.tickets_waiting():
        age = now - t.enqueued_at
        if age > out.get(t.group, 0.0):
            out[t.group] = age
    return out


class Metrics:
    """The proxy's metrics in their own registry (so several apps can live in one process).

    Args:
        scheduler: returns the live scheduler, or the schedulers of every pool (read at
            scrape time; queue depths and counts are summed over them).
        worker: this process's index among ``--workers`` processes, or ``None``: every
            series it renders then carries the label ``worker``.
        groups: the configured group names; their zero series are created at once.
        clock: the scheduler's clock (monotonic seconds), for queue ages.

    Attributes: ``requests``, ``rejections``, ``queue_wait``, ``ttft``, ``tokens``,
    ``upstream_aborts``, ``config_reloads``, ``preemptions`` (``pool``, ``engine``,
    ``group``: requests preempted off that engine), ``resumes`` (the same labels: shown
    streams preempted to be resumed): :class:`LabelCache` of each metric (call
    ``.labels(...)`` as on the metric; ``.metric`` is the metric itself).
    """

    def __init__(
        self,
        scheduler: Callable[[], Scheduler | Iterable[Scheduler]],
        groups: Iterable[str] = (),
        clock: Callable[[], float] = time.monotonic,
        worker: int | None = None,
    ) -> None:
        self.worker = worker
        self.registry = r = CollectorRegistry()
        self.requests = LabelCache(Counter("llm_qos_requests", "Requests finished, by group and outcome.", ["group", "outcome"], registry=r))
        self.rejections = LabelCache(Counter("llm_qos_rejections", "Requests refused admission, by group and reason.", ["group", "reason"], registry=r))
        self.queue_wait = LabelCache(Histogram("llm_qos_queue_wait_seconds", "Time from arrival to dispatch upstream.", ["group"], buckets=LATENCY_BUCKETS, registry=r))
        self.ttft = LabelCache(Histogram("llm_qos_time_to_first_token_seconds", "Time from arrival to the first byte of the answer relayed to the client.", ["group"], buckets=LATENCY_BUCKETS, registry=r))
        self.tokens = LabelCache(Counter("llm_qos_tokens", "Tokens served, by group and direction (prompt, completion).", ["group", "direction"], registry=r))
        self.upstream_aborts = LabelCache(Counter("llm_qos_upstream_aborts", "Upstream requests aborted by closing their connection.", ["reason"], registry=r))
        self.config_reloads = LabelCache(Counter("llm_qos_config_reloads", "Config reload attempts by result (ok, error).", ["result"], registry=r))
        self.preemptions = LabelCache(
            Counter("llm_qos_preemptions", "Requests preempted for a higher group's waiting request, by pool, engine and the preempted request's group.", ["pool", "engine", "group"], registry=r)
        )
        self.resumes = LabelCache(
            Counter("llm_qos_resumes", "Streams preempted after their client was shown tokens, to be resumed where they stopped, by pool, engine and group.", ["pool", "engine", "group"], registry=r)
        )
        for reason in ABORT_REASONS:
            self.upstream_aborts.labels(reason)
        for result in RELOAD_RESULTS:
            self.config_reloads.labels(result)
        self.add_groups(groups)
        r.register(_SchedulerCollector(scheduler, clock))

    def add_groups(self, groups: Iterable[str]) -> None:
        """Create the zero series of ``groups`` (idempotent: existing series keep their
        values). Called at start-up and after every reload."""
        for g in groups:
            for outcome in OUTCOMES:
                self.requests.labels(g, outcome)
            for reason in REFUSAL_REASONS:
                self.rejections.labels(g, reason)
            for direction in DIRECTIONS:
                self.tokens.labels(g, direction)
            self.queue_wait.labels(g)
            self.ttft.labels(g)

    def observe_request(self, ex, estimated_prompt_tokens: int) -> None:
        """Count one finished request in its group: ``requests`` by outcome (none known:
        ``upstream_error``), ``queue_wait``, ``ttft`` (when a first byte was relayed) and
        ``tokens`` (the upstream's prompt count, else ``estimated_prompt_tokens``; output
        as counted). Called once per request that was admitted, after its answer has gone
        out (``loop.call_soon``).

        Args:
            ex: the request as the proxy handled it (a :class:`proxy.relay.relay.Exchange`;
                read only).
            estimated_prompt_tokens: the proxy's prompt estimate (tokens).
        """
        group = ex.group
        self.queue_wait.labels(group).observe(ex.queue_wait or 0.0)
        self.requests.labels(group, ex.outcome or OUTCOME_UPSTREAM_ERROR).inc()
        if ex.first_byte_at is not None:
            self.ttft.labels(group).observe(ex.first_byte_at - ex.arrived_at)
        self.tokens.labels(group, "prompt").inc(ex.prompt_tokens if ex.prompt_tokens is not None else estimated_prompt_tokens)
        self.tokens.labels(group, "completion").inc(ex.output_tokens)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric of this process (with the
        label ``worker`` on every series when ``worker`` is set)."""
        if self.worker is None:
            return generate_latest(self.registry)
        return generate_latest(_Labelled(self.registry, {"worker": str(self.worker)}))


class _Labelled:
    """A registry's families with ``labels`` added to every sample (for
    ``generate_latest``, which only calls ``collect()``)."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self._registry = registry
        self._labels = labels

    def collect(self):
        for fam in self._registry.collect():
            out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            out.samples = [s._replace(labels={**s.labels, **self._labels}) for s in fam.samples]
            yield out


def merge_expositions(parts: Iterable[bytes]) -> bytes:
    """Several Prometheus text expositions (format 0.0.4, as ``generate_latest`` writes
    them: per family one ``# HELP`` line, one ``# TYPE`` line, then its samples) as one:
    each family once, its header from the first part that has it, then the samples of
    every part in order. The parts' series must differ by their labels (each worker's
    carry its own ``worker``); nothing is summed. A part that is not in that shape (a
    sample before any ``# HELP``) has those lines dropped. O(total size)."""
    families: dict[bytes, list[bytes]] = {}
    for part in parts:
        lines: list[bytes] | None = None
        for line in part.splitlines():
            if not line:
                continue
            if line.startswith(b"# HELP "):
                name = line.split(b" ", 3)[2]
                lines = families.get(name)
                if lines is None:
                    lines = families[name] = [line]
                continue
            if line.startswith(b"# TYPE "):
                if lines is not None and len(lines) == 1:
                    lines.append(line)
                continue
            if lines is not None:
                lines.append(line)
    return b"".join(b"\n".join(lines) + b"\n" for lines in families.values())
