"""A waiting request's place in its queue, for the client that asks (opt-in).

A client that sends ``x-llm-qos-queue-status: 1`` may learn where its request stands
while it waits for admission; a client that does not sees the proxy as before (the
engine's own status and headers, nothing added). Per request, the only cost without the
header is one header lookup.

* A **stream** (``stream: true``) that has to wait: the proxy sends the ``200`` status
  and the event-stream headers at once, then an SSE comment line
  ``: queue position=3 eta_s=2.1`` when it starts waiting, each time its position changes
  (event-driven: every dispatch of its pool signals the requests watching,
  :func:`moved`), and at least every :data:`REFRESH_S` seconds; OpenAI SDKs ignore
  comment lines. When it is dispatched, ``: queue position=0 waited_s=4.2``, then the
  engine's stream. Should it be refused after that (queue timeout, evicted), or the
  engine answer with an error, the status already said 200: the stream ends with an
  OpenAI-style error event ``data: {"error": {...}}`` instead (:func:`error_event`).
  A stream admitted at once gets nothing extra.
* **Any answer** the proxy makes itself (not yet sent): ``x-llm-qos-queue-wait-s``, the
  seconds it waited; on a refusal of admission (``429``/``503``) also
  ``x-llm-qos-queue-position`` (the place a request of its class arriving now would
  take, 1 = next) and ``x-llm-qos-queue-eta-s`` (that place's estimated wait at the
  pool's measured drain rate, :mod:`qos.queue_wait`), beside ``Retry-After``.

The position counts the requests waiting in the classes above the request's and those
of its class that arrived before it (:meth:`qos.Scheduler.queue_position`); the
estimate is position / the pool's drain rate.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import orjson
from aiohttp import web

from qos import RefusalReason, Scheduler, Ticket, TicketState

from ..wire.headers import REQUEST_ID

QUEUE_STATUS = "x-llm-qos-queue-status"
"""Request header: ``1`` (or ``true``) asks for the queue status."""

QUEUE_WAIT_S = "x-llm-qos-queue-wait-s"
QUEUE_POSITION = "x-llm-qos-queue-position"
QUEUE_ETA_S = "x-llm-qos-queue-eta-s"

REFRESH_S = 5.0
"""A waiting stream gets its status at least this often (seconds), moved or not."""

MIN_GAP_S = 0.2
"""Status lines of one stream are at least this far apart (seconds): a pool starting
hundreds of requests a second wakes each watcher at most this often."""


def wants_status(headers) -> bool:
    """Whether a request's ``headers`` ask for the queue status (one lookup)."""
    v = headers.get(QUEUE_STATUS)
    return v is not None and v.strip().lower() in ("1", "true", "yes")


class QueueWatch:
    """One opted-in request's watch on its queue, registered in its pool's ``watchers``
    under its task until admission ends.

    Attributes:
        ticket: its ticket once it is queued (set by
            :meth:`proxy.admission.admission.Admission.acquire`), else ``None``.
        moved: set when the pool's queue moved (a dispatch, a refusal) or the ticket was
            queued; the reporter clears it.
    """

    __slots__ = ("ticket", "moved")

    def __init__(self) -> None:
        self.ticket: Ticket | None = None
        self.moved = asyncio.Event()


def moved(watchers: dict) -> None:
    """Signal every watcher of a pool that its queue moved. O(watchers)."""
    for w in watchers.values():
        w.moved.set()


def status_line(position: int, eta_s: float) -> bytes:
    """The SSE comment for a waiting request: ``: queue position=P eta_s=E``."""
    return b": queue position=%d eta_s=%.1f\n\n" % (position, eta_s)


def error_event(status: int, body: bytes | None, code: str | None = None) -> bytes:
    """The OpenAI-style terminal error event for an answer that could not be sent as a
    status (the stream's 200 went out while it waited): the answer's own JSON error body
    when it has one, else an error object of ``status``."""
    if body:
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
            return b"data: " + orjson.dumps(obj) + b"\n\n"
        message = body.decode("utf-8", "replace")[:2000]
    else:
        message = f"the answer was {status}"
    return b"data: " + orjson.dumps({"error": {"message": message, "type": "proxy_error", "code": code or str(status)}}) + b"\n\n"


def stream_headers(request_id_header: str, request_id: str) -> dict[str, str]:
    """The headers a waiting stream is sent before its engine's: an event stream."""
    return {
        "Content-Type": "text/event-stream",
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",
        request_id_header: request_id,
    }


