"""Shared service counters through a real redis-server: service rendered on one replica
reaches the others as remote service, once, and counters expire when idle."""

from __future__ import annotations

import pytest
import redis

from proxy.shared import SharedState, SyncReport
from proxy.shared.counters import SERVICE_SCRIPT
from proxy.shared.keys import Keys
from tests.shared_helpers import config, settled, wait_for


@pytest.fixture
async def pair(redis_server):
    settled(redis_server.url, "svc")
    a = SharedState(config(redis_server.url, key_prefix="svc", timeout_s=1.0, lease_s=3.0, service_ttl_s=30), replica_id="A")
    b = SharedState(config(redis_server.url, key_prefix="svc", timeout_s=1.0, lease_s=3.0, service_ttl_s=30), replica_id="B")
    for s in (a, b):
        await s.start()
    yield a, b
    for s in (a, b):
        await s.stop()


async def test_service_on_one_replica_reaches_another_as_remote_service(pair):
    a, b = pair
    # alice waits on both replicas; bob only on B
    a.set_reporter(lambda: SyncReport(waiting_users={"pool": ["alice"]}))
    b.set_reporter(lambda: SyncReport(waiting_users={"pool": ["alice", "bob"]}))
    await wait_for(lambda: b.global_service("pool", "alice") == 0.0, 5, "B to read alice's counter")
    a.report_service("pool", "alice", 120.0)
    b.report_service("pool", "alice", 30.0)
    b.report_service("pool", "bob", 5.0)
    remote_at_b: dict = {}
    remote_at_a: dict = {}

    def collect() -> bool:
        for k, v in b.take_remote_service().items():
            remote_at_b[k] = remote_at_b.get(k, 0.0) + v
        for k, v in a.take_remote_service().items():
            remote_at_a[k] = remote_at_a.get(k, 0.0) + v
        return b.global_service("pool", "alice") == 150.0 and a.global_service("pool", "alice") == 150.0

    await wait_for(collect, 5, "both replicas to see alice's global service")
    await wait_for(lambda: collect() and remote_at_a.get(("pool", "alice")) == 30.0, 5, "A to see B's service")
    # each sees only what the other rendered: its own service is never counted twice
    assert remote_at_b == {("pool", "alice"): pytest.approx(120.0)}
    assert remote_at_a == {("pool", "alice"): pytest.approx(30.0)}
    assert b.global_service("pool", "bob") == 5.0
    assert a.global_service("pool", "bob") is None  # bob does not wait on A


async def test_a_resent_batch_of_service_is_counted_once(redis_server):
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    script = client.register_script(SERVICE_SCRIPT)
    k = Keys("once")
    keys = [k.replica("r1"), k.service("p", "u")]
    assert script(keys=keys, args=[1, 60_000, 60_000, "40.5"]) == ["40.5"]
    assert script(keys=keys, args=[1, 60_000, 60_000, "40.5"]) == ["40.5"]  # the reply was lost: resent
    assert script(keys=keys, args=[2, 60_000, 60_000, "1"]) == ["41.5"]
    assert 0 < client.pttl(k.service("p", "u")) <= 60_000  # forgotten when idle


async def test_pool_and_user_names_cannot_collide(redis_server):
    k = Keys("x")
    assert k.service("a:b", "c") != k.service("a", "b:c")
