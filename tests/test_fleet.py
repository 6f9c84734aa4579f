"""Several bundled engines on one host: ports, GPU groups, NCCL ports, and ``llm-qos up
--engines N`` as a user runs it (with two real CPU engines: tests/test_fleet_e2e.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from engine_server import fleet
from tests.test_cli import ENV, REPO_ROOT


def test_cpu_engines_get_consecutive_ports_and_their_own_commands():
    plans = fleet.plan_engines(3, "cpu", 9100, model="/m")
    assert [p.url for p in plans] == ["http://127.0.0.1:9100", "http://127.0.0.1:9101", "http://127.0.0.1:9102"]
    for p in plans:
        assert p.argv[1:3] == ["-m", "engine_server"] and p.argv[p.argv.index("--port") + 1] == str(p.port)
        assert p.argv[p.argv.index("--backend") + 1] == "cpu" and p.argv[p.argv.index("--model") + 1] == "/m"
        assert p.env == {} and p.nccl_port is None and "--nccl-port" not in p.argv


def test_lightllm_engines_split_the_gpus_and_leave_nccl_ports_to_lightllm():
    plans = fleet.plan_engines(2, "lightllm", 8001, tp=2, gpus=["0", "1", "2", "3"], model="/models/llama")
    assert [p.gpus for p in plans] == [("0", "1"), ("2", "3")]
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["0,1", "2,3"]
    # LightLLM v1.2.0 binds a free NCCL port of its own when given none
    assert [p.nccl_port for p in plans] == [None, None]
    for p in plans:
        assert "--nccl-port" not in p.argv and p.argv[p.argv.index("--tp") + 1] == "2"
    one = fleet.plan_engines(1, "lightllm", 8001, tp=1)
    assert one[0].env == {}  # one engine keeps every visible GPU


def test_an_explicit_nccl_base_port_gives_each_engine_its_own():
    plans = fleet.plan_engines(2, "lightllm", 8001, gpus=["0", "1"], nccl_port=29500)
    assert [p.nccl_port for p in plans] == [29500, 29501]
    for p in plans:
        assert p.argv[p.argv.index("--nccl-port") + 1] == str(p.nccl_port)


def test_impossible_plans_are_refused():
    with pytest.raises(ValueError, match="need 4 GPUs; 3 visible"):
        fleet.plan_engines(2, "lightllm", 8001, tp=2, gpus=["0", "1", "2"])
    with pytest.raises(ValueError, match="at least 1"):
        fleet.plan_engines(0, "cpu", 8001)
    with pytest.raises(ValueError, match="out of range"):
        fleet.plan_engines(3, "cpu", 65534)
    with pytest.raises(ValueError, match="cpu or lightllm"):
        fleet.plan_engines(2, "auto", 8001)


def test_colliding_ports_are_refused():
    # an NCCL port equal to another engine's HTTP port
    with pytest.raises(ValueError, match="collide: \\[8002\\]"):
        fleet.plan_engines(2, "lightllm", 8001, gpus=["0", "1"], nccl_port=8002)


def test_visible_gpus_follow_cuda_visible_devices():
    assert fleet.visible_gpus({"CUDA_VISIBLE_DEVICES": "0, 2"}) == ["0", "2"]
    assert fleet.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


def _up(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "proxy", "up", *args], capture_output=True, text=True, env=ENV, timeout=60, cwd=REPO_ROOT)


def test_up_refuses_a_bad_engine_count_at_once():
    t0 = time.monotonic()
    out = _up("--engines", "0", "--port", "1")
    assert out.returncode == 2 and "at least 1" in out.stderr and time.monotonic() - t0 < 30
