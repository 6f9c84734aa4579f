"""Several bundled engines on one host: their ports, GPUs and command lines (``llm-qos up
--engines N``). Pure: it plans, the caller starts the processes.

Engine ``i`` (from 0) listens on ``base_port + i`` and runs ``python -m engine_server``
with that port, so each is supervised and reports readiness as a single engine does.

* vLLM backend: N vLLM servers; on a CPU each holds its ``VLLM_CPU_KVCACHE_SPACE`` (1 GiB
  by default) of KV cache beside ~1 GB of its own; they share the model folder and vLLM's
  compile cache.
* CPU backend: N ``transformers serve`` processes (each ~1.8 GB of memory with the
  default ``--cb-*`` caps, :mod:`engine_server.cpu_backend`; docs/deploy.md, "The ``cpu``
  profile"); they share the converted model folder.
* LightLLM backend: one instance per GPU group of ``tp`` GPUs. With more than one engine,
  engine ``i`` sees only GPUs ``i*tp .. i*tp+tp-1`` of the visible ones
  (``CUDA_VISIBLE_DEVICES``). NCCL ports: LightLLM v1.2.0 binds a free one itself when
  given none (docs/deploy.md), so none is passed unless the operator names a base port
  (``--nccl-port``), which engine ``i`` then gets plus ``i``. Every HTTP and NCCL port of
  the plan is checked to be distinct.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field



@dataclass(frozen=True)
class EnginePlan:
    """One engine to start.

    Attributes:
        index: 0-based.
        host, port: its listen address.
        argv: the command (``python -m engine_server ...``).
        env: environment variables to set on top of the caller's (``CUDA_VISIBLE_DEVICES``).
        nccl_port: LightLLM's NCCL port, or ``None`` (CPU).
        gpus: the GPU ids it may use (LightLLM with several engines), else ``()``.
    """

    index: int
    host: str
    port: int
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    nccl_port: int | None = None
    gpus: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        """The engine's base URL."""
        return f"http://{self.host}:{self.port}"


def visible_gpus(env: Mapping[str, str] | None = None) -> list[str]:
    """The GPU ids this host offers: ``CUDA_VISIBLE_DEVICES`` when set (``""``: none),
    else one per line of ``nvidia-smi -L``, else none."""
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" in env:
        return [g.strip() for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU "))]


def plan_engines(
    n: int,
    backend: str,
    base_port: int,
    *,
    host: str = "127.0.0.1",
    tp: int = 1,
    gpus: list[str] | None = None,
    model: str | None = None,
    extra_args: list[str] | None = None,
    python: str | None = None,
    nccl_port: int | None = None,
) -> list[EnginePlan]:
    """Plan ``n`` engines of ``backend`` (``vllm``, ``cpu`` or ``lightllm``) from ``base_port`` up.

    Args:
        n: how many (>= 1).
        backend: ``vllm``, ``cpu`` or ``lightllm`` (resolve ``auto`` first).
        base_port: engine 0's HTTP port.
        host: their listen address.
        tp: LightLLM: GPUs per engine.
        gpus: LightLLM with n > 1: the GPU ids to split (default :func:`visible_gpus`).
        model: ``--model`` for every engine, or ``None``.
        extra_args: appended to every engine's command.
        python: the interpreter (default this one).
        nccl_port: LightLLM: engine ``i`` gets NCCL port ``nccl_port + i``; ``None``
            (default) passes none, and each LightLLM v1.2.0 binds a free one itself
            (its ``--nccl_port`` defaults to None there; 0.0.1 defaulted every
            instance to 28765, so give older releases a base port).

    Raises:
        ValueError: ``n`` or ``tp`` below 1, an unknown backend, too few GPUs for
            ``n * tp``, a port outside 1..65535, or two ports of the plan equal.
    """
    if n < 1 or tp < 1:
        raise ValueError(f"--engines and --tp must be at least 1 (got {n} and {tp})")
    if backend not in ("vllm", "cpu", "lightllm"):
        raise ValueError(f"backend must be vllm, cpu or lightllm, got {backend!r}")
    split = backend == "lightllm" and n > 1
    if split:
        gpus = visible_gpus() if gpus is None else gpus
        if len(gpus) < n * tp:
            raise ValueError(f"{n} LightLLM engines of {tp} GPU(s) each need {n * tp} GPUs; {len(gpus)} visible ({','.join(gpus) or 'none'})")
    plans: list[EnginePlan] = []
    for i in range(n):
        port = base_port + i
        argv = [python or sys.executable, "-m", "engine_server", "--backend", backend, "--host", host, "--port", str(port)]
        if model:
            argv += ["--model", model]
        nccl, group, env = None, (), {}
        if backend == "lightllm":
            argv += ["--tp", str(tp)]
            if nccl_port is not None:
                nccl = nccl_port + i
                argv += ["--nccl-port", str(nccl)]
            if split:
                group = tuple(gpus[i * tp : (i + 1) * tp])
                env = {"CUDA_VISIBLE_DEVICES": ",".join(group)}
        argv += list(extra_args or [])
        plans.append(EnginePlan(i, host, port, argv, env, nccl, group))
    ports = [p.port for p in plans] + [p.nccl_port for p in plans if p.nccl_port is not None]
    bad = [p for p in ports if not 0 < p < 65536]
    if bad:
        raise ValueError(f"ports out of range: {bad}")
    dup = sorted({p for p in ports if ports.count(p) > 1})
    if dup:
        raise ValueError(f"the engines' HTTP and NCCL ports collide: {dup}; pick another --engine-port")
    return plans
