"""Child processes of the tests die with the test process, even when it is killed."""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Iterator
from pathlib import Path

from bench.harness import free_port, wait_for_line  # noqa: F401  (re-exported for the tests)


def die_with_parent() -> None:
    """``preexec_fn`` for subprocess.Popen: ask Linux to SIGKILL the child when its
    parent dies (prctl PR_SET_PDEATHSIG), so no server outlives a killed test run."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


def live_processes() -> Iterator[tuple[int, str, str, int, int]]:
    """Every process now, from ``/proc/<pid>/stat`` (proc(5)): ``(pid, comm, state, ppid,
    pgid)``; ``state`` is one letter (``Z``: a zombie). Processes that end while being
    read are skipped."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        state, ppid, pgid = stat[stat.rindex(")") + 2 :].split()[:3]
        yield int(entry), comm, state, int(ppid), int(pgid)
