"""One request's hold on admission: its ticket and its place on an engine, for the
length of an ``async with``.

:class:`Admitted` is how a route holds what :class:`proxy.admission.admission.Admission`
gives it. Entering waits for admission in the request's pool (or, for a pass-through
request outside admission, takes a place on an engine at once); the body opens and
relays the request on :attr:`Admitted.engine`, moving it with :meth:`Admitted.reroute`
when its connection fails before any byte is sent, and waiting again with
:meth:`Admitted.requeue` after a preemption; leaving gives the ticket and the engine
place back, once.
"""

from __future__ import annotations

from collections.abc import Iterable

from qos import Ticket

from ..routing.exchange_verdict import Verdict
from ..routing.engine_state import EngineState
from .admission import Admission, NoEngine, Pool


class _OutsideAdmission:
    """The place on an engine of a pass-through request outside admission
    (:meth:`proxy.routing.router.PoolRouter.place_outside`): it reserves no tokens, and
    has no ticket's ``context`` (the router asks for it when it reroutes one without an
    affinity key: no key)."""

    __slots__ = ()
    reserved_tokens = 0
    context = None


class Admitted:
    """A request's admission, held by an ``async with``: it owns the ticket (admitted
    requests) or the engine place (a pass-through request with ``passthrough.admit:
    false``, outside admission), and the engine that place is on.

    Exactly once: every exit from the ``async with`` body, a normal end, an exception,
    the client's disconnect (the task cancelled) and an end after any number of
    preemption requeues (:meth:`requeue`) alike, releases what it holds exactly once
    (:meth:`proxy.admission.admission.Admission.release` of the ticket with the counts of
    :meth:`true_up`, or the router's release of the outside place, then a dispatch of the
    pool's queue). Entering that fails (a refusal, :class:`~.admission.NoEngine`, the
    client leaving while queued) holds nothing and releases nothing: ``acquire`` has
    already taken the ticket out of the queue. A requeue releases nothing: the
    preemption took the ticket out of flight and put it back in its queue; the ticket is
    released once, at the end, whatever it became (a requeued ticket refused or
    cancelled while waiting is a no-op release).

    Args:
        admission: the process's admission.
        pool: the request's pool.
        user_id: the caller.
        prompt_tokens: the request's prompt estimate (tokens).
        max_tokens: its output cap per choice (tokens), or ``None``.
        choices: its output multiplier.
        key: its affinity key (:func:`proxy.routing.placement.affinity_key`), or ``None``.
        admit: wait for admission (``False``: ``passthrough.admit: false``, placed on an
            engine without a ticket, no tokens reserved).

    Attributes:
        ticket: the admitted ticket, once entered (``None`` outside admission).
        engine: the engine the request goes to now, once entered (``None`` after a
            :meth:`reroute` that found none).
        entered: whether entering succeeded (the hold is or was taken).

    Raises (on entering): as :meth:`proxy.admission.admission.Admission.acquire`:
    :class:`qos.Refused` (:class:`~.admission.NoEngine` when no engine of the pool is in
    rotation, for requests outside admission too), ``asyncio.CancelledError``.
    """

    __slots__ = ("_admission", "pool", "_ask", "key", "_admit", "ticket", "engine", "entered", "_outside", "_released", "_counts")

    def __init__(
        self,
        admission: Admission,
        pool: Pool,
        user_id: str,
        prompt_tokens: int,
        max_tokens: int | None,
        choices: int = 1,
        *,
        key: str | None = None,
        admit: bool = True,
    ) -> None:
        self._admission = admission
        self.pool = pool
        self._ask = (user_id, prompt_tokens, max_tokens, choices)
        self.key = key
        self._admit = admit
        self.ticket: Ticket | None = None
        self.engine: EngineState | None = None
        self.entered = False
        self._outside: _OutsideAdmission | None = None
        self._released = False
        self._counts: tuple[int | None, int | None] = (None, None)

    async def __aenter__(self) -> Admitted:
        pool = self.pool
        if self._admit:
            user_id, prompt_tokens, max_tokens, choices = self._ask
            ceiling = pool.spec.output_ceiling(prompt_tokens)  # the engines' context length, if known
            self.ticket = await self._admission.acquire(user_id, None, prompt_tokens, max_tokens, choices, ceiling, pool=pool.name, key=self.key)
            self.engine = self.ticket.placement
        else:  # straight to an engine, outside admission
            outside = _OutsideAdmission()
            engine = pool.router.place_outside(outside, self.key)
            if engine is None:
                raise NoEngine(pool.name, pool.router.retry_after_s())
            self._outside, self.engine = outside, engine
        self.entered = True
        return self

    async def __aexit__(self, *exc_info: object) -> bool:
        self._release()
        return False  # exceptions go on

    def _release(self) -> None:
        """Give the ticket (with :meth:`true_up`'s counts) or the outside place back,
        once: a second call does nothing."""
        if self._released or not self.entered:
            return
        self._released = True
        if self.ticket is not None:
            self._admission.release(self.ticket, *self._counts)
        elif self._outside is not None and self.pool.router.release(self._outside) is not None:
            self.pool.scheduler.dispatch()  # its place on the engine is free for the queue

    def true_up(self, prompt_tokens: int | None, output_tokens: int | None) -> None:
        """The real token counts the release charges (``None``: the estimate stays;
        :meth:`qos.Scheduler.release`)."""
        self._counts = (prompt_tokens, output_tokens)

    @property
    def group(self) -> str | None:
        """The class the request was admitted in (``None`` outside admission)."""
        return self.ticket.group if self.ticket is not None else None

    @property
    def preemptions(self) -> int:
        """Times the request was preempted so far."""
        return self.ticket.preemptions if self.ticket is not None else 0

    @property
    def holds_headers(self) -> bool:
        """Whether a stream's headers wait for its first event: with preemption on, an
        admitted request may be preempted until its client is shown something."""
        return self.ticket is not None and self._admission.preemption.enabled

    def show(self) -> None:
        """Its client is sent the first byte of the answer: it is never preempted after
        this (:attr:`qos.Ticket.shown`)."""
        if self.ticket is not None:
            self.ticket.shown = True

    def mark_stream(self) -> None:
        """Its answer is streamed: its first token is timed (objective protection,
        :attr:`qos.Ticket.stream`) and awaited by its engine's meter (the capacity
        controller's growth is clocked by first tokens while streams await them:
        :meth:`proxy.routing.engine_meter.EngineMeter.awaiting`)."""
        t = self.ticket
        if t is not None:
            t.stream = True
            if t.placement is not None:
                t.placement.meter.awaiting(t)

    def record_output(self, output_tokens: int) -> None:
        """The output counted so far (:meth:`proxy.admission.admission.Admission.record_output`;
        nothing outside admission)."""
        if self.ticket is not None:
            self._admission.record_output(self.ticket, output_tokens)

    def reroute(self, tried: Iterable[EngineState]) -> EngineState | None:
        """Move the request, which never reached its engine, to another engine of its
        pool not in ``tried`` (:meth:`proxy.admission.admission.Admission.reroute`, or
        the router's for a request outside admission). Returns the new :attr:`engine`,
        or ``None`` when no other is in rotation."""
        if self.ticket is not None:
            self.engine = self._admission.reroute(self.ticket, tried)
        else:
            self.engine = self.pool.router.reroute(self._outside, tuple(tried), self.key, over=True)
        return self.engine

    def report(self, engine: EngineState, verdict: Verdict | None) -> None:
        """Tell ``engine``'s health the verdict of an exchange with it
        (:func:`proxy.routing.exchange_verdict.exchange_verdict`; ``None``: no claim)."""
        if verdict is not None:
            self._admission.report(engine, verdict.ok, verdict.reason, verdict.detail, status=verdict.status)

    def preempted(self) -> bool:
        """Called on ``asyncio.CancelledError``: whether the cancel was a preemption
        (taken back; then :meth:`requeue`) rather than the client leaving
        (:meth:`proxy.admission.admission.Admission.preempted`)."""
        return self.ticket is not None and self._admission.preempted(self.ticket)

    async def requeue(self) -> EngineState:
        """After :meth:`preempted`: wait at the head of its queue until dispatched again,
        and return the new :attr:`engine` (any engine of the pool).

        Raises:
            qos.Refused: it waited past ``queue_timeout_s``, was evicted, or the proxy
                is shutting down (the ticket then holds nothing; the release is a no-op).
            asyncio.CancelledError: the client left; the ticket is out of the queue.
        """
        assert self.ticket is not None
        self.engine = await self._admission.wait_requeued(self.ticket)
        return self.engine
