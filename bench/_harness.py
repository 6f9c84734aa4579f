"""Process plumbing shared by the benchmarks: start the fake upstream, the proxy, nginx
and the Rust routers (vllm-router, sglang-router; from their own venv, ``make
bench-routers``) as their own processes on 127.0.0.1, and read their CPU time and memory
from /proc.

Every process started here is stopped by :func:`stop` (SIGTERM, then SIGKILL); nothing
listens on anything but 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import random
import resource
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")

# API keys of the bench config: (key, user, group, weight)
USERS = [
    ("sk-bench-alice", "alice", "platinum", 3.0),
    ("sk-bench-bob", "bob", "platinum", 1.0),
    ("sk-bench-carol", "carol", "gold", 1.0),
    ("sk-bench-dave", "dave", "bronze", 1.0),
]
KEYS = [(k, w) for k, _, _, w in USERS]


_HANDED_OUT: set[int] = set()


def _port_range() -> tuple[int, int]:
    """Ports below the kernel's ephemeral range (Linux: ``ip_local_port_range``, 32768
    and up by default), where no outgoing connection's source port can land."""
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return (max(1024, low - 12000), low - 1) if low > 4096 else (40000, 60000)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a server a test or a bench
    starts. Drawn at random below the ephemeral range (a port the kernel hands out for
    ``bind(0)`` is also a source port for outgoing connections, which may take it before
    the server binds it), and never the same twice in one process."""
    lo, hi = _port_range()
    for _ in range(500):
        port = random.randint(lo, hi)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # the range is crowded: let the kernel pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raise_nofile() -> int:
    """Raise this process's open-files soft limit to its hard limit (children inherit
    it). Returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _env(src: Path = REPO_ROOT) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH")]))
    return env


def wait_for_line(proc: subprocess.Popen, marker: str, timeout_s: float, what: str, log_tail=lambda: "") -> str:
    """Read ``proc``'s stdout until a line starting with ``marker``; return it (stripped).
    Used by the benchmarks and the tests alike.

    Reads the pipe's file descriptor directly (``os.read`` after ``select``), never through
    the file object's buffer: a buffered ``readline`` can pull several lines in at once,
    and ``select`` then reports nothing more to read while the wanted line sits in the
    buffer. Output after the marker line that arrived in the same read is dropped.

    Raises:
        RuntimeError: the process exited first, or ``timeout_s`` seconds passed (the
            process is then left running: the caller stops it); ``log_tail()`` is appended.
    """
    deadline = time.monotonic() + timeout_s
    fd = proc.stdout.fileno()
    pending = b""
    want = marker.encode()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"{what} not ready in {timeout_s} s; log:\n{log_tail()}")
            if not sel.select(remaining):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:  # EOF: the process exited
                proc.wait()
                raise RuntimeError(f"{what} exited with {proc.returncode}; log:\n{log_tail()}")
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.startswith(want):
                    return line.decode("utf-8", "replace").strip()


def _wait_line(proc: subprocess.Popen, mark: str, timeout_s: float, what: str, log: Path | None) -> None:
    try:
        wait_for_line(proc, mark, timeout_s, what, (lambda: log.read_text()[-2000:]) if log else (lambda: ""))
    except RuntimeError:
        stop(proc)
        raise


def _popen(cmd: list[str], log: Path, cpus: set[int] | None, src: Path = REPO_ROOT) -> subprocess.Popen:
    def pin() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)

    with open(log, "wb") as f:
        return subprocess.Popen(
            cmd, cwd=src, env=_env(src), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=f, text=True,
            preexec_fn=pin, start_new_session=True,
        )


def start_fake_upstream(
    port: int, workdir: Path, ttft_s: float = 0.0, itl_s: float = 0.0, cpus: set[int] | None = None, max_model_len: int | None = None,
    name: str | None = None,
) -> subprocess.Popen:
    """``python -m bench.fake_upstream`` on 127.0.0.1:``port``; returns once it listens.
    ``max_model_len``: refuse longer requests with a 400, as vLLM does. ``name``: run
    :mod:`bench.scripted_engine` under that name instead (an engine of a pool: it answers
    the proxy's health checks and tags its answers ``X-Engine: name``)."""
    log = workdir / f"fake-upstream-{port}.log"
    module = "bench.scripted_engine" if name else "bench.fake_upstream"
    cmd = [sys.executable, "-m", module, "--port", str(port), "--ttft-s", str(ttft_s), "--itl-s", str(itl_s)]
    if name:
        cmd += ["--name", name]
    if max_model_len is not None:
        if name:
            raise ValueError("the scripted engine has no max_model_len")
        cmd += ["--max-model-len", str(max_model_len)]
    proc = _popen(cmd, log, cpus)
    what = f"scripted engine {name}" if name else "fake upstream"
    _wait_line(proc, f"{what} ready", 30, what, log)
    return proc


