"""The live dashboard in a real browser: Debian's chromium driven by Playwright, against
the real proxy process and the fake upstream (both their own processes) under load.

The page loads, refuses without the admin key, shows the same queues and requests in
flight as ``/admin/status``, moves under load, and writes a hostile user id as text."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest
import yaml
from playwright.sync_api import Page, expect, sync_playwright

from bench.dashboard_demo import launch_chromium
from tests.proc_util import die_with_parent, free_port, wait_for_line
from tests.proxy_process import REPO_ROOT, start_proxy, stop_proxy

ADMIN_KEY = "adm-dashboard-test"
HOSTILE_ID = '<img src=x onerror="window.__pwned=1">'
UI_TIMEOUT_MS = 20_000  # the page refreshes every second; generous for a loaded machine


def _config(upstream: str) -> dict:
    return {
        "upstream": {"url": upstream, "kind": "openai"},
        "admission": {"max_inflight": 4, "max_queue": 100, "queue_timeout_s": 120},
        "identity": {"header": "X-User-Id"},
        "admin": {"api_key": ADMIN_KEY},
        "default_group": "bronze",
        "groups": [
            {
                "name": "platinum",
                "users": [
                    {"id": "alice", "weight": 3, "api_key": "sk-alice"},
                    {"id": "bob", "weight": 1, "api_key": "sk-bob", "rate_limit": {"requests_per_minute": 2}},
                ],
                "ttft_target_s": 5,
            },
            {"name": "bronze", "min_share": 0.2, "users": [{"id": "carl", "weight": 1, "api_key": "sk-carl"}]},
        ],
    }


@dataclass
class Proxy:
    url: str
    port: int


@pytest.fixture
def proxy(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    up_port = free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "bench.fake_upstream", "--port", str(up_port)],
        cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent,
    )
    try:
        wait_for_line(up, "fake upstream ready", 30, "fake upstream")
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(_config(f"http://127.0.0.1:{up_port}")))
        port = free_port()
        proc = start_proxy(path, port, extra_args=["--no-watch"])
        try:
            yield Proxy(f"http://127.0.0.1:{port}", port)
        finally:
            assert stop_proxy(proc) == 0
    finally:
        up.terminate()
        up.wait(10)
        up.stdout.close()


def get_json(url: str, key: str | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def status(p: Proxy) -> dict:
    code, body = get_json(p.url + "/admin/status", ADMIN_KEY)
    assert code == 200
    return body


#: engine figures that move while requests are held (what the capacity controller measures)
MEASURED = ("tpot_s", "baseline_tpot_s", "ttft_s", "baseline_ttft_s", "capacity_reason", "capacity_decreases")


def _held(st: dict) -> dict:
    """``st`` less the engines' measured figures (they move while requests are held)."""
    return {**st, "engines": [{k: v for k, v in e.items() if k not in MEASURED} for e in st["engines"]]}


def wait_status(p: Proxy, pred, what: str, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while not pred(s := status(p)):
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {s}"
        time.sleep(0.05)
    return s


def hold(p: Proxy, n: int, header: str) -> list[socket.socket]:
    """``n`` chat requests the fake upstream answers only after 120 s, sent on raw
    sockets and never read: they stay queued or in flight until the socket closes."""
    body = json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "fake": {"ttft_s": 120}}).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{header}\r\n\r\n"
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", p.port), timeout=10)
        s.sendall(head.encode() + body)
        socks.append(s)
    return socks


def connect(page: Page, p: Proxy, key: str = ADMIN_KEY) -> None:
    page.goto(p.url + "/admin/dashboard")
    expect(page.locator("#key-panel")).to_be_visible(timeout=UI_TIMEOUT_MS)
    page.fill("#key", key)
    page.click("#key-form button[type=submit]")


def field(page: Page, row: str, name: str):
    return page.locator(f'{row} [data-field="{name}"]')


def test_the_dashboard_refuses_without_the_admin_key(proxy):
    assert get_json(proxy.url + "/admin/dashboard.json")[0] == 401
    code, body = get_json(proxy.url + "/admin/dashboard.json", "wrong-key")
    assert code == 401 and body["error"]["code"] == "invalid_admin_key"
    # the page itself is static text without data, locked to its own origin
    with urllib.request.urlopen(proxy.url + "/admin/dashboard", timeout=10) as r:
        html = r.read().decode()
        csp = r.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "platinum" not in html and ADMIN_KEY not in html
    with sync_playwright() as pw, launch_chromium(pw) as browser:
        page = browser.new_page()
        requests = []
        page.on("request", lambda r: requests.append(r.url))
        connect(page, proxy, "wrong-key")
        expect(page.locator("#key-message")).to_contain_text("refused", timeout=UI_TIMEOUT_MS)
        expect(page.locator("#status")).to_have_attribute("data-state", "refused")
        expect(page.locator("#board")).to_be_hidden()
        assert page.locator("tr[data-group]").count() == 0
        assert page.evaluate("sessionStorage.getItem('llm-qos.admin-key')") is None  # a refused key is not kept
        assert all(u.startswith(proxy.url + "/admin/") for u in requests), requests  # nothing fetched from elsewhere


