"""What the proxy costs on a request's path: direct vs llm-qos vs nginx vs the Rust routers.

One run on one machine starts the fake upstream (``bench.fake_upstream``), the llm-qos
proxy (``python -m proxy proxy``, its own process, admission on, shipped defaults
otherwise), nginx as a plain streaming reverse proxy (``proxy_buffering off``, one worker,
keep-alive upstream) if installed, and vllm-router and sglang-router (Rust, from PyPI, in
their own venv ``.venv-routers``: ``make bench-routers``; the command lines are in
``bench.harness.router_command``) if installed, all in front of the same upstream, and
measures, alternating between the targets round by round:

* p50 latency at concurrency 1 (non-streaming; "added" = target p50 - direct p50 of the
  same round);
* CPU per non-streaming request (closed loop, concurrency 8) and per 64-token stream
  (concurrency 16, 1 ms between tokens upstream: every event is its own chunk, as from an
  engine), from the target process's own accounting (``utime + stime`` in
  ``/proc/PID/stat``, threads and children included, deltas over a fixed request count;
  nginx: master + worker); per relayed chunk = per stream / 66 (64 token events, the
  final usage event, ``[DONE]``);
* non-streaming requests/s (closed loop, concurrency 32, two load processes);
* streams/s (closed loop of 64-token streams, concurrency 32, two load processes, no
  pause between tokens upstream: the relay's capacity, not an engine's pace);
* RSS after the run;

prints them in one table with the ratios of llm-qos to the best Rust router (and to
nginx), so that a change that costs CPU shows up as a ratio measured in the same
conditions, then holds 10 000 idle streams through one proxy process
(``bench.idle_streams``) and times one admission decision (``qos.Scheduler`` submit +
dispatch) with 10 000 queued.

The upstream's pause between a stream's tokens is set on the upstream between phases
(``POST /timing``), not in the request body: sglang-router rebuilds the body and drops
fields it does not know.

The load generator (``bench.loadgen``) runs in its own processes. The latency and
throughput phases run with every process free to use every CPU (as deployed: the sidecar
shares the machine). The CPU phases pin the target to CPU 0 and the load generator and
the fake upstream to the others (on a machine with 2+ CPUs; ``--no-pin`` turns this off),
so the target's own accounting is not inflated by fighting its clients for a core.

    python -m bench.overhead            # full run, 5-7 minutes on 2 cores
    python -m bench.overhead --quick    # about 1 minute
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from . import harness as h
from .loadgen import LoadPool, LoadSpec

STREAM_TOKENS = 64
STREAM_EVENTS = STREAM_TOKENS + 2  # token events, the final (usage) event, [DONE]
STREAM_ITL_S = 0.001  # between tokens: every event is its own chunk, as from an engine

TARGETS_SPEC = {
    "added_p50_ms": 0.5,
    "cpu_ms_per_request": 0.4,
    "cpu_ms_per_stream": 4.0,
    "cpu_us_per_chunk": 60.0,
    "idle_rss_mib": 1024.0,
    "admission_us": 20.0,
}


@dataclass
class Sizes:
    """How much of each phase: ``rounds`` (medians over them), requests at concurrency 1
    (``lat_requests``) and 8 (``cpu_requests``), ``streams`` at 16, seconds of each
    concurrency-32 throughput phase (``throughput_s``), ``idle_streams`` held."""

    rounds: int
    lat_requests: int
    cpu_requests: int
    streams: int
    throughput_s: float
    idle_streams: int


FULL = Sizes(rounds=3, lat_requests=2000, cpu_requests=5000, streams=500, throughput_s=4.0, idle_streams=10000)
QUICK = Sizes(rounds=1, lat_requests=800, cpu_requests=2000, streams=200, throughput_s=2.0, idle_streams=2000)


class Target:
    def __init__(self, name: str, url: str, pids: list[int] | None) -> None:
        self.name, self.url, self.pids = name, url, pids


def admission_micro(queued: int = 10000, iters: int = 4000, repeats: int = 5, users: int = 1000) -> float:
    """Microseconds per admission decision with ``queued`` requests waiting (spread over
    ``users`` users in three groups): one ``submit`` of a request that has to queue plus
    the ``release`` that dispatches the best waiting one. The median of ``repeats`` runs
    of ``iters`` decisions (the machine may be shared)."""
    from collections import deque

    from qos import GroupPolicy, Scheduler, SchedulerPolicy, UserPolicy

    groups = ("platinum", "gold", "bronze")
    upol = {f"u{i}": UserPolicy(f"u{i}", groups[i % 3], 1.0 + i % 4) for i in range(users)}
    inflight = 64
    policy = SchedulerPolicy(
        groups=tuple(GroupPolicy(g) for g in groups), default_group="bronze", users=upol,
        max_inflight=inflight, max_queue=queued + inflight + 10, queue_timeout_s=3600.0,
    )
    admitted: deque = deque()
    s = Scheduler(policy, on_admit=admitted.append)
    for i in range(queued + inflight):
        s.submit(f"u{i % users}", None, 50 + i % 200, 64 + i % 128)
    assert s.queued == queued and len(admitted) == inflight
    runs = []
    k = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            k += 1
            s.submit(f"u{(k * 7) % users}", None, 50 + k % 200, 64 + k % 128)
            s.release(admitted.popleft(), None, 32 + k % 64)
        runs.append((time.perf_counter() - t0) / iters * 1e6)
    assert s.queued == queued
    return statistics.median(runs)


def _phase(pool: LoadPool, spec: LoadSpec, target: Target, procs: int = 1) -> dict:
    c0 = h.cpu_s(*target.pids) if target.pids else None
    res = pool.run(replace(spec, url=target.url), procs)
    c1 = h.cpu_s(*target.pids) if target.pids else None
    s = res.summary()
    s["cpu_s"] = None if c0 is None else c1 - c0
    s["chunks"] = res.chunks
    return s


def _set_timing(upstream_url: str, **timing) -> None:
    """Set the fake upstream's default timing (``POST /timing``)."""
    h.http_json(upstream_url + "/timing", timing)


