"""Command line and environment for the CPU engine: ``transformers serve`` (transformers 5.24).

The server is started pinned to one local model folder (the positional ``FORCE_MODEL``
argument). It then answers only for that model, under the name it was given on the command
line, verbatim: requests must send ``"model": served_model_name(model_dir)`` or leave
``model`` out; any other name gets HTTP 400 ("Server is pinned to ..."). To give the model
a short name, the server runs in the folder's parent directory (:func:`cpu_workdir`) and is
given the folder's base name (``smollm2-135m-instruct`` for the bundled model). ``GET /v1/models``
lists exactly that one model::

    {"object": "list", "data": [{"owned_by": "local", "id": "<folder>", "object": "model",
                                 "created": 0, "status": {"value": "loaded"}}]}

It is invoked as ``<python> -m transformers.cli.transformers serve ...`` (the module the
``transformers`` console script wraps), so it works without the venv's ``bin`` on PATH and
without relying on the console script's absolute shebang.

Sources: ``transformers serve --help``; transformers/cli/serving/{model_manager,utils}.py.
The ``--cb-*`` caps (64 blocks, 512 batch tokens by default) matter: measured with
transformers 5.24, continuous batching reserved ~5.6 GB without them and ~1.8 GB RSS with
them (docs/deploy.md, "The ``cpu`` profile").
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

TRANSFORMERS_CLI_MODULE = "transformers.cli.transformers"

#: Environment forced on the child: no network, no update check.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_UPDATE_CHECK": "1",  # else the CLI may query PyPI once a day at start
    "HF_HUB_DISABLE_TELEMETRY": "1",
}


def served_model_name(model_dir: Path | str) -> str:
    """The ``model`` value the CPU engine accepts and reports: the folder's base name, as
    :func:`cpu_command` passes it (relative to :func:`cpu_workdir`)."""
    return Path(model_dir).expanduser().absolute().name


def cpu_workdir(model_dir: Path | str) -> Path:
    """Working directory for the server process: the model folder's parent, so that the
    relative name from :func:`served_model_name` resolves to the folder."""
    return Path(model_dir).expanduser().absolute().parent


def cpu_command(
    model_dir: Path | str,
    host: str,
    port: int,
    cb_num_blocks: int = 64,
    cb_max_batch_tokens: int = 512,
    *,
    python: str | None = None,
    log_level: str = "warning",
) -> list[str]:
    """Argv starting ``transformers serve`` on ``model_dir`` at ``host:port`` on the CPU.

    Args:
        model_dir: Hugging Face model folder (see :func:`engine_server.cpu_model.prepare_cpu_model`).
        host, port: listen address of the engine's HTTP server.
        cb_num_blocks: KV cache blocks for continuous batching (caps memory).
        cb_max_batch_tokens: max tokens per continuous-batching step (caps memory).
        python: interpreter to run; default ``sys.executable`` (the venv's own).
        log_level: transformers log level inside the server ("warning", "info", ...).
    """
    return [
        python or sys.executable,
        "-m",
        TRANSFORMERS_CLI_MODULE,
        "serve",
        served_model_name(model_dir),
        "--host",
        host,
        "--port",
        str(port),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--continuous-batching",
        "--cb-num-blocks",
        str(cb_num_blocks),
        "--cb-max-batch-tokens",
        str(cb_max_batch_tokens),
        "--log-level",
        log_level,
    ]


def cpu_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for the CPU engine child: ``base`` (default ``os.environ``) plus
    ``OMP_NUM_THREADS=1`` unless already set, and the offline switches of :data:`OFFLINE_ENV`."""
    env = dict(os.environ if base is None else base)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(OFFLINE_ENV)
    return env
