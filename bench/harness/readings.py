"""Readings of running processes and of the machine, from /proc (proc(5)): CPU time,
memory, open files, the CPU model, the share of the machine other processes took; and
metric values from a server's Prometheus text.

CPU times are in seconds (``utime + stime``, clock ticks of ``SC_CLK_TCK`` converted),
memory in KiB or MiB as named.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` now (``/proc/PID/task/*/children``); empty when it
    is gone."""
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def cpu_s(*pids: int) -> float:
    """utime + stime of ``pids`` (their threads included), in seconds, from
    ``/proc/PID/stat`` (fields 14 and 15). Raises ``OSError`` when one is gone."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / CLK_TCK


def tree_cpu_s(pids: list[int]) -> float:
    """:func:`cpu_s` of ``pids`` and all their descendants alive now, each counted once
    (seconds); processes that end while being read are left out."""
    seen, total = set(), 0.0
    stack = list(pids)
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            total += cpu_s(pid)
        except OSError:
            continue
        stack += children(pid)
    return total


def mem_kib(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` (peak RSS) of ``pid`` in KiB, from ``/proc/PID/status``.
    Raises ``OSError`` when it is gone."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1])
    return out


def rss_mib(pid: int) -> float:
    """Resident set size of process ``pid`` in MiB (``VmRSS``); NaN when it is gone."""
    try:
        return mem_kib(pid)["VmRSS"] / 1024
    except (OSError, KeyError):
        return math.nan


def open_fds(pid: int) -> int:
    """File descriptors ``pid`` has open now (entries of ``/proc/PID/fd``)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_model() -> str | None:
    """The CPU's ``model name`` from ``/proc/cpuinfo`` (the first CPU's), or ``None``."""
    for ln in Path("/proc/cpuinfo").read_text().splitlines():
        if ln.startswith("model name"):
            return ln.split(":", 1)[1].strip()
    return None


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy since boot, all CPUs summed: every
    time of the first line of ``/proc/stat`` but idle and iowait."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / CLK_TCK


@dataclass(frozen=True)
class CpuSample:
    """One reading for :func:`cpu_shares`: the machine's busy CPU seconds since boot
    (:func:`machine_busy_s`) and the CPU seconds of the watched process trees
    (:func:`tree_cpu_s`)."""

    busy_s: float
    ours_s: float


def cpu_sample(pids: list[int]) -> CpuSample:
    """Read the machine's busy time, then the CPU time of ``pids`` and their descendants."""
    return CpuSample(machine_busy_s(), tree_cpu_s(pids))


def cpu_shares(before: CpuSample, after: CpuSample, wall_s: float) -> tuple[float, float]:
    """``(others, ours)`` between two samples ``wall_s`` seconds apart: the CPU time of
    every other process on the machine, and of the watched trees, each as a fraction of
    the machine's capacity (``os.cpu_count()`` CPUs x ``wall_s``; 1.0 = all CPUs busy)."""
    capacity = wall_s * (os.cpu_count() or 1)
    ours = after.ours_s - before.ours_s
    others = max(0.0, (after.busy_s - before.busy_s) - ours)
    return others / capacity, ours / capacity


def parse_prometheus(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum of each metric of ``names`` over its label sets, from Prometheus text
    exposition format (``name{labels} value [timestamp]`` lines; ``#`` lines skipped).
    A metric absent from ``text`` is absent from the result."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        name = line[:brace] if brace >= 0 else line.split(" ", 1)[0]
        if name not in names:
            continue
        rest = line[line.rfind("}") + 1 :] if brace >= 0 else line[len(name) :]
        try:
            out[name] = out.get(name, 0.0) + float(rest.split()[0])
        except (ValueError, IndexError):
            continue
    return out
