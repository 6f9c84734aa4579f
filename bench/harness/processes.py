"""Processes of a benchmark: free ports on 127.0.0.1, a command started as the leader of
its own session (pinned to CPUs, its output in a log file), waiting until it is ready (a
line on its stdout, a listening port, an HTTP 200), talking JSON to its control
endpoints, and stopping it with everything it started.

Every process started here is stopped by :func:`stop`; nothing listens on anything but
127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import resource
import selectors
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]

_HANDED_OUT: set[int] = set()


def _port_range() -> tuple[int, int]:
    """Ports below the kernel's ephemeral range (Linux: ``ip_local_port_range``, 32768
    and up by default), where no outgoing connection's source port can land."""
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return (max(1024, low - 12000), low - 1) if low > 4096 else (40000, 60000)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a server a test or a bench
    starts. Drawn at random below the ephemeral range (a port the kernel hands out for
    ``bind(0)`` is also a source port for outgoing connections, which may take it before
    the server binds it), and never the same twice in one process."""
    lo, hi = _port_range()
    for _ in range(500):
        port = random.randint(lo, hi)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # the range is crowded: let the kernel pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raise_nofile() -> int:
    """Raise this process's open-files soft limit to its hard limit (children inherit
    it). Returns the new soft limit (a count of file descriptors)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def python_env(src: Path = REPO_ROOT) -> dict[str, str]:
    """This process's environment with ``src`` first on ``PYTHONPATH``: a Python child
    imports the packages of that checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH")]))
    return env


def spawn(
    cmd: list[str], log: Path, cpus: set[int] | None = None, src: Path = REPO_ROOT, env: dict[str, str] | None = None,
    cwd: Path | None = None, pipe_stdout: bool = True,
) -> subprocess.Popen:
    """Start ``cmd`` as the leader of a new session (so that :func:`stop` reaches what it
    forks), stdin from /dev/null, pinned to ``cpus`` (CPU numbers; ``None``: any).

    Output: stdout is a text pipe (for :func:`wait_for_line`) and stderr goes to the file
    ``log``; with ``pipe_stdout=False`` both go to ``log``. ``src``: the checkout the
    command runs in (its working directory and first ``PYTHONPATH`` entry); ``env``:
    the whole environment instead of :func:`python_env`; ``cwd``: another working
    directory. Raises ``OSError`` when the command cannot be started."""

    def pin() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)

    with open(log, "wb") as f:
        return subprocess.Popen(
            cmd, cwd=cwd or src, env=python_env(src) if env is None else env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if pipe_stdout else f, stderr=f if pipe_stdout else subprocess.STDOUT, text=pipe_stdout,
            preexec_fn=pin, start_new_session=True,
        )  # fmt: skip


def wait_for_line(proc: subprocess.Popen, marker: str, timeout_s: float, what: str, log_tail: Callable[[], str] = lambda: "") -> str:
    """Read ``proc``'s stdout until a line starting with ``marker``; return it (stripped).
    Used by the benchmarks and the tests alike.

    Reads the pipe's file descriptor directly (``os.read`` after ``select``), never through
    the file object's buffer: a buffered ``readline`` can pull several lines in at once,
    and ``select`` then reports nothing more to read while the wanted line sits in the
    buffer. Output after the marker line that arrived in the same read is dropped.

    Raises:
        RuntimeError: the process exited first, or ``timeout_s`` seconds passed (the
            process is then left running: the caller stops it); ``log_tail()`` is appended.
    """
    deadline = time.monotonic() + timeout_s
    fd = proc.stdout.fileno()
    pending = b""
    want = marker.encode()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"{what} not ready in {timeout_s} s; log:\n{log_tail()}")
            if not sel.select(remaining):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:  # EOF: the process exited
                proc.wait()
                raise RuntimeError(f"{what} exited with {proc.returncode}; log:\n{log_tail()}")
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.startswith(want):
                    return line.decode("utf-8", "replace").strip()


def await_ready_line(proc: subprocess.Popen, marker: str, timeout_s: float, what: str, log: Path | None, tail_chars: int = 2000) -> str:
    """:func:`wait_for_line` for a process just started: on failure it is stopped
    (:func:`stop`, its whole process group) and the ``RuntimeError`` carries the last
    ``tail_chars`` characters of ``log``. Returns the ready line."""
    try:
        return wait_for_line(proc, marker, timeout_s, what, (lambda: log.read_text(errors="replace")[-tail_chars:]) if log else (lambda: ""))
    except BaseException:
        stop(proc)
        raise


def wait_port(port: int, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> None:
    """Connect to 127.0.0.1:``port`` every 50 ms until it accepts, for at most
    ``timeout_s`` seconds. Raises ``RuntimeError`` when the time runs out or ``alive()``
    turns false (the server exited)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            if not alive():
                raise RuntimeError(f"127.0.0.1:{port}: the server exited") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"127.0.0.1:{port} not listening in {timeout_s} s") from None
            time.sleep(0.05)