def measure(sizes: Sizes, pin: bool, use_nginx: bool, idle: bool, log=print, proxy_src: str | None = None,
            routers: bool = True, routers_venv: Path = h.ROUTERS_VENV, router_policy: str = "round_robin") -> dict:
    """Run every phase against every target (see the module docstring) and return the
    results: ``rows`` (one per target: ``added_p50_ms``, ``cpu_ms_per_request``,
    ``cpu_ms_per_stream``, ``req_per_s_c32``, ``streams_per_s_c32``, ...; ms, req/s),
    ``ratios`` (llm-qos to the best Rust router and to nginx), ``versions``, notes on what
    was skipped, ``idle`` and ``admission_us``."""
    h.raise_nofile()
    all_cpus = os.sched_getaffinity(0)
    pin = pin and len(all_cpus) >= 2
    target_cpus = {min(all_cpus)}
    other_cpus = all_cpus - target_cpus
    results: dict = {"sizes": sizes.__dict__, "pinned": pin, "cpus": len(all_cpus), "python": sys.version.split()[0],
                     "loadavg_before": os.getloadavg()[0], "versions": {}, "routers": {}, "router_commands": {}}
    with tempfile.TemporaryDirectory(prefix="llmqos-bench-") as tmp:
        wd = Path(tmp)
        up_port, px_port, ng_port = h.free_port(), h.free_port(), h.free_port()
        upstream_url = f"http://127.0.0.1:{up_port}"
        up = proxy = nginx = None
        started_routers: list = []
        try:
            up = h.start_fake_upstream(up_port, wd)
            cfg = h.write_proxy_config(wd / "bench.yaml", upstream_url, max_inflight=4096, max_queue=10000)
            proxy = h.start_proxy(cfg, px_port, upstream_url, wd, src=proxy_src)
            targets = [Target("direct", upstream_url, None), Target("llm-qos", f"http://127.0.0.1:{px_port}", [proxy.pid])]
            binary = h.nginx_binary() if use_nginx else None
            if binary:
                nginx = h.Nginx(binary, ng_port, up_port, wd)
                targets.append(Target("nginx", f"http://127.0.0.1:{ng_port}", nginx.pids))
                results["nginx"] = "installed"
                results["versions"]["nginx"] = h.nginx_version(binary)
            else:
                results["nginx"] = "skipped: nginx is not installed (apt-get install -y nginx)" if use_nginx else "skipped (--no-nginx)"
                log(f"note: nginx {results['nginx']}")
            for name in h.ROUTERS:
                version = h.router_version(name, routers_venv) if routers else None
                if version is None:
                    results["routers"][name] = (
                        f"skipped: not installed in {routers_venv} (make bench-routers)" if routers else "skipped (--no-routers)"
                    )
                    log(f"note: {name} {results['routers'][name]}")
                    continue
                try:
                    router = h.RustRouter(name, h.free_port(), upstream_url, wd, policy=router_policy, venv=routers_venv)
                except RuntimeError as e:
                    results["routers"][name] = f"skipped: did not start: {str(e)[:500]}"
                    log(f"note: {name} {results['routers'][name]}")
                    continue
                started_routers.append(router)
                targets.append(Target(name, router.url, router.pids))
                results["routers"][name] = "installed"
                results["versions"][name] = version
                results["router_commands"][name] = " ".join(router.cmd)

            def place(pinned: bool) -> list | None:
                """Pinned: the targets on CPU 0, the upstream (and the load, via the
                returned CPU list) on the others. Otherwise everything floats."""
                for t in targets:
                    for pid in t.pids or ():
                        h.set_affinity(pid, target_cpus if pinned else all_cpus)
                h.set_affinity(up.pid, other_cpus if pinned else all_cpus)
                return sorted(other_cpus if pinned else all_cpus)

            with LoadPool(2) as pool:
                base = LoadSpec(url="", keys=h.KEYS, timeout_s=30.0)
                place(False)
                _set_timing(upstream_url, stream_itl_s=0.0)
                for t in targets:  # warm-up: connections open, code paths hot
                    pool.run(replace(base, url=t.url, concurrency=8, requests=400, duration_s=10))
                    pool.run(replace(base, url=t.url, concurrency=8, requests=40, duration_s=10, stream=True, max_tokens=8))
                streams = replace(base, stream=True, max_tokens=STREAM_TOKENS)
                # name: (spec, load processes, pinned, upstream pause between a stream's tokens)
                phases = {
                    "lat": (replace(base, concurrency=1, requests=sizes.lat_requests, duration_s=20), 1, False, 0.0),
                    "cpu": (replace(base, concurrency=8, requests=sizes.cpu_requests, duration_s=30), 1, pin, 0.0),
                    "stream": (replace(streams, concurrency=16, requests=sizes.streams, duration_s=30), 1, pin, STREAM_ITL_S),
                    "rps32": (replace(base, concurrency=32, duration_s=sizes.throughput_s), 2, False, 0.0),
                    "streams32": (replace(streams, concurrency=32, duration_s=sizes.throughput_s), 2, False, 0.0),
                }
                raw: dict = {t.name: {p: [] for p in phases} for t in targets}
                for r in range(sizes.rounds):
                    for pname, (spec, procs, pinned, itl) in phases.items():
                        spec = replace(spec, cpus=place(pinned))
                        _set_timing(upstream_url, stream_itl_s=itl)
                        order = targets[r % len(targets):] + targets[: r % len(targets)]  # alternate who goes first
                        for t in order:
                            s = _phase(pool, spec, t, procs)
                            raw[t.name][pname].append(s)
                            log(f"round {r + 1}/{sizes.rounds} {pname:9s} {t.name:13s} ok={s['ok']:6d} req/s={s['req_per_s']:8.1f} "
                                f"p50={s['p50_ms']}ms p99={s['p99_ms']}ms errors={s['errors'] or '-'}"
                                + ("" if s["cpu_s"] is None else f" cpu={s['cpu_s']:.2f}s"))
                place(False)
            rows = {}
            for t in targets:
                d = raw[t.name]
                row = {
                    "p50_ms_c1": h.median([s["p50_ms"] for s in d["lat"]]),
                    "p99_ms_c1": h.median([s["p99_ms"] for s in d["lat"]]),
                    "added_p50_ms": None if t.name == "direct" else h.median(
                        [s["p50_ms"] - dd["p50_ms"] for s, dd in zip(d["lat"], raw["direct"]["lat"])]
                    ),
                    "req_per_s_c32": h.median([s["req_per_s"] for s in d["rps32"]]),
                    "streams_per_s_c32": h.median([s["req_per_s"] for s in d["streams32"]]),
                    "stream_ttft_p50_ms": h.median([s["ttft_p50_ms"] for s in d["stream"]]),
                    "errors": sum(sum(s["errors"].values()) for p in d.values() for s in p),
                }
                if t.pids:
                    row["cpu_ms_per_request"] = h.median([s["cpu_s"] * 1000 / s["ok"] for s in d["cpu"] if s["ok"]])
                    row["cpu_ms_per_request_c1"] = h.median([s["cpu_s"] * 1000 / s["ok"] for s in d["lat"] if s["ok"]])
                    row["cpu_ms_per_stream"] = h.median([s["cpu_s"] * 1000 / s["ok"] for s in d["stream"] if s["ok"]])
                    row["cpu_us_per_chunk"] = None if row["cpu_ms_per_stream"] is None else row["cpu_ms_per_stream"] * 1000 / STREAM_EVENTS
                    # unpinned, no pause between tokens (the upstream's writes may coalesce)
                    row["cpu_ms_per_stream_c32"] = h.median([s["cpu_s"] * 1000 / s["ok"] for s in d["streams32"] if s["ok"]])
                    row["rss_mib"] = round(sum(h.mem_kib(p)["VmRSS"] for p in t.pids) / 1024, 1)
                rows[t.name] = row
            results["rows"] = rows
            results["ratios"] = ratios(rows)
        finally:
            h.stop(proxy)
            if nginx is not None:
                nginx.stop()
            for router in started_routers:
                router.stop()
            h.stop(up)
    if idle:
        from .idle_streams import run as idle_run

        log(f"idle streams: opening {sizes.idle_streams} through one proxy process ...")
        results["idle"] = idle_run(streams=sizes.idle_streams, proxy_src=proxy_src)
    results["admission_us"] = admission_micro()
    return results


