"""The fairness benchmark's workload and engine model, shared by the simulation
(:mod:`bench.sim`) and the live run (:mod:`bench.live`), so both see the same thing.

Engine (modelled in the simulation, emulated by :mod:`bench.rate_upstream` live):
continuous batching with a fixed aggregate decode rate of ``rate`` output tokens per
second, split equally among the requests decoding at the moment (at most
``max_stream_rate`` each); a request's prompt takes ``prompt / prefill_rate`` seconds
before its first token.

Users (3x overload in output tokens: the offered loads add up to 3.0 engine capacities):

=========  ========  ======  ===============  ====  ===========================
user       group     weight  requests         load  ``max_tokens`` (estimate)
=========  ========  ======  ===============  ====  ===========================
p-chat     platinum  1       short chat       0.2   64
g-long     gold      2       long generation  0.7   1536
g-chat     gold      1       short chat       0.5   64
g-mixed    gold      1       half / half      0.5   none (default 256)
b-batch    bronze    1       long generation  1.1   2048
=========  ========  ======  ===============  ====  ===========================

Short chat: prompt 80-120 tokens, output 40-60 tokens (about 150 in all); long
generation: prompt 250-350, output 1000-1400 (about 1500): sizes spread 10x. The
bronze group has ``min_share: 0.2``. Arrivals are Poisson; the seed fixes them.

Times scale: the live run uses an engine ``speedup`` times faster and divides every time
of the workload (arrivals, timeouts, windows) by it, so it is the same workload in
tokens, compressed in time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from qos import CostModel, GroupPolicy, SchedulerPolicy, UserPolicy

SHORT = ((80, 120), (40, 60))  # (prompt range, output range), tokens
LONG = ((250, 350), (1000, 1400))


@dataclass(frozen=True)
class UserSpec:
    """One synthetic user: who, where, what it sends, how much."""

    user: str
    group: str
    weight: float
    kind: str  # "chat", "long" or "mixed"
    load: float  # offered output tokens, as a fraction of the engine's decode rate
    max_tokens: int | None  # what the client sends as max_tokens (None: not sent)

    def mean_output(self) -> float:
        chat, long = sum(SHORT[1]) / 2, sum(LONG[1]) / 2
        return {"chat": chat, "long": long, "mixed": (chat + long) / 2}[self.kind]


USERS: tuple[UserSpec, ...] = (
    UserSpec("p-chat", "platinum", 1.0, "chat", 0.2, 64),
    UserSpec("g-long", "gold", 2.0, "long", 0.7, 1536),
    UserSpec("g-chat", "gold", 1.0, "chat", 0.5, 64),
    UserSpec("g-mixed", "gold", 1.0, "mixed", 0.5, None),
    UserSpec("b-batch", "bronze", 1.0, "long", 1.1, 2048),
)
GROUPS = ("platinum", "gold", "bronze")
MIN_SHARE = {"bronze": 0.2}


@dataclass(frozen=True)
class Engine:
    """The modelled engine (see the module docstring). Rates in tokens per second."""

    rate: float = 4000.0
    max_stream_rate: float = 250.0
    prefill_rate: float = 80000.0

    def stream_rate(self, decoding: int) -> float:
        """Decode tokens per second of each of ``decoding`` concurrent requests."""
        return 0.0 if decoding <= 0 else min(self.max_stream_rate, self.rate / decoding)

    def scaled(self, k: float) -> "Engine":
        return Engine(self.rate * k, self.max_stream_rate * k, self.prefill_rate * k)


@dataclass(frozen=True)
class Scenario:
    """Everything that defines one run, in the modelled engine's time (seconds)."""

    engine: Engine = Engine()
    max_inflight: int = 32
    queue_timeout_s: float = 30.0
    share_window_s: float = 30.0
    duration_s: float = 1200.0
    warmup_s: float = 60.0
    fairness_window_s: float = 30.0
    seed: int = 7
    users: tuple[UserSpec, ...] = USERS


@dataclass(slots=True)
class Request:
    """One request of the workload. ``arrival`` in the scenario's seconds."""

    rid: int
    user: str
    group: str
    arrival: float
    prompt: int
    output: int  # tokens the engine will really generate
    max_tokens: int | None


def make_requests(sc: Scenario) -> list[Request]:
    """The scenario's requests in arrival order (deterministic for a seed)."""
    rng = random.Random(sc.seed)
    out: list[Request] = []
    for spec in sc.users:
        lam = spec.load * sc.engine.rate / spec.mean_output()  # requests per second
        urng = random.Random(rng.random())
        t = urng.expovariate(lam)
        while t < sc.duration_s:
            kind = spec.kind if spec.kind != "mixed" else urng.choice(("chat", "long"))
            (p_lo, p_hi), (o_lo, o_hi) = SHORT if kind == "chat" else LONG
            out.append(Request(0, spec.user, spec.group, t, urng.randint(p_lo, p_hi), urng.randint(o_lo, o_hi), spec.max_tokens))
            t += urng.expovariate(lam)
    out.sort(key=lambda r: r.arrival)
    for i, r in enumerate(out):
        r.rid = i
    return out


def make_policy(sc: Scenario, time_scale: float = 1.0) -> SchedulerPolicy:
    """The scheduler policy of the scenario; times divided by ``time_scale``."""
    users = {u.user: UserPolicy(u.user, u.group, u.weight) for u in sc.users}
    return SchedulerPolicy(
        groups=tuple(GroupPolicy(g, min_share=MIN_SHARE.get(g, 0.0)) for g in GROUPS),
        default_group=GROUPS[-1],
        users=users,
        max_inflight=sc.max_inflight,
        max_queue=100_000,
        queue_timeout_s=sc.queue_timeout_s / time_scale,
        cost=CostModel(1.0, 2.0, 256),
        share_window_s=sc.share_window_s / time_scale,
    )


def proxy_config(sc: Scenario, upstream_url: str, time_scale: float) -> dict:
    """The proxy's YAML config (as a dict) equivalent to :func:`make_policy`."""
    groups = []
    for g in GROUPS:
        entry: dict = {"name": g, "users": [{"id": u.user, "weight": u.weight} for u in sc.users if u.group == g]}
        if MIN_SHARE.get(g):
            entry["min_share"] = MIN_SHARE[g]
        groups.append(entry)
    return {
        "upstream": {"url": upstream_url, "kind": "openai"},
        "admission": {
            "max_inflight": sc.max_inflight,
            "max_queue": 100_000,
            "queue_timeout_s": sc.queue_timeout_s / time_scale,
            "share_window_s": sc.share_window_s / time_scale,
        },
        "cost": {"input_weight": 1.0, "output_weight": 2.0, "default_max_tokens": 256},
        "identity": {"header": "X-User-Id"},
        "default_group": GROUPS[-1],
        "groups": groups,
    }


def targets(sc: Scenario) -> dict[str, float]:
    """Each gold user's target share of its group's weighted tokens (weight / sum)."""
    out: dict[str, float] = {}
    for g in GROUPS:
        members = [u for u in sc.users if u.group == g]
        total = sum(u.weight for u in members)
        for u in members:
            out[u.user] = u.weight / total if total else 0.0
    return out