async def report_while_waiting(
    request: web.Request,
    resp: web.StreamResponse,
    watch: QueueWatch,
    scheduler: Callable[[], Scheduler],
    done: asyncio.Event,
    now: Callable[[], float],
) -> None:
    """Send ``resp``'s status and headers once ``watch.ticket`` is queued, then its
    status lines (the module docstring) until ``done`` is set. Ends quietly when the
    client is gone (the handler's task is cancelled by aiohttp then)."""
    started = now()
    with contextlib.suppress(ConnectionResetError):
        # wait until it is queued (never, when it is admitted at once)
        while watch.ticket is None:
            if done.is_set():
                return
            watch.moved.clear()
            await _first(watch.moved, done)
        ticket = watch.ticket
        if ticket.state is not TicketState.QUEUED:
            return  # admitted (or refused) before this task ran: nothing was sent
        await resp.prepare(request)
        last: int | None = None
        last_at = -REFRESH_S
        while not done.is_set():
            place = scheduler().queue_position(ticket) if ticket.state is TicketState.QUEUED else None
            if place is None:
                break  # dispatched or refused: the handler says what comes next
            t = now()
            if place[0] != last or t - last_at >= REFRESH_S:
                await resp.write(status_line(*place))
                last, last_at = place[0], t
            watch.moved.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(MIN_GAP_S):
                    await done.wait()  # coalesce: a busy pool moves hundreds of times a second
            if done.is_set():
                break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, REFRESH_S - MIN_GAP_S)):
                    await _first(watch.moved, done)
        if ticket.state is TicketState.ADMITTED:
            await resp.write(b": queue position=0 waited_s=%.1f\n\n" % (now() - started))


async def _first(a: asyncio.Event, b: asyncio.Event) -> None:
    """Return when either event is set."""
    if a.is_set() or b.is_set():
        return
    ta, tb = asyncio.ensure_future(a.wait()), asyncio.ensure_future(b.wait())
    try:
        await asyncio.wait((ta, tb), return_when=asyncio.FIRST_COMPLETED)
    finally:
        ta.cancel()
        tb.cancel()


def answer_headers(resp: web.StreamResponse, waited_s: float, place: tuple[int, float] | None) -> None:
    """Add the queue headers to an answer the proxy makes itself (not yet prepared):
    the wait, and for a refusal the place a request would take now and its estimate."""
    resp.headers[QUEUE_WAIT_S] = f"{waited_s:.3f}"
    if place is not None:
        resp.headers[QUEUE_POSITION] = str(place[0])
        resp.headers[QUEUE_ETA_S] = f"{place[1]:.1f}"


QUEUE_REASONS = frozenset({RefusalReason.QUEUE_FULL, RefusalReason.GROUP_QUEUE_FULL, RefusalReason.TIMEOUT, RefusalReason.EVICTED})
"""Refusals of a request for want of queue room or time: their answer says the place a
request would take now (:data:`QUEUE_POSITION`, :data:`QUEUE_ETA_S`)."""


class WaitReporter:
    """The status lines of one waiting stream whose client asked for them: registers
    its :class:`QueueWatch` in ``pool.watchers`` under the current task, and runs
    :func:`report_while_waiting` beside it until :meth:`stop` (admitted or refused) or
    :meth:`close` (every end).

    Args:
        request: the client's request.
        pool: its pool (:class:`proxy.admission.pool.Pool`; its ``scheduler`` is read
            at each line, so a reload's is used).
        request_id: the ``X-Request-Id`` the stream is sent with.
        clock: the loop's clock (seconds).
    """

    __slots__ = ("response", "_watch", "_done", "_pool", "_key", "_task")

    def __init__(self, request: web.Request, pool, request_id: str, clock: Callable[[], float]) -> None:
        self.response = web.StreamResponse(status=200, headers=stream_headers(REQUEST_ID, request_id))
        self._watch = QueueWatch()
        self._done = asyncio.Event()
        self._pool = pool
        self._key = asyncio.current_task()
        pool.watchers[self._key] = self._watch
        self._task = asyncio.create_task(report_while_waiting(request, self.response, self._watch, lambda: pool.scheduler, self._done, clock))

    async def stop(self) -> web.StreamResponse | None:
        """Stop the lines; the response if its status and headers went out (the answer
        is written on it), else ``None`` (the answer is sent as usual)."""
        self._done.set()
        self._pool.watchers.pop(self._key, None)
        with contextlib.suppress(ConnectionResetError):
            await self._task
        return self.response if self.response.prepared else None

    def close(self) -> None:
        """Stop at once, however the request ends (idempotent)."""
        self._done.set()
        self._pool.watchers.pop(self._key, None)
        if not self._task.done():
            self._task.cancel()


async def queue_answer(resp: web.StreamResponse, early: web.StreamResponse | None, waited_s: float, place: tuple[int, float] | None) -> web.StreamResponse:
    """The answer to a client that asked for its queue status: on ``early`` (its stream's
    200 went out while it waited) an answer that is not that stream ends it with an
    :func:`error_event`; else the answer with the queue headers (:func:`answer_headers`)
    when it has not gone out yet."""
    if early is not None:
        if resp is not early and early.prepared:
            body = resp.body if isinstance(resp, web.Response) else None
            with contextlib.suppress(ConnectionResetError):
                await early.write(error_event(resp.status, body if isinstance(body, bytes) else None))
                await early.write_eof()
        return early
    if not resp.prepared:
        answer_headers(resp, waited_s, place)
    return resp


__all__ = [
    "MIN_GAP_S",
    "QUEUE_ETA_S",
    "QUEUE_POSITION",
    "QUEUE_REASONS",
    "QUEUE_STATUS",
    "QUEUE_WAIT_S",
    "REFRESH_S",
    "QueueWatch",
    "WaitReporter",
    "answer_headers",
    "error_event",
    "moved",
    "queue_answer",
    "report_while_waiting",
    "status_line",
    "stream_headers",
    "wants_status",
]
