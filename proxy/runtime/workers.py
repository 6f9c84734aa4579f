"""``llm-qos proxy --workers N``: N proxy processes serving one port, and their supervisor.

Each worker is a whole proxy (``python -m proxy proxy ... --worker-index I``) that binds
the port with ``SO_REUSEPORT``, so the kernel spreads new connections over the workers
(Linux 3.9+, ``socket(7)``). Each watches the config file itself. The supervisor (this
module, in the parent process) starts them, copies their output to stderr, prints one
ready line on stdout when all are ready, forwards SIGTERM/SIGINT (drain and stop) and SIGHUP (reload) to every
worker, and restarts a worker that dies, at most :data:`MAX_RESTARTS` times in
:data:`RESTART_WINDOW_S` seconds (beyond that it stops them all and exits 1). Workers die
with the supervisor, even a SIGKILLed one (``PR_SET_PDEATHSIG``).

**Without ``shared_state`` it refuses to start**: N independent schedulers would each
enforce strict priority, fairness and rate limits over their own share of the traffic
only, which is not what the config promises. With ``shared_state``, the workers are
replicas of one deployment (``docs/scaling.md``): each loads the whole config, the
engines' capacity is leased per engine through Redis and the rate limits are reserved
there, so the totals hold across workers; a worker that cannot reach Redis takes its
local share (capacity and limits ÷ live replicas, at least N).

**Metrics: every scrape shows the whole server.** The kernel gives a scrape of
``/metrics`` to any one worker, so each worker also serves its own exposition on a Unix
socket, ``worker-I.sock`` in a private directory the supervisor makes (mode 0700, named
to the workers by :data:`WORKER_DIR_ENV`, removed at exit), and the worker that takes a
scrape answers with its own series and every other worker's, fetched over those sockets
(:func:`whole_server_metrics`). Every series carries ``worker="I"`` (0..N-1), so
``sum without (worker)`` gives the server's totals, and a worker restarted after a crash
starts its counters at 0 as any restarted target does (``rate()`` handles the reset).
``llm_qos_worker_up{worker}`` says which workers answered that scrape (a worker that
does not answer within :data:`PEER_TIMEOUT_S`, e.g. while it restarts, is left out).
prometheus-client's multiprocess mode was not used: it aggregates only the counters,
histograms and gauges it writes to files, not the collectors that read the live
schedulers, engines and shared state at scrape time (queue depths, engine state, grants).
Log lines of a worker carry its index too (:mod:`proxy.telemetry.log_format`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import sys
import tempfile
import time

import aiohttp
from aiohttp import web

from ..config.loading import ConfigError, load_config

MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
READY_MARK = "llm-qos proxy ready on "
WORKER_DIR_ENV = "LLM_QOS_WORKER_DIR"  # the supervisor's private directory of the workers' sockets
PEER_TIMEOUT_S = 2.0  # how long a scrape waits for another worker's series
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def socket_path(directory: str, index: int) -> str:
    """The Unix socket on which worker ``index`` serves its own ``/metrics``."""
    return os.path.join(directory, f"worker-{index}.sock")


async def start_worker_socket(state) -> web.AppRunner | None:
    """Serve this worker's own ``GET /metrics`` (its series only, labelled ``worker``)
    on its Unix socket, when it is one of ``--workers`` processes started by the
    supervisor (``state.worker`` set and :data:`WORKER_DIR_ENV` in the environment).
    Returns the runner to clean up at exit, or ``None``.

    Raises:
        OSError: the socket cannot be bound."""
    directory = os.environ.get(WORKER_DIR_ENV)
    if state.worker is None or not directory:
        return None
    path = socket_path(directory, state.worker[0])

    async def own(request: web.Request) -> web.Response:
        return web.Response(body=state.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    app = web.Application()
    app.router.add_get("/metrics", own)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # left by this index's previous process (restarted)
    await web.UnixSite(runner, path).start()
    return runner


async def _peer_metrics(path: str) -> bytes | None:
    """Another worker's own exposition over its socket, or ``None`` (not answering)."""
    try:
        async with asyncio.timeout(PEER_TIMEOUT_S):
            async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path)) as s:
                async with s.get("http://worker/metrics") as r:
                    if r.status != 200:
                        return None
                    return await r.read()
    except (OSError, aiohttp.ClientError, TimeoutError):
        return None


async def whole_server_metrics(state) -> bytes:
    """The body of ``GET /metrics``: this process's exposition; for one of ``--workers``
    processes, every worker's series (each labelled ``worker``) in one exposition, with
    ``llm_qos_worker_up{worker}`` 1 for each worker that answered (see the module
    docstring). Never raises: a worker that does not answer is left out (0)."""
    from ..telemetry.metrics import merge_expositions

    directory = os.environ.get(WORKER_DIR_ENV)
    own = state.metrics.render()
    if state.worker is None or not directory:
        return own
    index, count = state.worker
    others = [i for i in range(count) if i != index]
    got = await asyncio.gather(*(_peer_metrics(socket_path(directory, i)) for i in others))
    up = {index: True, **{i: body is not None for i, body in zip(others, got)}}
    lines = [b"# HELP llm_qos_worker_up 1 for each worker whose series this scrape holds, 0 for one that did not answer in time.", b"# TYPE llm_qos_worker_up gauge"]
    lines += [b'llm_qos_worker_up{worker="%d"} %d.0' % (i, up[i]) for i in range(count)]
    return merge_expositions([own, *(body for body in got if body is not None), b"\n".join(lines) + b"\n"])


