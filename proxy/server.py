"""Running the proxy: listen, watch the config, reload on SIGHUP, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
from pathlib import Path

from aiohttp import web

from .telemetry import log_filters
from .telemetry import log_format as log_format_module
from .api.admin import RELOADER
from .api.app import create_app
from .config.loading import config_digest, parse_config
from .runtime.config_watch import reload_config, watch_config
from .api.handlers import STATE
from .config.pools import public_url
from .runtime.workers import start_worker_socket

log = logging.getLogger("llm_qos.proxy")


async def serve(
    config_path: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    upstream_url: str | list[str] | None = None,
    drain_timeout_s: float = 30.0,
    watch: bool = True,
    worker: tuple[int, int] | None = None,
) -> None:
    """Serve the proxy until SIGTERM/SIGINT.

    On a stop signal: stop accepting connections, refuse queued requests (503), let
    requests in flight finish for up to ``drain_timeout_s`` seconds, then close.
    ``worker``: (index, count) when this is one of ``--workers`` processes: the port is
    bound with SO_REUSEPORT (:mod:`proxy.runtime.workers`).

    Raises:
        ConfigError: the initial config is invalid (nothing starts).
        OSError: the port cannot be bound.
    """
    data = Path(config_path).read_bytes()
    config = parse_config(data.decode("utf-8", "replace"), config_path)
    app = create_app(config, config_digest(data), config_path, upstream_url, worker=worker)
    state = app[STATE]
    app[RELOADER] = lambda: reload_config(state)

    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=drain_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=2048, reuse_port=worker is not None)
    await site.start()
    own_metrics = await start_worker_socket(state)  # --workers: this worker's series for the others' scrapes
    # the signal handlers before the ready line: a SIGTERM right after it must drain
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: reload_config(state))
    where = _serving(state)
    log.info("proxy listening on http://%s:%d, %s", host, port, where)
    if worker is None:
        print(f"llm-qos proxy ready on http://{host}:{port} -> {where}", flush=True)
    else:
        print(f"llm-qos proxy worker {worker[0]} (of {worker[1]}, pid {os.getpid()}) ready on http://{host}:{port}", flush=True)

    # everything allocated at start-up lives as long as the process: keep it out of the
    # collector's full passes, which otherwise stall the loop for ~0.1-0.4 s at depth
    gc.collect()
    gc.freeze()
    watcher = asyncio.create_task(watch_config(state, stop)) if watch else None
    _flush_access_log(loop)
    try:
        await stop.wait()
    finally:
        log.info("stopping: refusing queued requests, draining in-flight ones (up to %g s)", drain_timeout_s)
        state.draining = True
        state.admission.close()
        if watcher is not None:
            watcher.cancel()
        await runner.cleanup()  # stops listening, waits for handlers up to shutdown_timeout
        if own_metrics is not None:
            await own_metrics.cleanup()
        for h in logging.getLogger("llm_qos.access").handlers:
            h.flush()
        log.info("proxy stopped")


ACCESS_LOG_BUFFER = 256  # lines
ACCESS_LOG_FLUSH_S = 1.0


def configure_logging(log_format: str = "text", access_log: str | None = None, worker: int | None = None) -> log_format_module.AccessLogBuffer:
    """Set up the two logs (:mod:`proxy.telemetry.log_format`): the diagnostic log on stderr as
    ``log_format`` (``text`` or ``json``); the access log, one JSON object per line, on
    stderr or appended to the file ``access_log`` (reopened when logrotate moves it).
    ``worker``: the index of one of ``--workers`` processes, carried by every line of
    both logs.

    The access log is buffered like nginx's ``access_log ... buffer= flush=``: written in
    batches of ``ACCESS_LOG_BUFFER`` lines, and at least every ``ACCESS_LOG_FLUSH_S``
    seconds by :func:`serve`, so the hot path pays no write system call per request;
    each batch is one write (:class:`proxy.telemetry.log_format.AccessLogBuffer`).
    Returns the access log's buffer.

    Raises:
        ValueError: an unknown ``log_format``.
        OSError: the access log file cannot be opened.
    """
    import logging.handlers

    diagnostic = logging.StreamHandler(sys.stderr)
    diagnostic.setFormatter(log_format_module.diagnostic_formatter(log_format, worker))
    logging.basicConfig(level=logging.INFO, handlers=[diagnostic], force=True)
    # the record fields we never print cost a lookup each per log line
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    log_filters.install()
    if access_log in (None, "", "-"):
        target: logging.Handler = logging.StreamHandler(sys.stderr)
    else:
        target = logging.handlers.WatchedFileHandler(access_log, encoding="utf-8")
    target.setFormatter(log_format_module.access_formatter(worker))
    access = logging.getLogger("llm_qos.access")
    for h in list(access.handlers):
        access.removeHandler(h)
    buffer = log_format_module.AccessLogBuffer(ACCESS_LOG_BUFFER, flushLevel=logging.ERROR, target=target, flushOnClose=True)
    access.addHandler(buffer)
    access.propagate = False
    return buffer


def _flush_access_log(loop: asyncio.AbstractEventLoop) -> None:
    for h in logging.getLogger("llm_qos.access").handlers:
        h.flush()
    loop.call_later(ACCESS_LOG_FLUSH_S, _flush_access_log, loop)


def run(
    config_path: str,
    host: str,
    port: int,
    upstream_url: str | list[str] | None = None,
    watch: bool = True,
    log_format: str = "text",
    access_log: str | None = None,
    worker: tuple[int, int] | None = None,
) -> int:
    """Blocking entry point for the CLI; uses uvloop when installed. Returns an exit code.

    ``log_format`` and ``access_log``: see :func:`configure_logging`; ``worker``: see
    :func:`serve`."""
    from .config.loading import ConfigError

    try:
        configure_logging(log_format, access_log, worker[0] if worker else None)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency
        runner = asyncio.run
    try:
        runner(serve(config_path, host, port, upstream_url, watch=watch, worker=worker))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _serving(state) -> str:
    """What the proxy sends requests to, for its start-up lines: the single upstream's URL
    and kind, or each pool with its engines."""
    if state.active.models.single_upstream:
        up = state.active.config.upstream
        return f"{public_url(up.url)} ({up.kind})"
    return "; ".join(
        f"pool {p.name}: {', '.join(f'{e.name} {public_url(e.url)}' if e.name != public_url(e.url) else e.name for e in p.router.engines.values())}"
        for p in state.admission.pools.values()
    )
