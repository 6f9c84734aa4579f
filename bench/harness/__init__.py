"""What every benchmark shares, so that each script in ``bench/`` is only its scenario.

- :mod:`bench.harness.processes`: free ports, starting a command in its own session
  (pinned, logged), waiting until it is ready, control requests, stopping it with what it
  started, running a coroutine on uvloop.
- :mod:`bench.harness.servers`: the servers a bench starts (fake upstream, scripted and
  rate upstreams, the proxy and its bench config, the engine server, nginx, the Rust
  routers).
- :mod:`bench.harness.readings`: CPU time, memory and open files of processes, the
  machine's busy time and CPU model (/proc), Prometheus text.
- :mod:`bench.harness.stats` and :mod:`bench.harness.tables`: percentiles and medians;
  Markdown and fixed-width tables, the JSON file of the results.

Every name is importable from the package itself (``from bench import harness as h``).
"""

from .processes import (
    REPO_ROOT,
    await_ready_line,
    free_port,
    http_json,
    python_env,
    raise_nofile,
    run_loop,
    run_script,
    set_affinity,
    spawn,
    stop,
    wait_for_line,
    wait_http_200,
    wait_port,
)
from .readings import (
    CLK_TCK,
    CpuSample,
    children,
    cpu_model,
    cpu_s,
    cpu_sample,
    cpu_shares,
    machine_busy_s,
    mem_kib,
    open_fds,
    parse_prometheus,
    rss_mib,
    tree_cpu_s,
)
from .servers import (
    KEYS,
    NGINX_CONF,
    ROUTERS,
    ROUTERS_VENV,
    USERS,
    Nginx,
    RustRouter,
    nginx_binary,
    nginx_version,
    router_command,
    router_version,
    start_engine_server,
    start_fake_upstream,
    start_proxy,
    start_rate_upstream,
    write_proxy_config,
)
from .stats import median, percentile
from .tables import fmt, markdown_table, target_table, write_json

__all__ = [
    "CLK_TCK", "KEYS", "NGINX_CONF", "REPO_ROOT", "ROUTERS", "ROUTERS_VENV", "USERS",
    "CpuSample", "Nginx", "RustRouter",
    "await_ready_line", "children", "cpu_model", "cpu_s", "cpu_sample", "cpu_shares", "fmt", "free_port", "http_json",
    "machine_busy_s", "markdown_table", "median", "mem_kib", "nginx_binary", "nginx_version", "open_fds",
    "parse_prometheus", "percentile", "python_env", "raise_nofile", "router_command", "router_version", "rss_mib",
    "run_loop", "set_affinity", "spawn", "start_engine_server", "start_fake_upstream", "start_proxy",
    "start_rate_upstream", "stop", "target_table", "tree_cpu_s", "wait_for_line", "wait_http_200", "wait_port",
    "write_json", "write_proxy_config",
]
