"""The engine's own load report, turned into an admission hold: the pollers of one proxy
(:class:`LoadSignal`, one :class:`~proxy.runtime.load_poller.EnginePoller` per engine of
every pool, kept in step with the config across reloads) and their Prometheus series.

The proxy's ``admission.max_inflight`` is a guess at what the engine can run at once. The
engine knows better: when its KV cache is full it queues new requests itself, in arrival
order, blind to priorities and fair shares. So while the engine reports itself saturated,
the proxy dispatches nothing new and lets requests wait in *its* queue, where the
scheduler orders them.

* :mod:`proxy.runtime.load_report`: what each engine kind reports (LightLLM's
  ``/token_load``, vLLM's and SGLang's ``/metrics``) and the capacity limit a reading
  calls for.
* :mod:`proxy.runtime.load_poller`: one engine's polling task: the ``GET`` every
  ``interval_s``, the backoff, the staleness rule, the capacity controller's step.

A reading older than ``stale_after_s`` lifts any limit: admission falls back to
``max_inflight``, never to zero because a poll failed. Arrivals faster than the poll
interval are not held until the next reading shows their load: the signal steers sustained
load, ``max_inflight`` still caps bursts.
"""

from __future__ import annotations

import asyncio
import math
import time

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .load_poller import EnginePoller
from .load_report import Reading
from .state import ProxyState


class LoadSignal:
    """The load pollers of one proxy: one :class:`EnginePoller` per engine of every pool,
    kept in step with the config by :meth:`sync` (called after every reload).

    Args:
        state: the proxy state (its admission's pools list the engines).

    :meth:`start` inside the running loop, :meth:`stop` on shutdown.

    Attributes (those of the first engine, the only one in the single-``upstream`` form;
    ``polls`` sums every engine's):
        reading: the last reading, or ``None``.
        reading_at: monotonic time of ``reading``.
        saturated: whether the last fresh reading says the engine is saturated.
        limit: the capacity limit set (``None``: ``max_inflight``).
        no_signal: the upstream answered without a load signal (polling paused).
    """

    def __init__(self, state: ProxyState, clock=time.monotonic) -> None:
        self._state = state
        self._clock = clock
        self._pollers: dict = {}
        self._stopping: set[asyncio.Task] = set()
        self._started = False
        self.polls = {"ok": 0, "error": 0, "no_signal": 0}
        state.metrics.registry.register(_Collector(self))
        state.on_engines_synced.append(self.sync)

    @property
    def first(self) -> EnginePoller | None:
        """The poller of the first engine of the first pool."""
        for e in self._state.admission.default.router.engines.values():
            return self._pollers.get(e)
        return None

    def poller(self, engine) -> EnginePoller | None:
        """The poller of ``engine``, or ``None``."""
        return self._pollers.get(engine)

    @property
    def reading(self) -> Reading | None:
        p = self.first
        return None if p is None else p.reading

    @property
    def reading_at(self) -> float:
        p = self.first
        return -math.inf if p is None else p.reading_at

    @property
    def saturated(self) -> bool:
        p = self.first
        return p is not None and p.saturated

    @property
    def limit(self) -> int | None:
        p = self.first
        return None if p is None else p.limit

    @property
    def no_signal(self) -> bool:
        p = self.first
        return p is not None and p.no_signal

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start polling every engine (a no-op when already started)."""
        self._started = True
        self.sync()

    def sync(self) -> None:
        """Poll exactly the engines of the pools now (draining ones stop being polled:
        they get nothing new anyway)."""
        if not self._started:
            return
        live = {e for _pool, e in self._state.admission.engines() if not e.draining}
        for e in [e for e in self._pollers if e not in live]:
            task = asyncio.get_running_loop().create_task(self._pollers.pop(e).stop())
            self._stopping.add(task)  # a reference until it ends
            task.add_done_callback(self._stopping.discard)
        for e in live:
            if e not in self._pollers:
                poller = self._pollers[e] = EnginePoller(e, self._state.admission.dispatch, self.polls, self._clock, self._demand_of(e))
                poller.start()

    def _demand_of(self, engine):
        """A function telling whether requests wait in ``engine``'s pool now."""
        admission = self._state.admission

        def demand() -> bool:
            pool = admission.pool_of(engine)
            return pool is not None and pool.scheduler.queued > 0

        return demand

    async def stop(self) -> None:
        """Stop polling, lift every hold, close the connections."""
        self._started = False
        pollers = list(self._pollers.values())
        self._pollers.clear()
        await asyncio.gather(*(p.stop() for p in pollers), *self._stopping, return_exceptions=True)


class _Collector(Collector):
    def __init__(self, signal: LoadSignal) -> None:
        self._signal = signal

    def collect(self):
        s = self._signal
        yield GaugeMetricFamily(
            "llm_qos_upstream_saturated", "1 while the engine reports itself saturated and new admissions are held.", value=int(s.saturated)
        )
        r = s.reading
        load = GaugeMetricFamily("llm_qos_upstream_load", "The engine's last reported KV-cache load (fraction).")
        if r is not None and r.load is not None:
            load.add_metric([], r.load)
        yield load
        waiting = GaugeMetricFamily("llm_qos_upstream_waiting", "Requests waiting inside the engine, as it last reported.")
        if r is not None and r.waiting is not None:
            waiting.add_metric([], r.waiting)
        yield waiting
        yield GaugeMetricFamily(
            "llm_qos_admission_capacity", "Requests allowed in flight now: max_inflight, or lower by the load signal.",
            value=s._state.admission.scheduler.capacity,
        )
        polls = CounterMetricFamily("llm_qos_load_signal_polls", "Polls of the engine's load, by result (ok, error, no_signal).", labels=["result"])
        for result, n in s.polls.items():
            polls.add_metric([result], n)
        yield polls


LOAD_SIGNAL = web.AppKey("llm_qos_load_signal", LoadSignal)
