"""The polling task of one engine's load (:class:`EnginePoller`): one small ``GET`` per
``upstream.load_signal.interval_s`` (0.5 s by default) on a connection of its own, the
task sleeping in between; each fresh reading (:mod:`proxy.runtime.load_report`) sets the
engine's load and capacity limit in its pool's router and steps its capacity controller.

With ``enabled: auto``, an upstream without a signal is not polled again until the
``upstream`` section changes; with ``enabled: true`` it is retried every
:data:`UNSUPPORTED_RETRY_S`, with one warning. A reading older than ``stale_after_s`` (the
engine stopped answering, polls fail or hang) lifts any limit: admission falls back to
``max_inflight``, never to zero because a poll failed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import aiohttp

from qos.capacity_control import Observation

from ..config.pools import public_url
from ..config.schema import LoadSignalConfig, UpstreamConfig
from .load_report import NoSignal, Reading, Source, capacity_for, is_repeat, is_saturated, parse_prometheus, parse_token_load, source_of

log = logging.getLogger("llm_qos.load_signal")

UNSUPPORTED_RETRY_S = 30.0  # ``enabled: true`` on an upstream without a signal
MAX_ERROR_BACKOFF_S = 2.0  # polls of an unreachable upstream slow down to this
MAX_POLL_TIMEOUT_S = 2.0


class EnginePoller:
    """The polling task of one engine: reads its load and sets its capacity limit in its
    pool's router (:meth:`proxy.routing.engine_state.EngineState.set_load`).

    Args:
        engine: the engine (:class:`proxy.routing.engine_state.EngineState`); its ``spec.upstream`` is
            read at every poll, so a hot reload of its settings applies at the next one.
        on_room: called with the engine when its limit was raised or lifted, and after
            each control step while requests wait for its pool (the proxy dispatches its
            pool's queue).
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
            # the engine's last step read again is no new observation for the controller
            self._new_reading = not is_repeat(self.reading, reading)
            self.reading, self.reading_at = reading, self._clock()
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
        dispatch when the capacity grew, or while requests wait for the pool (a class's
        room may have grown: :class:`qos.capacity.RecentPeaks`)."""
        engine = self.engine
        before = engine.capacity
        sample = engine.meter.sample(self._clock())
        engine.control.step(
            Observation(
                now=self._clock(),
                inflight=engine.inflight,
                peak_inflight=max(engine.peak_inflight, engine.inflight),
                demand=self._demand(),
                engine_waiting=None if fresh is None else fresh.waiting,
                engine_running=None if fresh is None else fresh.running,
                queue_at=cfg.queue_at,
                kv_usage=None if fresh is None else fresh.load,
                saturated_at=cfg.saturated_at,
                tpot_s=sample.tpot_s,
                streams=sample.streams,
                ttft_s=sample.ttft_s,
                answered=sample.answered,
                awaiting=sample.awaiting,
            )
        )
        engine.peak_inflight = engine.inflight  # the next step's peak starts from what runs now
        engine.note_late(self._clock(), sample.late_levels)  # a class's first tokens late here: the classes below leave more free
        engine.peaks.roll(self._clock(), engine.held)  # the classes' recent peaks, for their headroom
        if engine.capacity > before or self._demand():
            # the rooms are worked out anew at a step (the capacity, the classes' recent
            # peaks, the places kept for a late class): what waits may fit now
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
