"""The proxy's own CPU per request and per stream, A/B between checkouts, and where it goes.

A focused measurement for one change at a time (issue 22): the fake upstream
(``bench.fake_upstream``) and one proxy per checkout given (``--src DIR``, e.g. a ``git
worktree`` of the commit before a change; default: this checkout), each proxy pinned to
CPU 0 and the load generator and upstream to CPU 1. Each round measures every checkout
in turn (the first one rotating), so they see the same noise:

* CPU per non-streaming request: ``utime + stime`` of the proxy process
  (``/proc/PID/stat``) over ``--requests`` requests at concurrency 8, divided by the
  requests served;
* CPU per 64-token stream: the same over ``--streams`` streams at concurrency 16, the
  upstream pausing 1 ms between tokens (each token its own chunk, as from an engine).

Process CPU time is robust to what else runs on the machine in a way wall-clock figures
are not (a busy machine still inflates it somewhat: cache misses, a virtual CPU's
steal), and the interleaving cancels most of the rest; a difference that holds in every
round is real.

``--profile OUT``: before the rounds, py-spy (``pip install py-spy``) samples the first
checkout's proxy for ``--profile-s`` seconds under each load (closed loops at concurrency
32: non-streaming, then streams), writes the raw stacks to ``OUT-request.txt`` and
``OUT-stream.txt``, and prints each sample's phase (:data:`PHASES`: the innermost frame
on its stack that names one) as shares and as µs of the CPU per request and per stream
measured in the rounds. This is how the budget in ``docs/performance.md`` is made.

    python -m bench.cpu_ab --src /tmp/before --src .        # A/B, 3 rounds
    python -m bench.cpu_ab --profile /tmp/prof --rounds 2   # where the time goes
"""

from __future__ import annotations

import argparse
import collections
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from . import harness as h
from .loadgen import LoadPool, LoadSpec

STREAM_TOKENS = 64

#: (a substring of a py-spy frame, the phase it names), tried from the innermost frame of a
#: sample outwards; the first frame that matches names the sample's phase
PHASES: list[tuple[str, str]] = [
    ("admission/identity.py", "identity"),
    ("wire/request_body.py", "parse"),
    ("BaseRequest.read", "parse"),
    ("telemetry/access_log.py", "access log"),
    ("telemetry/log_format.py", "access log"),
    ("_flush_access_log", "access log"),
    ("telemetry/metrics.py", "metrics"),
    ("prometheus_client", "metrics"),
    ("routing/model_routing.py", "routing (model table)"),
    ("Admitted.record_output", "accounting"),
    ("Admitted.true_up", "accounting"),
    ("_settle", "accounting"),
    ("_observe_objectives", "accounting"),
    ("telemetry/objectives.py", "accounting"),
    ("proxy/admission/", "admission (queue, placement)"),
    ("qos/", "admission (queue, placement)"),
    ("proxy/routing/", "admission (queue, placement)"),
    ("wire/sse.py", "relay: SSE scanning, usage strip"),
    ("wire/usage_strip.py", "relay: SSE scanning, usage strip"),
    ("relay/upstream_body.py", "upstream request"),
    ("relay/engine_body.py", "upstream request"),
    ("relay/upstream.py", "upstream request"),
    ("StreamResponse.write", "relay: writing to the client"),
    ("StreamResponse.prepare", "relay: writing to the client"),
    ("write_eof", "relay: writing to the client"),
    ("AsyncStreamIterator", "relay: reading the upstream"),
    ("ClientResponse.read", "relay: reading the upstream"),
    ("relay/relay.py", "relay: its own lines"),
    ("relay/answer.py", "relay: its own lines"),
    ("api/handlers.py", "handler's own steps (plan, ids, trace headers)"),
    ("wire/headers.py", "handler's own steps (plan, ids, trace headers)"),
    ("api/routes.py", "handler's own steps (plan, ids, trace headers)"),
    ("api/app.py", "handler's own steps (plan, ids, trace headers)"),
]
CLIENT_PROTOCOL = "upstream socket reads (aiohttp's client protocol)"
OUTSIDE = "aiohttp's server, the event loop, the kernel (outside any handler)"


def phase_of(frames: list[str]) -> str:
    """The phase of one py-spy sample (its frames, outermost first): see :data:`PHASES`."""
    for frame in reversed(frames):
        for sub, name in PHASES:
            if sub in frame:
                return name
    if any("client_proto.py" in f for f in frames):
        return CLIENT_PROTOCOL
    return OUTSIDE


def phase_shares(raw: Path) -> dict[str, float]:
    """Each phase's share (0..1) of the samples in a py-spy ``--format raw`` file."""
    counts: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            counts[phase_of(stack.split(";"))] += int(n)
    total = sum(counts.values()) or 1
    return {name: n / total for name, n in counts.most_common()}


