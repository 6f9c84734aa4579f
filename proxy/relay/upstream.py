"""The upstream connection pool and how one request is opened on it.

One pooled ``aiohttp.ClientSession`` per engine (each engine of each pool has its own
:class:`Upstream`: its connections, its credential). It keeps no cookies (an
upstream's ``Set-Cookie`` must never be replayed on another user's request). It asks
for ``Accept-Encoding: identity`` (the relay reads every stream to count tokens and see
how it ends); an upstream that compresses anyway is decoded (gzip, deflate; br and zstd
when their decoder libraries are installed), and one it cannot decode fails with 502.
Aborting an upstream generation = closing its connection (``ClientResponse.close()``),
never returning it to the pool: engines abort a request when its connection drops.

A request is sent at most once. Once a request has been handed to a connection, the
proxy cannot know whether the engine read it and started generating (aiohttp, like any
HTTP/1.1 client, cannot tell whether the bytes were read before a reset), so a
connection that fails after that is answered 502 and never retried: a retry could start
a second generation. What keeps a pooled connection from going stale under a request:
aiohttp reuses only connections whose close it has not seen, and never one idle longer
than ``upstream.keepalive_timeout_s``, which is kept below the engines' own idle timeout
(uvicorn's 5 s: vLLM, SGLang, transformers serve, LightLLM 0.0.1; LightLLM v1.2.0's hypercorn: 10 s). A connect failure
(nothing sent, :attr:`UpstreamError.unsent`) is never retried on the same engine: the
handler sends the request to another engine of its pool when there is one
(:meth:`proxy.admission.admission.Admission.reroute`), else answers 502 at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from ..config.schema import UpstreamConfig
from ..config.pools import public_url
from ..wire.headers import REQUEST_ID

log = logging.getLogger("llm_qos.proxy")


def ends_in_api_version(url: str) -> bool:
    """Whether a base URL's path ends in ``/v1`` (the OpenAI SDK's ``base_url`` form):
    the proxy then sends ``/v1/v1/...``. Not refused: an engine mounted under a ``/v1``
    prefix is possible, only unlikely; :class:`Upstream` warns once per URL."""
    return URL(url).path.rstrip("/").lower().endswith("/v1")


class UpstreamError(Exception):
    """The upstream could not be reached, did not answer in time, or answered in a form
    the proxy cannot read.

    Attributes:
        status: the HTTP status to answer the client (502 or 504).
        code: a stable error code (``upstream_unreachable``, ``upstream_timeout``, ...).
        aborted: the request had been sent and its connection was closed under it (the
            engine may have started, and now aborts, a generation).
        unsent: no connection was made, so no byte of the request left the proxy (the
            connection was refused, or not made within ``connect_timeout_s``): it may be
            sent to another engine. Every other failure may have reached the engine and
            is never sent again.
    """

    def __init__(self, status: int, code: str, message: str, aborted: bool = False, unsent: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.aborted = aborted
        self.unsent = unsent


class Upstream:
    """The pool of connections to one upstream base URL.

    Args:
        config: the ``upstream`` section (URL, credential, timeouts, pool size).

    Attributes:
        accepts_stream_options: False once this upstream has rejected a request for its
            ``stream_options`` and accepted it without (:mod:`proxy.relay.upstream_body`);
            back to True when the URL changes.

    Create it inside a running event loop; :meth:`close` it on shutdown.
    """

    def __init__(self, config: UpstreamConfig) -> None:
        self.accepts_stream_options = True
        self.config = config
        self._warned_url: str | None = None
        self.reconfigure(config)
        connector = aiohttp.TCPConnector(
            limit=config.max_connections,
            keepalive_timeout=config.keepalive_timeout_s,
            ttl_dns_cache=300,
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            auto_decompress=True,  # only answers that carry a Content-Encoding are touched
            skip_auto_headers=("User-Agent",),
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    def reconfigure(self, config: UpstreamConfig) -> None:
        """Use a new ``upstream`` section for requests opened from now on (URL,
        credential, timeouts); pool sizing changes need a restart. The credential is
        read (from the environment, if so configured) here, once per config."""
        headers = {
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
            "Accept-Encoding": "identity",
        }
        key = config.credential()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self._headers = CIMultiDict(headers)
        self._timeout = aiohttp.ClientTimeout(total=None, connect=config.connect_timeout_s, sock_read=config.idle_timeout_s)
        self._urls: dict[str, URL] = {}
        if config.url != self.config.url:
            self.accepts_stream_options = True
        self.config = config
        if config.url != self._warned_url and ends_in_api_version(config.url):
            self._warned_url = config.url
            log.warning(
                "the upstream URL %s ends in /v1: the proxy appends the whole API path itself, so a chat request goes to "
                "%s/v1/chat/completions; give the engine's base URL without /v1 (the OpenAI SDK's base_url has it, the "
                "proxy's upstream URL does not), unless the engine really serves under that prefix",
                public_url(config.url),
                public_url(config.url),
            )

    def _url(self, path: str, query: str, cached: bool) -> URL:
        if query:
            return URL(f"{self.config.url}{path}?{query}", encoded=True)
        if not cached:
            return URL(self.config.url + path)
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = URL(self.config.url + path)
        return url

    def reject_stream_options(self, status: int) -> None:
        """Remember that this upstream rejects ``stream_options`` (it answered ``status``
        with it and accepted the request without it)."""
        if self.accepts_stream_options:
            self.accepts_stream_options = False
            log.warning(
                "the upstream %s rejected stream_options (HTTP %d) and accepted the request without it: "
                "not adding it any more (usage on streams is estimated; assembled answers carry the engine's usage only if it sends it)",
                public_url(self.config.url),
                status,
            )

    async def open(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        *,
        query: str = "",
        request_id: str | None = None,
        trace: Mapping[str, str] | None = None,
        body_headers: Mapping[str, str | None] | None = None,
        cached: bool = True,
    ) -> aiohttp.ClientResponse:
        """Send one request, once, and wait for the upstream's status line and headers.

        Args:
            method: ``GET`` or ``POST``.
            path: path with leading slash, appended to the upstream URL.
            body: bytes to send.
            query: the client's raw (still percent-encoded) query string, passed on.
            request_id: sent as ``X-Request-Id``.
            trace: the client's trace context headers, sent as they are
                (:func:`proxy.wire.headers.trace_headers`).
            body_headers: ``Content-Type`` and ``Accept`` to send instead of the proxy's
                own (JSON, and JSON or an event stream), a ``None`` value leaving that
                header out: a pass-through body keeps the client's types.
            cached: ``path`` is one of the proxy's own (a fixed few): its URL is built
                once. ``False`` for a path a client chose (pass-through), never kept.

        Returns:
            The response with its body unread; the caller must ``close()`` (abort) or
            ``release()`` (done) it.

        Raises:
            UpstreamError: 502 refused / DNS (``upstream_unreachable``), closed or reset
                without an answer (``upstream_disconnected``), an answer that cannot be
                read (``upstream_bad_response``: e.g. a Content-Encoding the proxy cannot
                decode); 504 no connection within ``connect_timeout_s`` or no headers
                within ``first_byte_timeout_s`` (``upstream_timeout``).
        """
        config, url, headers = self.config, self._url(path, query, cached), self._headers
        if request_id is not None or trace or body_headers:
            headers = headers.copy()
            if request_id is not None:
                headers[REQUEST_ID] = request_id
            if trace:
                headers.update(trace)
            if body_headers:
                for name, value in body_headers.items():
                    if value is None:
                        headers.popall(name, None)
                    else:
                        headers[name] = value
        try:
            if config.first_byte_timeout_s >= config.idle_timeout_s:
                # aiohttp's sock_read (idle_timeout_s) also bounds the wait for headers
                return await self.session.request(method, url, data=body, headers=headers, allow_redirects=False, timeout=self._timeout)
            async with asyncio.timeout(config.first_byte_timeout_s):
                return await self.session.request(method, url, data=body, headers=headers, allow_redirects=False, timeout=self._timeout)
        except aiohttp.ConnectionTimeoutError:
            raise UpstreamError(504, "upstream_timeout", f"no connection to the upstream within {config.connect_timeout_s:g} s", unsent=True) from None
        except TimeoutError:
            waited = min(config.first_byte_timeout_s, config.idle_timeout_s)
            raise UpstreamError(504, "upstream_timeout", f"the upstream sent no response within {waited:g} s", aborted=True) from None
        except aiohttp.ClientConnectorError as e:
            raise UpstreamError(502, "upstream_unreachable", f"cannot connect to the upstream: {e.os_error or e}", unsent=True) from None
        except aiohttp.ClientResponseError as e:
            # the parser's first line only: the rest echoes the upstream's bytes
            reason = str(e.message).splitlines()[0][:200] if e.message else type(e).__name__
            raise UpstreamError(502, "upstream_bad_response", f"the upstream's answer could not be read: {reason}", aborted=True) from None
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
            raise UpstreamError(502, "upstream_disconnected", f"the upstream closed the connection without answering: {e}") from None
        except aiohttp.ClientError as e:
            raise UpstreamError(502, "upstream_error", f"upstream request failed: {e}") from None

    async def close(self) -> None:
        """Close every pooled connection."""
        await self.session.close()
