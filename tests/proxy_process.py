"""Start the real proxy as its own process (``python -m proxy proxy ...``) for tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.proc_util import die_with_parent, wait_for_line

REPO_ROOT = Path(__file__).resolve().parent.parent
READY_MARK = "llm-qos proxy ready on "


def start_proxy(
    config_path: Path, port: int, upstream: str | None = None, timeout_s: float = 30.0, extra_args: list[str] | None = None, env: dict | None = None
) -> subprocess.Popen:
    """Start the proxy on 127.0.0.1:``port`` and wait for its ready line.

    Returns the process; ``process.log_path`` is its stderr log. Raises RuntimeError if it
    exits or is not ready within ``timeout_s`` seconds.
    """
    log = tempfile.NamedTemporaryFile(prefix=f"proxy-{port}-", suffix=".log", delete=False)
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "proxy", "proxy", "--config", str(config_path), "--host", "127.0.0.1", "--port", str(port)]
    if upstream:
        cmd += ["--upstream", upstream]
    cmd += extra_args or []
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, text=True, preexec_fn=die_with_parent
    )
    log.close()
    proc.log_path = Path(log.name)  # type: ignore[attr-defined]
    try:
        wait_for_line(proc, READY_MARK, timeout_s, "proxy", lambda: proc.log_path.read_text()[-3000:])
    except RuntimeError:
        stop_proxy(proc)
        raise
    return proc


def stop_proxy(proc: subprocess.Popen, grace_s: float = 40.0) -> int:
    """SIGTERM the proxy and wait for it (SIGKILL after ``grace_s``). Returns its status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
    return proc.returncode
