"""Rate limits shared through a real redis-server: exact across replicas under concurrent
clients, settled and refunded through the sync, applied once, pre-checked locally, and
bounded in the keys they leave."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest
import redis

from proxy.shared import RateLimited, SharedState
from proxy.shared.keys import Keys
from proxy.shared.rate_limits import ADJUST_SCRIPT, RESERVE_SCRIPT, Bucket, adjust_args, reserve_args
from qos import RateLimit
from tests.shared_helpers import config, settled

NONE = RateLimit(None, None)


@pytest.fixture
async def states(redis_server):
    """Factory: ``await make(n, **cfg)`` -> started SharedStates of one deployment."""
    made: list[SharedState] = []

    async def make(n: int, prefix: str = "rl", **cfg) -> list[SharedState]:
        settled(redis_server.url, prefix)
        # a generous timeout: on a loaded test machine a slow call must not count as an outage
        cfg = {"timeout_s": 2.0, "lease_s": 6.0, **cfg}
        out = [SharedState(config(redis_server.url, key_prefix=prefix, **cfg), replica_id=f"{prefix}{len(made) + i}") for i in range(n)]
        for s in out:
            await s.start()
        made.extend(out)
        return out

    yield make
    for s in made:
        await s.stop()


async def _attempt(state: SharedState, user: str, group: str, ul: RateLimit, gl: RateLimit, tokens: int) -> bool:
    try:
        await state.reserve_rate(user, group, ul, gl, tokens)
    except RateLimited:
        return False
    return True


async def test_requests_per_minute_is_exact_across_replicas_under_concurrent_clients(states):
    replicas = await states(3)
    limit = RateLimit(30, None)  # a bucket of 30, refilled at 0.5 per second
    start = time.monotonic()
    results = await asyncio.gather(*(_attempt(replicas[i % 3], "alice", "gold", limit, NONE, 10) for i in range(300)))
    elapsed = time.monotonic() - start
    assert all(s.mode == "shared" for s in replicas)
    # each replica alone would have let 30 through (90 in all)
    assert 30 <= sum(results) <= 30 + int(elapsed * 0.5) + 1


async def test_tokens_per_minute_and_the_group_limit_span_users_and_replicas(states):
    replicas = await states(3)
    tokens_limit = RateLimit(None, 1000)
    group_limit = RateLimit(8, None)
    results = await asyncio.gather(
        *(_attempt(replicas[i % 3], f"user{i % 5}", "team", tokens_limit, group_limit, 100) for i in range(120))
    )
    # 5 users x 1000 tokens / 100 = 50 by the user limits, but the group allows only 8
    assert 8 <= sum(results) <= 9


async def test_refused_request_says_when_it_would_fit(states):
    (s,) = await states(1)
    limit = RateLimit(6, None)  # 0.1 per second
    for _ in range(6):
        await s.reserve_rate("bob", "g", limit, NONE, 1)
    with pytest.raises(RateLimited) as e:
        await s.reserve_rate("bob", "g", limit, NONE, 1)
    assert e.value.scope == "user" and e.value.unit == "requests"
    assert 8.0 <= e.value.retry_after_s <= 10.0  # one request at 0.1 per second


async def test_settle_and_refund_reach_redis_with_the_next_sync(states, redis_server):
    a, b = await states(2)
    limit = RateLimit(None, 600)  # 10 tokens per second refill
    r1 = await a.reserve_rate("carol", "g", limit, NONE, 300)
    r2 = await a.reserve_rate("carol", "g", limit, NONE, 300)
    with pytest.raises(RateLimited):  # the bucket is empty: B sees it at once
        await b.reserve_rate("carol", "g", limit, NONE, 300)
    a.settle_rate(r1, 100)  # used 100 of the 300 taken
    a.refund_rate(r2)  # never reached an engine
    a.refund_rate(r2)  # a second hand-back does nothing
    await a.sync_once()
    # B's last reading (empty) keeps refusing locally for one sync interval at most
    await asyncio.sleep(b.config.sync_interval_s * 1.5)
    # 200 + 300 back: B can take 450 now, across replicas
    await b.reserve_rate("carol", "g", limit, NONE, 450)
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    level = float(client.hget(Keys("rl").user_bucket("carol"), "t"))
    assert -5 <= level <= 150 - 450 + 300 + 60  # 600 - 300 - 300 + 200 + 300 - 450 = 50, plus refill


async def test_a_batch_of_corrections_is_applied_once_even_when_resent(redis_server):
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    script = client.register_script(ADJUST_SCRIPT)
    k = Keys("once")
    bucket = Bucket(k.user_bucket("dan"), "user", 0.0, 6000.0)
    keys, args = adjust_args(k.replica("r1"), k.reserve_log("r1"), 1, 60_000, {bucket.key: [0.0, 6000.0, 0.0, 3000.0]})
    assert script(keys=keys, args=args) == 1
    assert script(keys=keys, args=args) == 0  # the reply was lost and the batch resent
    assert 3000 <= float(client.hget(bucket.key, "t")) <= 3100  # charged 3000 once (plus refill)


async def test_an_exhausted_limit_is_refused_locally_without_redis_calls(states, redis_server):
    (s,) = await states(1, sync_interval_s=0.5)
    limit = RateLimit(2, None)
    for _ in range(2):
        await s.reserve_rate("eve", "g", limit, NONE, 1)
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    before = client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    refused = 0
    for _ in range(200):
        try:
            await s.reserve_rate("eve", "g", limit, NONE, 1)
        except RateLimited:
            refused += 1
    calls = client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0) - before
    assert refused == 200
    assert calls <= 8  # the first refusal, then the mirror; plus the syncs of that moment


async def test_bucket_keys_expire_once_they_would_be_full_again(states, redis_server):
    (s,) = await states(1)
    await s.reserve_rate("frank", "g", RateLimit(60, None), NONE, 1)  # 1 per second refill
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    ttl = client.pttl(Keys("rl").user_bucket("frank"))
    assert 0 < ttl <= 2100  # full again after one second, then a second of margin
    # a user id is stored as given, hostile or not; it still expires
    weird = "x" * 5000 + "{}:\n\x00"
    await s.reserve_rate(weird, "g", RateLimit(60, None), NONE, 1)
    assert 0 < client.pttl(Keys("rl").user_bucket(weird)) <= 2100


async def test_no_limit_costs_no_redis_call(states, redis_server):
    (s,) = await states(1, sync_interval_s=0.5)
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    before = client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    for _ in range(100):
        r = await s.reserve_rate("gina", "g", NONE, NONE, 100)
        s.settle_rate(r, 50)
    assert client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0) - before <= 4  # syncs only


@pytest.fixture
def scripts(redis_server):
    """A client of the real Redis with the reserve and adjust scripts registered."""
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    return client, client.register_script(RESERVE_SCRIPT), client.register_script(ADJUST_SCRIPT)


def _levels(client, key: str) -> tuple[float, float]:
    r, t = client.hmget(key, "r", "t")
    return float(r) if r is not None else 6.0, float(t) if t is not None else 6000.0


async def test_a_written_off_reserve_that_ran_is_given_back(scripts):
    """Issue 21.3, on the real scripts: a reserve that ran but whose reply was lost is
    written off by the next adjust batch, and its take comes back, once."""
    client, reserve, adjust = scripts
    k = Keys("wo")
    b = Bucket(k.user_bucket("ann"), "user", 6.0, 6000.0)
    keys, args = reserve_args((b,), 3000, k.reserve_log("r1"), 1, 1, 60_000)
    assert orjson.loads(reserve(keys=keys, args=args))["ok"] == 1  # ran; its reply "lost"
    r, t = _levels(client, b.key)
    assert 4.9 <= r <= 5.1 and 2990 <= t <= 3100
    keys, args = adjust_args(k.replica("r1"), k.reserve_log("r1"), 1, 60_000, {}, [(1, (b,), 3000)])
    assert adjust(keys=keys, args=args) == 1
    r, t = _levels(client, b.key)
    assert r >= 5.99 and t >= 5990  # given back whole
    assert adjust(keys=keys, args=args) == 0  # a resent batch is not applied twice


async def test_a_written_off_reserve_that_had_not_run_never_takes(scripts):
    """A reserve still in a frozen Redis's buffer when its write-off arrives never takes
    when it finally runs."""
    client, reserve, adjust = scripts
    k = Keys("wo2")
    b = Bucket(k.user_bucket("ann"), "user", 6.0, 6000.0)
    keys, args = adjust_args(k.replica("r1"), k.reserve_log("r1"), 1, 60_000, {}, [(1, (b,), 3000)])
    assert adjust(keys=keys, args=args) == 1  # the write-off reaches Redis first
    keys, args = reserve_args((b,), 3000, k.reserve_log("r1"), 1, 1, 60_000)
    reply = orjson.loads(reserve(keys=keys, args=args))  # then the frozen Redis runs the reserve
    assert reply["ok"] == 0 and reply["gone"] == 1
    assert client.exists(b.key) == 0  # nothing taken: the bucket is full


async def test_a_resent_reserve_takes_once_and_the_log_keeps_only_what_is_unsettled(scripts):
    """A reserve sent twice takes once; the log forgets what the replica has settled."""
    client, reserve, _ = scripts
    k = Keys("wo3")
    b = Bucket(k.user_bucket("ann"), "user", 600.0, 0.0)
    log = k.reserve_log("r1")
    for _ in range(2):  # the same reserve sent twice (a pipeline resent after NOSCRIPT)
        keys, args = reserve_args((b,), 1, log, 1, 1, 60_000)
        assert orjson.loads(reserve(keys=keys, args=args))["ok"] == 1
    assert 598.9 <= _levels(client, b.key)[0] <= 599.1
    for n in range(2, 200):  # each reply read at once: the floor follows
        keys, args = reserve_args((b,), 1, log, n, n, 60_000)
        assert orjson.loads(reserve(keys=keys, args=args))["ok"] == 1
    assert client.zcard(log) <= 34  # the floor mark and at most 33 recent records, not 199
    assert 0 < client.pttl(log) <= 60_000
