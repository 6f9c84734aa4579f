"""The engine's own load report, turned into an admission hold.

The proxy's ``admission.max_inflight`` is a guess at what the engine can run at once. The
engine knows better: when its KV cache is full it queues new requests itself, in arrival
order, blind to priorities and fair shares. So while the engine reports itself saturated,
the proxy dispatches nothing new and lets requests wait in *its* queue, where the
scheduler orders them. One small ``GET`` per ``upstream.load_signal.interval_s`` (0.5 s by
default) on a connection of its own; the task sleeps in between.

Sources (LightLLM v1.2.0 ``lightllm/server/api_http.py:token_load``; docs/deploy.md):

* ``kind: lightllm``: ``GET /token_load`` -> ``{"current_load", "logical_max_load",
  "dynamic_max_load"}``, fractions of the KV token budget (lists, one per rank, with
  ``--dp`` > 1). A rank's load is ``max(current_load, dynamic_max_load)`` (the second is
  the router's estimate of the peak its running batch will reach); the engine is
  saturated when every rank's load is at least ``saturated_at``.
* ``kind: openai``: ``GET /metrics`` (Prometheus text). vLLM: ``vllm:kv_cache_usage_perc``
  (older releases: ``vllm:gpu_cache_usage_perc``), a fraction despite its name, and
  ``vllm:num_requests_waiting``; SGLang: ``sglang:token_usage`` and
  ``sglang:num_queue_reqs``. Over several series (engines of one server) the usage is the
  lowest and the waiting count the sum. Saturated when the usage is at least
  ``saturated_at`` or the waiting count at least ``queue_at`` (0: ignored).
* Anything else (a 404, other metric names: hosted APIs, ``transformers serve``): no
  signal. With ``enabled: auto`` polling stops until the ``upstream`` section changes;
  with ``enabled: true`` it is retried every 30 s, with one warning.

Each engine is polled on its own (:class:`EnginePoller`); each fresh reading sets that
engine's capacity limit in its pool's router (:func:`capacity_for`;
:meth:`proxy.routing.router.EngineState.set_load`), which the pool's scheduler sees at dispatch:

* saturated: 1. Nothing new is dispatched as long as any of our requests is in flight,
  and one is when none is, so the proxy cannot deadlock behind an engine kept busy by
  someone else; queued requests keep their ``queue_timeout_s``.
* not saturated, with ``n`` of our requests in flight and a load ``L``: ``n`` plus as
  many requests of the average size ``L / n`` as fit below ``saturated_at``, at least one.
  So when the engine drains, the proxy's queue is fed to it as room appears instead of
  all at once (which would only move the queue into the engine's FIFO); a share of the
  load that is not ours makes the estimate conservative, and capacity then grows by one
  request per poll.
* no load figure, or nothing of ours in flight: no limit (``max_inflight``).

A reading older than ``stale_after_s`` (the engine stopped answering, polls fail or hang)
lifts any limit: admission falls back to ``max_inflight``, never to zero because a poll
failed. Arrivals faster than the poll interval are not held until the next reading shows
their load: the signal steers sustained load, ``max_inflight`` still caps bursts.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Literal

import aiohttp
import orjson
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from qos.capacity_control import Observation

from ..config.schema import LoadSignalConfig, UpstreamConfig
from ..config.pools import public_url
from .state import ProxyState

log = logging.getLogger("llm_qos.load_signal")

Source = Literal["token_load", "metrics"]
UNSUPPORTED_RETRY_S = 30.0  # ``enabled: true`` on an upstream without a signal
MAX_ERROR_BACKOFF_S = 2.0  # polls of an unreachable upstream slow down to this
MAX_POLL_TIMEOUT_S = 2.0

_VLLM_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_VLLM_WAITING = ("vllm:num_requests_waiting",)
_SGLANG_USAGE = ("sglang:token_usage",)
_SGLANG_WAITING = ("sglang:num_queue_reqs",)
_VLLM_RUNNING = ("vllm:num_requests_running",)
_SGLANG_RUNNING = ("sglang:num_running_reqs",)
_WANTED = frozenset(_VLLM_USAGE + _VLLM_WAITING + _VLLM_RUNNING + _SGLANG_USAGE + _SGLANG_WAITING + _SGLANG_RUNNING)


@dataclass(frozen=True, slots=True)
class Reading:
    """One load report.

    Attributes:
        load: fraction (0-1) of the engine's KV budget in use or reserved, or ``None``.
        waiting: requests queued inside the engine, or ``None`` when it does not say.
        engine: ``lightllm``, ``vllm`` or ``sglang``.
        running: requests the engine runs now (vLLM ``vllm:num_requests_running``, SGLang
            ``sglang:num_running_reqs``; every client's, all replicas'), or ``None``.
    """

    load: float | None
    waiting: int | None
    engine: str
    running: int | None = None


class NoSignal(Exception):
    """The upstream answered, but with nothing this module can read as load."""


def _num(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def parse_token_load(body: bytes) -> Reading:
    """Read LightLLM's ``/token_load`` answer.

    Raises:
        NoSignal: not JSON, or without ``current_load`` / ``dynamic_max_load`` numbers.
    """
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise NoSignal("/token_load is not JSON") from None
    if not isinstance(obj, dict):
        raise NoSignal("/token_load is not a JSON object")

    def ranks(key: str) -> list[float]:
        v = obj.get(key)
        vals = v if isinstance(v, list) else [v]
        return [f for f in map(_num, vals) if f is not None]

    current, dynamic = ranks("current_load"), ranks("dynamic_max_load")
    if not current and not dynamic:
        raise NoSignal("/token_load has neither current_load nor dynamic_max_load")
    n = max(len(current), len(dynamic))
    per_rank = [
        max(current[i] if i < len(current) else 0.0, dynamic[i] if i < len(dynamic) else 0.0) for i in range(n)
    ]
    return Reading(load=min(per_rank), waiting=None, engine="lightllm")


def _sample(line: str) -> tuple[str, float] | None:
    """``(name, value)`` of one Prometheus sample line, or ``None`` if unreadable."""
    brace = line.find("{")
    if brace >= 0:
        name, rest = line[:brace], line[line.rfind("}") + 1 :]
    else:
        name, _, rest = line.partition(" ")
    parts = rest.split()
    if not parts:
        return None
    try:
        value = float(parts[0])
    except ValueError:
        return None
    return (name.strip(), value) if math.isfinite(value) else None


def parse_prometheus(text: str) -> Reading:
    """Read vLLM's or SGLang's load from a Prometheus ``/metrics`` text.

    Raises:
        NoSignal: none of the metrics named in the module docstring is there.
    """
    found: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not (line.startswith("vllm:") or line.startswith("sglang:")):
            continue
        s = _sample(line)
        if s is not None and s[0] in _WANTED:
            found.setdefault(s[0], []).append(s[1])
    for engine, usage_names, waiting_names, running_names in (
        ("vllm", _VLLM_USAGE, _VLLM_WAITING, _VLLM_RUNNING),
        ("sglang", _SGLANG_USAGE, _SGLANG_WAITING, _SGLANG_RUNNING),
    ):
        usage = next((found[n] for n in usage_names if n in found), None)
        waiting = next((found[n] for n in waiting_names if n in found), None)
        if usage is None and waiting is None:
            continue
        running = next((found[n] for n in running_names if n in found), None)
        return Reading(
            load=min(usage) if usage else None,
            waiting=int(sum(waiting)) if waiting else None,
            engine=engine,
            running=int(sum(running)) if running else None,
        )
    raise NoSignal("/metrics has no vLLM or SGLang load metrics")


def is_saturated(reading: Reading, cfg: LoadSignalConfig) -> bool:
    """Whether ``reading`` says the engine cannot take more work now."""
    if reading.load is not None and reading.load >= cfg.saturated_at:
        return True
    return cfg.queue_at > 0 and reading.waiting is not None and reading.waiting >= cfg.queue_at


def capacity_for(reading: Reading, cfg: LoadSignalConfig, inflight: int) -> int | None:
    """The scheduler capacity limit a fresh ``reading`` calls for while ``inflight`` of our
    requests are in flight (see the module docstring); ``None`` for no limit."""
    if is_saturated(reading, cfg):
        return 1
    if reading.load is None or reading.load <= 0 or inflight <= 0:
        return None
    per_request = reading.load / inflight
    return inflight + max(1, int((cfg.saturated_at - reading.load) / per_request + 1e-9))


def source_of(upstream: UpstreamConfig) -> Source | None:
    """What to poll for ``upstream``, or ``None`` when the signal is off."""
    if upstream.load_signal.enabled is False:
        return None
    return "token_load" if upstream.kind == "lightllm" else "metrics"


class EnginePoller:
    """The polling task of one engine: reads its load and sets its capacity limit in its
    pool's router (:meth:`proxy.routing.router.EngineState.set_load`).

    Args:
        engine: the engine (:class:`proxy.routing.router.EngineState`); its ``spec.upstream`` is
            read at every poll, so a hot reload of its settings applies at the next one.
        on_room: called with the engine when its limit was raised or lifted (the proxy
            dispatches its pool's queue).
        totals: the proxy-wide poll counts to add this engine's to.
        clock: monotonic clock (seconds).
        demand: whether requests wait in the proxy for the engine's pool now (the
            capacity controller grows only under demand).

    Attributes:
        reading, reading_at, saturated, limit, no_signal, polls: as for :class:`LoadSignal`,
            for this engine.
    """

    def __init__(self, engine, on_room, totals: dict[str, int], clock=time.monotonic, demand=lambda: False) -> None:
        self.engine = engine
        self._on_room = on_room
        self._demand = demand
        self._new_reading = False
        self._totals = totals
        self._clock = clock
        self._task: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None
        self._key: tuple | None = None
        self._paused_until = 0.0
        self._error_streak = 0
        self.reading: Reading | None = None
        self.reading_at = -math.inf
        self.saturated = False
        self.limit: int | None = None
        self.no_signal = False
        self.polls = {"ok": 0, "error": 0, "no_signal": 0}

    def start(self) -> None:
        """Start polling (a no-op when already started)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"llm-qos load signal {self.engine.name}")

    async def stop(self) -> None:
        """Stop polling, lift the limit, close the connection."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._apply(None)

    def _count(self, result: str) -> None:
        self.polls[result] += 1
        self._totals[result] += 1

    async def _run(self) -> None:
        while True:
            upstream = self.engine.spec.upstream
            delay = upstream.load_signal.interval_s
            try:
                delay = await self._step(upstream)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let a bug here stop the proxy or freeze a hold
                log.exception("load signal poll of %s failed unexpectedly; holding nothing", self.engine.name)
                self._apply(None)
            await asyncio.sleep(delay)

    async def _step(self, upstream: UpstreamConfig) -> float:
        """One poll (or none, when off or paused); returns the seconds until the next."""
        cfg = upstream.load_signal
        key = (upstream.url, upstream.kind, cfg.enabled, upstream.credential())
        if key != self._key:  # a new upstream: forget what the old one said
            self._key = key
            self._paused_until = 0.0
            self.no_signal = False
            self.reading, self.reading_at = None, -math.inf
            self._error_streak = 0
            if self._session is not None:
                await self._session.close()
                self._session = None
        source = source_of(upstream)
        now = self._clock()
        if source is None or now < self._paused_until:
            self._apply(None, signal="off" if source is None else "no_signal")
            self._control(None, cfg)
            return cfg.interval_s
        delay = cfg.interval_s
        try:
            reading = await self.poll(upstream, source)
        except NoSignal as e:
            self._count("no_signal")
            self.reading, self.reading_at = None, -math.inf
            if not self.no_signal:
                level = logging.INFO if cfg.enabled == "auto" else logging.WARNING
                log.log(level, "engine %s has no load signal (%s); admission uses its max_inflight alone", public_url(upstream.url), e)
            self.no_signal = True
            self._paused_until = math.inf if cfg.enabled == "auto" else now + UNSUPPORTED_RETRY_S
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            self._count("error")
            self._error_streak += 1
            if self._error_streak == 3:
                log.warning("load signal: cannot read the load of %s (%s); admission falls back to max_inflight once the last reading is stale", public_url(upstream.url), str(e) or type(e).__name__)
            delay = min(MAX_ERROR_BACKOFF_S, cfg.interval_s * 2 ** min(self._error_streak, 6))
        else:
            self._count("ok")
            self._error_streak = 0
            self.no_signal = False
            self.reading, self.reading_at = reading, self._clock()
            self._new_reading = True
        fresh = self.reading if self._clock() - self.reading_at <= cfg.stale_after_s else None
        if self.no_signal:
            signal = "no_signal"
        elif self.reading is None:
            signal = "waiting"
        else:
            signal = "ok" if fresh is not None else "stale"
        self._apply(fresh, cfg, signal)
        self._control(fresh if self._new_reading else None, cfg)
        self._new_reading = False
        return delay

    def _control(self, fresh: Reading | None, cfg: LoadSignalConfig) -> None:
        """One step of the engine's capacity controller (:mod:`qos.capacity_control`) from
        ``fresh`` (a reading taken in this step, else ``None``: an old reading is not
        counted twice) and the latency the proxy measured there since the last step;
        dispatch when the capacity grew."""
        engine = self.engine
        before = engine.capacity
        sample = engine.meter.sample(self._clock())
        engine.control.step(
            Observation(
                now=self._clock(),
                inflight=engine.inflight,
                demand=self._demand(),
                engine_waiting=None if fresh is None else fresh.waiting,
                engine_running=None if fresh is None else fresh.running,
                queue_at=cfg.queue_at,
                kv_usage=None if fresh is None else fresh.load,
                saturated_at=cfg.saturated_at,
                tpot_s=sample.tpot_s,
                streams=sample.streams,
                ttft_s=sample.ttft_s,
            )
        )
        if engine.capacity > before:
            self._on_room(engine)

    async def poll(self, upstream: UpstreamConfig, source: Source) -> Reading:
        """One ``GET`` of the load source.

        Raises:
            NoSignal: the answer holds no load signal (a 4xx, or no known metrics).
            aiohttp.ClientError, TimeoutError, OSError: the upstream could not be read.
        """
        cfg = upstream.load_signal
        path = "/token_load" if source == "token_load" else "/metrics"
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=1, keepalive_timeout=upstream.keepalive_timeout_s),
                auto_decompress=True,
            )
        headers = {"Accept": "application/json" if source == "token_load" else "text/plain"}
        key = upstream.credential()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        timeout = aiohttp.ClientTimeout(total=max(0.05, min(MAX_POLL_TIMEOUT_S, cfg.stale_after_s / 2)))
        async with self._session.get(upstream.url + path, headers=headers, timeout=timeout, allow_redirects=False) as resp:
            body = await resp.read()
            status = resp.status
        if 400 <= status < 500:
            raise NoSignal(f"GET {path} answered {status}")
        if status != 200:
            raise aiohttp.ClientResponseError(resp.request_info, (), status=status, message=f"GET {path} answered {status}")
        if source == "token_load":
            return parse_token_load(body)
        return parse_prometheus(body.decode("utf-8", "replace"))

    def _apply(self, fresh: Reading | None, cfg: LoadSignalConfig | None = None, signal: str | None = None) -> None:
        """Set the engine's load and capacity limit from a fresh reading (``None``: none)."""
        engine = self.engine
        saturated = fresh is not None and cfg is not None and is_saturated(fresh, cfg)
        # an adaptive engine's controller lowers its limit on the same reading
        # (:meth:`_control`); the old rule, a hold at 1 and room fed as the load falls,
        # is kept for a fixed capacity
        fixed = not engine.control.adaptive
        limit = capacity_for(fresh, cfg, engine.inflight) if fixed and fresh is not None and cfg is not None else None
        if saturated != self.saturated:
            self.saturated = saturated
            if saturated:
                log.info("engine %s saturated (load %s, waiting %s): holding new admissions to it", engine.name, fresh.load, fresh.waiting)
            else:
                log.info("engine %s no longer saturated (or its load is unknown)", engine.name)
        engine.set_load(
            None if fresh is None else fresh.load, saturated, limit, waiting=None if fresh is None else fresh.waiting, signal=signal
        )
        if limit != self.limit:
            old, self.limit = self.limit, limit
            if limit is None or (old is not None and limit > old):
                self._on_room(engine)  # room grew: dispatch the pool's queue


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
