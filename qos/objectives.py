"""Latency objectives: how many of a group's recent requests met their target, and the
percentile the group was promised, per engine (pure: no I/O, time is an argument).

An objective is a target and a percentile: "95 % of this group's requests see their first
token within 1 s" is ``Objective("ttft", target_s=1.0, percentile=95)``. Over a sliding
window (``window_s``, 60 s by default) the tracker gives, per group, per engine and over
all the group's engines:

* ``attainment``: the fraction of requests whose value was at most the target. Exact:
  each request is compared with the target when it is recorded.
* ``measured_s``: the group's promised percentile of the values (nearest rank: the
  smallest recorded value at or above ``ceil(percentile / 100 * requests)`` of them),
  read from a log-bucket histogram, within :data:`RELATIVE_ERROR` (5 %) of the exact one
  for values in [:data:`MIN_S`, :data:`MAX_S`]; below ``MIN_S`` it reads ``MIN_S``
  (1 ms off at most), above ``MAX_S`` it reads ``MAX_S`` (a lower bound).
* ``requests``: how many requests the window holds.

The objective is met when ``attainment >= percentile / 100`` (equivalently, up to the
histogram's error, when ``measured_s <= target_s``).

**The histogram** is DDSketch's log buckets with a fixed range (Masson, Rim, Lee,
"DDSketch: a fast and fully-mergeable quantile sketch with relative-error guarantees",
VLDB 2019, section 2; HdrHistogram's log-linear buckets are the same idea): with
``gamma = (1 + a) / (1 - a)`` for a relative error ``a``, bucket ``i >= 1`` holds the
values in ``(MIN_S * gamma**(i-1), MIN_S * gamma**i]`` and is read as
``MIN_S * 2 * gamma**i / (gamma + 1)``, which is within ``a`` of every value in it.
Bucket 0 holds the values at or below ``MIN_S``, the last one those above ``MAX_S``:
:data:`BINS` (141) buckets for 1 ms .. 1000 s at 5 %.

**The window** is a ring of :data:`SLICES` (60) time slices of ``window_s / SLICES``
seconds each (1 s for 60 s), each a histogram of its requests plus its count and its
count within target; the window's sums are kept beside them (a slice is added on record
and taken out when it leaves the window), so a reading is O(:data:`BINS`) and a record
O(1). A reading covers the current slice and the ``SLICES - 1`` before it: between
``window_s * (1 - 1/SLICES)`` and ``window_s`` of history.

**Memory** is fixed per (group, engine, objective), whatever the request rate:
``(SLICES + 1) * BINS`` counters of 4 bytes (about 34 KiB), plus a few numbers; a
(group, engine) that recorded nothing for a whole window is dropped at the next reading,
so the tracker holds at most groups x engines in use x 2 windows.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from typing import Iterable, Mapping

TTFT = "ttft"  # time to first token, seconds, from the request's arrival (its queue wait included)
TPOT = "tpot"  # time per output token, seconds: (last token - first token) / (output tokens - 1)
OBJECTIVES = (TTFT, TPOT)

MIN_S = 0.001
MAX_S = 1000.0
RELATIVE_ERROR = 0.05
GAMMA = (1 + RELATIVE_ERROR) / (1 - RELATIVE_ERROR)
_LOG_GAMMA = math.log(GAMMA)
_TOP = math.ceil(math.log(MAX_S / MIN_S) / _LOG_GAMMA)  # the last in-range bucket
BINS = _TOP + 2  # underflow, 1.._TOP, overflow
SLICES = 60
DEFAULT_WINDOW_S = 60.0


def bucket_of(value_s: float) -> int:
    """The histogram bucket of ``value_s`` (seconds): 0 at or below :data:`MIN_S`,
    ``BINS - 1`` above :data:`MAX_S`."""
    if value_s <= MIN_S:
        return 0
    i = math.ceil(math.log(value_s / MIN_S) / _LOG_GAMMA)
    return min(max(i, 1), BINS - 1)


def bucket_value(i: int) -> float:
    """The value bucket ``i`` is read as (seconds): within :data:`RELATIVE_ERROR` of every
    value in it (bucket 0: :data:`MIN_S`; the overflow bucket: :data:`MAX_S`)."""
    if i <= 0:
        return MIN_S
    if i >= BINS - 1:
        return MAX_S
    return MIN_S * 2 * GAMMA**i / (GAMMA + 1)


@dataclass(frozen=True, slots=True)
class Objective:
    """One latency objective of a group.

    Attributes:
        name: :data:`TTFT` or :data:`TPOT`.
        target_s: the target, seconds (> 0).
        percentile: the share of requests promised within it, in (0, 100).
    """

    name: str
    target_s: float
    percentile: float


@dataclass(frozen=True, slots=True)
class Reading:
    """An objective's state over a window.

    Attributes:
        requests: requests recorded in the window.
        met: those whose value was at most the target.
        attainment: ``met / requests`` (0..1), ``None`` without requests.
        measured_s: the objective's percentile of the values (seconds; see the module
            docstring for its error), ``None`` without requests.
    """

    requests: int
    met: int
    attainment: float | None
    measured_s: float | None


def percentile_of(counts: Iterable[int], requests: int, percentile: float) -> float | None:
    """The nearest-rank ``percentile`` (0..100) of a histogram: ``counts`` per bucket
    (:data:`BINS` of them) of ``requests`` values in all. ``None`` when empty."""
    if requests <= 0:
        return None
    rank = max(1, math.ceil(percentile / 100 * requests - 1e-9))
    seen = 0
    for i, n in enumerate(counts):
        seen += n
        if seen >= rank:
            return bucket_value(i)
    return MAX_S  # not reached when the counts add up to requests


def reading_of(requests: int, met: int, counts: Iterable[int], percentile: float) -> Reading:
    """The :class:`Reading` of ``requests`` values, ``met`` of them within target, whose
    histogram is ``counts``."""
    if requests <= 0:
        return Reading(0, 0, None, None)
    return Reading(requests, met, met / requests, percentile_of(counts, requests, percentile))


class LatencyWindow:
    """One objective's values over a sliding window, for one group on one engine.

    Args:
        target_s: the target a value is compared with (seconds).
        window_s: the window's length (seconds, > 0).
        slices: time slices the window is cut into (its resolution; :data:`SLICES`).

    ``now`` is any monotonic clock in seconds, the same for every call. Memory: fixed,
    ``(slices + 1) * BINS`` 4-byte counters and ``2 * (slices + 1)`` numbers.
    """

    __slots__ = ("target_s", "window_s", "slices", "_slice_s", "_ring", "_ring_no", "_ring_n", "_ring_met", "_total", "requests", "met")

    def __init__(self, target_s: float, window_s: float = DEFAULT_WINDOW_S, slices: int = SLICES) -> None:
        if window_s <= 0 or slices < 1:
            raise ValueError("window_s must be > 0 and slices >= 1")
        self.target_s = target_s
        self.window_s = window_s
        self.slices = slices
        self._slice_s = window_s / slices
        self._ring = [array("I", bytes(4 * BINS)) for _ in range(slices)]
        self._ring_no = [-1] * slices  # the slice number each ring entry holds (-1: none)
        self._ring_n = [0] * slices
        self._ring_met = [0] * slices
        self._total = array("I", bytes(4 * BINS))
        self.requests = 0  # in the window as of the last record or advance
        self.met = 0

    def _retire(self, j: int) -> None:
        """Take ring entry ``j`` out of the window's sums and empty it."""
        if self._ring_n[j]:
            ring, total = self._ring[j], self._total
            for i, n in enumerate(ring):
                if n:
                    total[i] -= n
                    ring[i] = 0
            self.requests -= self._ring_n[j]
            self.met -= self._ring_met[j]
            self._ring_n[j] = self._ring_met[j] = 0
        self._ring_no[j] = -1

    def advance(self, now: float) -> None:
        """Drop the slices that have left the window at ``now``. O(slices), plus
        O(BINS) per slice dropped."""
        current = math.floor(now / self._slice_s)
        oldest = current - self.slices + 1
        for j, no in enumerate(self._ring_no):
            if no != -1 and no < oldest:
                self._retire(j)

    def observe(self, now: float, value_s: float) -> None:
        """Record one request's value (seconds) at ``now``. O(1) (O(BINS) when it opens
        a slice whose ring entry still holds an old one)."""
        no = math.floor(now / self._slice_s)
        j = no % self.slices
        if self._ring_no[j] != no:
            self._retire(j)
            self._ring_no[j] = no
        i = bucket_of(value_s)
        self._ring[j][i] += 1
        self._total[i] += 1
        self._ring_n[j] += 1
        self.requests += 1
        if value_s <= self.target_s:
            self._ring_met[j] += 1
            self.met += 1

    def counts(self) -> array:
        """The window's histogram as of the last :meth:`advance` or :meth:`observe`
        (:data:`BINS` counts; read only)."""
        return self._total

    def reading(self, now: float, percentile: float) -> Reading:
        """The window's :class:`Reading` at ``now`` for ``percentile`` (0..100)."""
        self.advance(now)
        return reading_of(self.requests, self.met, self._total, percentile)

    def recent(self, now: float, seconds: float) -> tuple[int, int]:
        """``(requests, met)`` of the slices covering the last ``seconds`` at ``now``:
        the current slice and the ``ceil(seconds / slice) - 1`` before it (at least the
        current one, at most the whole window). O(slices)."""
        current = math.floor(now / self._slice_s)
        oldest = current - min(self.slices, max(1, math.ceil(seconds / self._slice_s - 1e-9))) + 1
        n = met = 0
        for j, no in enumerate(self._ring_no):
            if oldest <= no <= current:
                n += self._ring_n[j]
                met += self._ring_met[j]
        return n, met


