"""The ``pools:`` config model: the single-upstream form still loads and means one pool of
one engine; pools resolve their defaults; every broken pool config is refused with a
message naming what is wrong."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from proxy.api.admin import REDACTED, redacted_config
from proxy.config.schema import Config
from proxy.config.loading import ConfigError, load_config, parse_config, with_upstream_urls
from proxy.config.pools import CATCH_ALL, DEFAULT_POOL
from tests.conftest import base_config

REPO = Path(__file__).resolve().parent.parent
# the single-upstream configs shipped; config/config.cpu.yaml is a pool over the cpu
# profile's two engines (tests/test_docker_files.py)
SHIPPED = [REPO / "proxy" / "default_config.yaml", REPO / "config" / "config.yaml"]


def pools_config(**over) -> dict:
    """Two pools: ``small`` (two engines, one alias) and the catch-all ``big``."""
    cfg = base_config("http://unused")
    del cfg["upstream"]["url"]
    cfg["upstream"]["api_key_env"] = "SHARED_KEY"
    cfg["upstream"]["load_signal"] = {"saturated_at": 0.9}
    cfg["pools"] = [
        {
            "name": "small",
            "models": ["smol", {"name": "tiny", "upstream_model": "smol"}],
            "engines": [
                {"url": "http://10.0.0.1:8001/", "kind": "lightllm", "max_inflight": 3, "load_signal": {"queue_at": 0}},
                {"url": "http://10.0.0.2:8001", "name": "b", "api_key": "sk-engine", "max_inflight_tokens": 5000, "weight": 2},
            ],
            "routing": {"policy": "round_robin", "affinity": {"session_header": "X-Session-Id", "prefix_chars": 256}},
        },
        {"name": "big", "models": [CATCH_ALL], "engines": [{"url": "http://10.0.0.3:8001"}], "health": {"check_interval_s": 0}},
    ]
    cfg.update(over)
    return cfg


def _load(cfg: dict) -> Config:
    return parse_config(yaml.safe_dump(cfg))


# ------------------------------------------------------- the single-upstream form


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_is_one_catch_all_pool_of_its_upstream(path):
    cfg = load_config(path)
    assert cfg.pools is None and not cfg.passthrough.enabled
    (pool,) = cfg.effective_pools()
    assert pool.name == DEFAULT_POOL and pool.single_upstream and pool.catch_all
    (engine,) = pool.engines
    assert engine.upstream == cfg.upstream  # the very section the relay already uses
    assert (engine.url, engine.kind) == (cfg.upstream.url, cfg.upstream.kind)
    adm = cfg.admission
    assert (engine.max_inflight, engine.max_inflight_tokens) == (adm.capacity.ceiling(adm.max_inflight), adm.max_inflight_tokens)
    assert engine.control == adm.capacity.settings(adm.max_inflight)  # found by the proxy unless fixed
    assert engine.priority_field is None


@pytest.mark.parametrize("path", sorted((REPO / "config").glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_of_the_compose_stacks_loads(path):
    load_config(path)


def _docs_yaml_blocks() -> list[tuple[str, str]]:
    out = []
    for md in sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]:
        for i, block in enumerate(re.findall(r"```yaml\n(.*?)```", md.read_text(), re.S)):
            out.append((f"{md.name}#{i}", block))
    return out


@pytest.mark.parametrize("name,block", _docs_yaml_blocks(), ids=[n for n, _ in _docs_yaml_blocks()])
def test_every_config_example_in_the_docs_loads(name, block):
    """A block is a whole config, top-level keys to put into the shipped config, or
    entries of ``groups`` (replacing the shipped groups of the same name)."""
    base = yaml.safe_load((REPO / "proxy" / "default_config.yaml").read_text())
    data = yaml.safe_load(block)
    if isinstance(data, list):
        named = {g["name"]: g for g in data}
        base["groups"] = [named.pop(g["name"], g) for g in base["groups"]] + list(named.values())
    else:
        assert isinstance(data, dict), name
        if "pools" in data:
            base["upstream"].pop("url", None)
        base.update(data)
    cfg = _load(base)
    if "pools" in (data if isinstance(data, dict) else {}):
        assert cfg.pools and all(p.engines for p in cfg.effective_pools())


# ------------------------------------------------------------------- pools


def test_engines_inherit_what_they_do_not_name():
    cfg = _load(pools_config())
    small, big = cfg.effective_pools()
    a, b = small.engines
    assert a.name == a.url == "http://10.0.0.1:8001"  # no name: the URL, trailing slash dropped
    assert a.kind == "lightllm" and b.kind == "openai"  # own kind, else upstream's
    assert a.upstream.credential() is None or a.upstream.api_key_env == "SHARED_KEY"
    assert a.upstream.api_key_env == "SHARED_KEY" and b.upstream.api_key == "sk-engine" and b.upstream.api_key_env is None
    assert (a.max_inflight, a.max_inflight_tokens) == (3, None)
    assert (b.max_inflight, b.max_inflight_tokens) == (4, 5000)  # admission.max_inflight is the default
    assert a.upstream.load_signal.saturated_at == 0.9 and a.upstream.load_signal.queue_at == 0  # override on top of upstream's
    assert b.upstream.load_signal.queue_at == 1
    assert a.upstream.idle_timeout_s == cfg.upstream.idle_timeout_s  # shared settings
    assert b.weight == 2 and small.routing.policy == "round_robin" and small.routing.affinity.prefix_chars == 256
    assert [m.name for m in small.models] == ["smol", "tiny"] and small.models[1].upstream_model == "smol"
    assert big.catch_all and not small.catch_all and big.health.check_interval_s == 0


def test_max_model_len_and_stream_usage_per_engine():
    """An engine's own ``max_model_len`` / ``stream_usage``, else ``upstream``'s; a pool's
    output ceiling is its smallest engine's context length minus the prompt (>= 1)."""
    cfg = pools_config()
    cfg["upstream"]["max_model_len"] = 8192
    cfg["pools"][0]["engines"][0].update(max_model_len=4096, stream_usage=False)
    small, big = _load(cfg).effective_pools()
    a, b = small.engines
    assert (a.upstream.max_model_len, b.upstream.max_model_len, big.engines[0].upstream.max_model_len) == (4096, 8192, 8192)
    assert (a.upstream.stream_usage, b.upstream.stream_usage) == (False, True)
    assert small.max_model_len == 4096 and big.max_model_len == 8192
    assert small.output_ceiling(1000) == 3096 and small.output_ceiling(5000) == 1 and big.output_ceiling(0) == 8192
    del cfg["upstream"]["max_model_len"]
    small, big = _load(cfg).effective_pools()
    assert small.max_model_len == 4096 and big.max_model_len is None and big.output_ceiling(10) is None
    single = base_config("http://engine:8000")
    single["upstream"]["max_model_len"] = 2048
    (pool,) = _load(single).effective_pools()
    assert pool.output_ceiling(48) == 2000


