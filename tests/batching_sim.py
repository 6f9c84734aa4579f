"""Closed-loop clients in front of a continuously-batching engine, on an injected clock.

A deterministic model of what issue 20 measured with vLLM (CPU build, SmolLM2-135M): the
engine runs every request in flight in one batch, and each engine step gives every one
of them one output token, so a step lasts ``n / rate(n)`` seconds for ``n`` requests in
flight (``rate``: the aggregate tokens per second measured at 1, 32 and 160 streams,
linear in between; see ``docs/scheduling.md``). Requests of one length started in one
step end in one step. Prefill is not modelled (the prompts are short).

The real :class:`qos.Scheduler` admits: ``record_output`` as every token comes (the proxy
reports each chunk, one token on vLLM), ``release`` at the end with the engine's counts.
Each client keeps ``streams`` requests outstanding: when one ends it sends the next, and
(as over HTTP) every request ending in a step is released before the first of the next
requests arrives. The first requests arrive in the order an asyncio client creates its
tasks: one user's streams, then the next user's. A hold's end wakes the scheduler as the
proxy's timer does (``Scheduler.dispatch``).
"""

from __future__ import annotations

from dataclasses import dataclass

from qos import GroupPolicy, Scheduler, SchedulerPolicy, Ticket, UserPolicy

#: (requests in flight, aggregate output tokens/s) measured on vLLM 0.32 CPU, SmolLM2-135M, 2 cores
RATE_POINTS = ((1, 22.0), (32, 380.0), (160, 580.0))


def engine_rate(n: int) -> float:
    """Aggregate output tokens per second with ``n`` requests in flight (interpolated
    linearly between :data:`RATE_POINTS`, flat outside them)."""
    if n <= RATE_POINTS[0][0]:
        return RATE_POINTS[0][1]
    for (n0, r0), (n1, r1) in zip(RATE_POINTS, RATE_POINTS[1:]):
        if n <= n1:
            return r0 + (r1 - r0) * (n - n0) / (n1 - n0)
    return RATE_POINTS[-1][1]


@dataclass
class SimResult:
    """Output tokens each user received inside the measured window, and the engine's
    mean rate there (tokens/s)."""

    tokens: dict[str, int]
    tokens_per_s: float

    def share(self, user: str) -> float:
        """``user``'s fraction of all the tokens in the window."""
        return self.tokens[user] / max(1, sum(self.tokens.values()))


def run_closed_loop(
    streams: dict[str, int],
    weights: dict[str, float],
    *,
    slots: int = 32,
    output_tokens: int = 128,
    prompt_estimate: int = 10,
    prompt_real: int = 40,
    hold_slot_s: float = 0.05,
    duration_s: float = 150.0,
    warmup_s: float = 30.0,
) -> SimResult:
    """Run ``streams[u]`` closed-loop streams per user ``u`` (weights ``weights``, all in
    one class, ``slots`` = ``max_inflight``) for ``duration_s`` simulated seconds; count
    the output tokens generated after ``warmup_s``. Every request asks for and gets
    ``output_tokens`` (``max_tokens`` with ``ignore_eos``). Deterministic.

    Raises:
        AssertionError: the scheduler refused a request (nothing here should be refused).
    """
    now = [0.0]
    users = list(streams)
    policy = SchedulerPolicy(
        groups=(GroupPolicy("platinum"),),
        default_group="platinum",
        users={u: UserPolicy(u, "platinum", weights[u]) for u in users},
        max_inflight=slots,
        max_queue=100_000,
        queue_timeout_s=1e9,
        hold_slot_s=hold_slot_s,
    )
    running: dict[Ticket, int] = {}  # admitted ticket -> output tokens so far
    admitted: list[Ticket] = []
    sched = Scheduler(policy, clock=lambda: now[0], on_admit=admitted.append)

    def start_admitted() -> None:
        for t in admitted:
            running[t] = 0
        admitted.clear()

    def submit(user: str) -> None:
        sched.submit(user, None, prompt_estimate, output_tokens)
        start_admitted()

    tokens = {u: 0 for u in users}
    for u in users:  # an asyncio client creates one user's tasks, then the next user's
        for _ in range(streams[u]):
            submit(u)
    while now[0] < duration_s:
        n = len(running)
        step_end = now[0] + (n / engine_rate(n) if n else 1.0)
        # the proxy's hold timer: a hold ending before the step wakes the scheduler
        while (due := sched.next_hold_end()) is not None and due <= step_end:
            now[0] = max(now[0], due)
            sched.dispatch()
            start_admitted()
        now[0] = step_end
        ended: list[Ticket] = []
        for t in list(running):
            running[t] += 1
            if now[0] >= warmup_s:
                tokens[t.user_id] += 1
            sched.record_output(t, running[t])
            if running[t] >= output_tokens:
                ended.append(t)
        for t in ended:  # every stream that ended in this step is released first ...
            del running[t]
            sched.release(t, prompt_real, output_tokens)
            start_admitted()
        for t in ended:  # ... then its client's next request arrives
            submit(t.user_id)
    return SimResult(tokens, sum(tokens.values()) / (duration_s - warmup_s))


