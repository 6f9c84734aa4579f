"""Adversarial fairness scenario (``python -m bench.fairness --adversarial``): honest users
and one gamer per attack of issue 10, live, through the real proxy process.

Processes (all on 127.0.0.1): :mod:`bench.rate_upstream` (an engine whose aggregate token
rate is fixed and shared among its streams, refusing ``max_tokens`` beyond its context
length with a 400 as vLLM does), the proxy (``python -m proxy proxy``, this checkout, and
optionally an older one for comparison), and the load generator (this process).

The listed users share the group ``gold`` (the gamers attack the users they share a group
with); identities the config does not list (the churn) go to ``default_group: guests``,
below gold with ``min_share: 0.2``, as a gateway trusting an identity header should set it
up (with a trusted header, every distinct identity is a user of its own and gets a share
while it waits: a client minting identities in the honest users' group would get one
share per identity waiting, which no per-user fairness can prevent):

=============  ======  ==========================================================
user           weight  what it sends
=============  ======  ==========================================================
h-chat         1       short chat (prompt ~100, answer ~50, ``max_tokens`` 64), 32 at a time
h-long         1       long answers (prompt ~300, answer ~1 000, ``max_tokens`` 1 536), 32 at a time
h-mixed        2       half and half, no ``max_tokens``, 32 at a time
h-late         1       short chat like h-chat, 32 at a time, from ``LATE_AT_S`` (65 s) on: a
                       newcomer, lifted to the group's virtual time when it arrives
=============  ======  ==========================================================

The three first honest users send nothing new from 50 s to 65 s (``PAUSE_S``): their
queues drain, only the gamers are left waiting, and at 65 s they come back, with h-late,
lifted to the group's virtual time (where the gamers have left it: with the accounting
before issue 10, an absurd ``max_tokens`` charged at dispatch put it near 1e19).

=============  ======  ==========================================================
user           weight  what it sends
=============  ======  ==========================================================
g-absurd       1       ``max_tokens`` 2**62: the engine refuses each with a 400 (2 loops)
g-disconnect   1       ``max_tokens`` 30 000 streams, drops each after its first chunk (4 loops)
g-tools        1       a 5 000-token prompt stuffed in ``tools``, streams without usage, a
                       limit of 20 000 tokens a minute (4 loops)
churn          1 each  100 000 distinct identities (trusted ``X-User-Id``), one tiny request
                       each (prompt "hi", one token), at most 64 outstanding
=============  ======  ==========================================================

Measured at the engine (weighted tokens: prompt x1 when prefilled, output x2 as generated),
while the honest users are backlogged (the pause left out):
the honest users' shares of the honest users' tokens in every 30 s window against their
weight shares (25 / 25 / 50 %), the late user's share of all honest tokens from its
arrival on against its weight share (1/5) and how long its first answer took, each
gamer's share of gold's tokens (the late user's aside) against its weight share (1/7:
one of seven users' weights), the churn's share of all tokens against its group's
``min_share`` (20 %), and the proxy's RSS through the churn.
"""

from __future__ import annotations

import asyncio
import math
import random
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import yaml

from . import harness as h

HONEST = {"h-chat": 1.0, "h-long": 1.0, "h-mixed": 2.0}
GAMERS = {"g-absurd": 1.0, "g-disconnect": 1.0, "g-tools": 1.0}
LATE, LATE_WEIGHT = "h-late", 1.0
PAUSE_S = (50.0, 65.0)  # the first honest users send nothing new in this span (s after the start)
LATE_AT_S = PAUSE_S[1]  # when the late user arrives, as the others come back
CHURN = "churn"
USERS = (*HONEST, LATE, *GAMERS, CHURN)
STEADY_WEIGHT = sum(HONEST.values()) + sum(GAMERS.values())  # 7
GUESTS_MIN_SHARE = 0.2
HONEST_WORKERS = 32  # closed loops per honest user: 96 in all, against 48 slots, so all stay backlogged
CONTEXT = 32768
TOOLS = [{"type": "function", "function": {"name": "search", "description": "d" * 20_000, "parameters": {"type": "object"}}}]
OLD_REF = "1f0bdf4"  # the commit before issue 10's accounting (what main ran before it)


