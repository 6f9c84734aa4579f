"""The upstream connection pool and how one request is opened on it.

A small HTTP/1.1 client written for this one job, on asyncio protocols: a pool of
keep-alive connections to one upstream origin, one request at a time on each, the
request written in one ``write``, the response parsed as bytes arrive and its body
handed over as it comes, unparsed. It replaced ``aiohttp.ClientSession`` here because
the generic client cost about 100 µs of CPU per request and was the largest single item
on the proxy's hot path (``docs/performance.md``); this one costs about a quarter of that.

* Keep-alive shorter than the engine's (LightLLM closes idle connections after 5 s,
  ``shared/interop/lightllm.md``): idle connections are closed after
  ``keepalive_timeout_s``; the most recently used one is reused first.
* Aborting an upstream generation = closing its connection (:meth:`UpstreamResponse.close`),
  never returning it to the pool: engines abort a request when its connection drops.
* A connection that drops before any response (a stale pooled connection) is retried
  once on a fresh connection.
* Body reading is flow-controlled: above 64 KiB unread, the connection stops reading,
  so a slow client holds back the upstream instead of growing our memory.
* No bytes from the upstream for ``idle_timeout_s`` while a body is expected ends the
  body with :class:`aiohttp.SocketTimeoutError` (a ``TimeoutError``); one timer per
  response, re-armed lazily, not one per chunk.
* No cookies are kept, no redirects followed, no ``Accept-Encoding`` sent (bodies come
  back as they are relayed: identity), no ``User-Agent``.

Failures in the body raise aiohttp's exception types (``ClientPayloadError``,
``ServerDisconnectedError``, ``SocketTimeoutError``), which callers catch as
``aiohttp.ClientError`` / ``TimeoutError``.
"""

from __future__ import annotations

import asyncio
import socket
import ssl as ssl_module
import time
from typing import Iterator

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from .config import UpstreamConfig

MAX_HEAD_BYTES = 64 * 1024  # status line + headers
READ_HIGH_WATER = 64 * 1024  # unread body bytes above which the connection stops reading
DNS_TTL_S = 300.0
_NO_BODY_STATUS = (204, 304)


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


class _Disconnected(Exception):
    """The connection closed before a complete response head (retryable once)."""


class _BadResponse(Exception):
    """The upstream's response head is not valid HTTP/1.x."""


# ------------------------------------------------------------------ the response


_HEAD, _BODY_LENGTH, _BODY_CHUNKED, _BODY_EOF, _DONE = range(5)
# chunked sub-states
_C_SIZE, _C_DATA, _C_DATA_END, _C_TRAILER = range(4)


