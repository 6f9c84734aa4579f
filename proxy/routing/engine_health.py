"""Engine health: when an engine leaves rotation and when it comes back.

:class:`EngineHealth` is a pure state machine per engine (no I/O, injected clock and
random source). The asyncio side that sends the active checks and probes it asks for is
:class:`proxy.routing.health_checker.HealthChecker`; what one request's outcome tells an
engine's health is :func:`proxy.routing.exchange_verdict.exchange_verdict`.

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

import enum
import logging
import math
import random
import time
from collections.abc import Callable

from ..config.pools import HealthConfig

log = logging.getLogger("llm_qos.engine_health")

#: Why a request counted as failed (a bounded label set for metrics).
FAILURE_REASONS = ("connect", "reset", "timeout", "http_5xx", "stream_cut")

#: 5xx statuses that are not engine failures: ``501 Not Implemented`` and ``505 HTTP
#: Version Not Supported`` say the request asked for what the engine does not serve (a
#: route, a method, a version): the engine answered, as with a 4xx.
NOT_FAILURE_STATUSES = frozenset({501, 505})


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
