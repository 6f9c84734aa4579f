"""Start the real CPU engine for tests: ``python -m engine_server --backend cpu --port P``.

Use :func:`start_cpu_engine` directly, or the session-scoped :func:`cpu_engine` fixture
(import it into a conftest.py: ``from tests.engine_fixture import cpu_engine  # noqa: F401``).

The first start converts the model (~25-60 s, cached under ``$LLM_QOS_CACHE`` or
``~/.cache/llm-qos``); later starts take ~6-10 s on a 2-core machine. The engine's own logs go to
a temporary log file (its path is ``process.log_path``); stdout carries only the ready line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.proc_util import die_with_parent, free_port, wait_for_line  # noqa: F401  (free_port: used by other tests)

REPO_ROOT = Path(__file__).resolve().parent.parent
READY_MARK = "engine ready at "
DEFAULT_START_TIMEOUT_S = 300.0  # includes a first-time model conversion
DEFAULT_GRACE_S = 10.0


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def start_cpu_engine(
    port: int,
    *,
    timeout_s: float = DEFAULT_START_TIMEOUT_S,
    extra_args: list[str] | None = None,
) -> tuple[subprocess.Popen, str]:
    """Start the CPU engine on 127.0.0.1:``port`` and wait for its "engine ready at" line.

    Returns:
        ``(process, base_url)``; ``process.ready_line`` holds the line (``model=`` in it is the
        name to use in requests), ``process.log_path`` the engine's log file.

    Raises:
        RuntimeError: the engine exited or did not get ready within ``timeout_s`` (log tail included).
    """
    log_file = tempfile.NamedTemporaryFile(prefix=f"engine-{port}-", suffix=".log", delete=False)
    log_path = Path(log_file.name)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "engine_server", "--backend", "cpu", "--host", "127.0.0.1",
           "--port", str(port), *(extra_args or [])]
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=log_file, text=True, bufsize=1, preexec_fn=die_with_parent,
    )
    log_file.close()
    proc.log_path = log_path  # type: ignore[attr-defined]
    try:
        proc.ready_line = wait_for_line(proc, READY_MARK, timeout_s, "engine", lambda: _tail(log_path))  # type: ignore[attr-defined]
    except RuntimeError:
        stop_engine(proc)
        raise
    return proc, f"http://127.0.0.1:{port}"


def stop_engine(proc: subprocess.Popen, grace_s: float = DEFAULT_GRACE_S) -> int:
    """SIGTERM the engine launcher and wait up to ``grace_s`` + 5 s; SIGKILL it after that.

    Returns its exit status (0 = clean stop). The log file is removed after a clean stop."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s + 5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
    log_path = getattr(proc, "log_path", None)
    if proc.returncode == 0 and log_path is not None:
        Path(log_path).unlink(missing_ok=True)
    return proc.returncode


@pytest.fixture(scope="session")
def cpu_engine() -> Iterator[tuple[subprocess.Popen, str]]:
    """Session-wide real CPU engine: yields ``(process, base_url)``; stopped at the end."""
    proc, base_url = start_cpu_engine(free_port())
    try:
        yield proc, base_url
    finally:
        stop_engine(proc)