def test_the_dashboard_shows_what_admin_status_shows(proxy):
    """Requests held in flight and in the queue: every queue and in-flight figure on the
    page equals /admin/status; a hostile user id is shown as text, never run."""
    held = hold(proxy, 3, "Authorization: Bearer sk-alice")
    try:
        wait_status(proxy, lambda s: s["inflight"] == 3, "alice's 3 requests in flight")
        held += hold(proxy, 5, "Authorization: Bearer sk-carl")
        held += hold(proxy, 1, f"X-User-Id: {HOSTILE_ID}")
        st = wait_status(proxy, lambda s: s["inflight"] == 4 and s["queued"] == 5, "4 in flight, 5 queued")
        with sync_playwright() as pw, launch_chromium(pw) as browser:
            page = browser.new_page()
            connect(page, proxy)
            expect(page.locator("#status")).to_have_attribute("data-state", "live", timeout=UI_TIMEOUT_MS)
            assert _held(status(proxy)) == _held(st)  # nothing moved: the requests are held
            expect(field(page, "#summary", "inflight")).to_have_text(str(st["inflight"]), timeout=UI_TIMEOUT_MS)
            expect(field(page, "#summary", "capacity")).to_have_text(str(st["capacity"]))
            expect(field(page, "#summary", "queued")).to_have_text(str(st["queued"]))
            for g in st["groups"]:
                row = f'#groups tr[data-group="{g["name"]}"]'
                expect(field(page, row, "queued")).to_have_text(str(g["queued"]))
                expect(field(page, row, "inflight")).to_have_text(str(g["inflight"]))
            assert [g["name"] for g in st["groups"]] == page.locator("#groups tr[data-group]").evaluate_all("rows => rows.map(r => r.dataset.group)")
            expect(field(page, '#engines tr[data-engine="upstream"]', "inflight")).to_contain_text(f'{st["inflight"]} / {st["capacity"]}')
            (eng,) = st["engines"]
            expect(field(page, '#engines tr[data-engine="upstream"]', "capacity_found")).to_contain_text(str(eng["capacity_found"]))
            expect(field(page, '#groups tr[data-group="bronze"]', "oldest_wait_s")).not_to_have_text("–")
            for u in st["users"]:
                uid = u["user"]
                if u["queued"]:
                    row = page.locator("#users tr[data-user]").filter(has=page.locator('[data-field="id"]', has_text=uid))
                    expect(row.locator('[data-field="queued"]')).to_have_text(str(u["queued"]))
            hostile = page.locator("#users tr[data-user]").filter(has=page.locator('[data-field="id"]', has_text="onerror"))
            expect(hostile.locator('[data-field="id"]')).to_have_text(HOSTILE_ID)
            assert page.locator("#users img").count() == 0 and page.evaluate("window.__pwned") is None
            # the clients leave: the page follows the scheduler back to idle
            for s in held:
                s.close()
            held = []
            wait_status(proxy, lambda s: s["inflight"] == 0 and s["queued"] == 0, "idle")
            expect(field(page, "#summary", "queued")).to_have_text("0", timeout=UI_TIMEOUT_MS)
            expect(field(page, "#summary", "inflight")).to_have_text("0", timeout=UI_TIMEOUT_MS)
    finally:
        for s in held:
            s.close()


def _number(text: str) -> float | None:
    text = text.replace(",", "").strip()
    try:
        return float(text)
    except ValueError:
        return None


