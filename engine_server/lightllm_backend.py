"""Command line for the GPU engine: LightLLM's ``lightllm.server.api_server``, and detection.

LightLLM is NVIDIA-only (NCCL, torch.cuda, Triton). Its argument names use underscores.
``--nccl_port`` (LightLLM default 28765) also names a shared-memory segment, so two instances on
one host need different values: by default we derive it from the HTTP port
(:func:`default_nccl_port`). The HTTP port opens only after the model has loaded, and in
release 0.0.1 ``/health`` always answers 200: readiness is a real ``POST /generate``
(see :mod:`engine_server.readiness`). The server forks router/detokenizer/model processes,
so it must be stopped as a process group (the supervisor does that).

Sources: /work/shared/interop/lightllm.md; lightllm/server/api_server.py (0.0.1 argparse).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

LIGHTLLM_DEFAULT_NCCL_PORT = 28765
#: The Python that has LightLLM, when it is not the launcher's own: LightLLM's container image
#: ships Python 3.10 in /opt/conda while the launcher needs 3.11+ (docker/Dockerfile.engine).
LIGHTLLM_PYTHON_ENV = "LLM_QOS_LIGHTLLM_PYTHON"


def lightllm_python() -> str:
    """The interpreter LightLLM runs under: ``$LLM_QOS_LIGHTLLM_PYTHON``, else this one."""
    return os.environ.get(LIGHTLLM_PYTHON_ENV) or sys.executable


def default_nccl_port(http_port: int) -> int:
    """A NCCL port distinct per HTTP port: ``28765 + http_port % 1000`` (8001 -> 28766)."""
    return LIGHTLLM_DEFAULT_NCCL_PORT + http_port % 1000


@dataclass
class LightLLMOptions:
    """Options of one LightLLM instance.

    Attributes:
        model_dir: Hugging Face-format model folder (config, weights, tokenizer).
        host, port: HTTP listen address.
        tp: tensor-parallel degree (number of GPUs).
        max_total_token_num: KV cache budget in tokens (= max_batch * (input + output));
            None leaves LightLLM's default (6000 in 0.0.1).
        tokenizer_mode: "auto" (fast) or "slow".
        nccl_port: NCCL rendezvous port and shm name; None -> :func:`default_nccl_port`.
        extra_args: appended verbatim (e.g. ``["--max_req_total_len", "4096"]``).
    """

    model_dir: Path | str
    host: str = "127.0.0.1"
    port: int = 8001
    tp: int = 1
    max_total_token_num: int | None = None
    tokenizer_mode: str = "auto"
    nccl_port: int | None = None
    extra_args: list[str] = field(default_factory=list)

    def effective_nccl_port(self) -> int:
        return self.nccl_port if self.nccl_port is not None else default_nccl_port(self.port)


def lightllm_command(opts: LightLLMOptions, *, python: str | None = None) -> list[str]:
    """Argv ``<python> -m lightllm.server.api_server --model_dir ... --nccl_port ...``
    (``python`` defaults to :func:`lightllm_python`).

    Raises:
        ValueError: ``tp`` < 1, or the NCCL port equals the HTTP port.
    """
    if opts.tp < 1:
        raise ValueError(f"tp must be >= 1, got {opts.tp}")
    nccl = opts.effective_nccl_port()
    if nccl == opts.port:
        raise ValueError(f"nccl_port {nccl} must differ from the HTTP port")
    argv = [
        python or lightllm_python(),
        "-m",
        "lightllm.server.api_server",
        "--model_dir",
        str(Path(opts.model_dir).expanduser().absolute()),
        "--host",
        opts.host,
        "--port",
        str(opts.port),
        "--tp",
        str(opts.tp),
        "--tokenizer_mode",
        opts.tokenizer_mode,
        "--nccl_port",
        str(nccl),
    ]
    if opts.max_total_token_num is not None:
        argv += ["--max_total_token_num", str(opts.max_total_token_num)]
    argv += list(opts.extra_args)
    return argv


def lightllm_available() -> bool:
    """True when the ``lightllm`` package is importable (checked with find_spec, not imported),
    by the interpreter of ``$LLM_QOS_LIGHTLLM_PYTHON`` when that is set."""
    other = os.environ.get(LIGHTLLM_PYTHON_ENV)
    if other:
        probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('lightllm') is None)"
        try:
            return subprocess.run([other, "-c", probe], capture_output=True, timeout=60).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False
    try:
        return importlib.util.find_spec("lightllm") is not None
    except (ImportError, ValueError):
        return False


def cuda_available() -> bool:
    """True when an NVIDIA GPU looks usable: ``/dev/nvidia0`` exists or ``nvidia-smi`` is on PATH.

    Cheap and import-free (torch is not imported); it does not prove the driver works —
    the engine's readiness probe does.
    """
    return os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None
