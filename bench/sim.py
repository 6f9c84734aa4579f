"""Discrete-event simulation of an admission policy in front of a modelled engine.

The real :class:`qos.Scheduler` (or a baseline of :mod:`bench.policies`) runs on an
injected clock; the engine is the continuous-batching model of :mod:`bench.workload`
(a fixed aggregate decode rate shared equally by the requests decoding, a prefill delay
per request). Events: arrivals, ends of prefill, ends of generation, queue deadlines,
progress reports (every ``report_s``, the way the proxy reports streamed output with
``record_output``) and samples of the service every user got (every ``sample_s``).

Service is counted in weighted tokens as the engine produces them: a request's prompt
tokens (x1) when its prefill ends, its output tokens (x2) as they are generated.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field

from qos import Refused, Ticket

from .policies import make_scheduler
from .workload import Request, Scenario, make_policy, make_requests


@dataclass
class RequestResult:
    """What happened to one request (times in seconds of the scenario)."""

    user: str
    group: str
    arrival: float
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    refused: str | None = None


@dataclass
class RunResult:
    """The outcome of one policy on one scenario (simulated or live)."""

    policy: str
    users: list[str]
    groups: dict[str, str]  # user -> group
    times: list[float]  # sample times (seconds of the scenario)
    service: dict[str, list[float]]  # user -> cumulative weighted tokens at each sample
    requests: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0
    note: str = ""


class _Stream:
    __slots__ = ("req", "ticket", "v_join", "res", "decoding")

    def __init__(self, req: Request, ticket: Ticket, res: RequestResult) -> None:
        self.req, self.ticket, self.res = req, ticket, res
        self.v_join = 0.0
        self.decoding = False


def simulate(sc: Scenario, policy: str, report_s: float = 0.25, sample_s: float = 1.0, max_events: int = 20_000_000) -> RunResult:
    """Run ``policy`` ("ours", "fcfs", "reqcount") on scenario ``sc``; deterministic."""
    wall0 = time.perf_counter()
    eng = sc.engine
    reqs = make_requests(sc)
    users = [u.user for u in sc.users]
    uidx = {u: i for i, u in enumerate(users)}
    now = [0.0]
    streams: dict[int, _Stream] = {}  # ticket seq -> stream, for every admitted request
    prefill_heap: list[tuple[float, int]] = []  # (end of prefill, seq)
    finish_heap: list[tuple[float, int]] = []  # (virtual finish, seq) of decoding streams
    decoding_by_user = [0] * len(users)
    n_decoding = [0]
    results: list[RequestResult] = []
    pending: dict[int, tuple[Request, RequestResult]] = {}

    deferred: list[Ticket] = []  # admitted inside submit(), before its ticket is known

    def on_admit(t: Ticket) -> None:
        if t.seq not in pending:
            deferred.append(t)
            return
        req, res = pending.pop(t.seq)
        res.admitted = now[0]
        st = _Stream(req, t, res)
        streams[t.seq] = st
        heapq.heappush(prefill_heap, (now[0] + req.prompt / eng.prefill_rate, t.seq))

    def on_refuse(t: Ticket) -> None:
        _req, res = pending.pop(t.seq)
        res.refused = t.refusal.reason.value if t.refusal else "refused"

    sched = make_scheduler(policy, make_policy(sc), clock=lambda: now[0], on_admit=on_admit, on_refuse=on_refuse)

    v = 0.0  # decode tokens each decoding stream has received so far (processor sharing)
    cum = [0.0] * len(users)
    times: list[float] = []
    service: list[list[float]] = [[] for _ in users]
    next_sample = 0.0
    next_report = report_s
    ai = 0
    end = sc.duration_s

    def advance(to: float) -> None:
        nonlocal v
        dt = to - now[0]
        if dt > 0:
            dv = eng.stream_rate(n_decoding[0]) * dt
            if dv:
                v += dv
                for i, n in enumerate(decoding_by_user):
                    if n:
                        cum[i] += 2.0 * n * dv
            now[0] = to

    events = 0
    while events < max_events:
        events += 1
        rate = eng.stream_rate(n_decoding[0])
        t_fin = now[0] + (finish_heap[0][0] - v) / rate if finish_heap else math.inf
        t_pre = prefill_heap[0][0] if prefill_heap else math.inf
        t_arr = reqs[ai].arrival if ai < len(reqs) else math.inf
        nd = sched.next_deadline()
        t_dl = nd if nd is not None else math.inf
        t_next = min(t_fin, t_pre, t_arr, t_dl, next_report, next_sample)
        if t_next > end:
            break
        advance(t_next)
        if t_next == next_sample:
            times.append(now[0])
            for i in range(len(users)):
                service[i].append(cum[i])
            next_sample += sample_s
        elif t_next == t_fin:
            _vf, seq = heapq.heappop(finish_heap)
            st = streams.pop(seq)
            st.res.finished = now[0]
            decoding_by_user[uidx[st.req.user]] -= 1
            n_decoding[0] -= 1
            sched.release(st.ticket, prompt_tokens=st.req.prompt, output_tokens=st.req.output)
        elif t_next == t_pre:
            _tp, seq = heapq.heappop(prefill_heap)
            st = streams[seq]
            i = uidx[st.req.user]
            cum[i] += st.req.prompt  # input weight 1
            st.v_join = v
            st.decoding = True
            st.res.first_token = now[0] + 1.0 / eng.stream_rate(n_decoding[0] + 1)
            decoding_by_user[i] += 1
            n_decoding[0] += 1
            heapq.heappush(finish_heap, (v + st.req.output, seq))
        elif t_next == t_arr:
            req = reqs[ai]
            ai += 1
            res = RequestResult(req.user, req.group, req.arrival)
            results.append(res)
            try:
                ticket = sched.submit(req.user, None, req.prompt, req.max_tokens)
            except Refused as r:
                res.refused = r.reason.value
            else:
                pending[ticket.seq] = (req, res)
                while deferred:
                    on_admit(deferred.pop())
        elif t_next == t_dl:
            sched.expire()
        else:  # progress report: what the proxy does as chunks stream by
            for st in list(streams.values()):
                if st.decoding:
                    sched.record_output(st.ticket, min(st.req.output, int(v - st.v_join)))
            next_report += report_s
    return RunResult(
        policy=policy,
        users=users,
        groups={u.user: u.group for u in sc.users},
        times=times,
        service={u: service[i] for i, u in enumerate(users)},
        requests=results,
        wall_s=time.perf_counter() - wall0,
    )
