"""How the proxy's two logs are written.

* The access log (logger ``llm_qos.access``): one JSON object per line, nothing else on
  the line (the handler formats ``%(message)s`` only; the object is built by
  ``proxy.handlers._log_access``).
* The diagnostic log (every other logger): readable text by default,
  ``2026-01-02 03:04:05,678 INFO llm_qos.proxy message``; or, with ``--log-format json``,
  one JSON object per line: ``{"ts": ISO 8601 UTC, "level", "logger", "message"}`` plus
  ``"exc"`` (the formatted traceback) when there is one.
"""

from __future__ import annotations

import logging
import time

import orjson

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


class JsonFormatter(logging.Formatter):
    """Formats a record as one line of JSON (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        return orjson.dumps(out).decode()


def diagnostic_formatter(log_format: str) -> logging.Formatter:
    """The formatter for ``--log-format`` ``text`` or ``json``.

    Raises:
        ValueError: another format.
    """
    if log_format == "text":
        return logging.Formatter(TEXT_FORMAT)
    if log_format == "json":
        return JsonFormatter()
    raise ValueError(f"unknown log format {log_format!r} (text or json)")


ACCESS_FORMATTER = logging.Formatter("%(message)s")
