"""Engine health: when an engine leaves rotation and when it comes back.

Two parts: :class:`EngineHealth`, a pure state machine per engine (no I/O, injected clock
and random source), and :class:`HealthChecker`, the asyncio side that sends the active
checks and probes it asks for, one task per engine, each sleeping until its next check
is due or its state changes (an event: no polling loop).

The rule (``pools[].health``, :class:`proxy.config.pools.HealthConfig`):

* **Passive.** Every request the relay sends reports its result
  (:meth:`EngineHealth.record_request`). A failure is: the connection refused or reset
  before any answer byte, no response headers in time, a 5xx answer (or an error the
  engine reports inside a 200 answer whose ``code`` is a 5xx), or a stream cut or
  unfinished (:data:`FAILURE_REASONS`). ``failures_to_eject`` consecutive failures (3)
  eject the engine; any success resets the count. A 4xx is the client's problem: it is
  a success here, and so is any other error the engine reports in its answer (an
  in-band error event with code 400, LightLLM's "prompt too long" event, a JSON 200
  error body): the engine answered, and one client's bad requests must not eject it.
  So are a ``501 Not Implemented`` and a ``505 HTTP Version Not Supported``
  (:data:`NOT_FAILURE_STATUSES`): the engine says the request's route or version is
  one it does not serve, which any client can ask for.
* **The floor.** Failed requests are what a client can cause: one user whose requests
  make every engine answer 5xx would otherwise eject every engine of the pool, a denial
  of service for all. So a passive ejection is refused when it would leave more than
  ``max_ejection_percent`` (50) of the pool's engines ejected, and at least one engine
  always stays in rotation against passive ejections (:func:`max_passive_ejections`:
  of 1 engine none, of 2 at most 1, of 3 at most 1, of 4 at most 2), as Envoy's outlier
  detection does (``max_ejection_percent``). The pool decides (it knows how many of its
  engines are out: :meth:`proxy.routing.router.PoolRouter.report`); a refused ejection is
  counted (``ejections_refused``) and logged once per episode (until the engine answers
  a request well, or is ejected). Active checks are not held back: a failing check path
  is the engine's own state, no client's doing, and may take every engine out.
* **Active.** Every ``check_interval_s`` (5 s; 0: never) an engine in rotation gets a
  ``GET check_path`` (``/token_load`` for LightLLM, ``/v1/models`` for OpenAI-style
  engines); a non-2xx answer, a connection error or no answer within
  ``check_timeout_s`` is a failed check, and ``checks_to_eject`` consecutive failed
  checks (2) eject it. Request and check failures are counted apart, so a stream of
  successful checks cannot hide failing requests, nor the reverse.
* **Back in.** An ejected engine gets no new requests (those in flight finish). For its
  n-th ejection in a row it waits ``b = min(eject_max_s, eject_base_s * 2**(n-1))``
  seconds with "equal jitter", a uniformly random duration in ``[b/2, b]`` (M. Brooker,
  "Exponential Backoff And Jitter", AWS Architecture Blog, 2015), so that engines
  ejected together are not probed together; then one probe (the same ``GET``) decides:
  passed, the engine is back in rotation with its failure counts cleared; failed, it is
  ejected again for the next, doubled, wait. An ejection within ``eject_max_s`` of the
  last readmission counts as "in a row" (a flapping engine backs off exponentially); a
  later one starts over at ``eject_base_s``.

Draining (an engine removed by a reload) is not a health state: the router keeps it out
of rotation while its requests finish (:mod:`proxy.routing.router`).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp

from ..config.pools import HealthConfig

log = logging.getLogger("llm_qos.engine_health")

#: Why a request counted as failed (a bounded label set for metrics).
FAILURE_REASONS = ("connect", "reset", "timeout", "http_5xx", "stream_cut")

#: 5xx statuses that are not engine failures: ``501 Not Implemented`` and ``505 HTTP
#: Version Not Supported`` say the request asked for what the engine does not serve (a
#: route, a method, a version): the engine answered, as with a 4xx.
NOT_FAILURE_STATUSES = frozenset({501, 505})


@dataclass(frozen=True, slots=True)
class Verdict:
    """What this replica tells an engine's health after one exchange with it: the
    arguments of :meth:`EngineHealth.record_request` (through
    :meth:`proxy.routing.router.PoolRouter.report`).

    Attributes:
        ok: the engine answered (4xx included): its failure streak is reset.
        reason: for a failure, one of :data:`FAILURE_REASONS`.
        detail: a short description of the failure, for status pages.
        status: an ``http_5xx`` failure's status, when known.
    """

    ok: bool
    reason: str | None = None
    detail: str = ""
    status: int | None = None


ANSWERED = Verdict(True)


def exchange_verdict(
    answered: int | None,
    failed: bool = False,
    detail: str = "",
    *,
    unsent: bool = False,
    timed_out: bool = False,
    opaque: bool = False,
    engine_error: bool = False,
    engine_error_status: int | None = None,
) -> Verdict | None:
    """The engine-health verdict of one exchange with an engine: the one place where the
    passive rule (module docstring) reads a request's outcome.

    What does this replica claim for an engine it skips? Nothing: ``None``. An exchange
    that heard nothing from the engine and did not fail to reach it (the client left, or
    the request was preempted, while it waited for the engine's headers; no request was
    opened) is no evidence either way: no success that would reset the engine's failure
    streak, no failure that would count toward ejecting it. Nor is an engine the router
    passed over told anything. (The single-``upstream`` form claims nothing at all: its
    pool tracks no health, :attr:`proxy.admission.admission.Pool.tracks_health`.)

    Args:
        answered: the status of the engine's answer once its headers came; ``None``
            when none came.
        failed: the exchange failed on the engine's side. Without an answer: the
            request could not be opened (see ``unsent``, ``timed_out``; else the
            connection was reset or closed without an answer). With one: the relay ended
            it as ``upstream_error`` (a stream cut or unfinished, a body that broke, an
            encoding the proxy cannot read, or an error the engine reported itself: see
            ``engine_error``); for a pass-through answer, its transfer broke.
        detail: the failure's short description.
        unsent: the open failed before any byte reached the engine (``connect``).
        timed_out: the open got no headers in time (``timeout``).
        opaque: a pass-through path's answer: its status, any status, says nothing of
            the engine's health (a 5xx may be that path's own); only a broken transfer.
        engine_error: the failure was an error the engine reported in its answer (an
            in-band error event, a JSON error body): the engine answered, as with a 4xx.
        engine_error_status: the 4xx/5xx that error names, if any: a 5xx is a failure.

    Returns:
        ``None`` (no claim), :data:`ANSWERED`, or a failure: ``connect``, ``timeout``,
        ``reset`` (no answer), ``http_5xx`` (a 5xx status, or one the engine named in its
        answer), ``stream_cut`` (an answer below 400 that broke or ended unfinished).
    """
    if answered is None:
        if not failed:
            return None
        return Verdict(False, "connect" if unsent else "timeout" if timed_out else "reset", detail)
    if opaque:
        return Verdict(False, "stream_cut", detail) if failed else ANSWERED
    if answered >= 500:
        return Verdict(False, "http_5xx", f"answered {answered}", answered)
    if engine_error_status is not None and engine_error_status >= 500:
        return Verdict(False, "http_5xx", f"reported a {engine_error_status} error in its answer", engine_error_status)
    if failed and answered < 400 and not engine_error:
        return Verdict(False, "stream_cut", detail)
    return ANSWERED


def max_passive_ejections(engines: int, percent: int) -> int:
    """How many of a pool's ``engines`` (in rotation or ejected; draining ones aside) may
    be ejected at once when the next ejection is a passive one: ``percent`` of them,
    rounded down but at least 1 when ``percent > 0`` (Envoy's rule), and never all: at
    least one engine stays in rotation. 1 engine: 0; 2: 1; 3: 1 (at 50 %); 4: 2; 10: 5."""
    if engines <= 1 or percent <= 0:
        return 0
    return min(engines - 1, max(1, engines * percent // 100))


class Health(enum.Enum):
    """An engine's health: in rotation, or ejected until a probe passes."""

    HEALTHY = "healthy"
    EJECTED = "ejected"


def check_path_for(config: HealthConfig, kind: str) -> str:
    """The path an active check ``GET``s: ``config.check_path``, else ``/token_load``
    for a ``lightllm`` engine (``/health`` of LightLLM 0.0.1 always answers 200, and
    v1.2.0's answers 200 while nothing is in flight, which does not prove the engine
    generates: docs/deploy.md, "LightLLM") and
    ``/v1/models`` for an ``openai`` one (every
    OpenAI-compatible server, hosted APIs included, answers it)."""
    if config.check_path:
        return config.check_path
    return "/token_load" if kind == "lightllm" else "/v1/models"


class EngineHealth:
    """The health state machine of one engine (see the module docstring for the rule).

    Args:
        config: the pool's ``health`` settings.
        name: the engine's name (for log lines).
        clock: monotonic seconds.
        rng: returns a float in [0, 1) (the jitter of ejection times).

    Attributes:
        state: :class:`Health`.
        request_failures, check_failures: consecutive failures of each kind.
        streak: ejections in a row (sets the next backoff).
        ejected_until: clock reading at which an ejected engine is probed, else ``None``.
        ejections: ejections since start (a metric).
        ejections_refused: passive ejections refused since start because the pool was at
            its floor (``max_ejection_percent``; a metric).
        ejection_held: a passive ejection is being refused now (an episode: from the
            first refusal until a request succeeds or the engine is ejected).
        failures: failed requests by reason (:data:`FAILURE_REASONS`), since start.
        checks: checks and probes by result (``ok``, ``failed``), since start.
        last_error: a short description of the last failure, for status pages.
        on_change: called (no arguments) whenever the state or the time of the next
            check changes; :class:`HealthChecker` sets it to wake its task.
    """

    def __init__(
        self, config: HealthConfig, name: str = "", clock: Callable[[], float] = time.monotonic, rng: Callable[[], float] = random.random
    ) -> None:
        self.config = config
        self.name = name
        self._clock = clock
        self._rng = rng
        self.state = Health.HEALTHY
        self.request_failures = 0
        self.check_failures = 0
        self.streak = 0
        self.ejected_until: float | None = None
        self.readmitted_at = -math.inf
        self.last_check_at = clock()
        self.ejections = 0
        self.ejections_refused = 0
        self.ejection_held = False
        self.failures = dict.fromkeys(FAILURE_REASONS, 0)
        self.checks = {"ok": 0, "failed": 0}
        self.last_error: str | None = None
        self.on_change: Callable[[], None] | None = None

    @property
    def healthy(self) -> bool:
        """Whether the engine is in rotation (as far as health goes)."""
        return self.state is Health.HEALTHY

    def reconfigure(self, config: HealthConfig) -> None:
        """Use new settings from now on (a reload); counts and state are kept."""
        self.config = config
        self._changed()

    def reset(self) -> None:
        """Forget everything learned (the engine now names another server): healthy,
        no failures, no ejection streak. The counters since start are kept."""
        self.state = Health.HEALTHY
        self.request_failures = self.check_failures = self.streak = 0
        self.ejected_until = None
        self.readmitted_at = -math.inf
        self.last_error = None
        self.ejection_held = False
        self._changed()

    def record_request(
        self,
        ok: bool,
        reason: str | None = None,
        detail: str = "",
        *,
        status: int | None = None,
        may_eject: bool | Callable[[], bool] = True,
    ) -> bool:
        """Report the result of one request sent to the engine.

        Args:
            ok: it got an answer that is not a 5xx (a 4xx counts as ok).
            reason: for a failure, one of :data:`FAILURE_REASONS`.
            detail: a short description for status pages.
            status: for an ``http_5xx`` failure, the status the engine answered (or named
                in its answer), when known. One of :data:`NOT_FAILURE_STATUSES` makes the
                report a success.
            may_eject: whether this failure may eject the engine if it is the
                ``failures_to_eject``-th in a row (asked only then, when a callable): the
                pool's floor (:meth:`proxy.routing.router.PoolRouter.report`). Refused, the
                engine stays in rotation; the refusal is counted and logged once per
                episode.

        Returns:
            True when this failure ejected the engine.

        Raises:
            ValueError: ``ok`` is false and ``reason`` is not a known reason.
        """
        if not ok and reason == "http_5xx" and status in NOT_FAILURE_STATUSES:
            ok = True  # the engine answered that it does not serve this: not its failure
        if ok:
            self.request_failures = 0
            self.ejection_held = False
            return False
        if reason not in self.failures:
            raise ValueError(f"unknown failure reason {reason!r}; one of {FAILURE_REASONS}")
        self.failures[reason] += 1
        self.last_error = f"{reason}: {detail}" if detail else reason
        if self.state is not Health.HEALTHY:
            return False  # requests that were in flight when it was ejected
        self.request_failures += 1
        if self.request_failures >= self.config.failures_to_eject:
            allowed = may_eject() if callable(may_eject) else may_eject
            if not allowed:
                self.ejections_refused += 1
                if not self.ejection_held:
                    self.ejection_held = True
                    log.warning(
                        "engine %s kept in rotation: %d failed requests in a row (the last %s), but its pool is at its floor "
                        "(health.max_ejection_percent %d%%; at least one engine stays in rotation against failed requests); "
                        "counted in llm_qos_engine_ejections_refused_total, logged once until it answers a request or is ejected",
                        self.name,
                        self.request_failures,
                        self.last_error,
                        self.config.max_ejection_percent,
                    )
                return False
            self._eject(f"{self.request_failures} failed requests in a row, the last {self.last_error}")
            return True
        return False

    def record_check(self, ok: bool, detail: str = "") -> None:
        """Report the result of an active check (engine in rotation) or a probe
        (ejected engine whose wait is over)."""
        now = self._clock()
        self.last_check_at = now
        self.checks["ok" if ok else "failed"] += 1
        if self.state is Health.EJECTED:
            if ok:
                self.state = Health.HEALTHY
                self.request_failures = self.check_failures = 0
                self.ejected_until = None
                self.readmitted_at = now
                log.info("engine %s back in rotation: a probe passed", self.name)
            else:
                self.last_error = f"probe: {detail}" if detail else "probe failed"
                self._eject(self.last_error, again=True)
            self._changed()
            return
        if ok:
            self.check_failures = 0
        else:
            self.check_failures += 1
            self.last_error = f"check: {detail}" if detail else "check failed"
            if self.check_failures >= self.config.checks_to_eject:
                self._eject(f"{self.check_failures} failed checks in a row, the last {self.last_error}")
                return
        self._changed()

    def check_due_in(self) -> float | None:
        """Seconds until the next check or probe is due (0: now), or ``None`` when
        none is scheduled (``check_interval_s`` 0 and the engine in rotation)."""
        now = self._clock()
        if self.state is Health.EJECTED:
            assert self.ejected_until is not None
            return max(0.0, self.ejected_until - now)
        interval = self.config.check_interval_s
        if interval <= 0:
            return None
        return max(0.0, self.last_check_at + interval - now)

    def retry_after_s(self) -> float | None:
        """Seconds until an ejected engine is probed, else ``None``."""
        if self.ejected_until is None:
            return None
        return max(0.0, self.ejected_until - self._clock())

    def backoff_s(self, streak: int) -> float:
        """The wait before the probe after the ``streak``-th ejection in a row, before
        jitter: ``min(eject_max_s, eject_base_s * 2**(streak-1))`` seconds."""
        c = self.config
        return min(c.eject_max_s, c.eject_base_s * 2.0 ** min(max(streak, 1) - 1, 60))

    def _eject(self, why: str, again: bool = False) -> None:
        now = self._clock()
        if again or now - self.readmitted_at < self.config.eject_max_s:
            self.streak += 1
        else:
            self.streak = 1
        b = self.backoff_s(self.streak)
        wait = b / 2 + self._rng() * b / 2
        self.state = Health.EJECTED
        self.ejection_held = False
        self.ejected_until = now + wait
        if not again:  # a failed probe keeps it out; it was not in rotation to leave
            self.ejections += 1
        log.warning("engine %s ejected (%s); probed again in %.1f s (ejection %d in a row)", self.name, why, wait, self.streak)
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()


class HealthChecker:
    """Sends the active checks and probes that engines' :class:`EngineHealth` ask for.

    One asyncio task per watched engine. The task sleeps until
    :meth:`EngineHealth.check_due_in` says a check or probe is due, or until the
    engine's health changes (its ``on_change`` sets the task's event: a passive ejection
    moves the next probe), then sends one ``GET`` and reports the result. Nothing runs
    while nothing is due. Each check opens a fresh connection (``force_close``), so a check
    proves the engine still accepts connections, and its answer body is read to at most
    64 KiB.

    An engine is anything with ``name``, ``url``, ``health`` (an :class:`EngineHealth`)
    and ``spec.kind`` / ``spec.upstream.credential()`` (a :class:`proxy.routing.engine_state.EngineState`).

    ``on_checked``, when given, is called with the engine after each check or probe has
    been recorded (the proxy dispatches the engine's pool there: room may have come back).

    Create and use it inside a running event loop; :meth:`close` it on shutdown.
    """

    MAX_BODY = 64 * 1024

    def __init__(self, on_checked: Callable[[Any], None] | None = None) -> None:
        self._tasks: dict[Any, asyncio.Task] = {}
        self._session: aiohttp.ClientSession | None = None
        self.on_checked = on_checked

    @property
    def watched(self) -> list[Any]:
        """The engines being watched."""
        return list(self._tasks)

    def sync(self, engines: Iterable[Any]) -> None:
        """Watch exactly ``engines`` (all engines in rotation or ejected, across pools):
        start tasks for new ones, stop those of engines no longer listed."""
        keep = {e for e in engines if not getattr(e, "draining", False)}
        for e in list(self._tasks):
            if e not in keep:
                self.unwatch(e)
        for e in keep:
            self.watch(e)

    def watch(self, engine: Any) -> None:
        """Start checking ``engine`` (a no-op when it is watched already)."""
        if engine not in self._tasks:
            self._tasks[engine] = asyncio.get_running_loop().create_task(self._run(engine), name=f"llm-qos health {engine.name}")

    def unwatch(self, engine: Any) -> None:
        """Stop checking ``engine`` (its task is cancelled)."""
        task = self._tasks.pop(engine, None)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        """Stop every task and close the checks' connections."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _run(self, engine: Any) -> None:
        health: EngineHealth = engine.health
        wake = asyncio.Event()
        health.on_change = wake.set
        try:
            while True:
                wake.clear()
                due = health.check_due_in()
                if due is None:
                    await wake.wait()
                    continue
                if due > 0:
                    try:
                        async with asyncio.timeout(due):
                            await wake.wait()
                    except TimeoutError:
                        pass
                    continue
                ok, detail = await self.check(engine)
                if self._tasks.get(engine) is not asyncio.current_task():
                    return  # unwatched while the check was in flight
                health.record_check(ok, detail)
                if self.on_checked is not None:
                    self.on_checked(engine)  # an engine back in rotation: dispatch its pool
        finally:
            if health.on_change == wake.set:
                health.on_change = None

    async def check(self, engine: Any) -> tuple[bool, str]:
        """One ``GET`` of ``engine``'s check path. Returns ``(passed, detail)``: passed
        on a 2xx answer within ``check_timeout_s``; detail says what went wrong."""
        cfg: HealthConfig = engine.health.config
        path = check_path_for(cfg, engine.spec.kind)
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True, limit=0),
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=True,
            )
        headers = {"Accept": "application/json"}
        key = engine.spec.upstream.credential()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        try:
            async with asyncio.timeout(cfg.check_timeout_s):
                async with self._session.get(engine.url + path, headers=headers, allow_redirects=False) as resp:
                    await resp.content.read(self.MAX_BODY)
                    status = resp.status
        except TimeoutError:
            return False, f"GET {path}: no answer within {cfg.check_timeout_s:g} s"
        except (aiohttp.ClientError, OSError) as e:
            return False, f"GET {path}: {type(e).__name__}: {e}"
        if 200 <= status < 300:
            return True, ""
        return False, f"GET {path} answered {status}"
