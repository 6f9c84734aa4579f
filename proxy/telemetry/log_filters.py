"""Logging filters that keep request data out of the logs."""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError


class MalformedRequestFilter(logging.Filter):
    """Shortens aiohttp's log of an unparsable request (over-long header, bad request
    line, a ``Content-Encoding`` it cannot decode) to one line without the offending
    bytes: those can be an API key (an oversized ``Authorization`` header) or a prompt.
    The client still gets its 400.

    Also a body that failed to decode (a bad gzip stream, broken chunking): the handler
    answered 400 ``invalid_body``, then aiohttp, reading the rest of the body before it
    reuses the connection, logs "Unhandled exception" with a traceback; here one line
    (the connection is closed either way)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg, record.args = "malformed request refused (%s, status %s)", (type(exc).__name__, exc.code)
            record.exc_info = record.exc_text = None
        elif isinstance(exc, RequestPayloadError):
            cause = type(exc.__cause__).__name__ if exc.__cause__ is not None else "no cause"
            record.msg, record.args = "request body could not be read (%s: %s); connection closed", (type(exc).__name__, cause)
            record.exc_info = record.exc_text = None
        return True


def install() -> None:
    """Attach the filters to aiohttp's server logger."""
    logging.getLogger("aiohttp.server").addFilter(MalformedRequestFilter())