@dataclass
class Run:
    """One live run of the scenario against one proxy build."""

    label: str
    times: list[float] = field(default_factory=list)  # seconds since the start
    service: dict[str, list[float]] = field(default_factory=dict)  # user -> cumulative weighted tokens
    status: dict[str, dict[int, int]] = field(default_factory=dict)  # user -> HTTP status -> count
    rss: list[tuple[float, float]] = field(default_factory=list)  # (s, MiB)
    users_tracked: list[tuple[float, int]] = field(default_factory=list)
    churn_sent: int = 0
    duration_s: float = 0.0
    late_at_s: float = LATE_AT_S
    late_first_s: float = math.nan  # the late user's arrival to its first answer's end


def config(upstream_url: str, max_inflight: int) -> dict:
    """A config both the new and the old proxy accept (no key added by issue 10: the new
    proxy runs on its defaults, ``max_users`` 20 000 and ``max_tokens_ceiling`` 32 768)."""
    users = [{"id": u, "weight": w} for u, w in {**HONEST, LATE: LATE_WEIGHT, **GAMERS}.items()]
    users[-1]["rate_limit"] = {"tokens_per_minute": 20_000}  # g-tools
    return {
        "upstream": {"url": upstream_url, "kind": "openai", "load_signal": {"enabled": False}},
        "admission": {"max_inflight": max_inflight, "max_queue": 5000, "queue_timeout_s": 60},
        "identity": {"header": "X-User-Id"},
        "admin": {"api_key": "sk-bench-admin"},
        "default_group": "guests",
        "groups": [{"name": "gold", "users": users}, {"name": "guests", "users": [], "min_share": GUESTS_MIN_SHARE}],
    }


def _chat_body(user: str, prompt: int, out: int | None, max_tokens: int | None, stream: bool = True, **fake) -> dict:
    b: dict = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "x" * (4 * max(0, prompt - 4))}],
        "stream": stream,
        "fake": {"user": user, "prompt": prompt, **({"n": out} if out is not None else {}), **fake},
    }
    if max_tokens is not None:
        b["max_tokens"] = max_tokens
    return b