@pytest.mark.parametrize("bad", [0, -1, "4k"])
def test_max_model_len_must_be_a_positive_count(bad):
    cfg = pools_config()
    cfg["pools"][0]["engines"][0]["max_model_len"] = bad
    with pytest.raises(ConfigError, match="max_model_len"):
        _load(cfg)


def _broken(mutate) -> str:
    cfg = pools_config()
    mutate(cfg)
    with pytest.raises(ConfigError) as e:
        _load(cfg)
    return str(e.value)


@pytest.mark.parametrize(
    "mutate,needles",
    [
        (lambda c: c["pools"][1].update(name="small"), ["pool names must be unique", "small"]),
        (lambda c: c["pools"][1]["models"].append("smol"), ["'smol' is in two pools", "'small'", "'big'"]),
        (lambda c: c["pools"][0]["models"].append("*"), ["catch-all", "two pools"]),
        (lambda c: c["pools"][0]["engines"].append({"url": "http://10.0.0.1:8001"}), ["engine urls must be unique", "'small'"]),
        (lambda c: c["pools"][0]["engines"][0].update(name="b"), ["engine names must be unique", "'b'"]),
        (lambda c: c["pools"][0]["models"].append("smol"), ["model names must be unique"]),
        (lambda c: c["upstream"].update(url="http://10.0.0.9:1"), ["upstream.url", "pools", "not both"]),
        (lambda c: c["pools"][0]["engines"][0]["load_signal"].update(queue_att=1), ["load_signal", "queue_att"]),
        (lambda c: c["pools"][0]["engines"][0]["load_signal"].update(saturated_at=2), ["load_signal", "saturated_at"]),
        (lambda c: c.update(pools=[]), ["pools"]),
        (lambda c: c["pools"][1]["models"].__setitem__(0, {"name": "*", "upstream_model": "x"}), ["catch-all", "upstream_model"]),
        (lambda c: c["pools"][0].update(name="bad name"), ["pools.0.name"]),
        (lambda c: c["pools"][0]["routing"]["affinity"].update(session_header="X Session"), ["session_header"]),
        (lambda c: c["pools"][0]["routing"].update(policy="random"), ["pools.0.routing.policy"]),
        (lambda c: c["pools"][1]["health"].update(eject_base_s=10, eject_max_s=5), ["eject_max_s", "eject_base_s"]),
        (lambda c: c["pools"][0]["engines"][0].update(url="10.0.0.1:8001"), ["http://"]),
        (lambda c: c["pools"][0]["engines"][0].update(weight=0), ["weight"]),
        (lambda c: c["pools"][0]["engines"][0].update(priority_field="prio rity"), ["priority_field"]),
        (lambda c: c["pools"][0].update(engines=[]), ["engines"]),
    ],
)
def test_broken_pool_configs_are_refused_naming_the_problem(mutate, needles):
    msg = _broken(mutate)
    for n in needles:
        assert n in msg, msg


