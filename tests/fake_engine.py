"""A small fake engine process for the supervision tests: it takes LightLLM's command line
(``-m lightllm.server.api_server --host H --port P ...``, as the launcher builds it) and
answers LightLLM's native ``POST /generate`` readiness probe, with faults chosen by
environment variables (the launcher passes its environment on to the engine):

* ``FAKE_ENGINE_LOG``: a file; each start appends one JSON line ``{"pid", "argv"}``.
* ``FAKE_ENGINE_LOAD_S``: seconds spent "loading the model" before the port opens.
* ``FAKE_ENGINE_CRASH_CODE``: after loading, exit with this code instead of serving
  (an engine that always crashes while loading).
* ``FAKE_ENGINE_HANG_FIRST``: the first N ``POST /generate`` requests never get an answer
  (a probe that times out); later ones are answered at once.

Use it as the LightLLM interpreter: ``LLM_QOS_LIGHTLLM_PYTHON`` = a script that runs
``python tests/fake_engine.py "$@"`` (see :func:`write_fake_python`). The process exits
when its parent dies, so a killed test leaves nothing behind.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_hang_left = int(os.environ.get("FAKE_ENGINE_HANG_FIRST", "0"))
_lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *_args) -> None:  # quiet
        pass

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        global _hang_left
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path != "/generate":
            self.send_error(404)
            return
        with _lock:
            hang = _hang_left > 0
            _hang_left -= hang
        if hang:
            time.sleep(3600)  # never answers; the thread dies with the process
            return
        body = b'{"generated_text":["a"],"count_output_tokens":1,"finish_reason":"length","prompt_tokens":1}'
        self.send_response(200)  # no Content-Type, like LightLLM
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _die_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(0)


def main(argv: list[str]) -> int:
    if argv[:2] == ["-m", "lightllm.server.api_server"]:
        argv = argv[2:]
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    args, _unknown = p.parse_known_args(argv)  # LightLLM's other flags are recorded, not used
    threading.Thread(target=_die_with_parent, args=(os.getppid(),), daemon=True).start()
    if log := os.environ.get("FAKE_ENGINE_LOG"):
        with Path(log).open("a") as f:
            f.write(json.dumps({"pid": os.getpid(), "argv": argv}) + "\n")
    time.sleep(float(os.environ.get("FAKE_ENGINE_LOAD_S", "0")))
    if code := os.environ.get("FAKE_ENGINE_CRASH_CODE"):
        return int(code)
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    server.serve_forever()
    return 0


def write_fake_python(folder: Path) -> Path:
    """An executable standing in for LightLLM's interpreter that runs this fake engine."""
    script = folder / "fake-lightllm-python"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" "$@"\n')
    script.chmod(0o755)
    return script


def starts(log: Path) -> list[dict]:
    """The ``{"pid", "argv"}`` lines the fake engine wrote to ``log``, one per start."""
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
