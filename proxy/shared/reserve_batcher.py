"""The reserves of concurrent requests grouped into pipelines (:class:`ReserveBatcher`):
one pipeline in flight at a time, and every reserve that arrives meanwhile goes in the
next one.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import orjson

from .rate_limits import Bucket

Call = tuple[list[str], list]


class ReserveBatcher:
    """Group the reserves of concurrent requests into pipelines: one pipeline in flight at
    a time, and every reserve that arrives meanwhile goes in the next one. A burst of N
    requests costs about two round trips and one connection instead of N of each (the
    group commit of databases; Redis's own manual, "Pipelining").

    Args:
        send: sends one pipeline of reserve calls (KEYS, ARGV) and returns one reply or
            exception per call, in order; bounded in time by the caller's timeout.
        on_orphan: called with (buckets, tokens) for a reserve that succeeded in Redis
            after its request stopped waiting (cancelled or timed out), so that the take
            is given back.
        on_read: called with a reserve's number once its outcome is known here (its reply
            read, or it was never sent: its request stopped waiting first).
        on_lost: called with (number, buckets, tokens) for a reserve sent in a pipeline
            whose replies were lost (a timeout, a broken connection): it may have run.
    """

    def __init__(
        self,
        send: Callable[[list[Call]], Awaitable[list]],
        on_orphan: Callable[[tuple[Bucket, ...], int], None],
        on_read: Callable[[int], None] = lambda _n: None,
        on_lost: Callable[[int, tuple[Bucket, ...], int], None] = lambda _n, _b, _t: None,
    ) -> None:
        self._send = send
        self._on_orphan = on_orphan
        self._on_read = on_read
        self._on_lost = on_lost
        self._queue: list[tuple[Call, asyncio.Future, tuple[Bucket, ...], int, int]] = []
        self._task: asyncio.Task | None = None
        self.pipelines = 0  # sent, for the benchmark and tests

    async def reserve(self, call: Call, buckets: tuple[Bucket, ...], tokens: int, number: int = 0):
        """The raw reply of :data:`proxy.shared.rate_limits.RESERVE_SCRIPT` for ``call`` (reserve ``number``).

        Raises:
            whatever ``send`` raised for the pipeline, or the call's own error reply.
        """
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((call, fut, buckets, tokens, number))
        if self._task is None:
            self._task = asyncio.create_task(self._drain(), name="llm-qos rate-limit reserves")
        return await fut

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                sent = []
                for item in batch:
                    if item[1].done():  # its request stopped waiting before it was sent
                        self._on_read(item[4])
                    else:
                        sent.append(item)
                if not sent:
                    continue
                self.pipelines += 1
                try:
                    replies = await self._send([call for call, *_ in sent])
                except Exception as e:  # Redis unreachable: every request of the batch learns it
                    for _, fut, buckets, tokens, number in sent:
                        self._on_lost(number, buckets, tokens)  # it may have run: written off
                        if not fut.done():
                            fut.set_exception(type(e)(*e.args) if _copyable(e) else RuntimeError(str(e)))
                    continue
                for (_, fut, buckets, tokens, number), reply in zip(sent, replies):
                    self._on_read(number)
                    if fut.done():  # the request stopped waiting: undo a take it never used
                        if not isinstance(reply, BaseException) and orjson.loads(reply).get("ok"):
                            self._on_orphan(buckets, tokens)
                    elif isinstance(reply, BaseException):
                        fut.set_exception(reply)
                    else:
                        fut.set_result(reply)
        finally:
            self._task = None


def _copyable(e: Exception) -> bool:
    try:
        type(e)(*e.args)
    except Exception:
        return False
    return True
