"""Ctrl-C on ``llm-qos engine`` stops the engine cleanly (issue 21 item 12).

Before: the launcher forwarded SIGINT to the engine's process group; ``transformers serve``
(5.24) then shut uvicorn down, re-raised the SIGINT, and its interpreter waited forever for
the continuous-batching generation thread (not a daemon): every Ctrl-C ended with ``still
running after 10.0 s: SIGKILL``. Now the engine's group gets SIGTERM whatever stops the
launcher, and the grace period covers the whole group. The vLLM backend's own check is
tests/test_engine_vllm_real.py::test_sigint_stops_the_whole_group_without_sigkill.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time

import pytest

from engine_server.supervisor import group_members
from tests.engine_fixture import DEFAULT_GRACE_S, free_port, start_cpu_engine, stop_engine

@pytest.mark.engine
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_cpu_engine_stops_without_sigkill(sig: signal.Signals) -> None:
    proc, _ = start_cpu_engine(free_port())
    log_path = proc.log_path  # type: ignore[attr-defined]
    try:
        pgid = int(re.findall(r"engine\[cpu\]: pid (\d+)", log_path.read_text())[-1])
        assert group_members(pgid), "the engine's process group is not there"
        started = time.monotonic()
        proc.send_signal(sig)
        try:
            code = proc.wait(timeout=DEFAULT_GRACE_S + 5)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher did not exit within {DEFAULT_GRACE_S + 5} s of {sig.name}")
        took = time.monotonic() - started
        log = log_path.read_text(errors="replace")
    finally:
        stop_engine(proc)
    assert code == 0, log[-3000:]
    assert "SIGKILL" not in log, log[-3000:]
    assert took < 5.0, f"{sig.name} took {took:.1f} s"
    assert group_members(pgid) == []


def test_grace_covers_the_processes_the_engine_started(tmp_path) -> None:
    """A leader that exits at once on SIGTERM while its child (same group, as vLLM's
    EngineCore and Worker) needs a moment to finish: the child gets that moment (its
    clean-up runs, no SIGKILL), and the supervisor returns once the whole group is gone.
    Before, the group was SIGKILLed the moment the leader had exited."""
    import asyncio
    import sys
    import textwrap

    from engine_server.supervisor import EXIT_OK, RestartPolicy, Supervisor

    done = tmp_path / "child-cleaned-up"
    child = textwrap.dedent(f"""
        import signal, sys, time
        def stop(*_):
            time.sleep(0.5)  # a clean shutdown that takes a while
            open({str(done)!r}, "w").close()
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        signal.pause()
    """)
    leader = textwrap.dedent(f"""
        import subprocess, sys, signal
        subprocess.Popen([sys.executable, "-c", {child!r}])
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # exits at once, child still stopping
        signal.pause()
    """)
    sup: Supervisor

    def on_ready(_took: float) -> None:
        asyncio.get_running_loop().call_later(0.5, sup.request_stop, signal.SIGINT)

    sup = Supervisor([sys.executable, "-c", leader], policy=RestartPolicy(grace_s=5.0), on_ready=on_ready)

    async def run() -> int:
        return await asyncio.wait_for(sup.run(), 20)

    started = time.monotonic()
    assert asyncio.run(run()) == EXIT_OK
    assert done.exists(), "the engine's child was killed before it finished stopping"
    assert time.monotonic() - started < 5.0
    assert group_members(sup.process.pid) == []
