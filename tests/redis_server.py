"""A real ``redis-server`` (Debian's, see ``tests/system_deps.sh``) for the tests.

:class:`RedisServer` runs one on a free 127.0.0.1 port with no persistence (no RDB
snapshots, no AOF) in a temporary directory. It can be stopped and started again on the
same port (a restart loses every key, as a real restart without persistence does), killed
with SIGKILL, or paused with SIGSTOP (connections stay open but nothing answers: the
"unreachable but not refused" case). The process dies with the test process
(PR_SET_PDEATHSIG), so no server outlives a killed test run.

The pytest fixture ``redis_server`` (in ``tests/conftest.py``) gives one per test.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from tests.proc_util import die_with_parent, free_port


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1.

    Args:
        port: the port (default: a free one, kept across :meth:`restart`).
        binary: the server executable (default ``redis-server`` on PATH).

    Raises:
        RuntimeError: (from :meth:`start`) the binary is missing, or the server did not
            become ready within 15 s.
    """

    def __init__(self, port: int | None = None, binary: str = "redis-server") -> None:
        self.port = port or free_port()
        self.binary = binary
        self.dir = Path(tempfile.mkdtemp(prefix=f"redis-{self.port}-"))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 15.0) -> "RedisServer":
        """Start the server and wait until it accepts connections. Returns ``self``."""
        if shutil.which(self.binary) is None:
            raise RuntimeError(f"{self.binary} not found: run tests/system_deps.sh (Debian package redis-server)")
        if self.proc is not None and self.proc.poll() is None:
            return self
        cmd = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.dir),
            "--daemonize", "no",
            "--logfile", "",
            "--maxmemory-policy", "noeviction",
        ]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0, preexec_fn=die_with_parent
        )
        self._wait_ready(self.proc, timeout_s)
        return self

    def _wait_ready(self, proc: subprocess.Popen, timeout_s: float) -> None:
        """Read the server's log (its stdout) until it says it accepts connections, then
        hand the pipe to a thread that drains it, so a full pipe never blocks the server."""
        lines: list[str] = []
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while not lines or "Ready to accept connections" not in lines[-1]:
                remaining = deadline - time.monotonic()
                # unbuffered (bufsize=0): no line can hide in a buffer select() does not see
                line = proc.stdout.readline().decode(errors="replace") if remaining > 0 and sel.select(remaining) else ""
                if not line:  # EOF (the server exited) or out of time
                    self.kill()
                    raise RuntimeError(f"redis-server on port {self.port} not ready in {timeout_s} s:\n{''.join(lines[-20:])}")
                lines.append(line)
        threading.Thread(target=_drain, args=(proc.stdout,), daemon=True).start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM and wait (SIGKILL after ``timeout_s``); all keys are lost."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        """Stop, then start again on the same port, empty."""
        self.stop()
        self.start()

    def kill(self) -> None:
        """SIGKILL (no shutdown at all)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the port stays open, nothing answers (calls time out)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def _drain(stream) -> None:
    for _ in stream:
        pass