class UpstreamResponse:
    """One upstream answer: ``status`` and ``headers`` once :meth:`Upstream.open`
    returns, the body as it arrives (:meth:`read`, or ``content.iter_any()``).

    The caller must end it with :meth:`release` (body read to its end: the connection
    goes back to the pool) or :meth:`close` (abort: the connection is closed).
    """

    __slots__ = (
        "status", "reason", "headers", "content", "_conn", "_method", "_loop", "_state", "_head_buf",
        "_pieces", "_buffered", "_remaining", "_chunk_state", "_partial", "_keep_alive", "_exc",
        "_waiter", "_paused", "_idle_s", "_idle_timer", "_last_data", "_closed",
    )

    def __init__(self, conn: "_Conn", method: str, idle_s: float | None) -> None:
        self.status = 0
        self.reason = ""
        self.headers: CIMultiDictProxy[str] = _EMPTY_HEADERS
        self.content = self  # ``upstream.content.iter_any()`` as with aiohttp
        self._conn = conn
        self._method = method
        self._loop = conn.loop
        self._state = _HEAD
        self._head_buf = b""
        self._pieces: list[bytes] = []
        self._buffered = 0
        self._remaining = 0
        self._chunk_state = _C_SIZE
        self._partial = b""
        self._keep_alive = True
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._paused = False
        self._idle_s = idle_s
        self._idle_timer: asyncio.TimerHandle | None = None
        self._last_data = 0.0
        self._closed = False

    # ------------------------------------------------------------- feeding (protocol side)

    def _feed(self, data: bytes) -> None:
        if self._state == _HEAD:
            data = self._feed_head(data)
            if data is None:
                return
            self._wake()  # the head is complete
            if not data:
                self._arm_idle()
                return
        state = self._state
        if state == _BODY_CHUNKED:
            self._feed_chunked(data)
        elif state == _BODY_LENGTH:
            n = len(data)
            if n >= self._remaining:
                if n > self._remaining:  # bytes beyond the body: the connection is unusable
                    self._keep_alive = False
                    data = data[: self._remaining]
                self._remaining = 0
                self._push(data)
                self._finish()
            else:
                self._remaining -= n
                self._push(data)
        elif state == _BODY_EOF:
            self._push(data)
        else:  # data after the end of the body, or after an error
            self._keep_alive = False
        self._arm_idle()

    def _arm_idle(self) -> None:
        """Note the time of the upstream's latest bytes; one timer per response,
        started on the first body bytes awaited (see :meth:`_on_idle`)."""
        if self._state != _DONE and self._idle_s:
            self._last_data = self._loop.time()
            if self._idle_timer is None:
                self._idle_timer = self._loop.call_at(self._last_data + self._idle_s, self._on_idle)

    def _feed_head(self, data: bytes) -> bytes | None:
        """Parse the status line and headers; return the bytes after them, or ``None``
        while the head is incomplete."""
        buf = self._head_buf + data if self._head_buf else data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    self._fail(_BadResponse(f"response head over {MAX_HEAD_BYTES} bytes"))
                    return None
                self._head_buf = buf
                return None
            try:
                self._parse_head(buf[:end])
            except (ValueError, IndexError) as e:
                self._fail(_BadResponse(f"malformed response head: {e}"))
                return None
            buf = buf[end + 4 :]
            if self.status >= 200 or self.status == 101:
                break
            # 1xx informational (100 Continue, 103 Early Hints): the real head follows
        self._head_buf = b""
        self._start_body()
        return buf

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        version, _, rest = lines[0].partition(b" ")
        if not version.startswith(b"HTTP/1."):
            raise ValueError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        code, _, reason = rest.partition(b" ")
        status = int(code)
        headers: CIMultiDict[str] = CIMultiDict()
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip():
                raise ValueError(f"bad header line {line[:80]!r}")
            headers.add(name.decode("latin-1"), value.strip().decode("latin-1"))
        self.status = status
        self.reason = reason.decode("latin-1")
        self.headers = CIMultiDictProxy(headers)
        conn_hdr = headers.get("Connection", "").lower()
        if version == b"HTTP/1.0":
            self._keep_alive = "keep-alive" in conn_hdr
        elif "close" in conn_hdr:
            self._keep_alive = False

    def _start_body(self) -> None:
        h = self.headers
        if self._method == "HEAD" or self.status in _NO_BODY_STATUS or self.status < 200:
            self._state = _DONE
            return
        te = h.get("Transfer-Encoding")
        if te is not None and "chunked" in te.lower():
            self._state = _BODY_CHUNKED
            return
        cl = h.get("Content-Length")
        if cl is not None:
            n = int(cl) if cl.strip().isdigit() else -1
            if n < 0:
                self._fail(_BadResponse(f"bad Content-Length {cl!r}"))
                return
            self._remaining = n
            self._state = _BODY_LENGTH if n else _DONE
            return
        self._state = _BODY_EOF  # the body ends when the connection does
        self._keep_alive = False

    def _feed_chunked(self, data: bytes) -> None:
        if self._partial:
            data = self._partial + data
            self._partial = b""
        pos, n = 0, len(data)
        cs = self._chunk_state
        while pos < n:
            if cs == _C_DATA:
                take = min(self._remaining, n - pos)
                self._push(data[pos : pos + take] if (pos or take < n) else data)
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    cs = _C_DATA_END
            elif cs == _C_SIZE:
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    break
                line = data[pos:eol]
                semi = line.find(b";")
                if semi >= 0:
                    line = line[:semi]
                try:
                    size = int(line, 16)
                except ValueError:
                    self._chunk_state = cs
                    self._fail(aiohttp.ClientPayloadError(f"bad chunk size line {data[pos:eol][:40]!r}"))
                    return
                pos = eol + 2
                if size:
                    self._remaining = size
                    cs = _C_DATA
                else:
                    cs = _C_TRAILER
            elif cs == _C_DATA_END:
                if n - pos < 2:
                    break
                if data[pos : pos + 2] != b"\r\n":
                    self._chunk_state = cs
                    self._fail(aiohttp.ClientPayloadError("missing CRLF after a chunk"))
                    return
                pos += 2
                cs = _C_SIZE
            else:  # _C_TRAILER: lines until an empty one
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    break
                empty = eol == pos
                pos = eol + 2
                if empty:
                    if pos < n:
                        self._keep_alive = False
                    self._chunk_state = cs
                    self._finish()
                    return
        self._chunk_state = cs
        if pos < n:
            self._partial = data[pos:]
            if len(self._partial) > MAX_HEAD_BYTES:
                self._fail(aiohttp.ClientPayloadError("chunk size line too long"))

    def _push(self, piece: bytes) -> None:
        if not piece:
            return
        self._pieces.append(piece)
        self._buffered += len(piece)
        if self._buffered > READ_HIGH_WATER and not self._paused:
            self._paused = True
            self._conn.pause()
        self._wake()

    def _finish(self) -> None:
        self._state = _DONE
        self._stop_idle_timer()
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if self._exc is None:
            self._exc = exc
        self._keep_alive = False
        self._state = _DONE
        self._stop_idle_timer()
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    def _connection_lost(self, exc: BaseException | None) -> None:
        self._keep_alive = False
        state = self._state
        if state == _DONE:
            return
        if state == _HEAD:
            self._fail(_Disconnected(f"the upstream closed the connection{': ' + str(exc) if exc else ''}"))
        elif state == _BODY_EOF:
            self._finish()
        else:
            self._fail(aiohttp.ClientPayloadError("the upstream closed the connection before the end of the body"))

    def _on_idle(self) -> None:
        self._idle_timer = None
        if self._state in (_HEAD, _DONE) or self._closed:
            return
        now = self._loop.time()
        if self._paused or self._buffered:
            # the upstream is waiting for us (our reader is behind), not idle
            due = now + self._idle_s
        else:
            due = self._last_data + self._idle_s
        if due > now:
            self._idle_timer = self._loop.call_at(due, self._on_idle)
            return
        self._fail(aiohttp.SocketTimeoutError(f"no data from the upstream for {self._idle_s:g} s"))
        self._conn.close()

    def _head_timeout(self) -> None:
        if self._state == _HEAD:
            self._fail(TimeoutError())

    def _stop_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    # ------------------------------------------------------------- reading (caller side)

    async def _wait(self) -> None:
        w = self._waiter = self._loop.create_future()
        try:
            await w
        finally:
            self._waiter = None

    def _take(self) -> bytes:
        pieces = self._pieces
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        self._buffered = 0
        if self._paused and not self._closed:
            self._paused = False
            self._conn.resume()
        return data

    async def read(self) -> bytes:
        """The whole body (waits for its end).

        Raises:
            aiohttp.ClientPayloadError: the connection broke before the end of the body.
            aiohttp.SocketTimeoutError: no bytes for ``idle_timeout_s``.
        """
        out = []
        while True:
            if self._pieces:
                out.append(self._take())
            if self._state == _DONE:
                break
            await self._wait()
        if self._exc is not None:
            raise self._exc
        return out[0] if len(out) == 1 else b"".join(out)

    def iter_any(self) -> "UpstreamResponse":
        """Iterate over the body as it arrives (each item: all bytes received since the
        last one); raises like :meth:`read` once the bytes before a failure are out."""
        return self

    def __aiter__(self) -> "UpstreamResponse":
        return self

    async def __anext__(self) -> bytes:
        while not self._pieces:
            if self._state == _DONE:
                if self._exc is not None:
                    raise self._exc
                raise StopAsyncIteration
            await self._wait()
        return self._take()

    def release(self) -> None:
        """Done with a fully read body: the connection goes back to the pool (closed
        instead if the body is not at its end or the connection cannot be reused)."""
        if self._closed:
            return
        self._closed = True
        self._stop_idle_timer()
        conn = self._conn
        conn.response = None
        if self._state == _DONE and self._keep_alive and self._exc is None and not self._pieces:
            conn.pool._put(conn)
        else:
            conn.close()

    def close(self) -> None:
        """Abort: close the connection (the upstream sees it drop and stops generating)."""
        if self._closed:
            return
        self._closed = True
        self._stop_idle_timer()
        self._conn.response = None
        self._conn.close()