def check_workers(config_path: str, port: int, workers: int) -> str | None:
    """Why ``--workers`` cannot start with this config and port, or None."""
    try:
        config = load_config(config_path)
    except ConfigError as e:
        return str(e)
    if config.shared_state is None:
        return (
            f"--workers {workers} needs a shared_state section (Redis) in {config_path}: without it each worker "
            "would enforce priority, fairness and rate limits on its own share of the traffic only. "
            "Add shared_state: {url: redis://HOST:6379/0} (docs/scaling.md), or run one process."
        )
    if port == 0:
        return "--workers needs a fixed --port (with port 0 each worker would listen on a different one)"
    return None


def _die_with_parent() -> None:
    """``preexec_fn``: the kernel SIGKILLs the worker when the supervisor dies
    (``prctl(PR_SET_PDEATHSIG)``, Linux), so no worker outlives a killed supervisor."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


class Supervisor:
    """Runs and watches the workers (see the module docstring).

    Args:
        argv: the worker command line without ``--worker-index`` (it is added per worker).
        workers: how many.
        url: the listening URL, for the ready line.
    """

    def __init__(self, argv: list[str], workers: int, url: str) -> None:
        self.argv = argv
        self.directory = tempfile.mkdtemp(prefix="llm-qos-workers-")  # mode 0700
        self.env = {**os.environ, WORKER_DIR_ENV: self.directory}
        self.workers = workers
        self.url = url
        self.procs: list[asyncio.subprocess.Process | None] = [None] * workers
        self.ready = [False] * workers
        self.restarts: list[float] = []
        self.stopping = False
        self.all_ready = asyncio.Event()

    async def _spawn(self, index: int) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            *self.argv, "--worker-index", str(index), stdout=asyncio.subprocess.PIPE, preexec_fn=_die_with_parent, env=self.env
        )
        self.procs[index] = proc
        self.ready[index] = False
        asyncio.create_task(self._echo(index, proc))
        return proc

    async def _echo(self, index: int, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            text = line.decode(errors="replace")
            sys.stderr.write(text)  # stdout carries only the supervisor's own ready line
            sys.stderr.flush()
            if "ready on" in text and self.procs[index] is proc:
                self.ready[index] = True
                if all(self.ready) and not self.all_ready.is_set():
                    self.all_ready.set()
                    print(f"{READY_MARK}{self.url} ({self.workers} workers)", flush=True)

    def signal_all(self, sig: int) -> None:
        """Send ``sig`` to every running worker."""
        for proc in self.procs:
            if proc is not None and proc.returncode is None:
                try:
                    proc.send_signal(sig)
                except ProcessLookupError:
                    pass

    async def run(self) -> int:
        """Start the workers and supervise them until a stop signal. Returns the exit code."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, lambda: self.signal_all(signal.SIGHUP))
        for i in range(self.workers):
            await self._spawn(i)
        stopping = asyncio.create_task(stop.wait())
        code = 0
        try:
            while True:
                exits = {asyncio.create_task(p.wait()): i for i, p in enumerate(self.procs) if p is not None}
                done, _ = await asyncio.wait({stopping, *exits}, return_when=asyncio.FIRST_COMPLETED)
                for t in exits:
                    t.cancel()
                if stopping in done:
                    return 0
                for t in done:
                    i = exits[t]
                    status = self.procs[i].returncode
                    if not self.all_ready.is_set():
                        print(f"llm-qos proxy: worker {i} exited with {status} before the workers were ready; stopping", file=sys.stderr, flush=True)
                        code = 1
                        return code
                    now = time.monotonic()
                    self.restarts = [r for r in self.restarts if now - r < RESTART_WINDOW_S] + [now]
                    if len(self.restarts) > MAX_RESTARTS:
                        print(f"llm-qos proxy: workers died {len(self.restarts)} times in {RESTART_WINDOW_S:g} s; stopping", file=sys.stderr, flush=True)
                        code = 1
                        return code
                    print(f"llm-qos proxy: worker {i} exited with {status}; restarting it", file=sys.stderr, flush=True)
                    await self._spawn(i)
        finally:
            self.stopping = True
            stopping.cancel()
            self.signal_all(signal.SIGTERM)  # each drains (up to 30 s), then exits
            for p in self.procs:
                if p is not None:
                    try:
                        await asyncio.wait_for(p.wait(), 40.0)
                    except TimeoutError:
                        p.kill()
                        await p.wait()
            shutil.rmtree(self.directory, ignore_errors=True)


def supervise(
    config_path: str, host: str, port: int, upstream: list[str] | None, watch: bool, workers: int, extra_args: list[str] = ()
) -> int:
    """Entry point of ``llm-qos proxy --workers N`` (N > 1). Returns the exit code.

    ``upstream``: the ``--upstream`` URLs, passed to every worker; ``extra_args``: other
    worker flags (the log settings)."""
    problem = check_workers(config_path, port, workers)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    argv = [sys.executable, "-m", "proxy", "proxy", "--config", config_path, "--host", host, "--port", str(port), "--workers", str(workers)]
    for url in upstream or ():
        argv += ["--upstream", url]
    argv += list(extra_args)
    if not watch:
        argv.append("--no-watch")
    shown = f"[{host}]" if ":" in host else host
    return asyncio.run(Supervisor(argv, workers, f"http://{shown}:{port}").run())