def _spy(pid: int, seconds: int, out: Path) -> subprocess.Popen:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    cmd = [exe, "record", "-r", "250", "-f", "raw", "-d", str(seconds), "-o", str(out), "--pid", str(pid)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def measure(srcs: list[str], rounds: int, requests: int, streams: int, profile: Path | None, profile_s: int, log=print) -> dict:
    """Run the rounds (and the profile) of the module docstring; returns, per checkout,
    ``request_ms`` and ``stream_ms`` (one per round) and, with ``profile``, ``shares``
    (``request`` and ``stream``: phase -> share)."""
    started = []
    res: dict = {s: {"request_ms": [], "stream_ms": []} for s in srcs}
    try:
        with tempfile.TemporaryDirectory(prefix="llmqos-cpu-ab-") as tmp:
            wd = Path(tmp)
            up_port = h.free_port()
            up_url = f"http://127.0.0.1:{up_port}"
            up = h.start_fake_upstream(up_port, wd)
            started.append(up)
            h.set_affinity(up.pid, {1})
            cfg = h.write_proxy_config(wd / "bench.yaml", up_url)
            proxies = []
            for src in srcs:
                port = h.free_port()
                p = h.start_proxy(cfg, port, up_url, wd, src=Path(src))
                started.append(p)
                h.set_affinity(p.pid, {0})
                proxies.append((src, p, f"http://127.0.0.1:{port}"))
            with LoadPool(1, cpus={1}) as pool:
                base = LoadSpec(url="", keys=h.KEYS, timeout_s=30.0, cpus=[1])
                timing = lambda itl: h.http_json(up_url + "/timing", {"stream_itl_s": itl})  # noqa: E731
                for _, _, url in proxies:  # warm-up
                    timing(0.0)
                    pool.run(replace(base, url=url, concurrency=8, requests=500, duration_s=10))
                    pool.run(replace(base, url=url, concurrency=8, requests=50, duration_s=10, stream=True, max_tokens=8))
                if profile is not None:
                    src, p, url = proxies[0]
                    for kind, spec, itl in (
                        ("request", replace(base, url=url, concurrency=32, duration_s=profile_s + 3), 0.0),
                        ("stream", replace(base, url=url, concurrency=32, duration_s=profile_s + 3, stream=True, max_tokens=STREAM_TOKENS), 0.001),
                    ):
                        timing(itl)
                        out = Path(f"{profile}-{kind}.txt")
                        spy = _spy(p.pid, profile_s, out)
                        pool.run(spec)
                        spy.wait()
                        res[src].setdefault("shares", {})[kind] = phase_shares(out)
                        log(f"profile {kind}: {out}")
                for r in range(rounds):
                    for src, p, url in proxies[r % len(proxies):] + proxies[: r % len(proxies)]:
                        timing(0.0)
                        c0 = h.cpu_s(p.pid)
                        a = pool.run(replace(base, url=url, concurrency=8, requests=requests, duration_s=60)).summary()
                        c1 = h.cpu_s(p.pid)
                        timing(0.001)
                        b = pool.run(replace(base, url=url, concurrency=16, requests=streams, duration_s=60, stream=True, max_tokens=STREAM_TOKENS)).summary()
                        c2 = h.cpu_s(p.pid)
                        if a["ok"]:
                            res[src]["request_ms"].append((c1 - c0) * 1e3 / a["ok"])
                        if b["ok"]:
                            res[src]["stream_ms"].append((c2 - c1) * 1e3 / b["ok"])
                        log(f"round {r + 1}/{rounds} {src}: {res[src]['request_ms'][-1]:.3f} ms/request, {res[src]['stream_ms'][-1]:.3f} ms/stream"
                            f" (errors: {a['errors'] or '-'} / {b['errors'] or '-'})")
    finally:
        for p in reversed(started):
            h.stop(p)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", action="append", default=[], help="a checkout to run the proxy from (repeatable; default: this one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--streams", type=int, default=300)
    ap.add_argument("--profile", type=Path, default=None, help="py-spy the first checkout first; raw stacks to PROFILE-request.txt, PROFILE-stream.txt")
    ap.add_argument("--profile-s", type=int, default=15)
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    srcs = a.src or [str(h.REPO_ROOT)]
    h.raise_nofile()
    res = measure(srcs, a.rounds, a.requests, a.streams, a.profile, a.profile_s, log=lambda s: print(s, file=sys.stderr, flush=True))
    print("| proxy from | CPU per request (ms), median [min] | CPU per 64-token stream (ms), median [min] |")
    print("| --- | ---: | ---: |")
    for src in srcs:
        r = res[src]
        print(f"| {src} | {statistics.median(r['request_ms']):.3f} [{min(r['request_ms']):.3f}] | {statistics.median(r['stream_ms']):.3f} [{min(r['stream_ms']):.3f}] |")
    shares = res[srcs[0]].get("shares")
    if shares:
        per = {"request": statistics.median(res[srcs[0]]["request_ms"]) * 1e3, "stream": statistics.median(res[srcs[0]]["stream_ms"]) * 1e3}
        names = list(dict.fromkeys([*shares["request"], *shares["stream"]]))
        print(f"\nwhere {srcs[0]}'s CPU goes (py-spy, concurrency 32; µs = share x the median CPU above)\n")
        print("| phase | non-streaming | µs / request | 64-token stream | µs / stream |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for n in names:
            q, s = shares["request"].get(n, 0.0), shares["stream"].get(n, 0.0)
            print(f"| {n} | {100 * q:.1f} % | {q * per['request']:.0f} | {100 * s:.1f} % | {s * per['stream']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
