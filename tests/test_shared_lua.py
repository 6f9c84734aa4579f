"""The Lua the shared state runs in Redis (``proxy/shared/lua/``): every file compiles
under Lua 5.1 (``luac5.1 -p``), every script as sent passes ``luacheck`` and ``SCRIPT
LOAD`` on a real redis-server, the files ship as package data, and the token bucket of the
reserve and adjust scripts gives the answers of :class:`qos.TokenBucket` (Hypothesis:
random sequences of takes, corrections and give-backs at random times and limits, run on
the real scripts with only Redis's clock replaced by the test's).

The linters are Debian's ``lua5.1`` and ``lua-check`` (``tests/system_deps.sh``); Redis
runs Lua 5.1."""

from __future__ import annotations

import fnmatch
import hashlib
import itertools
import shutil
import subprocess
import tomllib
from importlib.resources import as_file, files

import pytest
import redis
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from proxy.shared import lua
from proxy.shared.counters import SERVICE_SCRIPT
from proxy.shared.keys import Keys
from proxy.shared.leases import LEASE_SCRIPT
from proxy.shared.rate_limits import ADJUST_SCRIPT, RESERVE_SCRIPT, Bucket, RateLimited, adjust_args, parse_reserve, reserve_args
from proxy.shared.rate_mirror import Mirror
from qos import TokenBucket
from tests.proxy_process import REPO_ROOT

LUA_FILES = sorted(p.name for p in files(lua.__name__).iterdir() if p.name.endswith(".lua"))
SENT = {"lease": LEASE_SCRIPT, "service": SERVICE_SCRIPT, "reserve": RESERVE_SCRIPT, "adjust": ADJUST_SCRIPT}
# what Redis gives a script besides Lua 5.1's standard library
REDIS_GLOBALS = ["redis", "cjson", "cmsgpack", "bit", "struct", "KEYS", "ARGV"]


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is missing: install Debian's lua5.1 and lua-check packages (bash tests/system_deps.sh)")
    return path


# ------------------------------------------------------------------------ the files


def test_the_scripts_are_their_files_and_every_file_is_used():
    assert LUA_FILES, "no .lua files found in proxy/shared/lua"
    assert set(SENT) == set(lua.SCRIPTS)
    for name, text in SENT.items():
        assert text == "".join(lua.source(f) for f in lua.SCRIPTS[name])
    assert {f for parts in lua.SCRIPTS.values() for f in parts} == set(LUA_FILES)


def test_the_lua_files_are_package_data():
    """A wheel or sdist built from pyproject.toml carries every .lua file (verified once by
    hand with ``pip wheel``; here the declaration that makes it so)."""
    setuptools = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert lua.__name__ in setuptools["packages"]
    patterns = setuptools["package-data"][lua.__name__]
    assert all(any(fnmatch.fnmatch(f, p) for p in patterns) for f in LUA_FILES)


