"""Child processes of the tests die with the test process, even when it is killed."""

from __future__ import annotations

import ctypes
import signal

from bench._harness import free_port, wait_for_line  # noqa: F401  (re-exported for the tests)


def die_with_parent() -> None:
    """``preexec_fn`` for subprocess.Popen: ask Linux to SIGKILL the child when its
    parent dies (prctl PR_SET_PDEATHSIG), so no server outlives a killed test run."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass
