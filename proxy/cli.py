"""The ``llm-qos`` command: ``proxy``, ``engine``, ``up``, ``check-config``.

``up`` runs the engine and the proxy as two separate processes (the proxy pointed at the
engine), starts the proxy once the engine is ready, and on Ctrl-C / SIGTERM / SIGHUP (the
terminal hung up) stops the proxy first (it drains) and then the engine. Both run in
sessions of their own, so signals reach them only through ``up``; under ``nohup`` (SIGHUP
ignored) ``up`` keeps ignoring SIGHUP. To reload the proxy's config, edit the file (it is
watched) or ``POST /admin/reload``. ``up --engines N`` starts N engines
(:mod:`engine_server.fleet`: ports ``--engine-port`` + i; one LightLLM per GPU group) and
the proxy with one ``--upstream`` per engine, which makes one catch-all pool ``default``
over them (:func:`proxy.config.loading.with_upstream_urls`); the operator's config file stays the
one the proxy watches.
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
    px.add_argument("--upstream", action="append", default=None, metavar="URL",
                    help="upstream base URL; overrides upstream.url (repeated: one pool over these engines)")
    px.add_argument("--no-watch", action="store_true", help="do not watch the config file; reload only on SIGHUP or POST /admin/reload")
    px.add_argument("--log-format", choices=("text", "json"), default="text", help="diagnostic log on stderr: readable text (default) or one JSON object per line")
    px.add_argument("--access-log", default="-", metavar="PATH", help="where the access log (one JSON object per request) goes: - for stderr (default), or a file appended to")
    px.add_argument("--workers", type=int, default=1, help="processes serving the port (SO_REUSEPORT); more than 1 needs a shared_state section")
    px.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)  # set by the supervisor

    en = sub.add_parser("engine", help="run the bundled engine (LightLLM on a GPU, else vLLM, else transformers serve)", add_help=False)
    en.add_argument("args", nargs=argparse.REMAINDER)

    up = sub.add_parser("up", help="run the engine and the proxy together")
    up.add_argument("--config", default=None, help=f"YAML config (default: the shipped {DEFAULT_CONFIG})")
    up.add_argument("--host", default="127.0.0.1", help="proxy listen address")
    up.add_argument("--port", type=int, default=8000, help="proxy port")
    up.add_argument("--engine-port", type=int, default=8001, help="the engine's port (engine i of --engines N: this + i)")
    up.add_argument("--engines", type=int, default=1, metavar="N", help="start N engines and a pool over them (default 1)")
    up.add_argument("--tp", type=int, default=1, help="lightllm: GPUs per engine (--engines N needs N*tp GPUs)")
    up.add_argument("--backend", default="auto", choices=["auto", "vllm", "cpu", "lightllm"],
                    help="the engine: auto (default: LightLLM on a GPU that has it, else vLLM, else transformers serve)")
    up.add_argument("--model", default=None, help="model folder for the engine")
    up.add_argument("--crash-limit", default=None, help="engine: give up after this many crashes in a row (default 5)")
    up.add_argument("--crash-window", default=None, help="engine: seconds ready before a crash no longer counts (default 60)")
    up.add_argument("--nccl-port", default=None, help="lightllm: NCCL port (default: LightLLM takes a free one)")

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
            from .runtime.workers import supervise

            return supervise(args.config, args.host, args.port, args.upstream, not args.no_watch, args.workers, ["--log-format", args.log_format, "--access-log", args.access_log])
        from .server import run

        worker = (args.worker_index, args.workers) if args.worker_index is not None else None
        return run(args.config, args.host, args.port, args.upstream, watch=not args.no_watch, log_format=args.log_format, access_log=args.access_log, worker=worker)
    if args.command == "check-config":
        return check_config(args.file)
    if args.command == "up":
        return asyncio.run(_up(args))
    return 2


def check_config(path: str) -> int:
    """Validate ``path``; print ``ok`` and a summary, or the errors. Exit code 0 / 1."""
    from .config.loading import ConfigError, load_config

    try:
        cfg = load_config(path)
    except ConfigError as e:
        print(f"invalid: {e}", file=sys.stderr)
        return 1
    users = sum(len(g.users) for g in cfg.groups)
    if cfg.pools:
        where = "pools " + "; ".join(
            f"{p.name} (models {', '.join(m.name for m in p.models)}; engines {', '.join(f'{e.name} ({e.kind})' for e in p.engines)})"
            for p in cfg.effective_pools()
        )
    else:
        from .config.pools import public_url

        where = f"upstream {public_url(cfg.upstream.url)} ({cfg.upstream.kind})"
    print(f"ok: {path}: {len(cfg.groups)} groups ({', '.join(g.name for g in cfg.groups)}), {users} users, {where}")
    return 0


async def _up(args: argparse.Namespace) -> int:
    config = args.config or default_config_path()
    if check_config(config) != 0:
        return 2
    try:
        plans = _engine_plans(args)
    except ValueError as e:
        print(f"llm-qos up: {e}", file=sys.stderr)
        return 2
    for host, port, what in [(args.host, args.port, "proxy"), *(("127.0.0.1", p.port, "engine") for p in plans)]:
        if not _port_free(host, port):
            print(f"llm-qos up: {host}:{port} is already in use; pick another {what} port (--{'port' if what == 'proxy' else 'engine-port'})", file=sys.stderr)
            return 2
    urls = [p.url for p in plans]
    proxy_cmd = [sys.executable, "-m", "proxy", "proxy", "--config", config, "--host", args.host, "--port", str(args.port)]
    for url in urls:
        proxy_cmd += ["--upstream", url]

    from engine_server.supervisor import stop_signals

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in stop_signals():  # SIGTERM, SIGINT, and SIGHUP unless nohup ignores it
        loop.add_signal_handler(sig, stop.set)

    engines: list[asyncio.subprocess.Process] = []
    proxy = None

    async def start(plan) -> asyncio.subprocess.Process:
        what = "the engine" if len(plans) == 1 else f"engine {plan.index}"
        _say(f"llm-qos up: starting {what} ({' '.join(plan.argv[1:])})")
        env = {**os.environ, **plan.env} if plan.env else None
        proc = await asyncio.create_subprocess_exec(*plan.argv, stdout=asyncio.subprocess.PIPE, start_new_session=True, env=env)
        engines.append(proc)
        return proc

    try:
        # the first engine alone (the CPU backend converts the model once, into a folder
        # the others then reuse), then the others together
        first = await start(plans[0])
        ready = [await _wait_line(first, "engine ready", stop)]
        if ready[0] and len(plans) > 1:
            rest = [await start(p) for p in plans[1:]]
            ready += await asyncio.gather(*(_wait_line(e, "engine ready", stop) for e in rest))
        if not all(ready):
            if stop.is_set():
                return 0
            for plan, e, ok in zip(plans, engines, ready):
                if not ok:
                    code = await e.wait()  # its stdout ended: it exited (or is about to)
                    what = "the engine" if len(plans) == 1 else f"engine {plan.index}"
                    _say(f"llm-qos up: {what} exited with status {code} before it was ready", err=True)
            return 1
        _say(f"llm-qos up: starting the proxy on http://{args.host}:{args.port} -> {', '.join(urls)}")
        proxy = await asyncio.create_subprocess_exec(*proxy_cmd, start_new_session=True)
        named = {"the proxy": proxy} | (
            {"the engine": engines[0]} if len(engines) == 1 else {f"engine {p.index}": e for p, e in zip(plans, engines)}
        )
        waits = {asyncio.create_task(p.wait()): name for name, p in named.items()}
        stopping = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({*waits, stopping}, return_when=asyncio.FIRST_COMPLETED)
        for t in (*waits, stopping):
            t.cancel()
        if stopping in done:
            return 0
        gone = [name for name, p in named.items() if p.returncode is not None]
        what = "; ".join(f"{name} {_exit_status(named[name].returncode, name != 'the proxy')}" for name in gone)
        others = [name for name in named if name not in gone]
        _say(f"llm-qos up: {what}" + (f"; stopping {_and(others)}" if others else ""), err=True)
        return 1
    finally:
        # signals before words: a terminal that hung up fails every write (EIO), and the
        # proxy and the engines, in sessions of their own, would outlive us
        try:
            await _terminate(proxy, "proxy", 35.0)
        finally:
            names = ["engine"] if len(engines) == 1 else [f"engine {i}" for i in range(len(engines))]
            await asyncio.gather(*(_terminate(e, n, 15.0) for e, n in zip(engines, names)))


def _engine_plans(args: argparse.Namespace) -> list:
    """The engines ``up`` starts (:func:`engine_server.fleet.plan_engines`). One engine is
    started as before pools existed (``--backend`` passed on as given, ``auto`` too);
    several need the backend resolved here, to split the GPUs among LightLLM instances.

    Raises:
        ValueError: see :func:`engine_server.fleet.plan_engines`.
    """
    from engine_server.fleet import EnginePlan, plan_engines

    supervision = []
    for flag, value in (("--crash-limit", args.crash_limit), ("--crash-window", args.crash_window)):
        if value is not None:
            supervision += [flag, value]  # the engine validates them
    nccl_port = int(args.nccl_port) if args.nccl_port is not None else None
    if args.engines == 1:
        argv = [sys.executable, "-m", "engine_server", "--backend", args.backend, "--host", "127.0.0.1", "--port", str(args.engine_port)]
        if args.model:
            argv += ["--model", args.model]
        if args.tp != 1:
            argv += ["--tp", str(args.tp)]
        if nccl_port is not None:
            argv += ["--nccl-port", str(nccl_port)]
        return [EnginePlan(0, "127.0.0.1", args.engine_port, argv + supervision, nccl_port=nccl_port)]
    from engine_server.main import choose_backend

    return plan_engines(
        args.engines, choose_backend(args.backend), args.engine_port, tp=args.tp, model=args.model, nccl_port=nccl_port, extra_args=supervision
    )


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
            text = line.decode(errors="replace")
            _say(text, end="")
            if marker in text:
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
    """Pass the rest of ``proc``'s stdout on (its pipe must be read, or the engine blocks
    on a full pipe once our terminal is gone)."""
    assert proc.stdout is not None
    while line := await proc.stdout.readline():
        _say(line.decode(errors="replace"), end="")


def _say(text: str, *, err: bool = False, end: str = "\n") -> None:
    """Write one of ``up``'s lines (or a child's, passed on) to stdout or stderr, never
    failing: once the terminal has hung up every write fails with EIO (a closed pipe: EPIPE),
    and a write's error must not cut the stopping of the proxy and the engines short.
    After such an error the stream's file descriptor is pointed at /dev/null, so the rest
    of the output (and the interpreter's final flush) is dropped quietly."""
    stream = sys.stderr if err else sys.stdout
    try:
        stream.write(text + end)
        stream.flush()
    except (BlockingIOError, InterruptedError):
        pass  # transient: this line is lost, the next may pass
    except (OSError, ValueError):  # EIO, EPIPE...; ValueError: the stream was closed
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, stream.fileno())
            finally:
                os.close(null)
        except (OSError, ValueError):
            pass


def _exit_status(code: int, engine: bool) -> str:
    """How a child of ``up`` ended, in words ("exited with status 3 (...)")."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    from engine_server.supervisor import EXIT_GAVE_UP, EXIT_NOT_READY

    why = {EXIT_GAVE_UP: "its supervisor gave up after repeated crashes, see --crash-limit",
           EXIT_NOT_READY: "it was not ready in time"}.get(code) if engine else None
    return f"exited with status {code}" + (f" ({why})" if why else "")


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


async def _terminate(proc: asyncio.subprocess.Process | None, name: str, grace_s: float) -> None:
    """SIGTERM ``proc``'s process group, SIGKILL after ``grace_s``; each signal is sent
    before the line that tells it (see :func:`_say`)."""
    if proc is None or proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    _say(f"llm-qos up: stopping the {name}")
    try:
        await asyncio.wait_for(proc.wait(), grace_s)
    except TimeoutError:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _say(f"llm-qos up: the {name} did not stop within {grace_s:g} s; killed it", err=True)
        await proc.wait()


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