@dataclass(slots=True)
class ObjectiveReport:
    """One objective of one group over the window.

    Attributes:
        objective: the objective.
        overall: over all the group's engines.
        engines: per engine key (``(pool, engine)``), those with requests in the window.
    """

    objective: Objective
    overall: Reading
    engines: dict[tuple[str, str], Reading] = field(default_factory=dict)


class ObjectiveTracker:
    """Every group's objectives, measured per (group, engine) over a sliding window.

    Args:
        objectives: group name -> its objectives (at most one per name); groups without
            any are not tracked.
        window_s: the window (seconds, > 0).
        slices: time slices per window (:data:`SLICES`).

    Engines are keys ``(pool, engine)``; a window is created at its first record and
    dropped by :meth:`report` once the window holds nothing of it. Memory: at most one
    :class:`LatencyWindow` per (group, engine, objective) recorded in the last window.
    """

    def __init__(self, objectives: Mapping[str, Iterable[Objective]] | None = None, window_s: float = DEFAULT_WINDOW_S, slices: int = SLICES) -> None:
        self._objectives: dict[str, dict[str, Objective]] = {}
        self._windows: dict[tuple[str, str, tuple[str, str]], LatencyWindow] = {}
        self.window_s = window_s
        self.slices = slices
        self.configure(objectives or {}, window_s)

    @property
    def objectives(self) -> dict[str, dict[str, Objective]]:
        """group -> objective name -> :class:`Objective` (read only)."""
        return self._objectives

    def configure(self, objectives: Mapping[str, Iterable[Objective]], window_s: float) -> None:
        """Take new objectives and window (a config reload). A (group, objective) whose
        target and window are unchanged keeps its measurements (a changed percentile
        changes only how they are read); one whose target or window changed starts
        afresh (its past values were compared with the old target); a group or
        objective no longer configured is forgotten.

        Raises:
            ValueError: an objective's name is not one of :data:`OBJECTIVES`, its target
                is not > 0, its percentile not in (0, 100), or ``window_s`` not > 0.
        """
        if not window_s > 0:
            raise ValueError("window_s must be > 0")
        new: dict[str, dict[str, Objective]] = {}
        for group, objs in objectives.items():
            for o in objs:
                if o.name not in OBJECTIVES or not o.target_s > 0 or not 0 < o.percentile < 100:
                    raise ValueError(f"bad objective for group {group!r}: {o}")
                new.setdefault(group, {})[o.name] = o
        same_window = window_s == self.window_s
        old = self._objectives
        for key in list(self._windows):
            group, name, _engine = key
            before, after = old.get(group, {}).get(name), new.get(group, {}).get(name)
            if after is None or before is None or after.target_s != before.target_s or not same_window:
                del self._windows[key]
        self._objectives = new
        self.window_s = window_s

    def observe(self, now: float, group: str, engine: tuple[str, str], name: str, value_s: float) -> None:
        """Record one request's ``name`` (:data:`TTFT`, :data:`TPOT`) value (seconds) at
        ``now`` for ``group`` on ``engine``; nothing when the group has no such objective."""
        obj = self._objectives.get(group, {}).get(name)
        if obj is None:
            return
        key = (group, name, engine)
        w = self._windows.get(key)
        if w is None:
            w = self._windows[key] = LatencyWindow(obj.target_s, self.window_s, self.slices)
        w.observe(now, value_s)

    def report(self, now: float) -> dict[str, dict[str, ObjectiveReport]]:
        """group -> objective name -> :class:`ObjectiveReport` at ``now``, for every
        configured objective (``overall.requests`` 0 when none was recorded in the
        window). O(windows x (SLICES + BINS))."""
        out: dict[str, dict[str, ObjectiveReport]] = {}
        sums: dict[tuple[str, str], tuple[int, int, list[int]]] = {}
        for group, objs in self._objectives.items():
            out[group] = {name: ObjectiveReport(o, Reading(0, 0, None, None)) for name, o in objs.items()}
        for key in list(self._windows):
            group, name, engine = key
            w = self._windows[key]
            w.advance(now)
            if w.requests == 0:
                del self._windows[key]
                continue
            rep = out[group][name]
            rep.engines[engine] = reading_of(w.requests, w.met, w.counts(), rep.objective.percentile)
            n, met, hist = sums.get((group, name), (0, 0, [0] * BINS))
            for i, c in enumerate(w.counts()):
                if c:
                    hist[i] += c
            sums[(group, name)] = (n + w.requests, met + w.met, hist)
        for (group, name), (n, met, hist) in sums.items():
            rep = out[group][name]
            rep.overall = reading_of(n, met, hist, rep.objective.percentile)
        return out

    def recent(self, now: float, group: str, name: str, pool: str, seconds: float) -> tuple[int, int]:
        """``(requests, met)`` of ``group``'s objective ``name`` over the last
        ``seconds`` (:meth:`LatencyWindow.recent`), summed over the engines of ``pool``;
        ``(0, 0)`` when none was recorded. O(windows) (for objective protection:
        :mod:`qos.objective_protection`)."""
        n = met = 0
        for (g, o, engine), w in self._windows.items():
            if g == group and o == name and engine[0] == pool:
                r, m = w.recent(now, seconds)
                n += r
                met += m
        return n, met

    def windows(self) -> int:
        """Windows held now (for the memory bound's tests)."""
        return len(self._windows)