def test_every_lua_file_and_every_script_compiles_under_lua_5_1():
    luac = _tool("luac5.1")
    for name in LUA_FILES:
        with as_file(files(lua.__name__) / name) as path:
            r = subprocess.run([luac, "-p", str(path)], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, f"{name}: {r.stderr}"
    for name, text in SENT.items():
        r = subprocess.run([luac, "-p", "-"], input=text, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, f"script {name}: {r.stderr}"


def test_every_script_as_sent_passes_luacheck(tmp_path):
    """As sent, because ``reserve.lua`` and ``adjust.lua`` use what ``bucket.lua`` defines:
    alone they would show undefined globals, and ``bucket.lua`` unused functions."""
    luacheck = _tool("luacheck")
    paths = []
    for name, text in SENT.items():
        paths.append(tmp_path / f"{name}.lua")
        paths[-1].write_text(text)
    cmd = [luacheck, "--no-config", "--no-color", "--codes", "--std", "lua51", "--globals", *REDIS_GLOBALS, "--", *map(str, paths)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_script_loads_into_a_real_redis(redis_server):
    """``SCRIPT LOAD`` compiles the script in Redis's own Lua; the SHA1 it answers is the one
    redis-py's ``register_script`` computes for ``EVALSHA``."""
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    for name, text in SENT.items():
        sha = client.script_load(text)
        assert sha == hashlib.sha1(text.encode()).hexdigest() == client.register_script(text).sha, name
    assert all(client.script_exists(*(hashlib.sha1(t.encode()).hexdigest() for t in SENT.values())))


# ---------------------------------------------- the Lua bucket and qos.TokenBucket

CLOCK_KEY = "twin:clock"
# a later local shadows bucket.lua's now_ms for the script's own file: Redis's TIME becomes
# the test's clock (ms); load and store take the time as an argument
CLOCK = f"local function now_ms() return tonumber(redis.call('GET', '{CLOCK_KEY}')) end\n"
START_MS = 1_700_000_000_000  # a Redis TIME of today's size, in ms: tostring() keeps it exact


def _with_test_clock(name: str) -> str:
    first, *rest = lua.SCRIPTS[name]
    assert first == "bucket.lua"
    text = lua.source(first) + CLOCK + "".join(lua.source(f) for f in rest)
    assert text.replace(CLOCK, "", 1) == SENT[name]  # the script as sent, but for the clock
    return text


def _level(b: TokenBucket, now: float) -> float:
    """``b``'s level at ``now`` by its own rule (without touching it)."""
    return TokenBucket.refilled(b.level, b.capacity, b.rate_per_s, now - b.updated_at)


def _close(a: float, b: float) -> bool:
    # Redis keeps levels as tostring() (14 significant digits) and the two sides compute the
    # refill in ms and in s: they agree to far better than a part in 1e9
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


LIMITS = st.one_of(st.just(0.0), st.integers(1, 600).map(float), st.floats(0.5, 50.0).map(lambda x: round(x, 2)))
TOKEN_LIMITS = st.one_of(st.just(0.0), st.integers(1, 20_000).map(float))
GAPS_MS = st.one_of(st.just(0), st.integers(1, 3_000), st.integers(3_000, 120_000))
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("take"), GAPS_MS, st.integers(0, 30_000)),  # tokens; above the capacity too
        st.tuples(st.just("adjust"), GAPS_MS, st.integers(-3, 3), st.integers(-20_000, 20_000)),  # requests, tokens
        st.tuples(st.just("give_back"), GAPS_MS, st.integers(0, 40)),  # which earlier take
    ),
    min_size=1,
    max_size=30,
)


