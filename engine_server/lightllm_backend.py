"""Command line for the GPU engine: LightLLM's ``lightllm.server.api_server``, and detection.

Checked against LightLLM v1.2.0 (tag of 2026-08-10): ``lightllm/server/api_cli.py``,
``api_start.py``, ``utils/shm_port_args.py``, ``utils/envs_utils.py``.

LightLLM is NVIDIA-only (NCCL, torch.cuda, Triton). Its argument names use underscores. The
flags passed here exist in v1.2.0 with these meanings:

* ``--model_dir``, ``--host``, ``--port`` (its default is 8000), ``--tp``;
* ``--tokenizer_mode auto`` (fast tokenizer, falling back to the slow one);
* ``--max_total_token_num`` only when given: left out, v1.2.0 sizes the KV cache from
  ``--mem_fraction`` (default 0.8 of free GPU memory);
* ``--nccl_port`` only when given. In v1.2.0 its default is None: LightLLM takes a free port
  (``socket.bind(("", 0))``) and names its shared-memory segments after a random id, so
  instances on one host never collide. Before v1.2.0 the default was 28765 and the segments
  were named after it: with such a release, give each instance its own ``nccl_port``. An
  explicit port must be free: LightLLM checks it at start (``validate_ports``) and so does the
  launcher, before starting anything (:func:`port_is_free`).

The HTTP port opens only after the model has loaded. ``/health`` in v1.2.0 answers 200 when
a generation succeeded recently or nothing is in flight, which does not prove that a cold
engine generates: readiness is a real ``POST /generate`` (see :mod:`engine_server.readiness`).
The server forks router/detokenizer/model processes, so it must be stopped as a process group
(the supervisor does that); it treats SIGTERM and SIGHUP as "shut down gracefully".
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

#: The LightLLM release this launcher is written against; docker/Dockerfile.engine and
#: docker-compose.yml pin its image, ``ghcr.io/modeltc/lightllm:<this>``.
LIGHTLLM_VERSION = "v1.2.0"
#: The Python that has LightLLM, when it is not the launcher's own: LightLLM's container image
#: ships Python 3.10 in /opt/conda while the launcher needs 3.11+ (docker/Dockerfile.engine).
LIGHTLLM_PYTHON_ENV = "LLM_QOS_LIGHTLLM_PYTHON"


def lightllm_python() -> str:
    """The interpreter LightLLM runs under: ``$LLM_QOS_LIGHTLLM_PYTHON``, else this one."""
    return os.environ.get(LIGHTLLM_PYTHON_ENV) or sys.executable


def port_is_free(port: int) -> bool:
    """Whether a TCP listener could bind ``port`` on every interface now, as LightLLM's own
    start-up check does (``lightllm/utils/net_utils.py:validate_ports``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


@dataclass
class LightLLMOptions:
    """Options of one LightLLM instance.

    Attributes:
        model_dir: Hugging Face-format model folder (config, weights, tokenizer).
        host, port: HTTP listen address.
        tp: tensor-parallel degree (number of GPUs).
        max_total_token_num: KV cache budget in tokens (= max_batch * (input + output));
            None leaves LightLLM's own sizing (v1.2.0: from ``--mem_fraction``, 0.8 of free
            GPU memory).
        tokenizer_mode: "auto" (fast, falling back to slow), "fast" or "slow".
        nccl_port: NCCL rendezvous port; None lets LightLLM (v1.2.0) take a free one.
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


def lightllm_command(opts: LightLLMOptions, *, python: str | None = None) -> list[str]:
    """Argv ``<python> -m lightllm.server.api_server --model_dir ... --host ... --port ...``
    (``python`` defaults to :func:`lightllm_python`).

    Raises:
        ValueError: ``tp`` < 1, ``max_total_token_num`` < 1, or the NCCL port equals the HTTP port.
    """
    if opts.tp < 1:
        raise ValueError(f"tp must be >= 1, got {opts.tp}")
    if opts.nccl_port is not None and opts.nccl_port == opts.port:
        raise ValueError(f"nccl_port {opts.nccl_port} must differ from the HTTP port")
    if opts.max_total_token_num is not None and opts.max_total_token_num < 1:
        raise ValueError(f"max_total_token_num must be >= 1, got {opts.max_total_token_num}")
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
    ]
    if opts.nccl_port is not None:
        argv += ["--nccl_port", str(opts.nccl_port)]
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