def test_the_dashboard_moves_under_load(proxy):
    """A real load (bench.loadgen, its own process): tokens per second rise and change
    from second to second, users' shares appear, and bob's rate-limit refusals show
    under their reason, never more than the proxy's own counter holds."""
    with sync_playwright() as pw, launch_chromium(pw) as browser:
        page = browser.new_page()
        connect(page, proxy)
        expect(page.locator("#status")).to_have_attribute("data-state", "live", timeout=UI_TIMEOUT_MS)
        tokens = field(page, "#summary", "tokens_per_s")
        assert _number(tokens.inner_text()) in (None, 0.0)  # nothing served yet
        load = subprocess.Popen(
            [sys.executable, "-m", "bench.loadgen", "--url", proxy.url, "--concurrency", "8", "--duration-s", "10", "--requests", "20000",
             "--max-tokens", "16", "--fake", '{"itl_s": 0.005}', "--key", "sk-alice:3", "--key", "sk-bob:1", "--key", "sk-carl:2"],
            cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, preexec_fn=die_with_parent,
        )
        try:
            seen: set[float] = set()
            deadline = time.monotonic() + 30
            while len({v for v in seen if v > 0}) < 3:  # three different positive readings: it moves
                assert time.monotonic() < deadline, f"tokens/s did not move: {seen}"
                if (v := _number(tokens.inner_text())) is not None:
                    seen.add(v)
                page.wait_for_timeout(300)
            for uid in ("alice", "carl"):
                row = page.locator("#users tr[data-user]").filter(has=page.locator('[data-field="id"]', has_text=uid))
                expect(row.locator('[data-field="service_share"]')).to_contain_text("%", timeout=UI_TIMEOUT_MS)
            expect(field(page, '#groups tr[data-group="platinum"]', "service_share")).to_contain_text("%")
            refused = page.locator('#refusals tr[data-reason="rate_limited"]')
            expect(refused.locator('[data-field="groups"]')).to_contain_text("platinum", timeout=UI_TIMEOUT_MS)
            shown = _number(refused.locator('[data-field="count"]').inner_text())
        finally:
            load.wait(60)
        with urllib.request.urlopen(proxy.url + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        counted = next(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                       if line.startswith('llm_qos_rejections_total{group="platinum",reason="rate_limited"}'))
        assert shown is not None and 0 < shown <= counted


def test_a_new_tab_shows_the_proxys_history_with_axes_at_once(proxy):
    """Traffic passes while no page is open; a tab opened afterwards draws its charts at
    its first answer from the points the proxy sampled meanwhile (several, not one), on
    labelled axes; each engine shows its routed and failed requests and its latency
    columns; the header shows the last reload's result."""
    body = json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}).encode()
    for _ in range(5):
        req = urllib.request.Request(proxy.url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json", "Authorization": "Bearer sk-carl"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200
    time.sleep(4.0)  # the proxy's own sampler takes a point a second, page or not
    with sync_playwright() as pw, launch_chromium(pw) as browser:
        page = browser.new_page()
        connect(page, proxy)
        expect(page.locator("#status")).to_have_attribute("data-state", "live", timeout=UI_TIMEOUT_MS)
        first = page.locator("#chart-requests polyline.series").first.get_attribute("points")
        assert len(first.split()) >= 4, first  # the history came with the first answer
        for chart in ("chart-requests", "chart-tokens", "chart-ttft", "chart-tpot"):
            x = page.locator(f"#{chart} text.axis.x").all_text_contents()
            assert x[0] == "now" and "−1 min" in x and "−5 min" in x, x
            y = page.locator(f"#{chart} text.axis.y").all_text_contents()
            assert len(y) == 5 and y[0] in ("0", "0 ms"), y
        engine = '#engines tr[data-engine="upstream"]'
        expect(field(page, engine, "routed")).to_contain_text("5")
        expect(field(page, engine, "failed")).to_contain_text("0")
        for name in ("ttft_s", "tpot_s"):
            assert field(page, engine, name).count() == 1
        expect(page.locator("#reload")).to_contain_text("none since start-up")


def test_the_dashboard_shows_each_objectives_attainment_and_charts_it(proxy):
    """Streamed requests of a group with a TTFT objective: the page's objectives row shows
    what /admin/status says (attainment, requests), and the attainment chart draws it."""
    body = json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}).encode()
    for _ in range(3):
        req = urllib.request.Request(proxy.url + "/v1/chat/completions", data=body, headers={"Authorization": "Bearer sk-alice", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()
    ttft = status(proxy)["objectives"]["platinum"]["ttft"]
    assert (ttft["overall"]["requests"], ttft["overall"]["attainment"]) == (3, 1.0)
    with sync_playwright() as pw, launch_chromium(pw) as browser:
        page = browser.new_page()
        connect(page, proxy)
        row = '#objectives tr[data-group="platinum"][data-objective="ttft"]'
        expect(field(page, row, "attainment")).to_contain_text("100.0 % ≥ 95.0 %", timeout=UI_TIMEOUT_MS)
        expect(field(page, row, "requests")).to_have_text("3")
        expect(field(page, row, "target")).to_have_text("5.0 s p95.0")
        assert page.locator("#objectives tr[data-group]").count() == 1  # bronze has no objectives
        expect(page.locator("#chart-objectives polyline")).to_have_count(1, timeout=UI_TIMEOUT_MS)
        expect(page.locator("#chart-objectives-legend")).to_contain_text("platinum ttft")
