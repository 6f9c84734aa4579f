"""What the engine itself can give: platinum's first token against bronze's throughput, at
each batch size, straight to vLLM (issue 20's feasibility check).

An admission policy in front of an engine chooses, in effect, how many requests the
engine runs at once (and which). This bench measures what each such choice yields with
no proxy at all: N bronze closed-loop streams of 128 tokens straight to vLLM, for N in
``--batches``, each with issue 20's platinum probes beside them (one 16-token stream every
0.5 s, as in :mod:`bench.real_engine`). While N stays below vLLM's own batch (128
sequences on its CPU build) nothing waits inside the engine, so a probe is taken into the
next engine step: its first token here is what the best proxy holding the engine at N
requests could give platinum, and the bronze tokens/s is what bronze gets there. A last
row, ``--reference`` streams (default 160, issue 20's overload row), is the "direct"
figure the issue's throughput target is taken against.

Per row (figures over the steady part, after the same warm-up as :mod:`bench.real_engine`):
vLLM's mean running count, bronze tokens/s, the probes' tokens/s, both together, the
probes' TTFT p50/p90; and whether the row meets issue 20's TTFT targets (from the
unloaded probe) and bronze's "at least 90 % of the reference row". No row meeting both
means no admission policy that only chooses the batch meets them on this engine.

Usage::

    .venv/bin/python -m bench.engine_frontier                       # 8..64 and 160: about 6 minutes
    .venv/bin/python -m bench.engine_frontier --batches 16,24,32 --duration 20

Output: a markdown table on stdout, every figure in ``bench/out/engine_frontier.json``.
Needs what :mod:`bench.real_engine` needs (``.venv-vllm`` and the prepared model).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench import harness as h
from bench import real_engine

OUT = h.REPO_ROOT / "bench" / "out" / "engine_frontier.json"
DEFAULT_BATCHES = (8, 16, 24, 32, 48, 64)


async def sweep(engine_url: str, model: str, batches: list[int], reference: int, duration: float, seed: int) -> dict:
    """The unloaded probes, then one direct row per batch size and the reference row."""
    sizes = [*batches, reference] if reference not in batches else list(batches)
    conn = aiohttp.TCPConnector(limit=max(sizes) + 2 * int(real_engine.PROBE_GRACE_S / real_engine.PROBE_INTERVAL_S) + 200, keepalive_timeout=30)
    timeout = aiohttp.ClientTimeout(total=duration + real_engine.PROBE_GRACE_S + 120)
    warmup = max(3.0, 0.2 * duration)
    rows = []
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        ctx = real_engine.Ctx(session, engine_url, engine_url, model, duration, warmup, 0, seed, [])
        base = await real_engine.unloaded(ctx, "direct")
        print(f"unloaded platinum TTFT p50 {base['p50_s']} s", file=sys.stderr, flush=True)
        for n in sizes:
            r = await real_engine.run_row(ctx, f"{n}-fixed", "direct")
            row = {"streams": n,
                   "running_mean": r["num_requests_running"]["mean"], "waiting_mean": r["num_requests_waiting"]["mean"],
                   "bronze_tok_s": r["bronze_tok_s"], "probe_tok_s": r["probe_tok_s"],
                   "ttft_p50_s": r["ttft_p50_s"], "ttft_p90_s": r["ttft_p90_s"], "probes": r["probes"]}
            row["total_tok_s"] = round(row["bronze_tok_s"] + row["probe_tok_s"], 1)
            rows.append(row)
            print(f"  {n:4} streams: running {row['running_mean']}, bronze {row['bronze_tok_s']} tok/s, probes {row['probe_tok_s']} tok/s, "
                  f"TTFT p50/p90 {row['ttft_p50_s']}/{row['ttft_p90_s']} s", file=sys.stderr, flush=True)
    return {"unloaded": base, "rows": rows, "warmup_s": warmup}


def judge(data: dict) -> dict:
    """Issue 20's targets for each batch row, in place; returns the targets."""
    tg = real_engine.targets(data["unloaded"]["p50_s"])
    ref = next(r for r in data["rows"] if r["streams"] == data["reference"])
    for r in data["rows"]:
        r["vs_reference"] = round(r["bronze_tok_s"] / ref["bronze_tok_s"], 3) if ref["bronze_tok_s"] else None
        ok_p50 = r["ttft_p50_s"] is not None and r["ttft_p50_s"] <= tg["ttft_p50_max_s"]
        ok_p90 = r["ttft_p90_s"] is not None and r["ttft_p90_s"] <= tg["ttft_p90_max_s"]
        ok_tput = r["vs_reference"] is not None and r["vs_reference"] >= tg["throughput_vs_direct_min"]
        r["checks"] = {"p50": ok_p50, "p90": ok_p90, "bronze ≥ 90 % of reference": ok_tput}
    data["feasible"] = [r["streams"] for r in data["rows"] if all(r["checks"].values()) and r["streams"] != data["reference"]]
    return tg


