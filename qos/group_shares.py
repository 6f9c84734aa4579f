"""Decayed service per priority class, for ``min_share``.

Each class's dispatched cost (token units, :class:`qos.policy.CostModel`) is summed with
exponential decay of time constant ``share_window_s``; a class with ``min_share`` whose
decayed fraction of the total is below its ``min_share`` is served before strict
priority would serve it (:meth:`GroupShares.most_owed`).

Three corrections keep the fraction honest (measured in ``bench/fairness.py``):

* **true-up:** the cost counted at dispatch is corrected by the real cost when the
  request ends; a refund is decayed as the charge it corrects was;
* **expected output:** at dispatch a class is charged its request's ``max_tokens``
  scaled by the ratio of real to estimated output of that user's recent finished
  requests, since a systematic over-estimate of requests in flight would be a
  proportional error of the fraction (user counters, by contrast, take the plain
  estimate: there an over-estimate only shifts a counter by a bounded amount);
* **no banked credit:** a class that starts waiting again is credited up to its share
  (:meth:`GroupShares.lift`), as an idle user's counter is lifted in
  :mod:`qos.fair_queue`, so it cannot return with a burst that holds off the higher
  classes for many slot turnovers.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

OUTPUT_RATIO_ALPHA = 0.1  # weight of each finished request in a user's output ratio


class GroupShares:
    """Decayed served cost per class and per-user output ratios.

    Args:
        window_s: decay time constant (seconds).
        clock: monotonic clock (seconds).
    """

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        self.window_s = window_s
        self._clock = clock
        self._served: dict[str, float] = {}
        self._at = clock()
        # per user: exponentially weighted sums of real and of estimated output tokens
        self._output_ratio: dict[str, list[float]] = {}

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

    def lift(self, group: str, min_share: float) -> None:
        """Credit ``group``, which starts waiting again, up to ``min_share`` of the total."""
        if min_share >= 1.0 or group not in self._served:
            return
        self._decay(self._clock())
        others = sum(v for k, v in self._served.items() if k != group)
        floor = min_share / (1.0 - min_share) * others
        if self._served[group] < floor:
            self._served[group] = floor

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

    def expected_output(self, user_id: str, max_output_tokens: int) -> float:
        """Output tokens a request of ``user_id`` with this estimate is expected to
        produce (the estimate itself until one of the user's requests has finished)."""
        r = self._output_ratio.get(user_id)
        if r is None or r[1] <= 0:
            return float(max_output_tokens)
        return max_output_tokens * r[0] / r[1]

    def forget(self, user_id: str) -> None:
        """Drop ``user_id``'s output ratio (its state is being forgotten)."""
        self._output_ratio.pop(user_id, None)

    def learn_output(self, user_id: str, max_output_tokens: int, output_tokens: int) -> None:
        """Record that a request estimated at ``max_output_tokens`` produced ``output_tokens``."""
        if max_output_tokens <= 0:
            return
        r = self._output_ratio.get(user_id)
        if r is None:
            self._output_ratio[user_id] = [float(output_tokens), float(max_output_tokens)]
        else:
            keep = 1.0 - OUTPUT_RATIO_ALPHA
            r[0] = r[0] * keep + output_tokens
            r[1] = r[1] * keep + max_output_tokens
