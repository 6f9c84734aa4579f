"""Per-engine series as Prometheus reads them, and the status list, from live routers."""

from __future__ import annotations

import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.routing import engine_metrics
from proxy.api.app import create_app
from proxy.config.loading import parse_config
from proxy.api.dashboard import DASHBOARD
from proxy.api.dashboard_data import ENGINE_FIELDS
from proxy.routing.engine_health import Health
from proxy.routing.router import PoolRouter
from tests.conftest import base_config
from tests.test_router import Clock, eng, pool, ticket


def _samples(registry: CollectorRegistry) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_engine_series_follow_the_routers_at_scrape_time():
    clock = Clock()
    routers = [PoolRouter(pool(eng(1, max_inflight=4, max_inflight_tokens=100), eng(2, max_inflight=2)), clock=clock)]
    reg = CollectorRegistry()
    engine_metrics.register(reg, lambda: routers)
    r = routers[0]
    a, b = r.engines.values()
    r.reserve(ticket(30))
    a.set_load(0.5)
    for _ in range(3):
        r.report(b, False, "connect")
    s = _samples(reg)
    A = (("engine", "e1"), ("pool", "p"))
    B = (("engine", "e2"), ("pool", "p"))
    assert s[("llm_qos_engine_inflight_requests", A)] == 1 and s[("llm_qos_engine_inflight_tokens", A)] == 30
    assert s[("llm_qos_engine_capacity_requests", A)] == 4 and s[("llm_qos_engine_load", A)] == 0.5
    assert ("llm_qos_engine_load", B) not in s  # no reading: no sample
    assert s[("llm_qos_engine_saturated", A)] == 0 and s[("llm_qos_engine_saturated", B)] == 0  # 0 without a signal too
    assert s[("llm_qos_engine_routed_requests_total", A)] == 1
    assert s[("llm_qos_engine_state", (*A[:1], ("pool", "p"), ("state", "healthy")))] == 1
    assert s[("llm_qos_engine_state", (*B[:1], ("pool", "p"), ("state", "ejected")))] == 1
    assert s[("llm_qos_engine_state", (*B[:1], ("pool", "p"), ("state", "healthy")))] == 0
    assert s[("llm_qos_engine_ejections_total", B)] == 1
    assert s[("llm_qos_engine_failures_total", (*B[:1], ("pool", "p"), ("reason", "connect")))] == 3
    assert s[("llm_qos_engine_headroom", A)] == min(1 - 1 / 4, 1 - 30 / 100, 1 - 0.5 / 0.95)
    b.set_load(0.97, True, None)  # its load signal says saturated
    assert _samples(reg)[("llm_qos_engine_saturated", B)] == 1
    # a reload is seen at the next scrape: e2 removed (idle) leaves, e3 appears
    r.reconfigure(pool(eng(1, max_inflight=4, max_inflight_tokens=100), eng(3)))
    s = _samples(reg)
    assert ("llm_qos_engine_inflight_requests", B) not in s
    assert s[("llm_qos_engine_inflight_requests", (("engine", "e3"), ("pool", "p")))] == 0


def test_status_lists_every_engine_of_every_pool():
    r1 = PoolRouter(pool(eng(1), eng(2)), clock=Clock())
    r2 = PoolRouter(pool(eng(3)), clock=Clock())
    t = ticket(5)
    r1.reserve(t)
    r1.reconfigure(pool(eng(2)))  # e1 keeps its request: draining
    rows = engine_metrics.engines_status([r1, r2])
    assert [(row["name"], row["pool"], row["state"]) for row in rows] == [("e2", "p", "healthy"), ("e1", "p", "draining"), ("e3", "p", "healthy")]
    row = rows[1]
    assert row["inflight"] == 1 and row["inflight_tokens"] == 5 and row["url"] == "http://10.0.0.1:8000" and row["routed"] == 1
    r2.engines["e3"].health.state = Health.EJECTED
    assert engine_metrics.engines_status([r2])[0]["state"] == "ejected"


def test_status_rows_carry_the_dashboards_engine_keys():
    """The dashboard's ``engines`` list is these rows plus the figures it computes
    (:data:`proxy.api.dashboard_data.ENGINE_FIELDS`): every other key of the row it builds for the
    single upstream must be in the status row."""
    app = create_app(parse_config(yaml.safe_dump(base_config("http://127.0.0.1:1"))))
    (today,) = app[DASHBOARD].data()["engines"]
    today = set(today) - set(ENGINE_FIELDS)
    r = PoolRouter(pool(eng(1)), clock=Clock())
    (e,) = r.engines.values()
    e.set_load(0.4, False, None, waiting=2, signal="ok")
    row = engine_metrics.engines_status([r])[0]
    assert set(today) <= set(row), set(today) - set(row)
    assert (row["load"], row["waiting"], row["load_signal"]) == (0.4, 2, "ok")


def test_refused_ejections_are_counted_per_engine_from_zero():
    """``llm_qos_engine_ejections_refused_total`` exists at 0 for every engine from the
    first scrape, and counts the passive ejections the pool's floor refused."""
    routers = [PoolRouter(pool(eng(1), eng(2), health={"failures_to_eject": 1}), clock=Clock())]
    reg = CollectorRegistry()
    engine_metrics.register(reg, lambda: routers)
    A = (("engine", "e1"), ("pool", "p"))
    B = (("engine", "e2"), ("pool", "p"))
    s = _samples(reg)
    assert s[("llm_qos_engine_ejections_refused_total", A)] == 0 and s[("llm_qos_engine_ejections_refused_total", B)] == 0
    a, b = routers[0].engines.values()
    assert routers[0].report(a, False, "http_5xx", "answered 500")  # 1 of 2: allowed
    for _ in range(3):
        assert not routers[0].report(b, False, "http_5xx", "answered 500")  # the last in rotation: refused
    s = _samples(reg)
    assert s[("llm_qos_engine_ejections_refused_total", A)] == 0 and s[("llm_qos_engine_ejections_refused_total", B)] == 3
    assert s[("llm_qos_engine_ejections_total", A)] == 1 and s[("llm_qos_engine_ejections_total", B)] == 0
