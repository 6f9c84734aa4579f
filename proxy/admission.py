"""The asyncio face of the scheduler: wait for a slot, give it back exactly once.

:class:`Admission` owns the :class:`qos.Scheduler`. A request calls :meth:`acquire`,
which either returns at once, or parks the request on a future that the scheduler's
``on_admit`` / ``on_refuse`` callbacks resolve. No polling, no threads: waking is driven by
the events that free capacity (a release, a cancel, a policy change). A queued request
whose client disconnects is cancelled by aiohttp, and the ``except`` path takes it out of
the queue at once.
"""

from __future__ import annotations

import asyncio
import time


from qos import RefusalReason, Refused, Scheduler, SchedulerPolicy, Ticket, TicketState

from .shared_limits import SharedRateLimiter, reserve_and_submit


def _nothing() -> None:
    return None


class Admission:
    """Admission control for one proxy process.

    Args:
        policy: the initial scheduler policy.
        clock: monotonic clock in seconds (the scheduler's).
        shared_limits: rate limits reserved in a shared state before submit
            (:class:`proxy.shared_limits.SharedRateLimiter`), or ``None`` (the
            scheduler's own buckets).

    Attributes:
        clock: the scheduler's clock.
        on_wait: called (no arguments) when a request starts waiting in the queue
            (a replica asks the shared state for a sync then: its grant may not cover it).
    """

    def __init__(self, policy: SchedulerPolicy, clock=time.monotonic, shared_limits: SharedRateLimiter | None = None) -> None:
        self.scheduler = Scheduler(policy, clock=clock, on_admit=self._wake, on_refuse=self._refuse, rate_limiter=shared_limits)
        self.shared_limits = shared_limits
        self.on_wait = _nothing
        self._clock = self.clock = clock

    @staticmethod
    def _wake(ticket: Ticket) -> None:
        fut = ticket.context
        if fut is not None and not fut.done():
            fut.set_result(None)

    @staticmethod
    def _refuse(ticket: Ticket) -> None:
        fut = ticket.context
        if fut is not None and not fut.done():
            fut.set_exception(_fresh(ticket.refusal))

    async def acquire(
        self,
        user_id: str,
        group: str | None,
        prompt_tokens: int,
        max_tokens: int | None,
        choices: int = 1,
        output_ceiling: int | None = None,
    ) -> Ticket:
        """Wait until the request may go upstream.

        Args:
            user_id: the caller.
            group: a class chosen for this request by a trusted source, or ``None``
                (the policy's: a listed user's own class, else the default one). Never
                pass the user's *configured* class here: after a reload removes the
                user, its queued requests must follow the new policy, not the old file.
            prompt_tokens: estimated prompt length (tokens).
            max_tokens: the request's output cap per choice (tokens) or ``None``.
            choices: the output multiplier (``max(n, best_of)`` x prompts).
            output_ceiling: the serving engine's output ceiling when known (tokens).

        Returns:
            An ADMITTED ticket; the caller must :meth:`release` it in a ``finally``.

        Raises:
            Refused: too large to ever fit (``TOO_LARGE``), rate limited, queue full,
                evicted, waited past ``queue_timeout_s``, or shutting down.
            asyncio.CancelledError: the client went away while queued; the ticket has
                been removed from the queue (or released, if admission raced the cancel).
        """
        sched = self.scheduler
        if self.shared_limits is None:
            ticket = sched.submit(user_id, group, prompt_tokens, max_tokens, choices=choices, output_ceiling=output_ceiling)
        else:
            submit = {"user_id": user_id, "group": group, "prompt_tokens": prompt_tokens, "max_output_tokens": max_tokens, "choices": choices, "output_ceiling": output_ceiling}
            ticket = await reserve_and_submit(sched, self.shared_limits, submit)
        if ticket.state is TicketState.ADMITTED:
            return ticket
        self.on_wait()
        fut = asyncio.get_running_loop().create_future()
        ticket.context = fut
        try:
            async with asyncio.timeout_at(self._loop_deadline(ticket)):
                await fut
        except TimeoutError:
            if sched.cancel(ticket, RefusalReason.TIMEOUT) or ticket.state is TicketState.REFUSED:
                raise _fresh(ticket.refusal) from None
            return ticket  # admitted in the same instant the deadline passed
        except BaseException:
            if not sched.cancel(ticket) and ticket.state is TicketState.ADMITTED:
                sched.release(ticket)
            raise
        finally:
            # no reference cycle (future -> exception -> traceback -> this frame -> future)
            # left for the garbage collector: refused requests are freed at once
            ticket.context = fut = None
        return ticket

    def _loop_deadline(self, ticket: Ticket) -> float:
        loop = asyncio.get_running_loop()
        return loop.time() + max(0.0, ticket.deadline - self._clock())

    def release(self, ticket: Ticket, prompt_tokens: int | None = None, output_tokens: int | None = None) -> bool:
        """Give the slot back and true up the cost; see :meth:`qos.Scheduler.release`."""
        return self.scheduler.release(ticket, prompt_tokens, output_tokens)

    def update_policy(self, policy: SchedulerPolicy) -> None:
        """Swap the policy (hot reload); see :meth:`qos.Scheduler.update_policy`."""
        self.scheduler.update_policy(policy)

    def close(self) -> None:
        """Refuse everything queued (503) and every later request."""
        self.scheduler.close()


def _fresh(refusal: Refused) -> Refused:
    """A new exception carrying ``refusal``'s reason: the ticket's own stays free of
    tracebacks (which would tie the ticket to the frames that raised it)."""
    return Refused(refusal.reason, refusal.retry_after_s, refusal.detail, refusal.scope, refusal.limit)


__all__ = ["Admission", "Refused", "RefusalReason"]
