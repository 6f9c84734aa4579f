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

pytestmark = pytest.mark.engine


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