# issue 22's bar for llm-qos against the best Rust router: (row key, kind, limit);
# kind "ratio_max": llm-qos / best <= limit (lower is better), "ratio_min": llm-qos / best
# >= limit (higher is better), "diff_max": llm-qos - best <= limit
RUST_BAR = {
    "cpu_ms_per_request": ("ratio_max", 2.0),
    "cpu_ms_per_stream": ("ratio_max", 1.0),
    "streams_per_s_c32": ("ratio_min", 1.0),
    "added_p50_ms": ("diff_max", 0.2),
    "req_per_s_c32": ("ratio_min", None),  # no bar: shown for the record
}


def ratios(rows: dict) -> dict:
    """llm-qos against references: ``best_rust`` (per figure, the best of the Rust
    routers measured) and ``nginx``. For each figure of :data:`RUST_BAR`: the reference
    target, its value, llm-qos's, and ``ratio`` (llm-qos / reference) or, for the added
    p50, ``diff_ms`` (llm-qos - reference). Empty where the reference was not measured."""
    mine = rows.get("llm-qos")
    out: dict = {"best_rust": {}, "nginx": {}}
    if not mine:
        return out
    rust = [n for n in h.ROUTERS if n in rows]
    for key, (kind, _) in RUST_BAR.items():
        higher_better = kind == "ratio_min"
        for ref, names in (("best_rust", rust), ("nginx", ["nginx"] if "nginx" in rows else [])):
            vals = [(rows[n][key], n) for n in names if rows[n].get(key) is not None]
            if not vals or mine.get(key) is None:
                continue
            v, n = max(vals) if higher_better else min(vals)
            entry = {"target": n, "value": v, "llm_qos": mine[key]}
            if kind == "diff_max":
                entry["diff_ms"] = mine[key] - v
            else:
                entry["ratio"] = mine[key] / v if v else None
            out[ref][key] = entry
    return out


