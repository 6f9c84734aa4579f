"""The launcher can run LightLLM under another interpreter than its own
(``LLM_QOS_LIGHTLLM_PYTHON``), as in LightLLM's container image (docker/Dockerfile.engine)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from engine_server import lightllm_backend


def _fake_python(tmp_path: Path, with_lightllm: bool) -> Path:
    """An executable that runs this Python, with a stub ``lightllm`` package on its path."""
    site = tmp_path / ("site-with" if with_lightllm else "site-without")
    if with_lightllm:
        (site / "lightllm").mkdir(parents=True)
        (site / "lightllm" / "__init__.py").write_text("")
    script = tmp_path / ("python-with" if with_lightllm else "python-without")
    script.write_text(f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable}" "$@"\n')
    script.chmod(0o755)
    return script


def test_default_is_the_launchers_own_interpreter(monkeypatch, tmp_path):
    monkeypatch.delenv(lightllm_backend.LIGHTLLM_PYTHON_ENV, raising=False)
    argv = lightllm_backend.lightllm_command(lightllm_backend.LightLLMOptions(tmp_path))
    assert argv[:3] == [sys.executable, "-m", "lightllm.server.api_server"]


def test_another_interpreter_is_used_and_probed(monkeypatch, tmp_path):
    with_ll = _fake_python(tmp_path, True)
    monkeypatch.setenv(lightllm_backend.LIGHTLLM_PYTHON_ENV, str(with_ll))
    argv = lightllm_backend.lightllm_command(lightllm_backend.LightLLMOptions(tmp_path))
    assert argv[0] == str(with_ll)
    assert lightllm_backend.lightllm_available()
    monkeypatch.setenv(lightllm_backend.LIGHTLLM_PYTHON_ENV, str(_fake_python(tmp_path, False)))
    assert not lightllm_backend.lightllm_available()
    monkeypatch.setenv(lightllm_backend.LIGHTLLM_PYTHON_ENV, os.fspath(tmp_path / "missing-python"))
    assert not lightllm_backend.lightllm_available()
