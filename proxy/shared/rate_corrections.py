"""The rate-limit corrections waiting for the next sync (:class:`PendingAdjustments`):
settles (real tokens minus the estimate), refunds, the takes made locally while Redis was
away, and the reserves written off (:class:`proxy.shared.reserve_log.ReserveLog`).

They are on no request's path: they are buffered and sent with the next sync
(:mod:`proxy.shared.sync`) as one batch with a sequence number that Redis applies at most
once (:data:`proxy.shared.rate_limits.ADJUST_SCRIPT`, its arguments
:func:`proxy.shared.rate_limits.adjust_args`): a batch whose reply was lost is resent, not
double-counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .rate_limits import Bucket


@dataclass(slots=True)
class PendingAdjustments:
    """Corrections waiting for the next sync: per bucket, requests and tokens to charge
    (negative: give back), with the bucket's limits; and the reserves written off (sent,
    their reply never read: see :class:`proxy.shared.reserve_log.ReserveLog`). Bounded: past ``max_buckets``
    distinct buckets (or written-off reserves), new ones are dropped and counted in
    ``dropped``.

    A batch (at most ``batch_size`` buckets and written-off reserves, so no script call runs
    long) is frozen by :meth:`freeze` with a sequence number and resent unchanged until
    Redis confirms it (:meth:`confirm`), so it is applied exactly once.
    """

    max_buckets: int = 100_000
    batch_size: int = 1000
    dropped: int = 0
    seq: int = 0
    _open: dict[str, list] = field(default_factory=dict)
    _lost: list[tuple[int, tuple[Bucket, ...], int]] = field(default_factory=list)
    _frozen: tuple[dict[str, list], list] | None = None

    def add(self, buckets: tuple[Bucket, ...], requests: float, tokens: float) -> None:
        """Add a correction for each bucket."""
        for b in buckets:
            entry = self._open.get(b.key)
            if entry is None:
                if len(self._open) >= self.max_buckets:
                    self.dropped += 1
                    continue
                entry = self._open[b.key] = [b.requests_per_minute, b.tokens_per_minute, 0.0, 0.0]
            entry[0], entry[1] = b.requests_per_minute, b.tokens_per_minute
            entry[2] += requests if b.requests_per_minute else 0.0
            entry[3] += tokens if b.tokens_per_minute else 0.0

    def write_off(self, number: int, buckets: tuple[Bucket, ...], tokens: int) -> bool:
        """Reserve ``number`` (one request and ``tokens`` from ``buckets``) was sent and its
        reply never read: with the next batch, Redis gives its take back if it ran and makes
        sure it never runs later. Returns False when dropped (past the bound)."""
        if len(self._lost) >= self.max_buckets:
            self.dropped += 1
            return False
        self._lost.append((number, buckets, tokens))
        return True

    def freeze(self) -> tuple[int, dict[str, list], list[tuple[int, tuple[Bucket, ...], int]]] | None:
        """The batch to send now (the unconfirmed one, else the open corrections and
        written-off reserves), as (sequence number, corrections per bucket key, written-off
        reserves), or None when there is nothing to send."""
        if self._frozen is None:
            batch: dict[str, list] = {}
            while self._open and len(batch) < self.batch_size:
                key = next(iter(self._open))
                entry = self._open.pop(key)
                if entry[2] or entry[3]:
                    batch[key] = entry
            room = max(0, self.batch_size - len(batch))
            lost, self._lost = self._lost[:room], self._lost[room:]
            if not batch and not lost:
                return None
            self.seq += 1
            self._frozen = (batch, lost)
        return self.seq, self._frozen[0], self._frozen[1]

    def confirm(self) -> list[int]:
        """Redis applied the frozen batch; returns the numbers of the reserves it wrote off
        (now settled)."""
        frozen, self._frozen = self._frozen, None
        return [n for n, _, _ in frozen[1]] if frozen is not None else []

    def __len__(self) -> int:
        frozen = len(self._frozen[0]) + len(self._frozen[1]) if self._frozen is not None else 0
        return len(self._open) + len(self._lost) + frozen