class Load:
    """The load generator: closed loops for honest users and gamers, a paced stream of
    fresh identities for the churn."""

    def __init__(self, url: str, run: Run, duration_s: float, churn_total: int, seed: int = 11) -> None:
        self.url = url + "/v1/chat/completions"
        self.run = run
        self.deadline = time.monotonic() + duration_s
        self.churn_total = churn_total
        self.duration_s = duration_s
        self.rng = random.Random(seed)

    def _count(self, user: str, status: int) -> None:
        d = self.run.status.setdefault(user, {})
        d[status] = d.get(status, 0) + 1

    async def _one(self, http: aiohttp.ClientSession, user: str, body: dict, first_chunk_only: bool = False) -> None:
        try:
            async with http.post(self.url, json=body, headers={"X-User-Id": user}) as r:
                self._count(user if not user.startswith("churn-") else CHURN, r.status)
                if first_chunk_only and r.status == 200:
                    await r.content.readany()
                    r.close()
                    return
                await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            self._count(user if not user.startswith("churn-") else CHURN, 0)

    async def honest(self, http: aiohttp.ClientSession, user: str, t0: float | None = None) -> None:
        """Closed loop of ``user``; with ``t0``, nothing new is sent during ``PAUSE_S``."""
        rng = random.Random(self.rng.random())
        while time.monotonic() < self.deadline:
            if t0 is not None and PAUSE_S[0] <= time.monotonic() - t0 < PAUSE_S[1]:
                await asyncio.sleep(t0 + PAUSE_S[1] - time.monotonic())
                continue
            kind = {"h-chat": "chat", LATE: "chat", "h-long": "long"}.get(user) or rng.choice(("chat", "long"))
            if kind == "chat":
                prompt, out = rng.randint(80, 120), rng.randint(40, 60)
                mt = None if user == "h-mixed" else 64
            else:
                prompt, out = rng.randint(250, 350), rng.randint(900, 1100)
                mt = None if user == "h-mixed" else 1536
            await self._one(http, user, _chat_body(user, prompt, out, mt))

    async def late(self, http: aiohttp.ClientSession, t0: float) -> None:
        """The late user: nothing until ``late_at_s``, then as h-chat with as many
        workers; notes when its first answer came."""
        arrive = t0 + self.run.late_at_s
        await asyncio.sleep(max(0.0, arrive - time.monotonic()))
        if time.monotonic() >= self.deadline:
            return

        async def first() -> None:
            await self._one(http, LATE, _chat_body(LATE, 100, 50, 64))
            self.run.late_first_s = time.monotonic() - arrive
            await self.honest(http, LATE)

        await asyncio.gather(first(), *[self.honest(http, LATE) for _ in range(HONEST_WORKERS - 1)])

    async def absurd(self, http: aiohttp.ClientSession) -> None:
        while time.monotonic() < self.deadline:
            await self._one(http, "g-absurd", _chat_body("g-absurd", 20, 50, 2**62, stream=False))
            await asyncio.sleep(0.05)

    async def disconnect(self, http: aiohttp.ClientSession) -> None:
        while time.monotonic() < self.deadline:
            await self._one(http, "g-disconnect", _chat_body("g-disconnect", 20, 30_000, 30_000), first_chunk_only=True)

    async def tools(self, http: aiohttp.ClientSession) -> None:
        while time.monotonic() < self.deadline:
            b = _chat_body("g-tools", 5000, 20, 32, usage=False)
            b["messages"][0]["content"] = "hi"
            b["tools"] = TOOLS
            await self._one(http, "g-tools", b)
            if self.run.status.get("g-tools", {}).get(429):
                await asyncio.sleep(0.05)  # a gamer retries at once, but not in a hot loop

    async def churn(self, http: aiohttp.ClientSession) -> None:
        sem = asyncio.Semaphore(64)
        start = time.monotonic()
        rate = self.churn_total / (self.duration_s * 0.95)
        tasks: set[asyncio.Task] = set()

        async def one(i: int) -> None:
            try:
                await self._one(http, f"churn-{i}", _chat_body(CHURN, 2, 1, 1, stream=False))
            finally:
                sem.release()

        for i in range(self.churn_total):  # bounded: one request per identity
            due = start + i / rate
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if time.monotonic() >= self.deadline:
                break
            await sem.acquire()
            t = asyncio.create_task(one(i))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            self.run.churn_sent = i + 1
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def watch(self, http: aiohttp.ClientSession, pid: int, t0: float, admin: bool) -> None:
        while time.monotonic() < self.deadline:
            self.run.rss.append((time.monotonic() - t0, h.rss_mib(pid)))
            if admin:
                try:
                    async with http.get(self.url.rsplit("/v1/", 1)[0] + "/admin/status?top=1", headers={"Authorization": "Bearer sk-bench-admin"}) as r:
                        if r.status == 200:
                            self.run.users_tracked.append((time.monotonic() - t0, (await r.json()).get("users_total", -1)))
                except aiohttp.ClientError:
                    pass
            await asyncio.sleep(1.0)

    async def go(self, pid: int, t0: float, admin: bool) -> None:
        conn = aiohttp.TCPConnector(limit=0, force_close=False)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as http:
            jobs = [self.honest(http, u, t0) for u in HONEST for _ in range(HONEST_WORKERS)]
            jobs.append(self.late(http, t0))
            jobs += [self.absurd(http) for _ in range(2)]
            jobs += [self.disconnect(http) for _ in range(4)]
            jobs += [self.tools(http) for _ in range(4)]
            jobs += [self.churn(http), self.watch(http, pid, t0, admin)]
            await asyncio.gather(*jobs)


def old_checkout(ref: str, into: Path) -> Path | None:
    """``git archive`` of ``ref`` unpacked under ``into`` (no worktree, nothing left in the
    repository), or ``None`` when git or the ref is not available."""
    git = shutil.which("git")
    if git is None:
        return None
    dest = into / "old"
    dest.mkdir(parents=True, exist_ok=True)
    try:
        archive = subprocess.run([git, "-C", str(h.REPO_ROOT), "archive", ref], check=True, capture_output=True, timeout=60).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True, timeout=60)
    except (subprocess.SubprocessError, OSError):
        return None
    return dest


