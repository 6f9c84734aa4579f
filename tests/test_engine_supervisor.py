"""Supervisor tests with real tiny child processes (python -c ...), bounded in time."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine_server.supervisor import EXIT_GAVE_UP, EXIT_NOT_READY, EXIT_OK, RestartPolicy, Supervisor

REPO_ROOT = Path(__file__).resolve().parent.parent
CRASH = [sys.executable, "-c", "import sys; sys.exit(3)"]
WAIT_FOR_SIGNAL = [sys.executable, "-c", "import signal; signal.pause()"]

FAST = dict(initial_backoff_s=0.05, max_backoff_s=0.2, crash_window_s=60.0, grace_s=2.0)


def run_bounded(coro, timeout: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_crash_loop_restarts_with_backoff_then_gives_up() -> None:
    sup = Supervisor(CRASH, policy=RestartPolicy(crash_limit=5, **FAST))
    started = time.monotonic()
    assert run_bounded(sup.run()) == EXIT_GAVE_UP
    assert sup.stats.starts == 5
    assert sup.stats.exit_codes == [3] * 5
    assert sup.stats.backoffs == [0.05, 0.1, 0.2, 0.2]  # doubling, capped
    assert time.monotonic() - started < 10


def test_restart_after_crash_then_stays_up(tmp_path: Path) -> None:
    marker = tmp_path / "crashed-once"
    child = [
        sys.executable, "-c",
        "import os, signal, sys\n"
        "if not os.path.exists(sys.argv[1]):\n"
        "    open(sys.argv[1], 'w').close(); sys.exit(7)\n"
        "signal.pause()\n",
        str(marker),
    ]
    sup: Supervisor

    def on_ready(_took: float) -> None:
        if sup.stats.starts == 2:
            sup.request_stop()

    sup = Supervisor(child, policy=RestartPolicy(crash_limit=3, **FAST), on_ready=on_ready)
    assert run_bounded(sup.run()) == EXIT_OK
    assert sup.stats.starts == 2
    assert sup.stats.exit_codes == [7]
    assert sup.stats.backoffs == [0.05]
    assert sup.process is not None and sup.process.returncode == -signal.SIGTERM


def test_crashes_spread_out_never_give_up_and_reset_backoff() -> None:
    fake_now = itertools.count(0.0, 100.0)  # every clock read is 100 s later: crashes are far apart
    sup: Supervisor

    def on_ready(_took: float) -> None:
        if sup.stats.starts == 6:
            sup.request_stop()

    sup = Supervisor(
        CRASH, policy=RestartPolicy(crash_limit=2, **FAST), on_ready=on_ready, clock=lambda: next(fake_now)
    )
    assert run_bounded(sup.run()) == EXIT_OK
    assert sup.stats.starts == 6
    assert sup.stats.backoffs == [0.05] * 5  # uptime >= crash window resets the backoff


def test_stop_forwards_sigterm_within_grace() -> None:
    sup: Supervisor

    def on_ready(_took: float) -> None:
        asyncio.get_running_loop().call_later(0.2, sup.request_stop)

    sup = Supervisor(WAIT_FOR_SIGNAL, policy=RestartPolicy(**FAST), on_ready=on_ready)
    started = time.monotonic()
    assert run_bounded(sup.run()) == EXIT_OK
    assert sup.process is not None and sup.process.returncode == -signal.SIGTERM
    assert time.monotonic() - started < FAST["grace_s"]
    assert sup.stats.exit_codes == []  # a requested stop is not a crash


def test_sigint_stops_the_engine_with_sigterm() -> None:
    """Ctrl-C reaches the engine as SIGTERM: ``transformers serve`` hangs after a SIGINT
    (tests/test_engine_stop_signals.py shows it on the real engines)."""
    sup: Supervisor

    def on_ready(_took: float) -> None:
        asyncio.get_running_loop().call_later(0.2, sup.request_stop, signal.SIGINT)

    sup = Supervisor(WAIT_FOR_SIGNAL, policy=RestartPolicy(**FAST), on_ready=on_ready)
    assert run_bounded(sup.run()) == EXIT_OK
    assert sup.process is not None and sup.process.returncode == -signal.SIGTERM


def test_child_ignoring_sigterm_is_killed_after_grace(tmp_path: Path) -> None:
    out = tmp_path / "child.out"
    child = [
        sys.executable, "-c",
        "import signal, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "open(sys.argv[1], 'w').close(); signal.pause()",
        str(out),
    ]

    class ArmedProbe:  # ready once the child has installed its SIGTERM handler
        async def __call__(self, _session) -> None:
            from engine_server.readiness import ProbeNotReady
            if not out.exists():
                raise ProbeNotReady("not armed yet")

    sup: Supervisor

    def on_ready(_took: float) -> None:
        sup.request_stop()

    policy = RestartPolicy(**{**FAST, "grace_s": 0.5})
    sup = Supervisor(child, probe=ArmedProbe(), ready_timeout_s=10, policy=policy, on_ready=on_ready)
    started = time.monotonic()
    assert run_bounded(sup.run()) == EXIT_OK
    elapsed = time.monotonic() - started
    assert sup.process is not None and sup.process.returncode == -signal.SIGKILL
    assert 0.5 <= elapsed < 5


def test_crash_before_ready_counts_as_crash() -> None:
    class NeverReady:
        async def __call__(self, _session) -> None:
            from engine_server.readiness import ProbeNotReady
            raise ProbeNotReady("no")

    sup = Supervisor(CRASH, probe=NeverReady(), ready_timeout_s=10, policy=RestartPolicy(crash_limit=2, **FAST))
    assert run_bounded(sup.run()) == EXIT_GAVE_UP
    assert sup.stats.exit_codes == [3, 3]
    assert sup.stats.ready_times == []


def test_not_ready_in_time_stops_child_and_fails() -> None:
    class NeverReady:
        async def __call__(self, _session) -> None:
            from engine_server.readiness import ProbeNotReady
            raise ProbeNotReady("no")

    sup = Supervisor(WAIT_FOR_SIGNAL, probe=NeverReady(), ready_timeout_s=0.5, policy=RestartPolicy(**FAST))
    assert run_bounded(sup.run()) == EXIT_NOT_READY
    assert sup.process is not None and sup.process.returncode == -signal.SIGTERM


def test_stop_while_starting() -> None:
    class NeverReady:
        async def __call__(self, _session) -> None:
            from engine_server.readiness import ProbeNotReady
            raise ProbeNotReady("no")

    async def scenario() -> int:
        sup = Supervisor(WAIT_FOR_SIGNAL, probe=NeverReady(), ready_timeout_s=30, policy=RestartPolicy(**FAST))
        asyncio.get_running_loop().call_later(0.5, sup.request_stop)
        code = await sup.run()
        assert sup.process is not None and sup.process.returncode == -signal.SIGTERM
        return code

    assert run_bounded(scenario()) == EXIT_OK


def _supervising_process(tmp_path: Path, handlers: bool) -> tuple[subprocess.Popen, int]:
    """A real process running a Supervisor of a child that writes its pid and waits for a
    signal (``handlers``: the supervisor installs its signal handlers, as the launcher
    does). Returns the process, once its child is ready, and the child's pid."""
    pidfile = tmp_path / "child.pid"
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        from engine_server.supervisor import RestartPolicy, Supervisor

        child = [sys.executable, "-c",
                 "import os, signal; open({str(pidfile)!r}, 'w').write(str(os.getpid())); signal.pause()"]

        async def main():
            sup = Supervisor(child, policy=RestartPolicy(grace_s=5),
                             on_ready=lambda took: print("ready", flush=True))
            if {handlers!r}:
                sup.install_signal_handlers()
            return await sup.run()

        sys.exit(asyncio.run(main()))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 10
        while not (pidfile.exists() and pidfile.read_text()):
            assert time.monotonic() < deadline, "child never wrote its pid"
            time.sleep(0.02)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, int(pidfile.read_text())


def test_sigterm_to_supervisor_process_is_forwarded(tmp_path: Path) -> None:
    """End to end through real signals: SIGTERM to a supervising process stops its child."""
    proc, child_pid = _supervising_process(tmp_path, handlers=True)
    try:
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
        assert time.monotonic() - started < 5
        with pytest.raises(ProcessLookupError):
            os.kill(child_pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_engine_is_stopped_when_the_launcher_is_killed(tmp_path: Path) -> None:
    """A launcher killed with SIGKILL (no chance to stop its engine) leaves no engine
    behind: the engine runs in a session of its own, and gets SIGTERM from the kernel when
    its launcher dies (PR_SET_PDEATHSIG). Seen before: a vLLM server orphaned for 30 min."""
    proc, child_pid = _supervising_process(tmp_path, handlers=False)
    try:
        proc.kill()
        proc.wait(timeout=5)
        deadline = time.monotonic() + 5
        while True:  # bounded: the kernel's SIGTERM ends it at once
            try:
                os.kill(child_pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, "the engine outlived its killed launcher"
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
