"""The ``vllm`` backend's command line, environment and detection (no engine started)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from engine_server import main, vllm_backend


def test_command_is_vllms_openai_server_on_the_folder(tmp_path: Path) -> None:
    opts = vllm_backend.VllmOptions(tmp_path / "smollm2-135m-instruct", "127.0.0.1", 8123,
                                    extra_args=["--max-num-seqs", "8"])
    argv = vllm_backend.vllm_command(opts, "/opt/vllm/bin/python")
    assert argv == [
        "/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(tmp_path / "smollm2-135m-instruct"),
        "--served-model-name", "smollm2-135m-instruct",
        "--host", "127.0.0.1", "--port", "8123",
        "--max-model-len", "2048", "--dtype", "bfloat16",
        "--max-num-seqs", "8",
    ]
    with pytest.raises(ValueError):
        vllm_backend.vllm_command(vllm_backend.VllmOptions(tmp_path, max_model_len=0), "python")


def test_env_sets_the_cpu_kv_cache_only_without_a_gpu() -> None:
    cpu = vllm_backend.vllm_env(3, base={"PATH": "/bin"}, gpu=False)
    assert cpu["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert cpu["VLLM_USE_AOT_COMPILE"] == "0"  # the compile cache that loads again
    assert cpu["HF_HUB_OFFLINE"] == "1" and cpu["VLLM_NO_USAGE_STATS"] == "1" and cpu["PATH"] == "/bin"
    # the operator's own setting wins
    assert vllm_backend.vllm_env(3, base={"VLLM_CPU_KVCACHE_SPACE": "8"}, gpu=False)["VLLM_CPU_KVCACHE_SPACE"] == "8"
    gpu = vllm_backend.vllm_env(3, base={}, gpu=True)
    assert "VLLM_CPU_KVCACHE_SPACE" not in gpu and "VLLM_USE_AOT_COMPILE" not in gpu
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError):
            vllm_backend.vllm_env(bad, base={}, gpu=False)  # type: ignore[arg-type]


def test_cpu_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_backend.platform, "machine", lambda: "x86_64")
    assert vllm_backend.cpu_unsupported_reason("flags\t\t: fpu sse4_2 avx avx2 fma\n") is None
    assert vllm_backend.cpu_unsupported_reason("flags\t\t: fpu avx avx512f avx512bw\n") is None
    why = vllm_backend.cpu_unsupported_reason("flags\t\t: fpu sse4_2 avx\n")
    assert why is not None and "AVX2" in why


def test_the_dtype_is_the_fast_one_for_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 on a GPU and on AVX-512; float32 on an x86-64 CPU with AVX2 alone, where
    vLLM's bfloat16 path ran 7 times slower (1.21 s against 0.18 s to a first token)."""
    monkeypatch.setattr(vllm_backend.platform, "machine", lambda: "x86_64")
    avx2 = "flags\t\t: fpu sse4_2 avx avx2 fma\n"
    avx512 = "flags\t\t: fpu avx avx2 avx512f avx512bw\n"
    assert vllm_backend.default_dtype(gpu=False, cpuinfo=avx2) == "float32"
    assert vllm_backend.default_dtype(gpu=False, cpuinfo=avx512) == "bfloat16"
    assert vllm_backend.default_dtype(gpu=True, cpuinfo=avx2) == "bfloat16"
    monkeypatch.setattr(vllm_backend.platform, "machine", lambda: "aarch64")
    assert vllm_backend.default_dtype(gpu=False, cpuinfo=avx2) == "bfloat16"


def test_python_lookup_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(vllm_backend.VLLM_PYTHON_ENV, "/from/env/python")
    assert vllm_backend.find_vllm_python("/explicit/python") == "/explicit/python"
    assert vllm_backend.find_vllm_python() == "/from/env/python"
    monkeypatch.delenv(vllm_backend.VLLM_PYTHON_ENV)
    monkeypatch.setattr(vllm_backend, "DEFAULT_VENV_PYTHON", tmp_path / "absent" / "python")
    try:
        import importlib.util

        has_vllm_here = importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        has_vllm_here = False
    if has_vllm_here:
        assert vllm_backend.find_vllm_python() == sys.executable
    else:
        with pytest.raises(vllm_backend.VllmUnavailableError, match="make install"):
            vllm_backend.find_vllm_python()


def test_an_interpreter_without_vllm_is_refused_with_the_import_error() -> None:
    # this test's interpreter (the proxy's environment) has no vllm: the import fails
    why = vllm_backend.unavailable_reason(sys.executable)
    if why is None:
        pytest.skip("this interpreter has vllm")
    assert "import vllm" in why and "ModuleNotFoundError" in why


def test_vllm_backend_without_its_environment_is_a_usage_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(vllm_backend.VLLM_PYTHON_ENV, raising=False)
    monkeypatch.setattr(vllm_backend, "DEFAULT_VENV_PYTHON", tmp_path / "absent" / "python")
    monkeypatch.setattr(vllm_backend.importlib.util, "find_spec", lambda name: None)
    assert main.main(["--backend", "vllm", "--model", str(tmp_path)]) == main.EXIT_USAGE
