"""The ``llm-qos`` command: ``proxy``, ``engine``, ``up``, ``check-config``.

``up`` runs the engine and the proxy as two separate processes (the proxy pointed at the
engine), starts the proxy once the engine is ready, and on Ctrl-C / SIGTERM stops the
proxy first (it drains) and then the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from importlib import resources

DEFAULT_CONFIG = "default_config.yaml"


def default_config_path() -> str:
    """Path of the example config shipped inside the package (used by ``up``)."""
    return str(resources.files("proxy").joinpath(DEFAULT_CONFIG))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llm-qos", description="QoS gateway for OpenAI-compatible LLM servers.")
    sub = p.add_subparsers(dest="command", required=True)

    px = sub.add_parser("proxy", help="run the QoS proxy in front of an upstream")
    px.add_argument("--config", required=True, help="YAML config file (watched and hot-reloaded)")
    px.add_argument("--host", default="127.0.0.1")
    px.add_argument("--port", type=int, default=8000)
    px.add_argument("--upstream", default=None, help="upstream base URL; overrides upstream.url")
    px.add_argument("--no-watch", action="store_true", help="do not watch the config file; reload only on SIGHUP or POST /admin/reload")
    px.add_argument("--workers", type=int, default=1, help="processes serving the port (SO_REUSEPORT); more than 1 needs a shared_state section")
    px.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)  # set by the supervisor

    en = sub.add_parser("engine", help="run the bundled engine (LightLLM on a GPU, CPU engine otherwise)", add_help=False)
    en.add_argument("args", nargs=argparse.REMAINDER)

    up = sub.add_parser("up", help="run the engine and the proxy together")
    up.add_argument("--config", default=None, help=f"YAML config (default: the shipped {DEFAULT_CONFIG})")
    up.add_argument("--host", default="127.0.0.1", help="proxy listen address")
    up.add_argument("--port", type=int, default=8000, help="proxy port")
    up.add_argument("--engine-port", type=int, default=8001)
    up.add_argument("--backend", default="auto", choices=["auto", "cpu", "lightllm"])
    up.add_argument("--model", default=None, help="model folder for the engine")

    cc = sub.add_parser("check-config", help="validate a config file without starting anything")
    cc.add_argument("file")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``llm-qos`` console script. Returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "engine":
        from engine_server.main import main as engine_main

        return engine_main(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "proxy":
        if args.workers < 1:
            print("error: --workers must be at least 1", file=sys.stderr)
            return 2
        if args.workers > 1 and args.worker_index is None:
            from .workers import supervise

            return supervise(args.config, args.host, args.port, args.upstream, not args.no_watch, args.workers)
        from .server import run

        worker = (args.worker_index, args.workers) if args.worker_index is not None else None
        return run(args.config, args.host, args.port, args.upstream, watch=not args.no_watch, worker=worker)
    if args.command == "check-config":
        return check_config(args.file)
    if args.command == "up":
        return asyncio.run(_up(args))
    return 2


def check_config(path: str) -> int:
    """Validate ``path``; print ``ok`` and a summary, or the errors. Exit code 0 / 1."""
    from .config import ConfigError, load_config

    try:
        cfg = load_config(path)
    except ConfigError as e:
        print(f"invalid: {e}", file=sys.stderr)
        return 1
    users = sum(len(g.users) for g in cfg.groups)
    print(f"ok: {path}: {len(cfg.groups)} groups ({', '.join(g.name for g in cfg.groups)}), {users} users, upstream {cfg.upstream.url} ({cfg.upstream.kind})")
    return 0


async def _up(args: argparse.Namespace) -> int:
    config = args.config or default_config_path()
    if check_config(config) != 0:
        return 2
    for host, port, what in ((args.host, args.port, "proxy"), ("127.0.0.1", args.engine_port, "engine")):
        if not _port_free(host, port):
            print(f"llm-qos up: {host}:{port} is already in use; pick another {what} port (--{'port' if what == 'proxy' else 'engine-port'})", file=sys.stderr)
            return 2
    engine_url = f"http://127.0.0.1:{args.engine_port}"
    engine_cmd = [sys.executable, "-m", "engine_server", "--backend", args.backend, "--host", "127.0.0.1", "--port", str(args.engine_port)]
    if args.model:
        engine_cmd += ["--model", args.model]
    proxy_cmd = [sys.executable, "-m", "proxy", "proxy", "--config", config, "--host", args.host, "--port", str(args.port), "--upstream", engine_url]

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    print(f"llm-qos up: starting the engine ({' '.join(engine_cmd[1:])})", flush=True)
    engine = await asyncio.create_subprocess_exec(*engine_cmd, stdout=asyncio.subprocess.PIPE, start_new_session=True)
    proxy = None
    try:
        ready = await _wait_line(engine, "engine ready", stop)
        if not ready:
            return 1 if engine.returncode not in (None, 0) else 0
        print(f"llm-qos up: starting the proxy on http://{args.host}:{args.port} -> {engine_url}", flush=True)
        proxy = await asyncio.create_subprocess_exec(*proxy_cmd, start_new_session=True)
        engine_exit = asyncio.create_task(engine.wait())
        proxy_exit = asyncio.create_task(proxy.wait())
        stopping = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({engine_exit, proxy_exit, stopping}, return_when=asyncio.FIRST_COMPLETED)
        for t in (engine_exit, proxy_exit, stopping):
            t.cancel()
        if stopping in done:
            return 0
        print("llm-qos up: a process exited; stopping the other", file=sys.stderr, flush=True)
        return 1
    finally:
        await _terminate(proxy, "proxy", 35.0)
        await _terminate(engine, "engine", 15.0)


def _port_free(host: str, port: int) -> bool:
    """Whether a TCP listener could bind ``host:port`` now (checked before starting
    anything, so a busy port fails at once instead of after the engine's start-up)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


async def _wait_line(proc: asyncio.subprocess.Process, marker: str, stop: asyncio.Event) -> bool:
    """Echo ``proc``'s stdout until a line containing ``marker`` (True), EOF or ``stop``
    (False); keeps echoing in the background afterwards."""
    assert proc.stdout is not None

    async def read_until() -> bool:
        while True:
            line = await proc.stdout.readline()
            if not line:
                return False
            sys.stdout.write(line.decode(errors="replace"))
            sys.stdout.flush()
            if marker in line.decode(errors="replace"):
                return True

    reader = asyncio.create_task(read_until())
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({reader, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if reader not in done:
        reader.cancel()
        return False
    ok = reader.result()
    if ok:
        asyncio.create_task(_echo(proc))
    return ok


async def _echo(proc: asyncio.subprocess.Process) -> None:
    assert proc.stdout is not None
    while line := await proc.stdout.readline():
        sys.stdout.write(line.decode(errors="replace"))
        sys.stdout.flush()


async def _terminate(proc: asyncio.subprocess.Process | None, name: str, grace_s: float) -> None:
    if proc is None or proc.returncode is not None:
        return
    print(f"llm-qos up: stopping the {name}", flush=True)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        await asyncio.wait_for(proc.wait(), grace_s)
    except TimeoutError:
        print(f"llm-qos up: the {name} did not stop within {grace_s:g} s; killing it", file=sys.stderr, flush=True)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await proc.wait()


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
