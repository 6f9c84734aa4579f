"""Prometheus metrics as operators scrape them: the series they alert on exist at 0 from
start-up and after a reload adds groups; the cached metric children are the exported ones."""

from __future__ import annotations

import urllib.request

import yaml
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from proxy.runtime.config_watch import reload_config
from proxy.telemetry.metrics import ABORT_REASONS, DIRECTIONS, OUTCOMES, REFUSAL_REASONS, RELOAD_RESULTS, LabelCache
from qos import RefusalReason
from tests.conftest import base_config
from tests.proc_util import free_port
from tests.proxy_process import start_proxy, stop_proxy


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """``{(sample name, labels): value}`` of a Prometheus text exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(scrape: dict, name: str, **labels: str) -> float | None:
    return scrape.get((name, frozenset(labels.items())))


def test_the_vocabularies_cover_every_refusal_reason():
    assert set(REFUSAL_REASONS) == {r.value for r in RefusalReason} - {"client_cancelled"}
    assert "rate_limited" in REFUSAL_REASONS and "queue_timeout" in REFUSAL_REASONS


def test_alerting_series_exist_at_zero_from_start_up(tmp_path):
    """A freshly started proxy process, before any request: every series an alert rule
    reads is there, at 0, so rate() and increase() work from the first scrape."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(base_config("http://127.0.0.1:9")))
    port = free_port()
    proc = start_proxy(path, port, extra_args=["--no-watch"])
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            scrape = samples(r.read().decode())
    finally:
        assert stop_proxy(proc) == 0
    for group in ("platinum", "bronze"):
        for outcome in OUTCOMES:
            assert value(scrape, "llm_qos_requests_total", group=group, outcome=outcome) == 0.0, (group, outcome)
        for reason in REFUSAL_REASONS:
            assert value(scrape, "llm_qos_rejections_total", group=group, reason=reason) == 0.0, (group, reason)
        for direction in DIRECTIONS:
            assert value(scrape, "llm_qos_tokens_total", group=group, direction=direction) == 0.0
        assert value(scrape, "llm_qos_queue_wait_seconds_count", group=group) == 0.0
        assert value(scrape, "llm_qos_queue_wait_seconds_bucket", group=group, le="+Inf") == 0.0
        assert value(scrape, "llm_qos_time_to_first_token_seconds_count", group=group) == 0.0
        assert value(scrape, "llm_qos_queue_depth", group=group) == 0.0
        assert value(scrape, "llm_qos_queue_oldest_wait_seconds", group=group) == 0.0
        assert value(scrape, "llm_qos_group_min_share", group=group) == 0.0
    for result in RELOAD_RESULTS:
        assert value(scrape, "llm_qos_config_reloads_total", result=result) == 0.0
    assert value(scrape, "llm_qos_cost_weight", direction="prompt") == 1.0
    assert value(scrape, "llm_qos_cost_weight", direction="completion") == 2.0
    for reason in ABORT_REASONS:
        assert value(scrape, "llm_qos_upstream_aborts_total", reason=reason) == 0.0


async def test_a_reload_adds_zero_series_for_new_groups_and_keeps_removed_ones(make_stack, http):
    st = await make_stack()
    async with http.post(st.proxy_url + "/v1/chat/completions", json=st.chat_body(3)) as r:
        assert r.status == 200  # one bronze request
        await r.read()
    cfg = yaml.safe_load(st.config_path.read_text())
    cfg["groups"] = [cfg["groups"][0], {"name": "gold", "min_share": 0.2}, {"name": "silver"}]  # bronze removed
    cfg["default_group"] = "silver"
    st.config_path.write_text(yaml.safe_dump(cfg))
    assert reload_config(st.state)
    async with http.get(st.proxy_url + "/metrics") as r:
        scrape = samples(await r.text())
    for group in ("gold", "silver"):
        for outcome in OUTCOMES:
            assert value(scrape, "llm_qos_requests_total", group=group, outcome=outcome) == 0.0, (group, outcome)
        for reason in REFUSAL_REASONS:
            assert value(scrape, "llm_qos_rejections_total", group=group, reason=reason) == 0.0, (group, reason)
        assert value(scrape, "llm_qos_queue_depth", group=group) == 0.0
    assert value(scrape, "llm_qos_group_min_share", group="gold") == 0.2
    # the removed group's counters stay, at their last value (counters never go backwards)
    assert value(scrape, "llm_qos_requests_total", group="bronze", outcome="ok") == 1.0
    assert value(scrape, "llm_qos_tokens_total", group="bronze", direction="completion") == 3.0
    assert value(scrape, "llm_qos_queue_depth", group="bronze") is None  # gauges follow the config
    assert value(scrape, "llm_qos_config_reloads_total", result="ok") == 1.0


def test_label_cache_hands_out_the_exported_child():
    registry = CollectorRegistry()
    counter = LabelCache(Counter("t_requests", "", ["group", "outcome"], registry=registry))
    child = counter.labels("g", "ok")
    assert counter.labels("g", "ok") is child is counter.metric.labels("g", "ok")
    child.inc(2)
    counter.labels("g", "ok").inc()
    assert registry.get_sample_value("t_requests_total", {"group": "g", "outcome": "ok"}) == 3.0
    counter.labels("h", "ok").inc()
    assert registry.get_sample_value("t_requests_total", {"group": "h", "outcome": "ok"}) == 1.0
