"""The servers the benchmarks start, each its own process on 127.0.0.1 (:func:`spawn`):
the fake upstream and the scripted engine, the rate upstream, the llm-qos proxy with the
bench config, the engine server (``python -m engine_server``), nginx as a plain
streaming reverse proxy, and the Rust routers (vllm-router, sglang-router; from their own
venv, ``make bench-routers``). Each start returns once the server is ready and stops it
when it is not (:func:`stop`).
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

from .processes import REPO_ROOT, await_ready_line, free_port, spawn, stop, wait_http_200, wait_port
from .readings import children

# API keys of the bench config: (key, user, group, weight)
USERS = [
    ("sk-bench-alice", "alice", "platinum", 3.0),
    ("sk-bench-bob", "bob", "platinum", 1.0),
    ("sk-bench-carol", "carol", "gold", 1.0),
    ("sk-bench-dave", "dave", "bronze", 1.0),
]
KEYS = [(k, w) for k, _, _, w in USERS]


def start_fake_upstream(
    port: int, workdir: Path, ttft_s: float = 0.0, itl_s: float = 0.0, cpus: set[int] | None = None, max_model_len: int | None = None,
    name: str | None = None, python: str = sys.executable,
) -> subprocess.Popen:
    """``python -m bench.fake_upstream`` on 127.0.0.1:``port``; returns once it listens.
    ``ttft_s``, ``itl_s``: its default pause before the first token and between tokens
    (seconds). ``max_model_len``: refuse longer requests with a 400, as vLLM does.
    ``name``: run :mod:`bench.scripted_engine` under that name instead (an engine of a
    pool: it answers the proxy's health checks and tags its answers ``X-Engine: name``).
    ``python``: the interpreter to run it with. Its log: ``workdir/fake-upstream-PORT.log``.
    Raises ``RuntimeError`` when it is not ready within 30 s."""
    log = workdir / f"fake-upstream-{port}.log"
    module = "bench.scripted_engine" if name else "bench.fake_upstream"
    cmd = [python, "-m", module, "--port", str(port), "--ttft-s", str(ttft_s), "--itl-s", str(itl_s)]
    if name:
        cmd += ["--name", name]
    if max_model_len is not None:
        if name:
            raise ValueError("the scripted engine has no max_model_len")
        cmd += ["--max-model-len", str(max_model_len)]
    proc = spawn(cmd, log, cpus)
    what = f"scripted engine {name}" if name else "fake upstream"
    await_ready_line(proc, f"{what} ready", 30, what, log)
    return proc


def start_rate_upstream(workdir: Path, args: list[str], label: str = "rate-upstream") -> tuple[subprocess.Popen, str]:
    """``python -m bench.rate_upstream ARGS`` on a port of its choosing (``--port 0``);
    returns the process and its base URL once it listens. ``args``: its options (rate,
    prefill rate, lifetime, ...). Its log: ``workdir/LABEL.log``. Raises ``RuntimeError``
    when it is not ready within 30 s."""
    log = workdir / f"{label}.log"
    proc = spawn([sys.executable, "-m", "bench.rate_upstream", "--port", "0", *args], log)
    line = await_ready_line(proc, "rate upstream ready on ", 30, "rate upstream", log)
    return proc, line.rsplit(" ", 1)[1]


def write_proxy_config(path: Path, upstream_url: str, max_inflight: int = 4096, max_queue: int = 10000) -> Path:
    """Write the bench config to ``path``: four users in three groups (API keys
    :data:`USERS`), one upstream, admission ``max_inflight`` and ``max_queue``
    (requests). Returns ``path``."""
    groups: dict[str, list] = {}
    for key, user, group, weight in USERS:
        groups.setdefault(group, []).append(f"      - {{id: {user}, weight: {weight}, api_key: {key}}}")
    lines = [
        "upstream:",
        f'  url: "{upstream_url}"',
        "  kind: openai",
        "admission:",
        f"  max_inflight: {max_inflight}",
        f"  max_queue: {max_queue}",
        "  queue_timeout_s: 30",
        "default_group: bronze",
        "groups:",
    ]
    for name in ("platinum", "gold", "bronze"):
        lines.append(f"  - name: {name}")
        lines.append("    users:")
        lines += groups.get(name, [])
    path.write_text("\n".join(lines) + "\n")
    return path


def start_proxy(
    config: Path, port: int, upstream_url: str | None, workdir: Path, cpus: set[int] | None = None, src: Path | None = None
) -> subprocess.Popen:
    """``python -m proxy proxy`` on 127.0.0.1:``port`` (its log, access lines included,
    goes to ``workdir/proxy-PORT.log``, as under a supervisor; the path is the returned
    process's ``log_path``); returns once it listens. ``upstream_url``: given as
    ``--upstream`` (``None`` for a config with ``pools``). ``src``: run the proxy package
    of another checkout (before/after comparisons). Raises ``RuntimeError`` when it is
    not ready within 60 s."""
    log = workdir / f"proxy-{port}.log"
    cmd = [sys.executable, "-m", "proxy", "proxy", "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--no-watch"]
    if upstream_url is not None:
        cmd += ["--upstream", upstream_url]
    proc = spawn(cmd, log, cpus, Path(src) if src else REPO_ROOT)
    proc.log_path = log  # type: ignore[attr-defined]
    await_ready_line(proc, "llm-qos proxy ready on", 60, "proxy", log)
    return proc


def start_engine_server(backend: str, port: int, workdir: Path, timeout_s: float) -> tuple[subprocess.Popen, str | None, list[str]]:
    """``python -m engine_server --backend BACKEND`` on 127.0.0.1:``port``, its output in
    ``workdir/engine.log``; returns once it prints ``engine ready at``: the process, the
    model it serves (from that line; ``None`` when the line names none) and the command.
    Raises ``RuntimeError`` (the engine stopped, the log's tail in the message) when it
    is not ready within ``timeout_s`` seconds."""
    log = workdir / "engine.log"
    cmd = [sys.executable, "-m", "engine_server", "--backend", backend, "--host", "127.0.0.1", "--port", str(port)]
    proc = spawn(cmd, log)
    line = await_ready_line(proc, "engine ready at ", timeout_s, "engine", log, tail_chars=3000)
    model = line.rsplit("model=", 1)[1].rstrip(")") if "model=" in line else None
    return proc, model, cmd


def nginx_binary() -> str | None:
    """The nginx executable (``PATH``, then ``/usr/sbin/nginx``), or ``None``."""
    for p in (shutil.which("nginx"), "/usr/sbin/nginx"):
        if p and os.access(p, os.X_OK):
            return p
    return None


def nginx_version(binary: str) -> str | None:
    """``1.22.1`` from ``nginx -v`` (it writes to stderr), or ``None``."""
    try:
        out = subprocess.run([binary, "-v"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = out.stderr + out.stdout
    return text.rsplit("/", 1)[-1].strip() if "/" in text else None


NGINX_CONF = """\
daemon off;
master_process on;
worker_processes 1;
{user}
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
worker_rlimit_nofile {nofile};
events {{ worker_connections {conns}; multi_accept on; }}
http {{
  access_log {dir}/access.log;
  client_body_temp_path {dir}/body; proxy_temp_path {dir}/proxy;
  fastcgi_temp_path {dir}/fcgi; uwsgi_temp_path {dir}/uwsgi; scgi_temp_path {dir}/scgi;
  upstream llm {{ server 127.0.0.1:{upstream_port}; keepalive 1024; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    keepalive_requests 1000000;
    location / {{
      proxy_pass http://llm;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
      proxy_read_timeout 300s;
    }}
  }}
}}
"""


class Nginx:
    """nginx as a plain streaming reverse proxy (``proxy_buffering off``, one worker,
    keep-alive to the upstream, one access-log line per request) on 127.0.0.1:``port``
    in front of 127.0.0.1:``upstream_port``, its files under ``workdir/nginx``. Returns
    once it listens (at most 10 s, else ``RuntimeError`` with its log's tail); ``pids``:
    the master and its worker (for :func:`cpu_s`)."""

    def __init__(self, binary: str, port: int, upstream_port: int, workdir: Path, cpus: set[int] | None = None) -> None:
        d = workdir / "nginx"
        d.mkdir(parents=True, exist_ok=True)
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        conf = NGINX_CONF.format(
            dir=d, port=port, upstream_port=upstream_port, nofile=nofile, conns=max(1024, nofile - 64),
            user="user root;" if os.geteuid() == 0 else "",
        )
        (d / "nginx.conf").write_text(conf)
        self.port = port
        log = d / "stderr.log"
        self.master = spawn([binary, "-c", str(d / "nginx.conf"), "-p", str(d)], log, cpus, env=dict(os.environ), cwd=d, pipe_stdout=False)
        try:
            wait_port(port, 10, alive=lambda: self.master.poll() is None)
        except RuntimeError:
            self.stop()
            raise RuntimeError(f"nginx did not start: {log.read_text()[-2000:]}") from None
        self.pids = [self.master.pid] + children(self.master.pid)

    def stop(self) -> None:
        """Stop the master and its worker (:func:`stop`)."""
        stop(self.master)


# The Rust routers, from PyPI, in their own venv (``make bench-routers``): never in the
# proxy's environment. name -> (package, console script, leading arguments)
ROUTERS_VENV = REPO_ROOT / ".venv-routers"
ROUTERS = {
    "vllm-router": ("vllm_router", "vllm-router", []),
    "sglang-router": ("sglang_router", "sglang-router", ["launch"]),
}


def router_version(name: str, venv: Path = ROUTERS_VENV) -> str | None:
    """The installed version of router ``name`` (a key of :data:`ROUTERS`) in ``venv``,
    read from its ``*.dist-info`` folder; ``None`` when it is not installed there."""
    package, script, _ = ROUTERS[name]
    if not os.access(venv / "bin" / script, os.X_OK):
        return None
    for site in sorted(venv.glob("lib/python*/site-packages")):
        for d in site.glob(f"{package}-*.dist-info"):
            return d.name[len(package) + 1 : -len(".dist-info")]
    return None


def router_command(name: str, port: int, upstream_url: str, metrics_port: int, policy: str = "round_robin",
                   venv: Path = ROUTERS_VENV) -> list[str]:
    """The command line that starts router ``name`` on 127.0.0.1:``port`` in front of one
    worker, ``upstream_url``.

    Both routers take the same flags here: ``--policy`` (``round_robin`` by default: with
    one worker every policy picks it, and round robin does no per-request work, where
    the shipped ``cache_aware`` inserts each prompt into a prefix tree and vllm-router's
    also probes the worker's ``/tokenize``); their Prometheus exporter stays on (as
    shipped), bound to 127.0.0.1:``metrics_port`` (a fixed default port would collide
    with another run); the start-up health check of the worker polls every second (the
    default waits 30 s between tries). Everything else is as shipped: request log at
    INFO, retries, circuit breaker, health checks every 60 s, vllm-router's token-bucket
    limiter (32 768 requests at once / per second).

    Seen with sglang-router 0.3.2: on a kept-alive client connection it relays a stream
    in about 40 ms batches (its client sockets lack ``TCP_NODELAY``: Nagle waits for the
    client's delayed ACK; a client that sets ``TCP_QUICKACK`` gets every event at once),
    so its TTFT is ~40 ms and its kernel sends fewer segments per stream."""
    _, script, lead = ROUTERS[name]
    return [
        str(venv / "bin" / script), *lead,
        "--host", "127.0.0.1", "--port", str(port), "--worker-urls", upstream_url,
        "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", "60",
    ]


class RustRouter:
    """One Rust router (a key of :data:`ROUTERS`) in front of one worker, its own process
    on 127.0.0.1:``port``, its output (request log included) to a file in ``workdir``.
    Returns once a chat completion through it answers 200 (at most ``timeout_s``);
    ``pids``: the router and its children at that moment (for :func:`cpu_s`).

    Raises:
        RuntimeError: it exited or did not answer in time (it is stopped; the log's tail
            is in the message).
    """

    def __init__(self, name: str, port: int, upstream_url: str, workdir: Path, policy: str = "round_robin",
                 venv: Path = ROUTERS_VENV, cpus: set[int] | None = None, timeout_s: float = 60.0) -> None:
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = router_command(name, port, upstream_url, free_port(), policy, venv)
        self.log = workdir / f"{name}-{port}.log"
        self.proc = spawn(self.cmd, self.log, cpus, env=dict(os.environ, NO_COLOR="1"), cwd=workdir, pipe_stdout=False)
        self.pids = [self.proc.pid]
        try:
            wait_http_200(
                self.url + "/v1/chat/completions", timeout_s, alive=lambda: self.proc.poll() is None,
                body={"model": "fake-model", "messages": [{"role": "user", "content": "ready?"}], "max_tokens": 1},
            )
        except RuntimeError as e:
            self.stop()
            raise RuntimeError(f"{name}: {e}; log:\n{self.log.read_text(errors='replace')[-2000:]}") from None
        self.pids = [self.proc.pid] + children(self.proc.pid)

    def stop(self) -> None:
        """Stop the router and whatever is left of its process group (:func:`stop`)."""
        stop(self.proc)
