"""The monitoring files against the real thing: every PromQL query of the Grafana
dashboard and of the alert rules names metrics a running proxy exports, and runs on a
real Prometheus (Debian's ``prometheus``, installed by tests/system_deps.sh) scraping a
real proxy process under a little load; the rules pass ``promtool check`` and their unit
tests; the compose ``monitoring`` profile mounts what the files expect."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.proc_util import die_with_parent, free_port, wait_for_line
from tests.proxy_process import REPO_ROOT, start_proxy, stop_proxy

DEPLOY = REPO_ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "llm-qos.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
# series Prometheus makes itself for every target
PROMETHEUS_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped", "scrape_series_added"}
SCRAPE_S = 1
RATE_INTERVAL = "5s"  # what Grafana's $__rate_interval becomes at a 1 s scrape interval


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is missing: install Debian's prometheus package (bash tests/system_deps.sh)")
    return path


# ------------------------------------------------------------------ PromQL names

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_GRAFANA_VAR = re.compile(r"\$\{[^}]*\}|\$\w+")
_NUMBER = re.compile(r"(?<![\w:])\d[\w.]*")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "inf", "nan", "atan2"}
_AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk", "quantile", "limitk", "limit_ratio"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: what is left once strings, label
    matchers, ranges, grouping clauses, Grafana variables, numbers, keywords and the
    names of functions and aggregations are taken out."""
    s = _STRING.sub(" ", expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = _GROUPING.sub(" ", s)
    s = _GRAFANA_VAR.sub(" ", s)
    s = _NUMBER.sub(" ", s)
    names = set()
    for m in _IDENT.finditer(s):
        word = m.group(0)
        if word in _KEYWORDS or word in _AGGREGATIONS or s[m.end():].lstrip().startswith("("):
            continue
        names.add(word)
    return names


def exported_names(exposition: str) -> tuple[set[str], set[str]]:
    """``(every name a query may select, the names with samples)`` of a Prometheus text
    scrape: sample names, plus each family's names by its TYPE (a counter's ``_total``,
    a histogram's ``_bucket``/``_sum``/``_count``), so a family that has no sample yet
    (a gauge the engine has not reported) still counts as exported."""
    selectable, sampled = set(), set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            selectable.add(name)
            if kind == "counter" and not name.endswith("_total"):
                selectable.add(name + "_total")
            if kind == "histogram":
                selectable.update(name + suffix for suffix in ("_bucket", "_sum", "_count"))
        elif line and not line.startswith("#"):
            sampled.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return selectable | sampled, sampled


def dashboard_queries() -> list[tuple[str, str]]:
    """``(where, expr)`` of every query in the Grafana dashboard (panels and variables)."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((f"panel {p['title']!r}", t["expr"]))
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"label_values\((.+),\s*\w+\)", q)
            out.append((f"variable {v['name']!r}", m.group(1) if m else q))
    return out


def alert_queries() -> list[tuple[str, str]]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [(f"alert {r['alert']}", r["expr"]) for g in rules["groups"] for r in g["rules"]]


def test_metric_names_are_found_in_promql():
    expr = (
        'sum by (group) (rate(llm_qos_tokens_total{job=~"$job",group!="a b"}[$__rate_interval]) * on (direction) group_left '
        "max by (direction) (llm_qos_cost_weight)) / ignoring (group) group_left sum(rate(x_total[5m] offset 1h)) > 0.5 "
        "and on (group) histogram_quantile(0.95, sum by (le) (rate(h_bucket[1m]))) > bool 1e3"
    )
    assert metric_names(expr) == {"llm_qos_tokens_total", "llm_qos_cost_weight", "x_total", "h_bucket"}
    assert metric_names("up == 0") == {"up"}


def test_every_file_has_queries():
    assert len(dashboard_queries()) >= 20 and len(alert_queries()) >= 8


# ------------------------------------------------------------------ live stack


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A fake upstream, a proxy process (two groups, one with a min_share floor, one
    with latency objectives, a rate-limited user) and Prometheus scraping it every second with the alert rules."""
    tmp = tmp_path_factory.mktemp("monitoring")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    procs: list[subprocess.Popen] = []
    proxy = None
    try:
        up_port = free_port()
        up = subprocess.Popen([sys.executable, "-m", "bench.fake_upstream", "--port", str(up_port)], cwd=REPO_ROOT, env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
        procs.append(up)
        wait_for_line(up, "fake upstream ready", 30, "fake upstream")
        cfg = {
            "upstream": {"url": f"http://127.0.0.1:{up_port}", "kind": "openai"},
            "admission": {"max_inflight": 4},
            "default_group": "bronze",
            "groups": [
                {"name": "platinum", "users": [{"id": "alice", "api_key": "sk-alice"}, {"id": "bob", "api_key": "sk-bob", "rate_limit": {"requests_per_minute": 1}}],
                 "ttft_target_s": 5, "tpot_target_s": 1},
                {"name": "bronze", "min_share": 0.25},
            ],
        }
        (tmp / "config.yaml").write_text(yaml.safe_dump(cfg))
        px_port = free_port()
        proxy = start_proxy(tmp / "config.yaml", px_port, extra_args=["--no-watch"])
        shutil.copy(ALERTS, tmp / "alerts.yml")
        prom_cfg = {
            "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
            "rule_files": ["alerts.yml"],
            "scrape_configs": [{"job_name": "llm-qos", "static_configs": [{"targets": [f"127.0.0.1:{px_port}"]}]}],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(prom_cfg))
        prom_port = free_port()
        prom_log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 - closed with the process
        prom = subprocess.Popen(
            [_tool("prometheus"), f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
            cwd=tmp, stdin=subprocess.DEVNULL, stdout=prom_log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
        )
        prom_log.close()  # the child holds its own copy
        procs.append(prom)
        prom_url = f"http://127.0.0.1:{prom_port}"
        px_url = f"http://127.0.0.1:{px_port}"
        # some traffic between scrapes: served requests, a rate-limit refusal, a bad request
        for key in ("sk-alice", "sk-alice", "sk-bob", "sk-bob", None):
            _post(px_url, key)
        _post(px_url, "sk-alice", stream=True)  # measured in platinum's latency objectives
        _wait(lambda: _query(prom_url, "count_over_time(up[1m])") and float(_query(prom_url, "count_over_time(up[1m])")[0]["value"][1]) >= 3,
              "three scrapes", tmp / "prometheus.log")
        for key in ("sk-alice", None):
            _post(px_url, key)
        _wait(lambda: _query(prom_url, 'sum(llm_qos_requests_total{outcome="ok"})') and float(_query(prom_url, 'sum(llm_qos_requests_total{outcome="ok"})')[0]["value"][1]) >= 5,
              "the later requests scraped", tmp / "prometheus.log")
        with urllib.request.urlopen(px_url + "/metrics", timeout=10) as r:
            scrape = r.read().decode()
        yield {"prometheus": prom_url, "scrape": scrape, "log": tmp / "prometheus.log"}
    finally:
        if proxy is not None:
            stop_proxy(proxy)
        for p in procs:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout is not None:
                p.stdout.close()


def _post(url: str, key: str | None, stream: bool = False) -> None:
    body = json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "/v1/chat/completions", data=body, headers=headers), timeout=30) as r:
            r.read()
    except urllib.error.HTTPError as e:
        e.read()


def _api(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


def _query(prom: str, expr: str) -> list:
    body = _api(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert body["status"] == "success", f"{expr}: {body.get('error')}"
    return body["data"]["result"]


def _wait(pred, what: str, log: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if pred():
                return
        except (OSError, KeyError, IndexError, ValueError):  # Prometheus not listening yet, or "Service Unavailable" while it starts
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}; prometheus log:\n{log.read_text()[-2000:]}"
        time.sleep(0.2)


def _grafana_to_promql(expr: str) -> str:
    return expr.replace("$__rate_interval", RATE_INTERVAL).replace("$job", ".*")


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_query_names_a_metric_the_proxy_exports(live, source):
    exported, _ = exported_names(live["scrape"])
    queries = dashboard_queries() if source == "dashboard" else alert_queries()
    unknown = {(where, name) for where, expr in queries for name in metric_names(expr) if name not in exported | PROMETHEUS_SERIES}
    assert not unknown, f"queries name metrics the proxy does not export: {sorted(unknown)}"


def test_the_name_check_catches_a_misspelt_metric(live):
    exported, _ = exported_names(live["scrape"])
    assert "llm_qos_requests_total" in exported and "llm_qos_queue_wait_seconds_bucket" in exported
    assert "llm_qos_upstream_load" in exported  # a gauge without a sample yet still counts
    assert "llm_qos_request_total" not in exported and "llm_qos_requests" not in exported


def test_every_dashboard_query_runs_on_prometheus_and_finds_data(live):
    """Each panel's query, run by Prometheus on what it scraped from the proxy: valid
    PromQL, and data wherever every metric it names has samples."""
    _, sampled = exported_names(live["scrape"])
    empty = []
    for where, expr in dashboard_queries():
        result = _query(live["prometheus"], _grafana_to_promql(expr))
        if not result and metric_names(expr) <= sampled:
            empty.append(where)
    assert not empty, f"queries without data: {empty}"


def test_prometheus_runs_every_alert_rule_without_error(live):
    def evaluated() -> list:
        rules = [r for g in _api(live["prometheus"] + "/api/v1/rules")["data"]["groups"] for r in g["rules"]]
        return rules if rules and all(r.get("lastEvaluation", "").startswith("2") and not r["lastEvaluation"].startswith("0001") for r in rules) else []

    _wait(lambda: evaluated(), "every rule evaluated", live["log"])
    rules = evaluated()
    assert {r["name"] for r in rules} == {name.split(" ", 1)[1] for name, _ in alert_queries()}
    bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not bad


def test_promtool_checks_the_rules_their_unit_tests_and_the_scrape_config():
    promtool = _tool("promtool")
    for args in (["check", "rules", ALERTS.name], ["test", "rules", "alerts_test.yml"], ["check", "config", PROMETHEUS_YML.name]):
        r = subprocess.run([promtool, *args], cwd=ALERTS.parent, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"promtool {' '.join(args)}:\n{r.stdout}\n{r.stderr}"


def test_every_alert_has_a_unit_test():
    rules = yaml.safe_load(ALERTS.read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    unit = yaml.safe_load((ALERTS.parent / "alerts_test.yml").read_text())
    tested = {t["alertname"] for case in unit["tests"] for t in case.get("alert_rule_test", [])}
    # and fires in one of them: a test that only expects silence proves little
    fired = {t["alertname"] for case in unit["tests"] for t in case.get("alert_rule_test", []) if t.get("exp_alerts")}
    assert alerts, "no alerts found in alerts.yml"
    assert alerts - tested == set(), "alerts without a promtool unit test in alerts_test.yml"
    assert alerts - fired == set(), "alerts whose unit tests never expect them to fire"


def test_the_scrape_job_is_the_one_the_alerts_name():
    cfg = yaml.safe_load(PROMETHEUS_YML.read_text())
    (job,) = cfg["scrape_configs"]
    assert job["job_name"] == "llm-qos" and 'job="llm-qos"' in ALERTS.read_text()
    assert cfg["rule_files"] == [ALERTS.name]
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())["services"]
    (sd,) = job["dns_sd_configs"]
    for name in sd["names"]:  # every proxy service of the stack, on the port it listens on
        assert name in compose and "--port" in compose[name]["command"]
        assert str(sd["port"]) == compose[name]["command"][compose[name]["command"].index("--port") + 1]


def test_the_monitoring_profile_mounts_what_prometheus_and_grafana_read():
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())["services"]
    monitoring = {n for n, s in compose.items() if "monitoring" in s.get("profiles", [])}
    assert monitoring == {"prometheus", "grafana"}
    prom = compose["prometheus"]
    mounts = {m["target"]: m for m in prom["volumes"] if isinstance(m, dict)}
    config_arg = next(a for a in prom["command"] if a.startswith("--config.file="))
    config_path = config_arg.split("=", 1)[1]
    (target,) = [t for t in mounts if config_path.startswith(t + "/")]
    assert (REPO_ROOT / mounts[target]["source"] / Path(config_path).relative_to(target)) == PROMETHEUS_YML
    assert mounts[target]["read_only"] is True
    graf = compose["grafana"]
    gm = {m["target"]: REPO_ROOT / m["source"] for m in graf["volumes"] if isinstance(m, dict) and m["type"] == "bind"}
    provisioning = gm["/etc/grafana/provisioning"]
    assert provisioning == DEPLOY / "grafana" / "provisioning"
    provider = yaml.safe_load((provisioning / "dashboards" / "llm-qos.yml").read_text())["providers"][0]
    assert gm[provider["options"]["path"]] == DASHBOARD.parent
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090" and datasource["type"] == "prometheus"
    dash = json.loads(DASHBOARD.read_text())
    (ds_var,) = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    assert ds_var["current"]["value"] == datasource["uid"]
    assert graf["depends_on"] == ["prometheus"] or "prometheus" in graf["depends_on"]