def test_the_lua_bucket_gives_the_answers_of_qos_token_bucket(redis_server):
    """One bucket pair (requests and tokens per minute; 0: no limit), driven through the
    real reserve and adjust scripts and through two :class:`qos.TokenBucket` s at the same
    times: every take is allowed or refused alike (refused: the same wait and unit), and
    the levels agree after every step, debt and clipping at the capacity included. The
    mirror's local pre-check, fed the reserve replies, refuses what Redis would.

    A take whose refill lands within rounding of the need (a tie) may go either way; the
    model then follows Redis."""
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    reserve = client.register_script(_with_test_clock("reserve"))
    adjust = client.register_script(_with_test_clock("adjust"))
    runs = itertools.count()

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(rpm=LIMITS, tpm=TOKEN_LIMITS, ops=OPS)
    def run(rpm: float, tpm: float, ops: list[tuple]) -> None:
        assume(rpm or tpm)
        k = Keys(f"twin{next(runs)}")
        b = Bucket(k.user_bucket("u"), "user", rpm, tpm)
        log, replica = k.reserve_log("r1"), k.replica("r1")
        rq = TokenBucket.per_minute(rpm, 0.0) if rpm else None
        tk = TokenBucket.per_minute(tpm, 0.0) if tpm else None
        clock = [0.0]
        mirror = Mirror(max_age_s=1e9, clock=lambda: clock[0])
        fresh = False  # the mirror's reading is Redis's levels after the previous step
        sent: dict[int, int] = {}  # reserve number -> tokens
        ran: set[int] = set()  # reserves that took and were not given back
        now_ms, number, seq = START_MS, 0, 0

        def levels_agree(r: float | None, t: float | None, now: float, what: str) -> None:
            for bucket, level, unit in ((rq, r, "requests"), (tk, t, "tokens")):
                if bucket is not None:
                    assert _close(level, _level(bucket, now)), (what, unit, level, _level(bucket, now))

        def stored(now: float, what: str) -> None:
            """Redis's levels as stored at ``now`` (a missing key or field: full)."""
            r, t = client.hmget(b.key, "r", "t")
            levels_agree(float(r) if r is not None else rpm, float(t) if t is not None else tpm, now, what)

        for step, (kind, gap, *a) in enumerate(ops):
            now_ms += gap
            now = clock[0] = (now_ms - START_MS) / 1000.0
            client.set(CLOCK_KEY, now_ms)
            what = f"step {step}: {kind}"
            if kind == "take":
                n = a[0]
                waits = [(bucket.wait_time(need, now), unit) for bucket, need, unit in ((rq, 1, "requests"), (tk, n, "tokens")) if bucket is not None]
                want = max(w for w, _ in waits)
                number += 1
                sent[number] = n
                keys, args = reserve_args((b,), n, log, number, 1, 600_000)
                wait, scope, unit, lv = parse_reserve(reserve(keys=keys, args=args), (b,))
                tie = (wait == 0) != (want == 0)
                if tie:  # the refill lands within rounding of the need
                    assert max(wait, want) <= 1e-6, (what, wait, want)
                elif wait:
                    assert abs(wait - want) <= 1e-6 * max(1.0, want), (what, wait, want)
                    if all(abs(w - want) > 1e-6 * max(1.0, want) for w, u in waits if u != unit):
                        assert scope == "user" and unit == max(waits)[1], (what, unit, waits)
                if fresh:  # the local pre-check, on the levels of the previous reply
                    try:
                        mirror.check((b,), n)
                    except RateLimited as e:
                        assert abs(e.retry_after_s - wait) <= 1e-6 * max(1.0, wait), (what, e.retry_after_s, wait)
                    else:
                        assert wait <= 1e-6, (what, "the mirror lets through what Redis refuses", wait)
                if wait == 0:
                    for bucket, need in ((rq, 1), (tk, n)):
                        if bucket is not None:
                            bucket.take(need, now)
                    ran.add(number)
                levels_agree(lv[0][0], lv[0][1], now, what)
                mirror.record((b,), lv)
                fresh = True
            else:
                seq += 1
                if kind == "adjust":
                    dr, dt = a
                    keys, args = adjust_args(replica, log, seq, 600_000, {b.key: [rpm, tpm, float(dr), float(dt)]})
                    for bucket, delta in ((rq, dr), (tk, dt)):
                        if bucket is not None:
                            bucket.adjust(delta, now)
                    stored_now = True
                else:
                    if not sent:
                        continue
                    which = 1 + a[0] % number
                    keys, args = adjust_args(replica, log, seq, 600_000, {}, [(which, (b,), sent[which])])
                    stored_now = which in ran
                    if which in ran:  # given back once; a refused or returned take gives nothing
                        ran.discard(which)
                        for bucket, need in ((rq, 1), (tk, sent[which])):
                            if bucket is not None:
                                bucket.adjust(-need, now)
                assert adjust(keys=keys, args=args) == 1
                fresh = False
                if stored_now:  # Redis wrote the bucket at this step's time
                    stored(now, what)
            # the script's expiry is in Redis's real time, the test's clock is simulated: a
            # key must live until the model says full (the expiry has tests of its own)
            client.persist(b.key)

    run()