def run_two_loads(
    streams: dict[str, int],
    weights: dict[str, float],
    *,
    batch: int = 128,
    output_tokens: int = 128,
    duration_s: float = 40.0,
    warmup_s: float = 8.0,
    gap_s: float = 2.0,
    restart: bool = True,
) -> list[SimResult]:
    """Two loads of closed-loop streams, one after the other on the same scheduler (the
    second ``gap_s`` after every request of the first was cancelled, as when a benchmark
    runs twice), with the capacity found by a real :class:`qos.capacity_control.CapacityController`
    stepped every 0.5 s as the proxy's load poller does (the engine reports what runs, no
    queue: its batch is the controller's ceiling, ``batch``). Each load's users start
    their streams in the order of ``streams`` (one user's, then the next user's), all in
    one instant. ``restart`` False dispatches up to the capacity found at once
    (:attr:`CapacityController.value`) instead of the restart pace (``usable``).
    Returns each load's tokens after ``warmup_s``. Deterministic."""
    from qos.capacity_control import CapacityController, ControlSettings, Observation

    now = [0.0]
    users = list(streams)
    policy = SchedulerPolicy(
        groups=(GroupPolicy("platinum"),),
        default_group="platinum",
        users={u: UserPolicy(u, "platinum", weights[u]) for u in users},
        max_inflight=batch,
        max_queue=100_000,
        queue_timeout_s=1e9,
    )
    running: dict[Ticket, int] = {}
    admitted: list[Ticket] = []
    queued: set[Ticket] = set()
    sched = Scheduler(policy, clock=lambda: now[0], on_admit=admitted.append)
    control = CapacityController(ControlSettings(initial=16, ceiling=batch))
    sched.set_capacity_limit(control.usable)
    next_step = 0.0

    def start_admitted() -> None:
        for t in admitted:
            running[t] = 0
            queued.discard(t)
        admitted.clear()

    def submit(user: str) -> None:
        t = sched.submit(user, None, 10, output_tokens)
        queued.add(t)
        start_admitted()

    def control_steps(until: float) -> None:  # the load poller's steps, every 0.5 s
        nonlocal next_step
        while next_step <= until:
            now[0] = max(now[0], next_step)
            next_step += 0.5
            k = len(running)
            control.step(Observation(now=now[0], inflight=k, demand=bool(queued), engine_waiting=0, engine_running=k))
            sched.set_capacity_limit(control.usable if restart else control.value)
            start_admitted()

    results = []
    for _load in range(2):
        control_steps(now[0])  # through the gap since the last load
        begin = now[0]
        tokens = {u: 0 for u in users}
        for u in users:
            for _ in range(streams[u]):
                submit(u)
        while now[0] < begin + duration_s:
            n = len(running)
            step_end = now[0] + (n / engine_rate(n) if n else 0.05)
            control_steps(step_end)
            while (due := sched.next_hold_end()) is not None and due <= step_end:
                now[0] = max(now[0], due)
                sched.dispatch()
                start_admitted()
            now[0] = step_end
            ended = []
            for t in list(running):
                running[t] += 1
                if now[0] >= begin + warmup_s:
                    tokens[t.user_id] += 1
                sched.record_output(t, running[t])
                if running[t] >= output_tokens:
                    ended.append(t)
            for t in ended:
                del running[t]
                sched.release(t, 40, output_tokens)
                start_admitted()
            for t in ended:
                submit(t.user_id)
        for t in list(queued):  # the benchmark's clients leave: queued ones first
            sched.cancel(t)
        queued.clear()
        for t in list(running):
            sched.release(t, 40, running[t])
        running.clear()
        results.append(SimResult(tokens, sum(tokens.values()) / (duration_s - warmup_s)))
        now[0] += gap_s
    return results
