"""The live dashboard under load, in a real browser: a demo and the screenshot in docs/.

Starts the fake upstream (``bench.fake_upstream``) and the proxy (``python -m proxy
proxy``) on 127.0.0.1 with a demo config of three groups (platinum with weights 3:1 and a
rate-limited user, gold with a ``min_share`` floor, bronze with a short queue), drives an
open-loop load that overruns ``max_inflight`` (``bench.loadgen``, one process per group), opens
``/admin/dashboard`` in Debian's chromium (driven by Playwright), enters the admin key and
saves a screenshot once the page has watched the load for ``--watch-s`` seconds.

    python -m bench.dashboard_demo --screenshot docs/img/dashboard.png

The browser helpers (:func:`launch_chromium`) are shared with ``tests/test_dashboard.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from . import harness as h

CHROMIUM = "/usr/bin/chromium"
# headless, and nothing reaching out to the internet (updates, sync, first-run pages)
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ADMIN_KEY = "demo-admin-key"

DEMO_CONFIG = """\
upstream:
  url: "{upstream}"
  kind: openai
admission:
  max_inflight: 8
  max_queue: 200
  queue_timeout_s: 8
admin:
  api_key: {admin_key}
default_group: bronze
groups:
  - name: platinum
    users:
      - {{id: alice, weight: 3, api_key: sk-alice}}
      - {{id: bob, weight: 1, api_key: sk-bob, rate_limit: {{requests_per_minute: 30}}}}
  - name: gold
    min_share: 0.25
    users:
      - {{id: carol, weight: 2, api_key: sk-carol}}
      - {{id: dave, weight: 1, api_key: sk-dave}}
  - name: bronze
    max_queue: 10
    users:
      - {{id: erin, weight: 1, api_key: sk-erin}}
      - {{id: frank, weight: 1, api_key: sk-frank}}
"""

# one open-loop load process per group: (keys with their draw weights, requests per second).
# Each request takes about 0.5 s upstream (48 tokens 10 ms apart), so max_inflight 8
# serves about 16 requests/s: 20 offered overrun it, and the lowest group queues, waits
# and is refused.
LOAD = [
    (["sk-alice:3", "sk-bob:1"], 7.0),
    (["sk-carol:1", "sk-dave:1"], 7.0),
    (["sk-erin:1", "sk-frank:1"], 6.0),
]


@contextlib.contextmanager
def launch_chromium(playwright) -> Iterator[object]:
    """A headless Debian chromium (``/usr/bin/chromium``) launched by Playwright, closed
    on exit. Raises RuntimeError naming the package when chromium is not installed."""
    if not Path(CHROMIUM).exists():
        raise RuntimeError(f"{CHROMIUM} is missing: install Debian's chromium (bash tests/system_deps.sh)")
    browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    try:
        yield browser
    finally:
        browser.close()


def start_loads(url: str, duration_s: float, workdir: Path, itl_s: float = 0.01, max_tokens: int = 48) -> list[subprocess.Popen]:
    """One open-loop ``bench.loadgen`` process per group of :data:`LOAD`, each bounded by
    ``duration_s`` seconds (and 64 requests in flight), its output in ``workdir``."""
    procs = []
    for i, (keys, rate) in enumerate(LOAD):
        cmd = [sys.executable, "-m", "bench.loadgen", "--url", url, "--rate", str(rate), "--concurrency", "64", "--duration-s", str(duration_s),
               "--max-tokens", str(max_tokens), "--fake", f'{{"itl_s": {itl_s}}}', "--timeout-s", "30"]
        for k in keys:
            cmd += ["--key", k]
        procs.append(h.spawn(cmd, workdir / f"load-{i}.log", pipe_stdout=False))
    return procs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--screenshot", default="docs/img/dashboard.png", help="PNG to write")
    ap.add_argument("--watch-s", type=float, default=60.0, help="seconds the page watches the load before the screenshot")
    ap.add_argument("--width", type=int, default=1400)
    a = ap.parse_args()
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="llmqos-dashboard-") as tmp:
        wd = Path(tmp)
        up_port, px_port = h.free_port(), h.free_port()
        upstream = f"http://127.0.0.1:{up_port}"
        cfg = wd / "demo.yaml"
        cfg.write_text(DEMO_CONFIG.format(upstream=upstream, admin_key=ADMIN_KEY))
        up = proxy = None
        loads: list[subprocess.Popen] = []
        try:
            up = h.start_fake_upstream(up_port, wd)
            proxy = h.start_proxy(cfg, px_port, upstream, wd)
            url = f"http://127.0.0.1:{px_port}"
            with sync_playwright() as p, launch_chromium(p) as browser:
                page = browser.new_page(viewport={"width": a.width, "height": 900})
                page.goto(url + "/admin/dashboard")
                page.fill("#key", ADMIN_KEY)
                page.click("#key-form button[type=submit]")
                page.wait_for_selector("#board:not([hidden])", timeout=10_000)
                loads = start_loads(url, a.watch_s + 15, wd)
                time.sleep(a.watch_s)
                out = Path(a.screenshot)
                out.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(out), full_page=True)
                print(f"wrote {out}")
        finally:
            for proc in loads:
                h.stop(proc)
            h.stop(proxy)
            h.stop(up)


if __name__ == "__main__":
    main()