async def run_one(label: str, src: Path, workdir: Path, duration_s: float, churn_total: int, rate: float, max_inflight: int) -> Run:
    """One run: a fresh upstream and a proxy from ``src``, the load for ``duration_s``."""
    px_port = h.free_port()
    up_args = [
        "--rate", str(rate), "--max-stream-rate", "300", "--prefill-rate", "80000", "--max-model-len", str(CONTEXT),
        "--max-lifetime-s", str(duration_s + 300),
    ]  # fmt: skip
    up, upstream_url = h.start_rate_upstream(workdir, up_args, f"upstream-{label}")
    proxy = None
    try:
        cfg = workdir / f"config-{label}.yaml"
        cfg.write_text(yaml.safe_dump(config(upstream_url, max_inflight)))
        proxy = h.start_proxy(cfg, px_port, upstream_url, workdir, src=src)
        run = Run(label)
        async with aiohttp.ClientSession() as http:
            await (await http.post(upstream_url + "/stats/reset")).release()
        t0 = time.monotonic()
        await Load(f"http://127.0.0.1:{px_port}", run, duration_s, churn_total).go(proxy.pid, t0, admin=src == h.REPO_ROOT)
        run.duration_s = duration_s
        async with aiohttp.ClientSession() as http:
            async with http.get(upstream_url + "/stats") as r:
                stats = await r.json()
        run.times = [t - t0 for t, _ in stats["samples"]]
        run.service = {u: [cum.get(u, 0.0) for _t, cum in stats["samples"]] for u in USERS}
        return run
    finally:
        h.stop(proxy)
        h.stop(up)


@dataclass
class Result:
    """The figures of one run (shares in fractions, RSS in MiB)."""

    honest_share: dict[str, float]
    honest_worst_err: dict[str, float]
    gamer_share: dict[str, float]
    gamer_worst_window: dict[str, float]
    honest_share_after: dict[str, float]  # the same, from the late user's arrival (the return) on
    late_share: float  # of all honest tokens (the late user's included) from its arrival on
    late_worst_err: float  # the worst window from its arrival on, against its weight share
    late_first_s: float
    windows: int
    rss_start: float
    rss_max: float
    rss_end: float
    users_tracked_max: int | None


def measure(run: Run, warmup_s: float, window_s: float) -> Result:
    """Shares over the run after ``warmup_s``, and over every ``window_s`` window sliding
    by 1 s, both while the honest users are backlogged: the honest users' pause
    (``PAUSE_S``, while their queues drain and the gamers are alone) is left out, since
    no share is owed to a user with nothing waiting."""
    t = np.asarray(run.times)
    end = min(t[-1], run.duration_s)  # the load's end (requests still in flight then are not the scenario)
    cum = {u: np.asarray(run.service[u]) for u in USERS}
    at = lambda u, x: np.interp(x, t, cum[u])  # noqa: E731
    spans = [(a, b) for a, b in ((warmup_s, min(end, PAUSE_S[0])), (max(warmup_s, PAUSE_S[1]), end)) if b > a]
    tot = {u: float(sum(at(u, b) - at(u, a) for a, b in spans)) for u in USERS}
    honest_total = sum(tot[u] for u in HONEST) or 1.0
    all_total = sum(tot.values()) or 1.0
    gold_total = (all_total - tot[CHURN] - tot[LATE]) or 1.0  # the gamers' targets are of 7 weights
    late_from = max(warmup_s, run.late_at_s)
    since = {u: float(at(u, end) - at(u, late_from)) for u in (*HONEST, LATE)}
    late_share = since[LATE] / (sum(since.values()) or 1.0)
    honest_after = sum(since[u] for u in HONEST) or 1.0
    late_target = LATE_WEIGHT / (sum(HONEST.values()) + LATE_WEIGHT)
    lstarts = np.arange(late_from, end - window_s + 1e-9, 1.0)
    linc = {u: at(u, lstarts + window_s) - at(u, lstarts) for u in (*HONEST, LATE)}
    with np.errstate(invalid="ignore", divide="ignore"):
        late_worst = float(np.max(np.abs(linc[LATE] / sum(linc.values()) - late_target))) if len(lstarts) else math.nan
    wsum = sum(HONEST.values())
    starts = np.concatenate([np.arange(a, b - window_s + 1e-9, 1.0) for a, b in spans] or [np.zeros(0)])
    inc = {u: at(u, starts + window_s) - at(u, starts) for u in USERS}
    hsum = sum(inc[u] for u in HONEST)
    asum = sum(inc.values())
    gsum = asum - inc[CHURN] - inc[LATE]
    with np.errstate(invalid="ignore", divide="ignore"):
        worst = {u: float(np.max(np.abs(inc[u] / hsum - HONEST[u] / wsum))) for u in HONEST} if len(starts) else {}
        gworst = {u: float(np.max(inc[u] / gsum)) for u in GAMERS} if len(starts) else {}
        if len(starts):
            gworst[CHURN] = float(np.max(inc[CHURN] / asum))
    rss = [m for s, m in run.rss]
    return Result(
        honest_share={u: tot[u] / honest_total for u in HONEST},
        honest_worst_err=worst,
        gamer_share={**{u: tot[u] / gold_total for u in GAMERS}, CHURN: tot[CHURN] / all_total},
        gamer_worst_window=gworst,
        honest_share_after={u: since[u] / honest_after for u in HONEST},
        late_share=late_share,
        late_worst_err=late_worst,
        late_first_s=run.late_first_s,
        windows=len(starts),
        rss_start=rss[0] if rss else math.nan,
        rss_max=max(rss) if rss else math.nan,
        rss_end=rss[-1] if rss else math.nan,
        users_tracked_max=max((n for _s, n in run.users_tracked), default=None),
    )


