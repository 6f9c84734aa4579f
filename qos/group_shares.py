"""Decayed service per priority class, for ``min_share``.

Each class's dispatched cost (token units, :class:`qos.policy.CostModel`) is summed with
exponential decay of time constant ``share_window_s``; a class with ``min_share`` whose
decayed fraction of the total is below its ``min_share`` is served before strict
priority would serve it (:meth:`GroupShares.most_owed`).

Three corrections keep the fraction honest (measured in ``bench/fairness.py``):

* **true-up:** the cost counted at dispatch is corrected by the real cost when the
  request ends; a refund is decayed as the charge it corrects was;
* **expected cost:** at dispatch a class is charged the request's expected cost
  (:class:`qos.usage_model.UsageModel`: its estimates scaled by how that user's recent
  requests turned out), since a systematic over-estimate of requests in flight would be
  a proportional error of the fraction;
* **no banked credit:** a class that starts waiting again is credited as if it had
  received its share for the time it was away (:meth:`GroupShares.lift`), as an idle
  user's counter is lifted in :mod:`qos.fair_queue`, so it cannot return with a burst
  that holds off the higher classes for many slot turnovers; a short absence (a class
  turned away for want of queue room counts as waiting, not away) is not wiped into
  credit either, or a class kept out of a full queue would lose its floor.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

class GroupShares:
    """Decayed served cost per class.

    Args:
        window_s: decay time constant (seconds).
        clock: monotonic clock (seconds).
    """

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        self.window_s = window_s
        self._clock = clock
        self._served: dict[str, float] = {}
        self._at = clock()

    def configure(self, groups: Iterable[str], window_s: float) -> None:
        """Track exactly ``groups`` (new ones start at 0, removed ones are dropped)."""
        self._decay(self._clock())
        names = set(groups)
        self._served = {g: self._served.get(g, 0.0) for g in names}
        self.window_s = window_s

    def _decay(self, now: float) -> None:
        dt = now - self._at
        if dt > 0:
            f = math.exp(-dt / self.window_s)
            for k in self._served:
                self._served[k] *= f
            self._at = now

    def add(self, group: str, delta: float, charged_at: float | None = None) -> None:
        """Add ``delta`` cost (negative: refund) to ``group``. A refund that corrects a
        charge made at ``charged_at`` (clock seconds) is decayed as that charge was."""
        if group not in self._served or delta == 0:
            return
        now = self._clock()
        self._decay(now)
        if delta < 0 and charged_at is not None and now > charged_at:
            delta *= math.exp(-(now - charged_at) / self.window_s)
        self._served[group] = max(0.0, self._served[group] + delta)

    def lift(self, group: str, min_share: float, away_s: float = math.inf) -> None:
        """Credit ``group``, which starts waiting again after ``away_s`` seconds away,
        as if it had received ``min_share`` of the service while it was away: its
        deficit below ``min_share`` shrinks by ``1 - exp(-away_s / window_s)`` (all of
        it after a long absence, nearly none after a short one; a class at or above its
        share is left alone). So an absence is neither banked as credit nor held against
        the class, whatever its length."""
        if min_share >= 1.0 or group not in self._served or not away_s > 0:
            return
        self._decay(self._clock())
        others = sum(v for k, v in self._served.items() if k != group)
        mine = self._served[group]
        if others <= 0 or mine / (mine + others) >= min_share:
            return
        share = mine / (mine + others)
        target = share + (min_share - share) * -math.expm1(-away_s / self.window_s)
        self._served[group] = max(mine, target / (1.0 - target) * others)

    def share(self, group: str) -> float:
        """``group``'s decayed fraction of all dispatched cost now (0.0 when nothing has
        been dispatched)."""
        self._decay(self._clock())
        total = sum(self._served.values())
        return self._served.get(group, 0.0) / total if total > 0 else 0.0

    def most_owed(self, candidates: Iterable[tuple[str, float]]) -> str | None:
        """Among ``(group, min_share)`` pairs (classes with work waiting), the one furthest
        below its share, or ``None`` when none is below."""
        self._decay(self._clock())
        total = sum(self._served.values())
        best, best_deficit = None, 0.0
        for group, min_share in candidates:
            share = self._served.get(group, 0.0) / total if total > 0 else 0.0
            if min_share - share > best_deficit:
                best, best_deficit = group, min_share - share
        return best
