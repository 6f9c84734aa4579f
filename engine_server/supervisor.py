"""Run the engine as a child process: wait until ready, restart on crash, stop on signals.

Life cycle of :meth:`Supervisor.run`:

1. start the child with :func:`asyncio.create_subprocess_exec` in its own session/process
   group (so a terminal's Ctrl-C reaches it only through us, and its own children — LightLLM
   forks router/detokenizer/model processes — are stopped with it);
2. wait for readiness (:func:`engine_server.readiness.wait_ready`), log "ready in N s" and call
   ``on_ready``;
3. wait for either the child's exit or a stop request:
   * stop request (SIGTERM/SIGINT/SIGHUP via :meth:`Supervisor.install_signal_handlers`, or
     :meth:`Supervisor.request_stop`): send SIGTERM to the child's process group, whichever
     signal we got, wait up to ``grace_s`` for the whole group to exit (the leader, then the
     processes it started: vLLM's EngineCore and Worker), then SIGKILL what is left, saying
     so in a WARNING line. ``run`` returns 0.
     Never SIGINT: ``transformers serve`` (5.24) answers SIGINT with a graceful uvicorn
     shutdown, then re-raises it; the KeyboardInterrupt ends its main thread, and the
     interpreter then waits forever for continuous batching's generation thread, which is
     not a daemon (``transformers/generation/continuous_batching/continuous_api.py``), so
     every Ctrl-C ended in SIGKILL after the grace period. A re-raised SIGTERM kills at once.
   * the child exits on its own (whatever its code, it is never supposed to): a crash. The
     process group is SIGKILLed to reap stragglers, then the child is restarted after a backoff
     (1 s doubling to 30 s by default). A child that had been *ready* for ``crash_window_s``
     or longer before it crashed was healthy: its crash starts a fresh count and the backoff
     starts again at the initial delay. Otherwise (it crashed while loading, or soon after
     it got ready) the crash adds to the count, and at ``crash_limit`` crashes in a row the
     supervisor gives up and ``run`` returns :data:`EXIT_GAVE_UP`. Up-time is counted from
     readiness, not from the start, so an engine that always crashes while loading gives up
     however long one load takes.
   * not ready within ``ready_timeout_s``, or the probe is rejected: the child is stopped and
     ``run`` returns :data:`EXIT_NOT_READY` (restarting would not fix a model that is too slow
     to load or a wrong configuration).

Times are seconds. The clock and all delays are constructor knobs so tests can run real tiny
child processes (``python -c "import sys; sys.exit(3)"``) quickly.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .readiness import EngineExitedError, Probe, ProbeRejectedError, wait_ready

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_GAVE_UP = 3  # crash loop
EXIT_NOT_READY = 4  # readiness timeout / probe rejected


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals that stop a launcher: SIGTERM, SIGINT, and SIGHUP unless it is ignored
    already (started under ``nohup``, which asks to outlive the terminal)."""
    sigs = [signal.SIGTERM, signal.SIGINT]
    if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:
        sigs.append(signal.SIGHUP)
    return tuple(sigs)


def group_members(pgid: int) -> list[int]:
    """The pids of the live processes of process group ``pgid`` (zombies left out), read
    from Linux's ``/proc/<pid>/stat`` (field 5, ``pgrp``; ``proc(5)``). Empty where there
    is no ``/proc``."""
    pids = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rindex(b")") + 2:].split()  # after "pid (comm) "
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            pids.append(int(entry))
    return pids


async def wait_group_gone(pgid: int, timeout_s: float) -> list[int]:
    """Wait up to ``timeout_s`` seconds for every live process of group ``pgid`` to exit.

    Event-driven: one ``pidfd`` per member (``os.pidfd_open``, Linux 5.3+; it becomes
    readable when the process exits, ``pidfd_open(2)``) watched by the event loop. Returns
    the pids still running at the end (empty: all gone). Where pidfds are not available
    it returns the members found at once, without waiting.
    """
    members = group_members(pgid)
    if not members or not hasattr(os, "pidfd_open"):
        return members
    loop = asyncio.get_running_loop()
    fds: dict[int, int] = {}
    gone: dict[int, asyncio.Future] = {}
    try:
        for pid in members:
            try:
                fds[pid] = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            except OSError:  # no pidfd support: do not wait
                return [p for p in members if p not in gone]
            fut = loop.create_future()
            gone[pid] = fut
            loop.add_reader(fds[pid], lambda f=fut: f.done() or f.set_result(None))
        if gone and timeout_s > 0:
            await asyncio.wait(gone.values(), timeout=timeout_s)
        return [pid for pid, fut in gone.items() if not fut.done()]
    finally:
        for fd in fds.values():
            loop.remove_reader(fd)
            os.close(fd)