def table(runs: list[Run], results: list[Result], window_s: float) -> str:
    labels = [r.label for r in runs]
    rows: list[tuple[str, str, list[str]]] = []
    wsum = sum(HONEST.values())
    for u, w in HONEST.items():
        rows.append((f"{u} (w={w:g}) share of honest tokens", f"{100 * w / wsum:.1f}%", [f"{100 * r.honest_share[u]:.1f}%" for r in results]))
    rows.append((f"honest: worst {window_s:g} s window error, pp", "<= 3.0", [f"{100 * max(r.honest_worst_err.values()):.1f}" for r in results]))
    rows.append(
        (
            f"honest shares after the return (t >= {runs[0].late_at_s:g} s)",
            " / ".join(f"{100 * w / wsum:.0f}" for w in HONEST.values()) + "%",
            [" / ".join(f"{100 * r.honest_share_after[u]:.1f}" for u in HONEST) + "%" for r in results],
        )
    )
    late_target = LATE_WEIGHT / (wsum + LATE_WEIGHT)
    rows.append((f"{LATE} (w={LATE_WEIGHT:g}, from t={runs[0].late_at_s:g} s) share of honest tokens", f"{100 * late_target:.1f}%", [f"{100 * r.late_share:.1f}%" for r in results]))
    rows.append((f"{LATE}: worst {window_s:g} s window error, pp", "<= 3.0", [f"{100 * r.late_worst_err:.1f}" for r in results]))
    rows.append((f"{LATE}: first answer after, s", "", [f"{r.late_first_s:.2f}" for r in results]))
    for u in GAMERS:
        rows.append((f"{u} share of gold's tokens (worst window)", f"<= {100 / STEADY_WEIGHT:.1f}%", [f"{100 * r.gamer_share[u]:.1f}% ({100 * r.gamer_worst_window[u]:.1f}%)" for r in results]))
    rows.append(("churn (guests) share of all tokens (worst window)", f"~{100 * GUESTS_MIN_SHARE:.0f}%", [f"{100 * r.gamer_share[CHURN]:.1f}% ({100 * r.gamer_worst_window[CHURN]:.1f}%)" for r in results]))
    for u in (*HONEST, LATE, *GAMERS, CHURN):
        rows.append((f"{u}: answers ok / refused (status)", "", [_statuses(run.status.get(u, {})) for run in runs]))
    rows.append(("churn identities sent", "100000", [f"{run.churn_sent}" for run in runs]))
    rows.append(("proxy RSS start / max / end, MiB", "bounded", [f"{r.rss_start:.0f} / {r.rss_max:.0f} / {r.rss_end:.0f}" for r in results]))
    rows.append(("users tracked (max)", "<= 20000", [str(r.users_tracked_max) if r.users_tracked_max is not None else "-" for r in results]))
    return h.target_table(labels, rows)


def _statuses(d: dict[int, int]) -> str:
    ok = d.get(200, 0)
    other = sorted((s, n) for s, n in d.items() if s != 200)
    return f"{ok} / " + (", ".join(f"{n} ({s})" for s, n in other) if other else "0")


def plot(runs: list[Run], warmup_s: float, path: Path) -> None:
    """Cumulative weighted tokens per user (top) and the proxy's RSS (bottom), one column
    per accounting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"h-chat": "tab:orange", "h-long": "tab:blue", "h-mixed": "tab:green", LATE: "tab:olive", "g-absurd": "tab:red", "g-disconnect": "tab:purple", "g-tools": "tab:brown", CHURN: "tab:gray"}
    fig, axes = plt.subplots(2, len(runs), figsize=(7.5 * len(runs), 8), squeeze=False, gridspec_kw={"height_ratios": [3, 1]})
    wsum = sum(HONEST.values())
    for c, run in enumerate(runs):
        ax = axes[0][c]
        t = np.asarray(run.times)
        i0 = int(np.searchsorted(t, warmup_s))
        i1 = int(np.searchsorted(t, run.duration_s))
        t = t[:i1]
        base = {u: run.service[u][i0] for u in USERS}
        svc = {u: np.asarray(run.service[u][i0:i1]) - base[u] for u in USERS}
        for u in USERS:
            ls = "-" if u in HONEST or u == LATE else "--"
            ax.plot(t[i0:], svc[u] / 1e6, color=colors[u], lw=1.8 if u in HONEST or u == LATE else 1.2, ls=ls, label=u)
        hsum = sum(svc[u] for u in HONEST)
        for u, w in HONEST.items():
            ax.plot(t[i0:], w / wsum * hsum / 1e6, color=colors[u], lw=0.9, ls=":")
        j = int(np.searchsorted(t, max(warmup_s, run.late_at_s))) - i0
        if 0 <= j < len(hsum):  # the late user's weight share of honest tokens since it came
            since = sum(svc[u][j:] - svc[u][j] for u in (*HONEST, LATE))
            ax.plot(t[i0 + j :], (svc[LATE][j] + LATE_WEIGHT / (wsum + LATE_WEIGHT) * since) / 1e6, color=colors[LATE], lw=0.9, ls=":")
        ax.axvspan(*PAUSE_S, color="0.9", zorder=0, label="honest users paused")
        ax.set_title(f"{run.label}: weighted tokens since t={warmup_s:g} s")
        ax.set_ylabel("millions of weighted tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
        ax2 = axes[1][c]
        ax2.plot([s for s, _ in run.rss], [m for _, m in run.rss], color="black")
        ax2.set_ylabel("proxy RSS (MiB)")
        ax2.set_xlabel("time (s)")
        ax2.grid(alpha=0.3)
    fig.suptitle("Adversarial scenario, live through the proxy process (dotted: each honest user's weight share of honest tokens; grey: the pause)", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


async def main_async(duration_s: float, warmup_s: float, window_s: float, churn_total: int, old_ref: str | None, plot_path: Path, rate: float, max_inflight: int) -> tuple[str, bool]:
    """Run the scenario (this checkout, then ``old_ref`` if given and available); return
    the printed report and whether the targets were met by this checkout."""
    h.raise_nofile()
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="llm-qos-adversarial-") as d:
        wd = Path(d)
        runs.append(await run_one("new accounting", h.REPO_ROOT, wd, duration_s, churn_total, rate, max_inflight))
        if old_ref:
            src = old_checkout(old_ref, wd)
            if src is None:
                print(f"(old accounting skipped: cannot check out {old_ref})")
            else:
                runs.append(await run_one(f"old accounting ({old_ref})", src, wd, duration_s, churn_total, rate, max_inflight))
    results = [measure(r, warmup_s, window_s) for r in runs]
    report = table(runs, results, window_s)
    new = results[0]
    ok = max(new.honest_worst_err.values()) <= 0.03 and all(new.gamer_share[g] <= 1 / STEADY_WEIGHT for g in GAMERS)
    ok = ok and not new.late_worst_err > 0.03
    plot(runs, warmup_s, plot_path)
    return report, ok
