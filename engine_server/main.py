"""``llm-qos engine``: start the LLM engine behind the proxy and keep it running.

Usage::

    python -m engine_server [--backend auto|vllm|cpu|lightllm] [--host 127.0.0.1] [--port 8001]
                            [--model PATH] [--tp N] [--max-total-token-num N] [--nccl-port P]
                            [--vllm-python PATH] [--vllm-kv-cache-gib N] [--max-model-len N]
                            [--cb-num-blocks N] [--cb-max-batch-tokens N] [--cache-dir PATH]
                            [--ready-timeout S] [--grace S] [--cpu-temperature T]
                            [--crash-limit N] [--crash-window S] [-- ENGINE ARGS...]

``auto`` picks LightLLM when an NVIDIA GPU and the ``lightllm`` package are present, else
vLLM (:mod:`engine_server.vllm_backend`, its own environment) when it can run here, else
``transformers serve`` (backend ``cpu``), with one log line saying why vLLM could not. The
``vllm`` and ``cpu`` backends serve SmolLM2-135M-Instruct, converted once into
``--cache-dir``, unless ``--model`` names a folder. Arguments after ``--`` are appended to the
engine's own command line (e.g. ``-- --max-num-seqs 8`` for vLLM). When the engine answers a
real generation, one line is printed on stdout::

    engine ready at http://127.0.0.1:8001 (backend=cpu, model=smollm2-135m-instruct)

(again after every restart). ``model=`` is the value to send in requests' ``model`` field.

A crashed engine is restarted (backoff 1 s doubling to 30 s); after ``--crash-limit`` crashes
in a row (default 5) the launcher gives up. A crash of an engine that had been ready for
``--crash-window`` seconds (default 60) or longer starts a fresh count: up-time is counted from
readiness, so an engine that always crashes while loading gives up however long a load takes.

Signals: SIGTERM, SIGINT and SIGHUP stop the engine (SIGTERM to its process group whichever
came; SIGKILL to what of the group is left after ``--grace``) and then the launcher. The engine runs in a session of its
own, so a terminal's hang-up reaches it only through the launcher; under ``nohup`` (SIGHUP
ignored) the launcher keeps ignoring it, and both keep running.

Exit status: 0 after a stop signal, 2 bad usage / model missing / busy NCCL port, 3 crash loop,
4 not ready within ``--ready-timeout``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from . import cpu_backend, cpu_model, lightllm_backend, readiness, vllm_backend
from .supervisor import RestartPolicy, Supervisor

log = logging.getLogger("engine_server")

EXIT_USAGE = 2
#: vLLM's first start compiles the model (~2 min on 2 idle cores, 13.5 min measured on busy ones).
DEFAULT_READY_TIMEOUT_S = {"cpu": 180.0, "vllm": 1800.0, "lightllm": 1800.0}


def choose_backend(requested: str = "auto", vllm_python: str | None = None) -> str:
    """``vllm``, ``cpu`` or ``lightllm``: ``requested`` unless it is ``auto``.

    ``auto``: ``lightllm`` when a GPU and the package are present; else ``vllm`` when
    :func:`engine_server.vllm_backend.unavailable_reason` finds nothing against it (it runs
    ``import vllm`` in vLLM's interpreter: a few seconds); else ``cpu``, with one WARNING
    line on the ``engine_server`` logger saying why vLLM could not run.
    """
    if requested != "auto":
        return requested
    if lightllm_backend.cuda_available() and lightllm_backend.lightllm_available():
        return "lightllm"
    why = vllm_backend.unavailable_reason(vllm_python)
    if why is None:
        return "vllm"
    log.warning("backend auto: vLLM cannot run here (%s); using transformers serve (backend cpu)", why)
    return "cpu"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llm-qos engine", description="Start and supervise the LLM engine behind the QoS proxy."
    )
    p.add_argument("--backend", choices=("auto", "vllm", "cpu", "lightllm"), default="auto")
    p.add_argument("--host", default="127.0.0.1", help="engine listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8001, help="engine listen port (default 8001)")
    p.add_argument("--model", type=Path, help="model folder (required for lightllm; vllm, cpu: skips the conversion)")
    p.add_argument("--tp", type=int, default=1, help="lightllm: tensor-parallel GPUs")
    p.add_argument("--max-total-token-num", type=int, default=0,
                   help="lightllm: KV cache budget in tokens (default 0: LightLLM sizes it from free GPU memory)")
    p.add_argument("--nccl-port", type=int, help="lightllm: NCCL port, checked free at start "
                   "(default: LightLLM v1.2.0 takes a free port itself)")
    p.add_argument("--vllm-python", help=f"vllm: the interpreter that has vLLM (default ${vllm_backend.VLLM_PYTHON_ENV}, "
                   "else <project>/.venv-vllm/bin/python, else this one if it has vllm)")
    p.add_argument("--vllm-kv-cache-gib", type=_positive_int, default=vllm_backend.DEFAULT_KVCACHE_GIB,
                   help="vllm on a CPU: KV cache in whole GiB (VLLM_CPU_KVCACHE_SPACE; default "
                        f"{vllm_backend.DEFAULT_KVCACHE_GIB}; an explicit VLLM_CPU_KVCACHE_SPACE wins; ignored on a GPU)")
    p.add_argument("--max-model-len", type=_positive_int, default=vllm_backend.DEFAULT_MAX_MODEL_LEN,
                   help=f"vllm: context length in tokens (default {vllm_backend.DEFAULT_MAX_MODEL_LEN})")
    p.add_argument("--cb-num-blocks", type=int, default=64, help="cpu: KV cache blocks")
    p.add_argument("--cb-max-batch-tokens", type=int, default=512, help="cpu: tokens per batch step")
    p.add_argument("--cpu-temperature", type=float, default=0.0,
                   help="cpu: temperature of the readiness probe, which (continuous batching quirk) "
                        "fixes the sampling of every later request; 0 = greedy (default)")
    p.add_argument("--cache-dir", type=Path, help="cpu: converted model folder "
                   "(default $LLM_QOS_CACHE/smollm2-135m-instruct or ~/.cache/llm-qos/...)")
    p.add_argument("--ready-timeout", type=float, help="seconds to wait for readiness (cpu 180, vllm 1800, lightllm 1800)")
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    add_restart_arguments(p)
    p.add_argument("--log-level", default="INFO")
    return p


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def add_restart_arguments(p: argparse.ArgumentParser) -> None:
    """``--crash-limit N`` and ``--crash-window S``: the restart policy's knobs, shared by
    ``llm-qos engine`` and ``llm-qos up`` (see :class:`engine_server.supervisor.RestartPolicy`)."""
    d = RestartPolicy()
    p.add_argument("--crash-limit", type=_positive_int, default=d.crash_limit,
                   help=f"give up after this many engine crashes in a row (default {d.crash_limit}; exit status 3)")
    p.add_argument("--crash-window", type=_non_negative, default=d.crash_window_s,
                   help="seconds an engine must have been ready before a crash no longer counts "
                        f"towards --crash-limit (default {d.crash_window_s:g}; counted from readiness, not start)")


def _run_loop(coro_factory: Callable[[], object]) -> int:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro_factory())
    return uvloop.run(coro_factory())


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit status (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    engine_args: list[str] = []
    if "--" in argv:  # the rest goes to the engine's own command line
        cut = argv.index("--")
        argv, engine_args = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    backend = choose_backend(args.backend, args.vllm_python)
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
        ) + engine_args
        env = cpu_backend.cpu_env()
        workdir: Path | None = cpu_backend.cpu_workdir(model_dir)
        model_name = cpu_backend.served_model_name(model_dir)
        probe: readiness.Probe = readiness.OpenAIProbe(base_url, model=model_name, temperature=args.cpu_temperature)
    elif backend == "vllm":
        try:
            python = vllm_backend.find_vllm_python(args.vllm_python)
            model_dir = args.model or cpu_model.prepare_cpu_model(args.cache_dir)
        except (vllm_backend.VllmUnavailableError, cpu_model.ModelNotAvailableError) as exc:
            log.error("%s", exc)
            return EXIT_USAGE
        model_name = Path(model_dir).expanduser().absolute().name
        opts = vllm_backend.VllmOptions(
            model_dir, args.host, args.port, served_name=model_name,
            max_model_len=args.max_model_len, dtype=vllm_backend.default_dtype(), extra_args=engine_args,
        )
        argv_child = vllm_backend.vllm_command(opts, python)
        env = vllm_backend.vllm_env(args.vllm_kv_cache_gib)
        workdir = None
        probe = readiness.VllmProbe(base_url, model=model_name)
    else:
        if args.model is None:
            log.error("--model is required with --backend lightllm")
            return EXIT_USAGE
        if args.nccl_port is not None and not lightllm_backend.port_is_free(args.nccl_port):
            log.error("--nccl-port %d is already in use; pick another, or leave it out and LightLLM "
                      "takes a free one", args.nccl_port)
            return EXIT_USAGE
        opts = lightllm_backend.LightLLMOptions(
            model_dir=args.model, host=args.host, port=args.port, tp=args.tp,
            max_total_token_num=args.max_total_token_num or None, nccl_port=args.nccl_port,
            extra_args=engine_args,
        )
        try:
            argv_child = lightllm_backend.lightllm_command(opts)
        except ValueError as exc:
            log.error("%s", exc)
            return EXIT_USAGE
        env = None
        workdir = None
        # what LightLLM's /v1/models lists (the folder's name; the chat routes echo any name)
        model_name = Path(args.model).expanduser().absolute().name
        probe = readiness.LightLLMProbe(base_url)

    ready_timeout = args.ready_timeout or DEFAULT_READY_TIMEOUT_S[backend]

    def on_ready(took: float) -> None:
        print(f"engine ready at {base_url} (backend={backend}, model={model_name})", flush=True)

    async def supervise() -> int:
        sup = Supervisor(
            argv_child, env=env, probe=probe, ready_timeout_s=ready_timeout,
            policy=RestartPolicy(grace_s=args.grace, crash_limit=args.crash_limit, crash_window_s=args.crash_window),
            on_ready=on_ready, name=f"engine[{backend}]", cwd=workdir,
        )
        sup.install_signal_handlers()
        return await sup.run()

    return _run_loop(supervise)


if __name__ == "__main__":
    sys.exit(main())