_EMPTY_HEADERS: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())


# ------------------------------------------------------------------ the connection


class _Conn(asyncio.Protocol):
    """One TCP (or TLS) connection to the upstream, one exchange at a time."""

    __slots__ = ("pool", "origin", "loop", "transport", "response", "closed", "idle_since")

    def __init__(self, pool: "Upstream", origin: tuple, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.origin = origin
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.response: UpstreamResponse | None = None
        self.closed = False
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def data_received(self, data: bytes) -> None:
        resp = self.response
        if resp is None:  # bytes on an idle connection: it cannot be trusted any more
            self.close()
            return
        resp._feed(data)

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        self.pool._forget(self)
        resp = self.response
        if resp is not None:
            resp._connection_lost(exc)

    def pause(self) -> None:
        if not self.closed and self.transport is not None:
            try:
                self.transport.pause_reading()
            except (RuntimeError, AttributeError):
                pass

    def resume(self) -> None:
        if not self.closed and self.transport is not None:
            try:
                self.transport.resume_reading()
            except (RuntimeError, AttributeError):
                pass

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool._forget(self)
            if self.transport is not None:
                self.transport.close()


# ------------------------------------------------------------------ the pool


class _Target:
    """What a config says about where requests go, prepared once per config."""

    __slots__ = ("config", "origin", "host", "port", "ssl", "server_hostname", "base_path", "head_prefix", "key")

    def __init__(self, config: UpstreamConfig) -> None:
        url = URL(config.url)
        if url.scheme not in ("http", "https") or not url.raw_host:
            raise ValueError(f"bad upstream URL {config.url!r}")
        self.config = config
        self.host = url.raw_host
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.ssl = url.scheme == "https"
        self.server_hostname = url.raw_host if self.ssl else None
        self.origin = (url.scheme, self.host, self.port)
        self.base_path = url.raw_path.rstrip("/")
        self.key = config.credential()
        lines = [f"Host: {url.host_port_subcomponent}", "Accept: application/json, text/event-stream"]
        if self.key:
            lines.append(f"Authorization: Bearer {self.key}")
        self.head_prefix = ("\r\n".join(lines) + "\r\n").encode("latin-1")

    def request_bytes(self, method: str, path: str, body: bytes | None) -> bytes:
        start = f"{method} {self.base_path}{path} HTTP/1.1\r\n".encode("latin-1")
        if body is None:
            return start + self.head_prefix + b"\r\n"
        return b"%s%sContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (start, self.head_prefix, len(body), body)


class Upstream:
    """The pool of connections to one upstream base URL.

    Args:
        config: the ``upstream`` section (URL, credential, timeouts, pool size).

    Create it inside a running event loop; :meth:`close` it on shutdown.
    """

    def __init__(self, config: UpstreamConfig) -> None:
        self.config = config
        self._target = _Target(config)
        self._loop = asyncio.get_running_loop()
        self._idle: dict[_Conn, None] = {}  # insertion order = release order (LIFO reuse)
        self._conns: set[_Conn] = set()  # every open connection, idle or busy
        self._slot_waiters: list[asyncio.Future] = []
        self._sweeper: asyncio.TimerHandle | None = None
        self._dns: dict[str, tuple[float, list]] = {}
        self._ssl_context: ssl_module.SSLContext | None = None
        self._closed = False

    def reconfigure(self, config: UpstreamConfig) -> None:
        """Use a new ``upstream`` section for requests opened from now on (URL,
        credential, timeouts); pool sizing changes need a restart. Idle connections to
        an origin that is no longer the upstream are closed."""
        self.config = config
        self._target = _Target(config)
        for conn in list(self._idle):
            if conn.origin != self._target.origin:
                conn.close()

    def _current_target(self) -> _Target:
        t = self._target
        if t.config is not self.config or t.key != self.config.credential():
            t = self._target = _Target(self.config)
        return t

    # ------------------------------------------------------------- connections

    def _put(self, conn: _Conn) -> None:
        if conn.closed or self._closed or conn.origin != self._target.origin:
            conn.close()
            return
        conn.idle_since = self._loop.time()
        self._idle[conn] = None
        if self._slot_waiters:
            self._wake_slot_waiter()
        if self._sweeper is None:
            self._sweeper = self._loop.call_later(self.config.keepalive_timeout_s, self._sweep)

    def _forget(self, conn: _Conn) -> None:
        self._idle.pop(conn, None)
        if conn in self._conns:
            self._conns.discard(conn)
            if self._slot_waiters:
                self._wake_slot_waiter()

    def _wake_slot_waiter(self) -> None:
        while self._slot_waiters:
            w = self._slot_waiters.pop(0)
            if not w.done():
                w.set_result(None)
                return

    def _sweep(self) -> None:
        """Close connections idle for longer than ``keepalive_timeout_s``."""
        self._sweeper = None
        ttl = self.config.keepalive_timeout_s
        now = self._loop.time()
        for conn in list(self._idle):  # oldest first
            if now - conn.idle_since < ttl:
                break
            conn.close()
        if self._idle:
            oldest = next(iter(self._idle))
            self._sweeper = self._loop.call_at(oldest.idle_since + ttl, self._sweep)

    def _take_idle(self, target: _Target) -> _Conn | None:
        """The most recently released idle connection to ``target``, or ``None``."""
        idle = self._idle
        while idle:
            conn, _ = idle.popitem()
            if conn.closed or conn.origin != target.origin:
                conn.close()
                continue
            if self._loop.time() - conn.idle_since >= self.config.keepalive_timeout_s:
                conn.close()  # the upstream may be closing it right now
                for old in list(idle):  # all older ones are stale too
                    old.close()
                return None
            return conn
        return None

    async def _acquire(self, target: _Target) -> _Conn:
        """An idle connection to ``target``, else a new one once ``max_connections``
        allows."""
        limit = self.config.max_connections
        while True:
            conn = self._take_idle(target)
            if conn is not None:
                return conn
            if not limit or len(self._conns) < limit:
                return await self._connect(target)
            w = self._loop.create_future()
            self._slot_waiters.append(w)
            try:
                await w
            finally:
                if w in self._slot_waiters:
                    self._slot_waiters.remove(w)

    async def _resolve(self, host: str, port: int) -> tuple[str, int]:
        """A numeric address for ``host`` (cached for :data:`DNS_TTL_S`)."""
        try:
            socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
            return host, port
        except OSError:
            pass
        now = time.monotonic()
        hit = self._dns.get(host)
        if hit is None or now - hit[0] > DNS_TTL_S:
            infos = await self._loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            if not infos:
                raise OSError(f"cannot resolve {host!r}")
            hit = self._dns[host] = (now, infos)
        return hit[1][0][4][0], port

    async def _connect(self, target: _Target) -> _Conn:
        config = self.config
        ssl_ctx = None
        if target.ssl:
            if self._ssl_context is None:
                self._ssl_context = ssl_module.create_default_context()
            ssl_ctx = self._ssl_context
        conn = _Conn(self, target.origin, self._loop)
        try:
            async with asyncio.timeout(config.connect_timeout_s):
                addr, port = await self._resolve(target.host, target.port)
                await self._loop.create_connection(
                    lambda: conn, addr, port, ssl=ssl_ctx, server_hostname=target.server_hostname
                )
        except TimeoutError:
            conn.close()
            raise UpstreamError(504, "upstream_timeout", f"cannot connect to the upstream within {config.connect_timeout_s:g} s") from None
        except (OSError, ssl_module.SSLError) as e:
            conn.close()
            raise UpstreamError(502, "upstream_unreachable", f"cannot connect to the upstream: {e}") from None
        if self._closed:
            conn.close()
            raise UpstreamError(502, "upstream_unreachable", "the proxy is shutting down")
        self._conns.add(conn)
        return conn

    # ------------------------------------------------------------- requests

    async def open(self, method: str, path: str, body: bytes | None = None) -> UpstreamResponse:
        """Send one request and wait for the upstream's status line and headers.

        A connection that closes before a complete response head (a stale pooled
        connection) is retried once on a fresh connection.

        Args:
            method: ``GET`` or ``POST``.
            path: path with leading slash, appended to the upstream URL.
            body: bytes to send (the client's body, unchanged), sent as JSON.

        Returns:
            The response with its body unread; the caller must ``close()`` (abort) or
            ``release()`` (done) it.

        Raises:
            UpstreamError: 502 refused / reset / DNS / not HTTP, 504 no headers within
                ``first_byte_timeout_s`` (or no connection within ``connect_timeout_s``).
        """
        config = self.config
        target = self._current_target()
        data = target.request_bytes(method, path, body)
        loop = self._loop
        deadline = loop.time() + config.first_byte_timeout_s
        for attempt in (0, 1):
            conn = self._take_idle(target)
            if conn is None:
                try:
                    async with asyncio.timeout_at(deadline):
                        conn = await self._acquire(target)
                except TimeoutError:
                    raise UpstreamError(504, "upstream_timeout", f"the upstream sent no response within {config.first_byte_timeout_s:g} s") from None
            resp = UpstreamResponse(conn, method, config.idle_timeout_s)
            conn.response = resp
            conn.transport.write(data)
            timer = loop.call_at(deadline, resp._head_timeout)
            try:
                while resp._state == _HEAD:
                    await resp._wait()
            except BaseException:
                timer.cancel()
                resp.close()  # cancelled (the client left): abort the upstream request
                raise
            timer.cancel()
            exc = resp._exc
            if exc is None or resp.status:  # a complete head (a body error shows when read)
                return resp
            resp.close()
            if isinstance(exc, TimeoutError):
                raise UpstreamError(504, "upstream_timeout", f"the upstream sent no response within {config.first_byte_timeout_s:g} s")
            if isinstance(exc, _Disconnected):
                if attempt == 0:
                    continue
                raise UpstreamError(502, "upstream_disconnected", f"the upstream closed the connection: {exc}")
            raise UpstreamError(502, "upstream_error", f"upstream request failed: {exc}")
        raise AssertionError("unreachable")

    async def close(self) -> None:
        """Close every pooled connection (busy ones too)."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in list(self._conns):
            conn.close()
        self._idle.clear()
        for w in self._slot_waiters:
            if not w.done():
                w.set_exception(UpstreamError(502, "upstream_unreachable", "the proxy is shutting down"))
        self._slot_waiters.clear()

    def connections(self) -> Iterator[_Conn]:
        """Open connections (for tests and metrics)."""
        return iter(list(self._conns))
