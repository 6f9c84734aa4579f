"""How the proxy's two logs are written.

* The access log (logger ``llm_qos.access``): one JSON object per line, nothing else on
  the line (the handler formats ``%(message)s`` only; the object is built by
  :func:`proxy.telemetry.access_log.access_line`).
* The diagnostic log (every other logger): readable text by default,
  ``2026-01-02 03:04:05,678 INFO llm_qos.proxy message``; or, with ``--log-format json``,
  one JSON object per line: ``{"ts": ISO 8601 UTC, "level", "logger", "message"}`` plus
  ``"exc"`` (the formatted traceback) when there is one.

Under ``llm-qos proxy --workers N`` every line of both logs says which worker wrote it
(its index, 0..N-1, as the ``worker`` label of its metrics): ``worker=I`` after the
logger's name in text, ``"worker": I`` in each JSON object (the access log's first key).
"""

from __future__ import annotations

import logging
import logging.handlers
import time

import orjson

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


class JsonFormatter(logging.Formatter):
    """Formats a record as one line of JSON (see the module docstring).

    Args:
        worker: the worker's index under ``--workers``, or ``None`` (no ``worker`` key).
    """

    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.worker is not None:
            out["worker"] = self.worker
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        return orjson.dumps(out).decode()


def diagnostic_formatter(log_format: str, worker: int | None = None) -> logging.Formatter:
    """The formatter for ``--log-format`` ``text`` or ``json``; ``worker``: the index of
    one of ``--workers`` processes, written on every line.

    Raises:
        ValueError: another format.
    """
    if log_format == "text":
        return logging.Formatter(TEXT_FORMAT if worker is None else f"%(asctime)s %(levelname)s %(name)s worker={worker} %(message)s")
    if log_format == "json":
        return JsonFormatter(worker)
    raise ValueError(f"unknown log format {log_format!r} (text or json)")


class _WorkerAccessFormatter(logging.Formatter):
    """The access line's JSON object with ``"worker": I`` as its first key."""

    def __init__(self, worker: int) -> None:
        super().__init__("%(message)s")
        self._prefix = f'{{"worker":{int(worker)},'

    def format(self, record: logging.LogRecord) -> str:
        line = record.getMessage()
        return self._prefix + line[1:] if line.startswith("{") and len(line) > 2 else line


ACCESS_FORMATTER = logging.Formatter("%(message)s")


def access_formatter(worker: int | None = None) -> logging.Formatter:
    """The access log's formatter: the line as built; with ``worker`` (one of
    ``--workers`` processes), ``"worker": I`` added to its JSON object."""
    return ACCESS_FORMATTER if worker is None else _WorkerAccessFormatter(worker)


class AccessLogBuffer(logging.handlers.MemoryHandler):
    """The access log's buffer (like nginx's ``access_log ... buffer=``): records are kept
    until ``capacity`` of them are held (or one at ``flushLevel`` comes, or :meth:`flush`
    is called), then written to ``target`` **in one write**: the lines formatted by the
    target's formatter, joined, written to its stream and flushed once. The standard
    ``MemoryHandler`` hands each record to the target on its own, which costs a
    ``write`` system call per line, and with a ``WatchedFileHandler`` an ``os.stat`` per
    line as well (its rotation check, here once per batch).

    A target that is not a ``logging.StreamHandler``, or one with filters of its own, gets
    the records one by one as from ``MemoryHandler``. A batch that cannot be formatted or
    written is reported through the target's ``handleError`` (logging's own rule: a
    logging failure never raises into the program) and dropped.
    """

    def flush(self) -> None:
        """Write the buffered records to the target (see the class docstring)."""
        self.acquire()
        try:
            target, records = self.target, self.buffer
            if target is None or not records:
                return
            self.buffer = []
            if not isinstance(target, logging.StreamHandler) or target.filters:
                for record in records:
                    target.handle(record)
                return
            target.acquire()
            try:
                if isinstance(target, logging.handlers.WatchedFileHandler):
                    target.reopenIfNeeded()  # logrotate moved the file: write to the new one
                terminator = target.terminator
                target.stream.write("".join([target.format(r) + terminator for r in records]))
                target.flush()
            except Exception:
                target.handleError(records[-1])
            finally:
                target.release()
        finally:
            self.release()
