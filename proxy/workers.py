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
replicas of one deployment (``docs/scaling.md``). Until admission consults the capacity
leases (phase 2 of the shared state), each worker enforces its own part of every capacity
and limit, :func:`split_for_worker`: the totals hold across workers, priority and
fairness hold within each worker.
"""

from __future__ import annotations

import asyncio
import ctypes
import signal
import sys
import time

from .config import Config, ConfigError, load_config

MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
READY_MARK = "llm-qos proxy ready on "


def _part(total: int, workers: int, index: int) -> int:
    """Worker ``index``'s part of ``total``: total ÷ workers, the remainder to the first."""
    base, rest = divmod(total, workers)
    return base + (1 if index < rest else 0)


def split_for_worker(config: Config, workers: int, index: int) -> Config:
    """``config`` as worker ``index`` of ``workers`` enforces it: ``admission.max_inflight``,
    ``max_inflight_tokens``, ``max_queue``, every group's ``max_queue``, every rate limit and
    every pool engine's own ``max_inflight`` / ``max_inflight_tokens`` divided among the
    workers (integer parts add up to the total exactly).

    Raises:
        ValueError: ``admission.max_inflight`` (or ``max_inflight_tokens``, or an engine's)
            is smaller than ``workers``: some worker would get no capacity at all.
    """
    if workers <= 1:
        return config
    a = config.admission
    if a.max_inflight < workers or (a.max_inflight_tokens is not None and a.max_inflight_tokens < workers):
        raise ValueError(f"admission.max_inflight ({a.max_inflight}) must be at least the number of workers ({workers})")

    def limit(rl):
        return rl.model_copy(
            update={
                "requests_per_minute": rl.requests_per_minute / workers if rl.requests_per_minute else None,
                "tokens_per_minute": rl.tokens_per_minute / workers if rl.tokens_per_minute else None,
            }
        )

    admission = a.model_copy(
        update={
            "max_inflight": _part(a.max_inflight, workers, index),
            "max_inflight_tokens": None if a.max_inflight_tokens is None else _part(a.max_inflight_tokens, workers, index),
            "max_queue": _part(a.max_queue, workers, index),
        }
    )
    groups = [
        g.model_copy(
            update={
                "max_queue": None if g.max_queue is None else _part(g.max_queue, workers, index),
                "rate_limit": limit(g.rate_limit),
                "users": [u.model_copy(update={"rate_limit": limit(u.rate_limit)}) for u in g.users],
            }
        )
        for g in config.groups
    ]
    pools = None
    if config.pools:
        pools = []
        for p in config.pools:
            engines = []
            for e in p.engines:
                if (e.max_inflight is not None and e.max_inflight < workers) or (e.max_inflight_tokens is not None and e.max_inflight_tokens < workers):
                    raise ValueError(f"pool {p.name!r} engine {e.engine_name!r}: max_inflight ({e.max_inflight}) must be at least the number of workers ({workers})")
                engines.append(
                    e.model_copy(
                        update={
                            "max_inflight": None if e.max_inflight is None else _part(e.max_inflight, workers, index),
                            "max_inflight_tokens": None if e.max_inflight_tokens is None else _part(e.max_inflight_tokens, workers, index),
                        }
                    )
                )
            pools.append(p.model_copy(update={"engines": engines}))
    return config.model_copy(update={"admission": admission, "groups": groups, "pools": pools})


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
    try:
        split_for_worker(config, workers, 0)
    except ValueError as e:
        return str(e)
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
        self.workers = workers
        self.url = url
        self.procs: list[asyncio.subprocess.Process | None] = [None] * workers
        self.ready = [False] * workers
        self.restarts: list[float] = []
        self.stopping = False
        self.all_ready = asyncio.Event()

    async def _spawn(self, index: int) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            *self.argv, "--worker-index", str(index), stdout=asyncio.subprocess.PIPE, preexec_fn=_die_with_parent
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
