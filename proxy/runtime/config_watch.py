"""Hot reload: watch the config file's directory, validate, swap atomically.

The watcher (watchfiles, inotify underneath) watches the *directory* that holds the file,
not the file's inode, so it sees an in-place write, an editor's write-to-temp-then-rename,
and a Kubernetes ConfigMap update (where the file is a symlink through ``..data``, a
symlink swapped atomically). Every event in the directory triggers a re-read; a file whose
bytes did not change is ignored, a file that does not parse or validate changes nothing
(the old config stays, the error is logged once and counted); the first good read after
an error logs one line saying the config is valid again.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from ..config.loading import ConfigError, config_digest, parse_config
from ..telemetry.metrics import RELOAD_ERROR, RELOAD_OK
from .state import ProxyState

log = logging.getLogger("llm_qos.config")


def reload_config(state: ProxyState) -> bool:
    """Re-read ``state.config_path`` and apply it if it is valid and changed.

    Returns:
        True if the active config is now the file's content (applied, or unchanged);
        False on any error, which is kept in ``state.last_error``, logged, and counted
        in ``llm_qos_config_reloads_total{result="error"}``.
    """
    path = state.config_path
    if path is None:
        return False
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        return _failed(state, f"{path}: cannot read: {e}")
    digest = config_digest(data)
    was_broken = state.last_error is not None
    if digest == state.active.digest:
        state.last_error = None  # the file is the active config again (e.g. a bad edit undone)
        if was_broken:
            log.info("config %s is valid again: it is the active config (hash %s)", path, digest)
        return True
    try:
        config = parse_config(data.decode("utf-8"), path)
        state.apply(config, digest)
    except UnicodeDecodeError as e:
        return _failed(state, f"{path}: not UTF-8: {e}")
    except (ConfigError, ValueError) as e:
        return _failed(state, str(e))
    state.metrics.config_reloads.labels(RELOAD_OK).inc()
    if was_broken:
        log.info("config %s is valid again: reloaded (hash %s)", path, digest)
    else:
        log.info("config reloaded from %s (hash %s)", path, digest)
    return True


def _failed(state: ProxyState, message: str) -> bool:
    if message != state.last_error:
        log.error("config reload failed, keeping the active config (hash %s): %s", state.active.digest, message)
    state.last_error = message
    state.metrics.config_reloads.labels(RELOAD_ERROR).inc()
    return False


async def watch_config(state: ProxyState, stop: asyncio.Event, debounce_ms: int = 50) -> None:
    """Reload the config whenever something changes in its directory, until ``stop``.

    Args:
        state: the proxy state (its ``config_path`` is watched).
        stop: set to end the watch.
        debounce_ms: events closer than this are coalesced (milliseconds). The watcher
            thread checks for changes every 100 ms (watchfiles `step`): each check takes
            the GIL, so a shorter step costs request latency.
    """
    from watchfiles import awatch

    logging.getLogger("watchfiles").setLevel(logging.WARNING)  # not a line per file event

    path = Path(state.config_path).absolute()
    async for _changes in awatch(path.parent, stop_event=stop, debounce=debounce_ms, step=100, recursive=False):
        reload_config(state)
