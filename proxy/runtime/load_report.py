"""What an engine's own load report says: reading it, and what it means for admission.

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
  signal (:class:`NoSignal`).

What a fresh reading calls for (:func:`capacity_for`; the engine's limit in its pool's
router, :meth:`proxy.routing.engine_state.EngineState.set_load`, which the pool's scheduler sees
at dispatch):

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import orjson

from ..config.schema import LoadSignalConfig, UpstreamConfig

Source = Literal["token_load", "metrics"]

_VLLM_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_VLLM_WAITING = ("vllm:num_requests_waiting",)
_SGLANG_USAGE = ("sglang:token_usage",)
_SGLANG_WAITING = ("sglang:num_queue_reqs",)
_VLLM_RUNNING = ("vllm:num_requests_running",)
_SGLANG_RUNNING = ("sglang:num_running_reqs",)
_VLLM_WORK = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
_SGLANG_WORK = ("sglang:prompt_tokens_total", "sglang:generation_tokens_total")
_WANTED = frozenset(
    _VLLM_USAGE + _VLLM_WAITING + _VLLM_RUNNING + _VLLM_WORK + _SGLANG_USAGE + _SGLANG_WAITING + _SGLANG_RUNNING + _SGLANG_WORK
)


@dataclass(frozen=True, slots=True)
class Reading:
    """One load report.

    Attributes:
        load: fraction (0-1) of the engine's KV budget in use or reserved, or ``None``.
        waiting: requests queued inside the engine, or ``None`` when it does not say.
        engine: ``lightllm``, ``vllm`` or ``sglang``.
        running: requests the engine runs now (vLLM ``vllm:num_requests_running``, SGLang
            ``sglang:num_running_reqs``; every client's, all replicas'), or ``None``.
        work: tokens the engine has processed since it started (its prompt and generation
            token counters summed), or ``None`` when it does not say: a report whose
            ``work`` has not moved while the engine holds requests is the same engine step
            read again (:func:`is_repeat`).
    """

    load: float | None
    waiting: int | None
    engine: str
    running: int | None = None
    work: float | None = None


def is_repeat(last: Reading | None, new: Reading) -> bool:
    """Whether ``new`` is the engine's last step read again, not a report of a new one.

    vLLM sets its gauges (``num_requests_running``/``waiting``, KV usage) once per engine
    step, with its token counters; a step can last longer than the poll interval (vLLM's
    CPU build at a full batch, or a host short of CPU: measured, one reading of 44
    running and 24 waiting unchanged for 36 s). Two such readings are one observation: the
    capacity controller's "two reports in a row" must be two engine steps. True when both
    carry ``work``, it has not moved, and the engine holds requests (an idle engine's
    repeats say nothing either way).
    """
    return (
        last is not None
        and new.work is not None
        and new.work == last.work
        and bool(new.running or new.waiting)
    )


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
    for engine, usage_names, waiting_names, running_names, work_names in (
        ("vllm", _VLLM_USAGE, _VLLM_WAITING, _VLLM_RUNNING, _VLLM_WORK),
        ("sglang", _SGLANG_USAGE, _SGLANG_WAITING, _SGLANG_RUNNING, _SGLANG_WORK),
    ):
        usage = next((found[n] for n in usage_names if n in found), None)
        waiting = next((found[n] for n in waiting_names if n in found), None)
        if usage is None and waiting is None:
            continue
        running = next((found[n] for n in running_names if n in found), None)
        work = [v for n in work_names for v in found.get(n, ())]
        return Reading(
            load=min(usage) if usage else None,
            waiting=int(sum(waiting)) if waiting else None,
            engine=engine,
            running=int(sum(running)) if running else None,
            work=sum(work) if work else None,
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
