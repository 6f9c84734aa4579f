"""Child processes of the tests die with the test process, even when it is killed."""

from __future__ import annotations

import ctypes
import selectors
import signal
import subprocess
import time


def die_with_parent() -> None:
    """``preexec_fn`` for subprocess.Popen: ask Linux to SIGKILL the child when its
    parent dies (prctl PR_SET_PDEATHSIG), so no server outlives a killed test run."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


def wait_for_line(proc: subprocess.Popen, marker: str, timeout_s: float, what: str, log_tail=lambda: "") -> str:
    """Read ``proc``'s stdout (text mode) until a line starting with ``marker``; return it.

    Raises:
        RuntimeError: the process exited first, or ``timeout_s`` seconds passed (the
            process is then left running: the caller stops it); ``log_tail()`` is appended.
    """
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"{what} not ready in {timeout_s} s; log:\n{log_tail()}")
            if not sel.select(remaining):
                continue
            line = proc.stdout.readline()
            if not line:  # EOF: the process exited
                proc.wait()
                raise RuntimeError(f"{what} exited with {proc.returncode}; log:\n{log_tail()}")
            if line.startswith(marker):
                return line.strip()
