"""This replica's log of reserves whose outcome in Redis it may not know yet
(:class:`ReserveLog`): what makes a reserve whose reply came late, or never, cost its
limits once.
"""

from __future__ import annotations

import heapq


class ReserveLog:
    """This replica's reserves whose outcome in Redis it may not know yet: what makes a
    reserve whose reply came late (or never) cost its limits once.

    Every reserve sent to Redis gets a number (increasing).
    :data:`proxy.shared.rate_limits.RESERVE_SCRIPT` records a take under its number in the
    replica's log (``{P}:rsv:<replica id>``). When the reply is read, the number is
    settled. When it is not (the pipeline timed out or its connection broke, so the
    request was served from the local share, whose take is charged to Redis as well), the
    reserve is *written off*: the next adjust batch asks
    Redis to give its take back if it ran, and to mark it so that it never runs later (a
    frozen Redis runs what it had received when it thaws); once Redis confirms, the number
    is settled. Each reserve also tells Redis the *floor*, the smallest number not settled
    here: Redis forgets the records below it (in steps of 32 numbers, to spare calls), so
    the log holds the reserves in flight plus at most 32.

    Exact while the log lives: it expires ``keep`` (10 leases, at least a minute) after its
    last write, so a write-off that reaches Redis later than that (a replica cut off for
    longer) finds no record and gives nothing back; by then a bucket has refilled anyway,
    unless it is in debt.
    """

    def __init__(self) -> None:
        self.number = 0
        self._open: list[int] = []  # a heap of the numbers not settled (lazy deletion)
        self._settled: set[int] = set()

    def open(self) -> int:
        """A number for a new reserve (unsettled until :meth:`settle`)."""
        self.number += 1
        heapq.heappush(self._open, self.number)
        return self.number

    def settle(self, number: int) -> None:
        """Its reply was read, or Redis confirmed its write-off, or it was never sent."""
        self._settled.add(number)
        while self._open and self._open[0] in self._settled:
            self._settled.discard(heapq.heappop(self._open))

    @property
    def floor(self) -> int:
        """The smallest number not settled (the next one when all are)."""
        return self._open[0] if self._open else self.number + 1

    def __len__(self) -> int:
        return len(self._open) - len(self._settled)
