"""The ``llm-qos`` command line, as a user runs it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from tests.proxy_process import REPO_ROOT

ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "proxy", *args], capture_output=True, text=True, env=ENV, timeout=timeout, cwd=REPO_ROOT)


def test_help_lists_the_subcommands():
    out = _run("--help")
    assert out.returncode == 0
    for cmd in ("proxy", "engine", "up", "check-config"):
        assert cmd in out.stdout
    eng = _run("engine", "--help")
    assert eng.returncode == 0 and "--backend" in eng.stdout


def test_up_fails_at_once_on_a_busy_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        out = _run("up", "--port", str(port))
    assert out.returncode == 2
    assert "already in use" in out.stderr
    assert time.monotonic() - t0 < 20  # no engine was started first