def wait_http_200(url: str, timeout_s: float, alive: Callable[[], bool] = lambda: True, body: dict | None = None) -> bytes:
    """Poll ``url`` every 0.2 s (POST of ``body`` as JSON when given, else GET; 2 s per
    try) until it answers 200; bounded by ``timeout_s`` seconds. Returns that answer's
    body. Raises ``RuntimeError`` when the time runs out or ``alive()`` turns false (the
    server exited)."""
    deadline = time.monotonic() + timeout_s
    data = None if body is None else json.dumps(body).encode()
    last = "no answer"
    while True:
        if not alive():
            raise RuntimeError(f"{url}: the server exited ({last})")
        try:
            req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=2) as r:
                answer = r.read()
                if r.status == 200:
                    return answer
                last = f"status {r.status}"
        except urllib.error.HTTPError as e:
            last = f"status {e.code}"
        except (OSError, urllib.error.URLError) as e:
            last = str(e)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer 200 in {timeout_s} s ({last})")
        time.sleep(0.2)


def http_json(url: str, obj: dict | None = None, timeout_s: float = 10.0) -> Any:
    """One blocking request to a control endpoint of a server the bench started (the fake
    upstream's ``/timing``, ``/stats``, ...): POST of ``obj`` as JSON, or GET when
    ``obj`` is ``None``; returns the decoded JSON answer. Raises ``urllib.error.HTTPError``
    on a status >= 400 and ``OSError`` when there is no answer within ``timeout_s``."""
    data = None if obj is None else json.dumps(obj).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def set_affinity(pid: int, cpus: set[int]) -> None:
    """Pin every thread of process ``pid`` (``/proc/PID/task``) to ``cpus`` (CPU
    numbers); threads that end meanwhile are skipped."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass


def stop(proc: subprocess.Popen | None, grace_s: float = 10.0) -> None:
    """Stop ``proc`` and what it started, and reap it.

    SIGTERM goes to its whole process group when it leads one (every process
    :func:`spawn` starts does: an engine's forked workers get it too), else to ``proc``
    alone; after ``grace_s`` seconds (or once it has exited) SIGKILL goes to whatever of
    the group is left, and to ``proc`` if it still runs. Never signals this process's own
    group. ``None`` or a process already reaped: nothing is signalled."""
    if proc is None:
        return
    group = None
    if proc.returncode is None:  # not reaped: its pid (and so its group id) is still its own
        try:
            group = proc.pid if os.getpgid(proc.pid) == proc.pid else None
        except ProcessLookupError:
            pass
        try:
            if group is not None:
                os.killpg(group, signal.SIGTERM)
            else:
                proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    if group is not None:
        try:  # members that outlived the leader
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def run_loop(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` to completion in a new event loop, uvloop's when it is installed
    (as the proxy runs), else asyncio's; returns its result."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)
    return uvloop.run(coro)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_script(main: Callable[[], int], stopped: str) -> None:
    """Run a bench's ``main`` as a script and exit with its status. SIGTERM stops it as
    Ctrl-C does (a ``KeyboardInterrupt``, so the ``finally`` blocks of ``main`` stop what
    it started); then it prints ``interrupted; <stopped>`` and exits 130."""
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print(f"interrupted; {stopped}", file=sys.stderr)
        sys.exit(130)