@dataclass
class RestartPolicy:
    """Restart and shutdown knobs, in seconds.

    Attributes:
        initial_backoff_s: delay before the first restart after a crash.
        max_backoff_s: cap of the doubling backoff.
        crash_limit: give up at this many crashes in a row (``crash_limit - 1`` restarts).
        crash_window_s: a child that had been ready this long before it crashed counts as
            healthy: its crash resets the count and the backoff. Counted from readiness.
        grace_s: time between the forwarded SIGTERM/SIGINT and SIGKILL.

    Raises:
        ValueError: ``crash_limit`` < 1, or a negative time.
    """

    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    crash_limit: int = 5
    crash_window_s: float = 60.0
    grace_s: float = 10.0

    def __post_init__(self) -> None:
        if self.crash_limit < 1:
            raise ValueError(f"crash_limit must be at least 1, got {self.crash_limit}")
        for name in ("initial_backoff_s", "max_backoff_s", "crash_window_s", "grace_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass
class SupervisorStats:
    """What happened, for logs and tests: starts, exit codes of crashed children, backoffs
    used (seconds), ready times (seconds from start to ready), and the crashes in a row
    that count towards ``crash_limit`` now."""

    starts: int = 0
    exit_codes: list[int] = field(default_factory=list)
    backoffs: list[float] = field(default_factory=list)
    ready_times: list[float] = field(default_factory=list)
    crashes_in_a_row: int = 0


class Supervisor:
    """Supervise one engine child process. See the module docstring for the life cycle.

    Args:
        argv: child command line.
        env: child environment (default: inherit).
        probe: readiness probe; None means "ready as soon as started".
        ready_timeout_s: readiness deadline per start.
        policy: :class:`RestartPolicy`.
        on_ready: called with the seconds from start to ready, on every (re)start that got ready.
        clock: monotonic clock in seconds (crash window and measurements).
        name: label used in log lines.
        stdout_to_stderr: send the child's stdout to our stderr (default), so our stdout
            carries only what the caller prints (the "engine ready at ..." line) and a caller
            reading it through a pipe can never block the engine's access log.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        probe: Probe | None = None,
        ready_timeout_s: float = 300.0,
        policy: RestartPolicy | None = None,
        on_ready: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        name: str = "engine",
        stdout_to_stderr: bool = True,
        cwd: str | Path | None = None,
    ) -> None:
        self.argv = list(argv)
        self.cwd = cwd
        self.env = dict(env) if env is not None else None
        self.probe = probe
        self.ready_timeout_s = ready_timeout_s
        self.policy = policy or RestartPolicy()
        self.on_ready = on_ready
        self.clock = clock
        self.name = name
        self.stdout_to_stderr = stdout_to_stderr
        self.stats = SupervisorStats()
        self.process: asyncio.subprocess.Process | None = None
        self._stop = asyncio.Event()
        self._ready_at: float | None = None  # clock() when the current child got ready

    # ----- control -----

    def request_stop(self, sig: int = signal.SIGTERM) -> None:
        """Ask :meth:`run` to stop the child and return.

        The child's process group gets SIGTERM whatever ``sig`` is (SIGINT would leave
        ``transformers serve`` hanging, see the module docstring; a SIGHUP to us is a hang-up
        of our terminal, not a reload: the engine, in its own session, would never see it and
        live on as an orphan), then SIGKILL after the grace period. ``sig`` is only logged.
        """
        if not self._stop.is_set():
            log.info("%s: stop requested (%s)", self.name, signal.Signals(sig).name)
            self._stop.set()

    def install_signal_handlers(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Route SIGTERM, SIGINT and SIGHUP of this process to :meth:`request_stop` (Unix only).

        SIGHUP is left alone when it is ignored already (``nohup``): whoever started us asked
        to outlive the terminal, and that choice holds for the engine too.
        """
        loop = loop or asyncio.get_running_loop()
        for sig in stop_signals():
            loop.add_signal_handler(sig, self.request_stop, sig)

    # ----- main loop -----

    async def run(self) -> int:
        """Supervise until stopped (returns :data:`EXIT_OK`) or given up (non-zero)."""
        backoff = self.policy.initial_backoff_s
        while not self._stop.is_set():
            started = self.clock()
            proc = await self._spawn()
            exited = asyncio.ensure_future(proc.wait())
            try:
                code = await self._supervise_one(proc, exited, started)
            finally:
                if not exited.done():  # cancelled from outside: never leave the child behind
                    await asyncio.shield(self._terminate(proc, exited))
            if code is not None:
                return code
            if self._stop.is_set():
                break
            # The child exited on its own: a crash.
            now = self.clock()
            ready_for = 0.0 if self._ready_at is None else now - self._ready_at
            self.stats.exit_codes.append(proc.returncode)
            if self._ready_at is None:
                log.warning("%s: exited with code %s after %.1f s, before it was ready", self.name, proc.returncode, now - started)
            else:
                log.warning("%s: exited with code %s after %.1f s ready", self.name, proc.returncode, ready_for)
            self._kill_group(proc.pid, signal.SIGKILL)  # stragglers of a dead leader
            if self._ready_at is not None and ready_for >= self.policy.crash_window_s:  # it had been healthy
                backoff = self.policy.initial_backoff_s
                self.stats.crashes_in_a_row = 0
            self.stats.crashes_in_a_row += 1
            if self.stats.crashes_in_a_row >= self.policy.crash_limit:
                log.error(
                    "%s: giving up after %d crashes in a row (none stayed ready for %.0f s)",
                    self.name, self.stats.crashes_in_a_row, self.policy.crash_window_s,
                )
                return EXIT_GAVE_UP
            log.info("%s: restart in %.1f s", self.name, backoff)
            self.stats.backoffs.append(backoff)
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=backoff)
            except TimeoutError:
                pass
            backoff = min(backoff * 2, self.policy.max_backoff_s)
        log.info("%s: stopped", self.name)
        return EXIT_OK

    async def _spawn(self) -> asyncio.subprocess.Process:
        self.stats.starts += 1
        self._ready_at = None
        log.info("%s: start #%d: %s", self.name, self.stats.starts, " ".join(self.argv))
        proc = await asyncio.create_subprocess_exec(
            *self.argv,
            env=self.env,
            cwd=self.cwd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=2 if self.stdout_to_stderr else None,  # fd 2: the OS-level stderr
            start_new_session=True,
            preexec_fn=_term_with_launcher,
        )
        self.process = proc
        log.info("%s: pid %d", self.name, proc.pid)
        return proc

    async def _supervise_one(
        self, proc: asyncio.subprocess.Process, exited: asyncio.Future, started: float
    ) -> int | None:
        """Watch one child. Returns an exit code for :meth:`run` to return, or None when
        the child crashed (run decides about restarting) or a stop was requested and done."""
        stop_wait = asyncio.ensure_future(self._stop.wait())
        try:
            if self.probe is not None:
                ready = asyncio.ensure_future(wait_ready(self.probe, self.ready_timeout_s, exited))
                await asyncio.wait({ready, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                if not ready.done():  # stop requested while starting
                    ready.cancel()
                    await asyncio.gather(ready, return_exceptions=True)
                    await self._terminate(proc, exited)
                    return None
                try:
                    ready.result()
                except EngineExitedError:
                    return None  # crash before ready
                except (TimeoutError, ProbeRejectedError) as exc:
                    log.error("%s: not ready: %s", self.name, exc)
                    await self._terminate(proc, exited)
                    return EXIT_NOT_READY
            self._ready_at = self.clock()
            took = self._ready_at - started
            self.stats.ready_times.append(took)
            log.info("%s: ready in %.1f s", self.name, took)
            if self.on_ready is not None:
                self.on_ready(took)
            await asyncio.wait({exited, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            if not exited.done():
                await self._terminate(proc, exited)
            return None
        finally:
            stop_wait.cancel()

    # ----- stopping -----

    async def _terminate(self, proc: asyncio.subprocess.Process, exited: asyncio.Future) -> None:
        """SIGTERM the child's group; SIGKILL what of it still runs after the grace period.

        The grace covers the whole group, not only its leader: vLLM's server exits before its
        ``EngineCore`` and ``Worker`` processes have finished stopping, so after the leader
        the launcher waits (:func:`wait_group_gone`) for the others until the grace period
        ends, and SIGKILLs only those still there then, saying which."""
        sig = signal.SIGTERM
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.policy.grace_s
        if not exited.done():
            log.info("%s: sending %s to pid %d (grace %.1f s)", self.name, sig.name, proc.pid, self.policy.grace_s)
            self._kill_group(proc.pid, sig)
            try:
                await asyncio.wait_for(asyncio.shield(exited), timeout=self.policy.grace_s)
            except TimeoutError:
                log.warning("%s: still running after %.1f s: SIGKILL", self.name, self.policy.grace_s)
                self._kill_group(proc.pid, signal.SIGKILL)
                await exited
        log.info("%s: pid %d exited with code %s", self.name, proc.pid, proc.returncode)
        left = await wait_group_gone(proc.pid, max(0.0, deadline - loop.time()))
        if left:
            log.warning("%s: %d process(es) of its group still running %.1f s after the stop: SIGKILL (pids %s)",
                        self.name, len(left), self.policy.grace_s, ", ".join(map(str, left)))
        self._kill_group(proc.pid, signal.SIGKILL)  # leftovers of the group, if any

    @staticmethod
    def _kill_group(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _term_with_launcher() -> None:
    """``preexec_fn`` of the engine: ask Linux to send it SIGTERM when the launcher dies
    (``prctl(PR_SET_PDEATHSIG)``, prctl(2)), so an engine in a session of its own does not
    outlive a launcher killed with SIGKILL (a clean stop signals its group anyway); the
    engine's own SIGTERM handling then stops its children (vLLM's EngineCore and Worker).
    A no-op where prctl is missing."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass
