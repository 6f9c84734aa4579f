"""``llm-qos engine``: start the LLM engine behind the proxy and keep it running.

Usage::

    python -m engine_server [--backend auto|cpu|lightllm] [--host 127.0.0.1] [--port 8001]
                            [--model PATH] [--tp N] [--max-total-token-num N] [--nccl-port P]
                            [--cb-num-blocks N] [--cb-max-batch-tokens N] [--cache-dir PATH]
                            [--ready-timeout S] [--grace S] [--cpu-temperature T]

``auto`` picks LightLLM when an NVIDIA GPU and the ``lightllm`` package are present, else the
CPU engine (``transformers serve`` on SmolLM2-135M-Instruct, converted once into
``--cache-dir``). When the engine answers a real generation, one line is printed on stdout::

    engine ready at http://127.0.0.1:8001 (backend=cpu, model=/root/.cache/llm-qos/smollm2-135m-instruct)

(again after every restart). ``model=`` is the value to send in requests' ``model`` field.

Exit status: 0 after SIGTERM/SIGINT (forwarded to the engine, SIGKILL after ``--grace``),
2 bad usage / model missing, 3 crash loop, 4 not ready within ``--ready-timeout``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from . import cpu_backend, cpu_model, lightllm_backend, readiness
from .supervisor import RestartPolicy, Supervisor

log = logging.getLogger("engine_server")

EXIT_USAGE = 2
DEFAULT_READY_TIMEOUT_S = {"cpu": 180.0, "lightllm": 1800.0}


def choose_backend(requested: str = "auto") -> str:
    """``cpu`` or ``lightllm``; ``auto`` = lightllm if a GPU and the package are present."""
    if requested != "auto":
        return requested
    if lightllm_backend.cuda_available() and lightllm_backend.lightllm_available():
        return "lightllm"
    return "cpu"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llm-qos engine", description="Start and supervise the LLM engine behind the QoS proxy."
    )
    p.add_argument("--backend", choices=("auto", "cpu", "lightllm"), default="auto")
    p.add_argument("--host", default="127.0.0.1", help="engine listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8001, help="engine listen port (default 8001)")
    p.add_argument("--model", type=Path, help="model folder (required for lightllm; cpu: skips the conversion)")
    p.add_argument("--tp", type=int, default=1, help="lightllm: tensor-parallel GPUs")
    p.add_argument("--max-total-token-num", type=int, help="lightllm: KV cache budget in tokens")
    p.add_argument("--nccl-port", type=int, help="lightllm: NCCL port (default 28765 + port %% 1000)")
    p.add_argument("--cb-num-blocks", type=int, default=64, help="cpu: KV cache blocks")
    p.add_argument("--cb-max-batch-tokens", type=int, default=512, help="cpu: tokens per batch step")
    p.add_argument("--cpu-temperature", type=float, default=0.0,
                   help="cpu: temperature of the readiness probe, which (continuous batching quirk) "
                        "fixes the sampling of every later request; 0 = greedy (default)")
    p.add_argument("--cache-dir", type=Path, help="cpu: converted model folder "
                   "(default $LLM_QOS_CACHE/smollm2-135m-instruct or ~/.cache/llm-qos/...)")
    p.add_argument("--ready-timeout", type=float, help="seconds to wait for readiness (cpu 180, lightllm 1800)")
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--log-level", default="INFO")
    return p


def _run_loop(coro_factory: Callable[[], object]) -> int:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro_factory())
    return uvloop.run(coro_factory())


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit status (see the module docstring)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    backend = choose_backend(args.backend)
    base_url = f"http://{args.host}:{args.port}"
    log.info("backend=%s (requested %s)", backend, args.backend)

    if backend == "cpu":
        try:
            model_dir = args.model or cpu_model.prepare_cpu_model(args.cache_dir)
        except cpu_model.ModelNotAvailableError as exc:
            log.error("%s", exc)
            return EXIT_USAGE
        argv_child = cpu_backend.cpu_command(
            model_dir, args.host, args.port, args.cb_num_blocks, args.cb_max_batch_tokens
        )
        env = cpu_backend.cpu_env()
        workdir: Path | None = cpu_backend.cpu_workdir(model_dir)
        model_name = cpu_backend.served_model_name(model_dir)
        probe: readiness.Probe = readiness.OpenAIProbe(base_url, model=model_name, temperature=args.cpu_temperature)
    else:
        if args.model is None:
            log.error("--model is required with --backend lightllm")
            return EXIT_USAGE
        opts = lightllm_backend.LightLLMOptions(
            model_dir=args.model, host=args.host, port=args.port, tp=args.tp,
            max_total_token_num=args.max_total_token_num, nccl_port=args.nccl_port,
        )
        argv_child = lightllm_backend.lightllm_command(opts)
        env = None
        workdir = None
        model_name = str(Path(args.model).expanduser().absolute())
        probe = readiness.LightLLMProbe(base_url)

    ready_timeout = args.ready_timeout or DEFAULT_READY_TIMEOUT_S[backend]

    def on_ready(took: float) -> None:
        print(f"engine ready at {base_url} (backend={backend}, model={model_name})", flush=True)

    async def supervise() -> int:
        sup = Supervisor(
            argv_child, env=env, probe=probe, ready_timeout_s=ready_timeout,
            policy=RestartPolicy(grace_s=args.grace), on_ready=on_ready, name=f"engine[{backend}]", cwd=workdir,
        )
        sup.install_signal_handlers()
        return await sup.run()

    return _run_loop(supervise)


if __name__ == "__main__":
    sys.exit(main())