def test_several_upstream_urls_make_one_catch_all_pool():
    single = _load(base_config("http://127.0.0.1:1", max_inflight=6))
    cfg = with_upstream_urls(single, ["http://127.0.0.1:2/", "http://127.0.0.1:3"])
    (pool,) = cfg.effective_pools()
    assert pool.name == DEFAULT_POOL and pool.catch_all and not pool.single_upstream
    assert [e.url for e in pool.engines] == ["http://127.0.0.1:2", "http://127.0.0.1:3"]
    assert [e.max_inflight for e in pool.engines] == [6, 6]  # each engine as the one was
    assert cfg.groups == single.groups and cfg.admission == single.admission
    assert with_upstream_urls(single, ["http://127.0.0.1:9"]).upstream.url == "http://127.0.0.1:9"
    assert with_upstream_urls(single, None) is single
    with pytest.raises(ConfigError, match="unique"):
        with_upstream_urls(single, ["http://127.0.0.1:2", "http://127.0.0.1:2/"])
    with pytest.raises(ConfigError, match="has pools"):
        with_upstream_urls(_load(pools_config()), ["http://127.0.0.1:2"])


def test_admin_config_view_redacts_engine_keys():
    data = redacted_config(_load(pools_config()))
    engines = data["pools"][0]["engines"]
    assert engines[1]["api_key"] == REDACTED and "sk-engine" not in repr(data)


# ------------------------------------------------------------- the processes

ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def test_check_config_summarizes_pools(tmp_path):
    path = tmp_path / "pools.yaml"
    path.write_text(yaml.safe_dump(pools_config()))
    out = subprocess.run([sys.executable, "-m", "proxy", "check-config", str(path)], capture_output=True, text=True, env=ENV, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pools small (models smol, tiny; engines http://10.0.0.1:8001 (lightllm), b (openai)); big (models *;" in out.stdout


def test_pool_models_are_copied_not_shared():
    """resolve_pools must not hand out the config's own mutable lists."""
    cfg = _load(pools_config())
    before = copy.deepcopy(cfg.model_dump())
    pools = cfg.effective_pools()
    assert isinstance(pools[0].models, tuple) and isinstance(pools[0].engines, tuple)
    assert cfg.model_dump() == before