IDLE_TARGET_STREAMS = 10000


def _idle_at_target(idle: dict) -> float:
    """RSS (MiB) at 10 000 idle streams: measured, or extrapolated from fewer."""
    if idle["streams_held"] >= IDLE_TARGET_STREAMS:
        return idle["rss_mib"]
    return idle["baseline_rss_mib"] + idle["kib_per_stream"] * IDLE_TARGET_STREAMS / 1024


NA = "—"  # a figure not measured


def _name(results: dict, name: str) -> str:
    v = results.get("versions", {}).get(name)
    return f"{name} {v}" if v else name


def table(results: dict) -> str:
    """The run as Markdown: issue 22's table, the ratios of llm-qos to the best Rust
    router and to nginx, then the details (p50/p99, per chunk, RSS), idle streams and the
    admission decision."""
    rows = results["rows"]
    out = h.markdown_table(
        ["target", "added p50 at c=1 (ms)", "CPU per non-streaming request (ms)", "CPU per 64-token stream (ms)",
         "non-streaming req/s (c=32)", "streams/s (c=32)"],
        [[f"**{_name(results, name)}**" if name == "llm-qos" else _name(results, name), h.fmt(r["added_p50_ms"], "+.2f", NA),
          h.fmt(r.get("cpu_ms_per_request"), ".3f", NA), h.fmt(r.get("cpu_ms_per_stream"), ".3f", NA),
          h.fmt(r["req_per_s_c32"], ".0f", NA), h.fmt(r["streams_per_s_c32"], ".0f", NA)] for name, r in rows.items()],
        "lrrrrr",
    )  # fmt: skip
    labels = {
        "cpu_ms_per_request": "CPU per request", "cpu_ms_per_stream": "CPU per stream",
        "streams_per_s_c32": "streams/s", "req_per_s_c32": "req/s", "added_p50_ms": "added p50",
    }
    for ref, title in (("best_rust", "the best Rust router"), ("nginx", "nginx")):
        rat = results.get("ratios", {}).get(ref) or {}
        if not rat:
            continue
        parts = []
        for key, e in rat.items():
            if "diff_ms" in e:
                parts.append(f"{labels[key]} {e['diff_ms']:+.2f} ms ({e['target']})")
            elif e.get("ratio") is not None:
                parts.append(f"{labels[key]} {e['ratio']:.2f}x ({e['target']})")
        out += f"\n\nllm-qos / {title}: " + ", ".join(parts)
    out += "\n\n" + h.markdown_table(
        ["target", "p50 c=1 (ms)", "p99 c=1 (ms)", "CPU / request at c=1 (ms)", "CPU / chunk (µs)", "stream TTFT p50 (ms)",
         "CPU / stream at c=32, no token pause (ms)", "RSS (MiB)", "errors"],
        [[name, h.fmt(r["p50_ms_c1"], ".3f", NA), h.fmt(r["p99_ms_c1"], ".3f", NA), h.fmt(r.get("cpu_ms_per_request_c1"), ".3f", NA),
          h.fmt(r.get("cpu_us_per_chunk"), ".1f", NA), h.fmt(r["stream_ttft_p50_ms"], ".2f", NA),
          h.fmt(r.get("cpu_ms_per_stream_c32"), ".3f", NA), h.fmt(r.get("rss_mib"), ".1f", NA), r["errors"]] for name, r in rows.items()],
        "l" + "r" * 8,
    )  # fmt: skip
    idle = results.get("idle")
    if idle:
        extra = ""
        if idle["streams_held"] < IDLE_TARGET_STREAMS:
            why = f"open-files limit {idle['nofile_limit']}, 2 sockets per stream; " if idle["streams_requested"] > idle["streams_held"] else ""
            extra = f" ({why}{idle['kib_per_stream']} KiB/stream -> {_idle_at_target(idle):.1f} MiB at {IDLE_TARGET_STREAMS}, extrapolated)"
        out += (
            f"\n\nidle streams: {idle['streams_held']} held by one proxy process: RSS {idle['rss_mib']} MiB "
            f"(baseline {idle['baseline_rss_mib']} MiB){extra}; all {idle['aborted_upstream']} upstream requests aborted "
            f"{idle['abort_s']} s after the clients left"
        )
    out += f"\nadmission decision (qos.Scheduler submit + dispatch, 10 000 queued): {results['admission_us']:.1f} µs"
    return out


