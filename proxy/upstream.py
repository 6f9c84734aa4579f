"""The upstream connection pool and how one request is opened on it.

One pooled ``aiohttp.ClientSession`` per proxy process, keep-alive shorter than the
engine's (LightLLM v1.2.0's hypercorn closes idle connections after 10 s, 0.0.1's uvicorn
after 5 s; docs/deploy.md).
It keeps no cookies (an upstream's ``Set-Cookie`` must never be replayed on another
user's request) and asks for no compression (bodies are relayed as bytes, unparsed).
Aborting an upstream generation = closing its connection (``ClientResponse.close()``),
never returning it to the pool: engines abort a request when its connection drops.
"""

from __future__ import annotations

import asyncio

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from .config import UpstreamConfig

_RETRYABLE = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


class UpstreamError(Exception):
    """The upstream could not be reached or did not answer in time.

    Attributes:
        status: the HTTP status to answer the client (502 or 504).
        code: a stable error code (``upstream_unreachable``, ``upstream_timeout``, ...).
    """

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class Upstream:
    """The pool of connections to one upstream base URL.

    Args:
        config: the ``upstream`` section (URL, credential, timeouts, pool size).

    Create it inside a running event loop; :meth:`close` it on shutdown.
    """

    def __init__(self, config: UpstreamConfig) -> None:
        self.reconfigure(config)
        connector = aiohttp.TCPConnector(
            limit=config.max_connections,
            keepalive_timeout=config.keepalive_timeout_s,
            ttl_dns_cache=300,
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    def reconfigure(self, config: UpstreamConfig) -> None:
        """Use a new ``upstream`` section for requests opened from now on (URL,
        credential, timeouts); pool sizing changes need a restart. The credential is
        read (from the environment, if so configured) here, once per config."""
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        key = config.credential()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self._headers = CIMultiDict(headers)
        self._timeout = aiohttp.ClientTimeout(total=None, connect=config.connect_timeout_s, sock_read=config.idle_timeout_s)
        self._urls: dict[str, URL] = {}
        self.config = config

    def _url(self, path: str) -> URL:
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = URL(self.config.url + path)
        return url

    async def open(self, method: str, path: str, body: bytes | None = None) -> aiohttp.ClientResponse:
        """Send one request and wait for the upstream's status line and headers.

        A connection reset before any response (a stale pooled connection) is retried
        once on a fresh connection.

        Args:
            method: ``GET`` or ``POST``.
            path: path with leading slash, appended to the upstream URL.
            body: bytes to send (the client's body, unchanged).

        Returns:
            The response with its body unread; the caller must ``close()`` (abort) or
            ``release()`` (done) it.

        Raises:
            UpstreamError: 502 refused / reset / DNS, 504 no headers within
                ``first_byte_timeout_s``.
        """
        config, url, headers = self.config, self._url(path), self._headers
        for attempt in (0, 1):
            try:
                if config.first_byte_timeout_s >= config.idle_timeout_s:
                    # aiohttp's sock_read (idle_timeout_s) also bounds the wait for headers
                    return await self.session.request(method, url, data=body, headers=headers, allow_redirects=False, timeout=self._timeout)
                async with asyncio.timeout(config.first_byte_timeout_s):
                    return await self.session.request(method, url, data=body, headers=headers, allow_redirects=False, timeout=self._timeout)
            except TimeoutError:
                waited = min(config.first_byte_timeout_s, config.idle_timeout_s)
                raise UpstreamError(504, "upstream_timeout", f"the upstream sent no response within {waited:g} s") from None
            except aiohttp.ClientConnectorError as e:
                raise UpstreamError(502, "upstream_unreachable", f"cannot connect to the upstream: {e.os_error or e}") from None
            except _RETRYABLE as e:
                if attempt == 0:
                    continue
                raise UpstreamError(502, "upstream_disconnected", f"the upstream closed the connection: {e}") from None
            except aiohttp.ClientError as e:
                raise UpstreamError(502, "upstream_error", f"upstream request failed: {e}") from None
        raise AssertionError("unreachable")

    async def close(self) -> None:
        """Close every pooled connection."""
        await self.session.close()