def write_proxy_config(path: Path, upstream_url: str, max_inflight: int = 4096, max_queue: int = 10000) -> Path:
    """A config with four users in three groups (API keys :data:`USERS`)."""
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
    goes to a file, as under a supervisor); returns once it listens. ``upstream_url``:
    given as ``--upstream`` (``None`` for a config with ``pools``). ``src``: run the
    proxy package of another checkout (before/after comparisons)."""
    log = workdir / f"proxy-{port}.log"
    cmd = [sys.executable, "-m", "proxy", "proxy", "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--no-watch"]
    if upstream_url is not None:
        cmd += ["--upstream", upstream_url]
    proc = _popen(cmd, log, cpus, Path(src) if src else REPO_ROOT)
    proc.log_path = log  # type: ignore[attr-defined]
    _wait_line(proc, "llm-qos proxy ready on", 60, "proxy", log)
    return proc


def nginx_binary() -> str | None:
    for p in (shutil.which("nginx"), "/usr/sbin/nginx"):
        if p and os.access(p, os.X_OK):
            return p
    return None


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
    keep-alive to the upstream, one access-log line per request)."""

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

        def pin() -> None:
            if cpus:
                os.sched_setaffinity(0, cpus)

        with open(log, "wb") as f:
            self.master = subprocess.Popen(
                [binary, "-c", str(d / "nginx.conf"), "-p", str(d)], stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                preexec_fn=pin, start_new_session=True,
            )
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if self.master.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"nginx did not start: {log.read_text()[-2000:]}")
                time.sleep(0.05)
        self.pids = [self.master.pid] + children(self.master.pid)

    def stop(self) -> None:
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


def wait_http_200(url: str, timeout_s: float, alive=lambda: True, body: dict | None = None) -> None:
    """Poll ``url`` (POST of ``body`` as JSON when given, else GET) until it answers 200;
    bounded by ``timeout_s``. Raises ``RuntimeError`` when the time runs out or ``alive()``
    turns false (the server exited)."""
    deadline = time.monotonic() + timeout_s
    data = None if body is None else json.dumps(body).encode()
    last = "no answer"
    while True:
        if not alive():
            raise RuntimeError(f"{url}: the server exited ({last})")
        try:
            req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=2) as r:
                r.read()
                if r.status == 200:
                    return
                last = f"status {r.status}"
        except urllib.error.HTTPError as e:
            last = f"status {e.code}"
        except (OSError, urllib.error.URLError) as e:
            last = str(e)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer 200 in {timeout_s} s ({last})")
        time.sleep(0.2)


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

        def pin() -> None:
            if cpus:
                os.sched_setaffinity(0, cpus)

        env = dict(os.environ, NO_COLOR="1")
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(
                self.cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                preexec_fn=pin, start_new_session=True,
            )
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
        """SIGTERM (SIGKILL after 10 s) the router, then SIGKILL what is left of its
        process group (it was started as the leader of its own session)."""
        stop(self.proc)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def cpu_s(*pids: int) -> float:
    """utime + stime of ``pids`` (their threads included), in seconds, from /proc/PID/stat."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / CLK_TCK


def mem_kib(pid: int) -> dict:
    """VmRSS and VmHWM (peak RSS) of ``pid`` in KiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1])
    return out


def set_affinity(pid: int, cpus: set[int]) -> None:
    """Pin every thread of process ``pid`` to ``cpus``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def stop(proc: subprocess.Popen | None, grace_s: float = 10.0) -> None:
    """SIGTERM ``proc`` (SIGKILL after ``grace_s``) and reap it."""
    if proc is None:
        return
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        except ProcessLookupError:
            pass
    if proc.stdout is not None:
        proc.stdout.close()