def table(data: dict) -> str:
    lines = ["| bronze streams | vLLM running (mean) | bronze tok/s | platinum tok/s | together | platinum TTFT p50 / p90 | bronze vs reference | targets |",
             "| ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |"]
    for r in data["rows"]:
        checks = ", ".join(f"{k} {'pass' if v else 'FAIL'}" for k, v in r["checks"].items())
        name = f"{r['streams']} (reference)" if r["streams"] == data["reference"] else str(r["streams"])
        p50 = "–" if r["ttft_p50_s"] is None else f"{r['ttft_p50_s']:.2f}"
        p90 = "–" if r["ttft_p90_s"] is None else f"{r['ttft_p90_s']:.2f}"
        lines.append(f"| {name} | {r['running_mean']} | {r['bronze_tok_s']} | {r['probe_tok_s']} | {r['total_tok_s']} | {p50} / {p90} s | "
                     f"{100 * r['vs_reference']:.0f} % | {checks} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default=",".join(map(str, DEFAULT_BATCHES)), help="comma-separated bronze stream counts")
    ap.add_argument("--reference", type=int, default=160, help="the overload row the throughput target is taken against")
    ap.add_argument("--duration", type=float, default=25.0, help="seconds per row")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, default=OUT)
    a = ap.parse_args(argv)
    batches = sorted({int(x) for x in a.batches.split(",") if x.strip()})
    if not batches or min(batches) < 1 or max(batches) > 512 or not 1 <= a.reference <= 512 or not 5 <= a.duration <= 600:
        ap.error("--batches and --reference in 1..512, --duration in 5..600 s")
    h.raise_nofile()
    workdir = Path(tempfile.mkdtemp(prefix="bench-engine-frontier-"))
    engine = None

    load_before = os.getloadavg()
    try:
        print(f"starting vLLM (logs in {workdir}) ...", file=sys.stderr, flush=True)
        t = time.monotonic()
        engine, engine_url, model, how = real_engine.start_engine(h.free_port(), workdir)
        print(f"vLLM ready in {time.monotonic() - t:.0f} s", file=sys.stderr, flush=True)
        data = asyncio.run(sweep(engine_url, model, batches, a.reference, a.duration, a.seed))
    finally:
        h.stop(engine, real_engine.STOP_GRACE_S)
    data["reference"] = a.reference
    tg = judge(data)
    meta = {"engine": how, "model": model, "cpus": os.cpu_count(), "cpu": h.cpu_model() or "?",
            "load_before": [round(x, 2) for x in load_before], "duration_s": a.duration, "targets": tg}
    h.write_json(a.json, {**meta, **data})
    print(f"vLLM 0.32 CPU build, {model}, {os.cpu_count()} CPUs ({meta['cpu']}); {a.duration:g} s per row, first {data['warmup_s']:g} s not counted")
    print(f"unloaded platinum TTFT {data['unloaded']['p50_s']} s: targets p50 <= {tg['ttft_p50_max_s']} s, p90 <= {tg['ttft_p90_max_s']} s, "
          f"bronze >= 90 % of the {a.reference}-stream row\n")
    print(table(data))
    print(f"\nbatch sizes meeting every target: {data['feasible'] or 'none'}; figures in {a.json}")
    return 0


if __name__ == "__main__":
    h.run_script(main, "engine stopped")
