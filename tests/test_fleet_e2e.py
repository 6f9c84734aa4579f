"""End to end: ``llm-qos up --engines 2 --backend cpu`` as a user runs it (``python -m
proxy up ...``), two real CPU engines behind one proxy, driven with the OpenAI SDK; both
engines serve, and Ctrl-C (SIGINT) leaves no process behind.

Slow (two engine starts, ~10 s each once the model is prepared; the first start of all
prepares it, ~20-60 s, cached under ``$LLM_QOS_CACHE`` or ``~/.cache/llm-qos`` and shared
with the other engine tests): marked ``engine``. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import yaml

from engine_server import cpu_model
from proxy.cli import default_config_path
from tests.proc_util import die_with_parent, free_port, live_processes
from tests.test_cli import ENV, REPO_ROOT

pytestmark = pytest.mark.engine

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ADMIN_KEY = "admin-e2e-fleet"
READY_DEADLINE_S = 360.0  # both engines (the first may prepare the model), then the proxy
STOP_DEADLINE_S = 60.0  # up: the proxy drains (nothing in flight here), then both engines stop


def _free_port_pair() -> int:
    """A port P with P and P + 1 both free on 127.0.0.1 (``--engine-port P`` for two
    engines). P + 1 is drawn by :func:`free_port`, below the kernel's ephemeral range, so P
    is below it too: an engine whose port an outgoing connection takes as its source port
    crash-loops until ``up`` gives up."""
    for _ in range(100):
        p = free_port() - 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                continue
        return p
    raise RuntimeError("no two consecutive free ports")


def _children() -> dict[int, list[int]]:
    """Every live process's children, by parent PID (from /proc)."""
    kids: dict[int, list[int]] = {}
    for pid, _comm, _state, ppid, _pgid in live_processes():
        kids.setdefault(ppid, []).append(pid)
    return kids


def _descendants(pid: int) -> dict[int, str]:
    """``pid``'s descendants (all generations): PID -> command line."""
    kids, out, todo = _children(), {}, [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            try:
                out[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            todo.append(child)
    return out


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie has exited: gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _get(url: str, key: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_up_with_two_cpu_engines_serves_the_sdk_from_both_and_stops_them_all(tmp_path):
    try:
        cpu_model.find_gguf()
    except cpu_model.ModelNotAvailableError as e:
        pytest.skip(f"the CPU engine's model package is not installed (make install): {e}")
    t0 = time.monotonic()
    cfg = yaml.safe_load(Path(default_config_path()).read_text())  # what `llm-qos up` serves by default
    cfg["admin"] = {"api_key": ADMIN_KEY}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    engine_port, port = _free_port_pair(), free_port()
    engine_urls = {f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{engine_port + 1}"}
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "up.log"
    cmd = [sys.executable, "-m", "proxy", "up", "--engines", "2", "--backend", "cpu", "--config", str(config),
           "--host", "127.0.0.1", "--port", str(port), "--engine-port", str(engine_port)]
    with open(log_path, "w") as log:
        up = subprocess.Popen(cmd, cwd=REPO_ROOT, env={**ENV, "PYTHONUNBUFFERED": "1"}, stdin=subprocess.DEVNULL,
                              stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)

    def tail() -> str:
        return log_path.read_text(errors="replace")[-5000:]

    procs: dict[int, str] = {}
    try:
        # --- ready: both engines, then the proxy (up starts it only once both answer)
        deadline = time.monotonic() + READY_DEADLINE_S
        while _get(base + "/ready")[0] != 200:
            assert up.poll() is None, f"llm-qos up exited with {up.returncode} before it was ready:\n{tail()}"
            assert time.monotonic() < deadline, f"not ready within {READY_DEADLINE_S:g} s:\n{tail()}"
            time.sleep(0.5)
        ready_s = time.monotonic() - t0
        text = log_path.read_text(errors="replace")
        for url in engine_urls:
            assert f"engine ready at {url} (backend=cpu" in text, tail()
        assert f"starting the proxy on {base} -> " in text, tail()

        # --- the processes up runs: two engine launchers, each with its transformers
        # server, and the proxy
        procs = _descendants(up.pid)
        launchers = [p for p, c in procs.items() if "-m engine_server" in c]
        servers = [p for p, c in procs.items() if "transformers" in c and " serve " in f"{c} "]
        proxies = [p for p, c in procs.items() if "-m proxy proxy" in c]
        assert len(launchers) == 2 and len(servers) == 2 and len(proxies) == 1, procs

        # --- the OpenAI SDK through the proxy
        client = openai.OpenAI(base_url=base + "/v1", api_key="sk-alice", timeout=120, max_retries=0)
        models = [m.id for m in client.models.list().data]
        assert models, "the proxy lists no model"
        model = models[0]
        assert model == "smollm2-135m-instruct"

        for _ in range(2):  # one after the other: the engines take turns when equally free
            out = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=24)
            assert "Paris" in out.choices[0].message.content, out
            assert out.usage is not None and out.usage.completion_tokens >= 1

        def stream() -> tuple[str, str | None]:
            chunks = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=24, stream=True)
            text, finish = "", None
            for c in chunks:  # ends: the proxy closed the stream cleanly
                if c.choices:
                    text += c.choices[0].delta.content or ""
                    finish = c.choices[0].finish_reason or finish
            return text, finish

        with ThreadPoolExecutor(2) as pool:  # two at once: the second goes to the engine with room
            answers = list(pool.map(lambda _: stream(), range(2)))
        for text, finish in answers:
            assert "Paris" in text and finish in ("stop", "length"), answers

        # --- both engines served: the proxy's own per-engine counts
        status, body = _get(base + "/admin/status", ADMIN_KEY)
        assert status == 200, body[:500]
        engines = {e["url"]: e for e in json.loads(body)["engines"]}
        assert set(engines) == engine_urls, engines
        routed = {u: e["routed"] for u, e in engines.items()}
        assert all(n >= 1 for n in routed.values()) and sum(routed.values()) >= 4, routed
        assert all(e["state"] == "healthy" and e["inflight"] == 0 for e in engines.values()), engines
        assert _get(base + "/admin/status")[0] == 401  # the admin key is really asked for
        served_s = time.monotonic() - t0

        # --- Ctrl-C: up stops the proxy, then both engines; nothing is left behind
        up.send_signal(signal.SIGINT)
        try:
            code = up.wait(STOP_DEADLINE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"llm-qos up did not exit within {STOP_DEADLINE_S:g} s of SIGINT:\n{tail()}")
        assert code == 0, tail()
        left = {p: c for p, c in procs.items() if not _gone(p)}
        stop_by = time.monotonic() + 10  # a child's exit may still be on its way to us
        while left and time.monotonic() < stop_by:
            time.sleep(0.1)
            left = {p: c for p, c in left.items() if not _gone(p)}
        assert not left, f"processes outlived llm-qos up: {left}"
        for p in (port, engine_port, engine_port + 1):
            assert not _listening(p), f"port {p} still answers after llm-qos up exited"
        print(f"\nllm-qos up --engines 2: ready after {ready_s:.1f} s, served by {served_s:.1f} s, "
              f"stopped by {time.monotonic() - t0:.1f} s; routed {routed}")
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()
        for p in [*procs, *_descendants(up.pid)]:  # only on a failure above: nothing of ours stays
            if not _gone(p):
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
