"""Logging filters that keep request data out of the logs."""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError


class MalformedRequestFilter(logging.Filter):
    """Shortens aiohttp's log of an unparsable request (over-long header, bad request
    line) to one line without the offending bytes: those can be an API key (an
    oversized ``Authorization`` header) or a prompt. The client still gets its 400."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg, record.args = "malformed request refused (%s, status %s)", (type(exc).__name__, exc.code)
            record.exc_info = record.exc_text = None
        return True


def install() -> None:
    """Attach the filters to aiohttp's server logger."""
    logging.getLogger("aiohttp.server").addFilter(MalformedRequestFilter())