def verdict(results: dict) -> list[str]:
    """PASS/FAIL lines: the absolute targets (:data:`TARGETS_SPEC`), then issue 22's bar
    against the best Rust router (:data:`RUST_BAR`) where routers were measured."""
    r = results["rows"]["llm-qos"]
    idle = results.get("idle")
    checks = [
        ("added p50 at concurrency 1", r["added_p50_ms"], TARGETS_SPEC["added_p50_ms"], "ms"),
        ("CPU per non-streaming request", r["cpu_ms_per_request"], TARGETS_SPEC["cpu_ms_per_request"], "ms"),
        ("CPU per 64-token stream", r["cpu_ms_per_stream"], TARGETS_SPEC["cpu_ms_per_stream"], "ms"),
        ("CPU per relayed chunk", r["cpu_us_per_chunk"], TARGETS_SPEC["cpu_us_per_chunk"], "µs"),
        ("RSS with 10 000 idle streams", idle and _idle_at_target(idle), TARGETS_SPEC["idle_rss_mib"], "MiB"),
        ("admission decision at 10 000 queued", results["admission_us"], TARGETS_SPEC["admission_us"], "µs"),
    ]
    out = []
    for what, v, limit, unit in checks:
        if v is None:
            out.append(f"  {what}: not measured")
        else:
            out.append(f"  {'PASS' if v <= limit else 'FAIL'} {what}: {v:.3g} {unit} (target <= {limit:g} {unit})")
    rat = results.get("ratios", {}).get("best_rust") or {}
    names = {
        "cpu_ms_per_request": "CPU per non-streaming request", "cpu_ms_per_stream": "CPU per 64-token stream",
        "streams_per_s_c32": "streams/s (c=32)", "added_p50_ms": "added p50 at concurrency 1",
    }
    for key, (kind, limit) in RUST_BAR.items():
        e = rat.get(key)
        if limit is None:
            continue
        if e is None:
            out.append(f"  {names[key]} against the best Rust router: not measured")
        elif kind == "diff_max":
            out.append(f"  {'PASS' if e['diff_ms'] <= limit else 'FAIL'} {names[key]}: {e['diff_ms']:+.2f} ms against {e['target']} (target <= +{limit:g} ms)")
        elif e.get("ratio") is not None:
            ok = e["ratio"] <= limit if kind == "ratio_max" else e["ratio"] >= limit
            sign = "<=" if kind == "ratio_max" else ">="
            out.append(f"  {'PASS' if ok else 'FAIL'} {names[key]}: {e['ratio']:.2f}x {e['target']} (target {sign} {limit:g}x)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one round, fewer requests, 2 000 idle streams (about 1 minute)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin the target to its own CPU")
    ap.add_argument("--no-nginx", dest="nginx", action="store_false")
    ap.add_argument("--no-routers", dest="routers", action="store_false", help="skip vllm-router and sglang-router")
    ap.add_argument("--routers-venv", default=str(h.ROUTERS_VENV), help="the venv holding the Rust routers (make bench-routers)")
    ap.add_argument("--router-policy", default="round_robin", help="--policy of both routers (their shipped default is cache_aware)")
    ap.add_argument("--no-idle", dest="idle", action="store_false", help="skip the idle-streams measurement")
    ap.add_argument("--idle-streams", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the raw results to this file")
    ap.add_argument("--proxy-src", default=None, help="run the proxy from another checkout (e.g. a git worktree of an older commit) for before/after figures")
    a = ap.parse_args(argv)
    sizes = QUICK if a.quick else FULL
    if a.rounds:
        sizes = replace(sizes, rounds=a.rounds)
    if a.idle_streams:
        sizes = replace(sizes, idle_streams=a.idle_streams)
    t0 = time.monotonic()
    results = measure(
        sizes, a.pin, a.nginx, a.idle, log=lambda s: print(s, file=sys.stderr, flush=True), proxy_src=a.proxy_src,
        routers=a.routers, routers_venv=Path(a.routers_venv), router_policy=a.router_policy,
    )
    if a.proxy_src:
        results["proxy_src"] = a.proxy_src
    results["router_policy"] = a.router_policy
    results["wall_s"] = round(time.monotonic() - t0, 1)
    print()
    if results["loadavg_before"] > 0.5 * results["cpus"]:
        print(f"warning: the machine was busy when the run started (load average {results['loadavg_before']:.1f}); figures are noisier")
    print(f"llm-qos overhead, {results['cpus']} CPUs, Python {results['python']}, "
          f"{'CPU phases: target pinned to CPU 0, load + upstream on the rest' if results['pinned'] else 'unpinned'}, "
          f"{sizes.rounds} round(s) (medians), {results['wall_s']} s")
    if not results["nginx"].startswith("installed"):
        print(f"nginx: {results['nginx']}")
    for name, note in results["routers"].items():
        if note != "installed":
            print(f"{name}: {note}")
    if any(n in results["rows"] for n in h.ROUTERS):
        print(f"Rust routers: --policy {a.router_policy}, one worker (the fake upstream)")
    print()
    print(table(results))
    print()
    print("targets:")
    print("\n".join(verdict(results)))
    if a.json:
        h.write_json(Path(a.json), results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
