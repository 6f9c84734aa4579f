"""Upstream HTTP client libraries side by side, for the proxy's job (issue 22).

The job, from one asyncio (uvloop) process, keep-alive pooled connections to one HTTP/1.1
upstream (``bench.fake_upstream``) on 127.0.0.1:

* a non-streaming request: POST a ~300-byte JSON body, read the status, walk the
  response headers once, read the small JSON answer and parse it (orjson, the same for
  every library);
* a stream: POST with ``"stream": true, "max_tokens": 64`` and read the SSE answer (66
  events: 64 tokens, the last chunk with usage, ``[DONE]``) chunk by chunk as the library
  hands it over; measured with no pause between tokens upstream (the issue's "streams
  with no pause", where chunks coalesce) and with ``--paced-itl-s`` between tokens
  (1 ms: every event its own chunk, as from an engine);
* checks, once per library: that a stream's chunks reach Python as they arrive (20 ms
  between tokens upstream: the first chunk before the second token is written, one chunk
  per event), and that closing a response mid-stream closes the connection (the
  upstream's ``/stats`` counts the stream ``aborted`` within 3 s; this is how the proxy
  aborts a generation), and that the pool still serves a request afterwards.

Each library runs in its own child process (``--child LIB``), pinned with all its threads
to ``--client-cpu`` (the fake upstream to ``--upstream-cpu``), and measures its own CPU
(``time.process_time()``: every thread of the process, Rust runtimes and thread pools
included) over a closed loop of ``--requests`` requests, then ``--streams`` streams, then
``--paced-streams`` paced streams, at ``--concurrency``, after a warm-up that fills the
pool. ``--rounds`` rounds alternate the libraries (the order rotates each round); the
table gives medians. Requests/s is bounded by the one-process fake upstream on its core
as much as by the client: CPU per request is the figure to compare.

``raw`` is not a candidate: a minimal hand-written HTTP/1.1 client on
``asyncio.Protocol`` (Content-Length and chunked bodies, nothing else), here as the floor
of what any asyncio client pays in Python for this job.

Run it with a Python that has the libraries (a throwaway venv, never the proxy's)::

    python3 -m venv /tmp/clients-venv
    /tmp/clients-venv/bin/pip install aiohttp uvloop orjson pyreqwest httpr rnet curl-cffi niquests httpx
    /tmp/clients-venv/bin/python -m bench.http_clients            # 3 rounds, about 6 minutes on 2 cores
    /tmp/clients-venv/bin/python -m bench.http_clients --quick    # 1 round, small counts

Libraries that are not installed are skipped with a note. The fake upstream runs with
``--upstream-python`` (default: the repo's ``.venv`` if present, else this Python).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import harness as h

# library name -> (module to import, distribution name for its version)
LIBS = {
    "aiohttp": ("aiohttp", "aiohttp"),
    "httpx": ("httpx", "httpx"),
    "niquests": ("niquests", "niquests"),
    "curl_cffi": ("curl_cffi", "curl_cffi"),
    "rnet": ("rnet", "rnet"),
    "pyreqwest": ("pyreqwest", "pyreqwest"),
    "httpr": ("httpr", "httpr"),
    "raw": (None, None),
}
PROMPT = "Write a short poem about the sea, in four lines, with a rhyme on the second and fourth lines. " * 2
HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream", "Authorization": "Bearer sk-upstream-key"}
STREAM_TOKENS = 64
STREAM_EVENTS = STREAM_TOKENS + 2  # 64 tokens, the last chunk with usage, [DONE]


def _body(stream: bool, max_tokens: int) -> bytes:
    return json.dumps(
        {"model": "fake-model", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens, "stream": stream, "temperature": 0.7},
        separators=(",", ":"),
    ).encode()


# ---------------------------------------------------------------- adapters (child side)
#
# Each adapter: ``await request(body) -> bytes`` (the whole answer), ``await stream(body,
# on_chunk)`` (calls ``on_chunk(chunk)`` per chunk handed over; ``on_chunk`` returns True
# to abort: the adapter then closes the response, the way the proxy aborts), ``await
# aclose()``. ``make(url, concurrency)`` builds one inside the running loop.


class AiohttpClient:
    """aiohttp's ClientSession as the proxy configures it (``proxy/relay/upstream.py``)."""

    def __init__(self, url: str, conc: int) -> None:
        import aiohttp
        from multidict import CIMultiDict
        from yarl import URL

        self.aiohttp = aiohttp
        self.url = URL(url)
        self.headers = CIMultiDict(HEADERS)
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=conc, keepalive_timeout=60, ttl_dns_cache=300),
            timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=60),
            auto_decompress=True,
            skip_auto_headers=("User-Agent",),
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    async def request(self, body: bytes) -> bytes:
        r = await self.session.request("POST", self.url, data=body, headers=self.headers, allow_redirects=False)
        try:
            _touch(r.status, r.headers.items())
            return await r.read()
        finally:
            r.release()

    async def stream(self, body: bytes, on_chunk) -> None:
        r = await self.session.request("POST", self.url, data=body, headers=self.headers, allow_redirects=False)
        _touch(r.status, r.headers.items())
        async for chunk in r.content.iter_any():
            if on_chunk(chunk):
                r.close()  # the proxy's abort: the connection is closed, not drained
                return
        r.release()

    async def aclose(self) -> None:
        await self.session.close()


class HttpxClient:
    """httpx.AsyncClient (httpcore + h11 underneath)."""

    def __init__(self, url: str, conc: int) -> None:
        import httpx

        self.url = url
        self.client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=conc, max_keepalive_connections=conc), timeout=httpx.Timeout(60.0), headers=HEADERS
        )

    async def request(self, body: bytes) -> bytes:
        r = await self.client.post(self.url, content=body)
        _touch(r.status_code, r.headers.items())
        return r.content

    async def stream(self, body: bytes, on_chunk) -> None:
        async with self.client.stream("POST", self.url, content=body) as r:
            _touch(r.status_code, r.headers.items())
            async for chunk in r.aiter_raw():
                if on_chunk(chunk):
                    return  # leaving the block closes the response

    async def aclose(self) -> None:
        await self.client.aclose()


class NiquestsClient:
    """niquests.AsyncSession (urllib3-future underneath)."""

    def __init__(self, url: str, conc: int) -> None:
        import niquests

        self.url = url
        self.session = niquests.AsyncSession(pool_connections=1, pool_maxsize=conc, retries=False, disable_http2=True, disable_http3=True, headers=HEADERS)

    async def request(self, body: bytes) -> bytes:
        r = await self.session.post(self.url, data=body)
        _touch(r.status_code, r.headers.items())
        return r.content

    async def stream(self, body: bytes, on_chunk) -> None:
        r = await self.session.post(self.url, data=body, stream=True)
        try:
            _touch(r.status_code, r.headers.items())
            async for chunk in await r.iter_content(chunk_size=-1):
                if on_chunk(chunk):
                    return
        finally:
            await r.close()

    async def aclose(self) -> None:
        await self.session.close()


class CurlCffiClient:
    """curl_cffi.requests.AsyncSession (libcurl's multi interface on the event loop)."""

    def __init__(self, url: str, conc: int) -> None:
        from curl_cffi import requests as cr

        self.url = url
        self.session = cr.AsyncSession(max_clients=conc, headers=HEADERS, timeout=60)

    async def request(self, body: bytes) -> bytes:
        r = await self.session.post(self.url, data=body)
        _touch(r.status_code, r.headers.items())
        return r.content

    # its documented close (``aclose``, the end of ``session.stream()``) waits for the
    # transfer to end; True: abort by cancelling the response's transfer task instead
    # (``astream_task``: not a public API), which removes the handle from curl's multi
    # and so closes the connection
    internal_abort = False

    async def stream(self, body: bytes, on_chunk) -> None:
        r = await self.session.post(self.url, data=body, stream=True)
        try:
            _touch(r.status_code, r.headers.items())
            async for chunk in r.aiter_content():
                if on_chunk(chunk):
                    if self.internal_abort:
                        r.astream_task.cancel()
                    return
        finally:
            try:
                await r.aclose()
            except asyncio.CancelledError:
                if not self.internal_abort or asyncio.current_task().cancelling():
                    raise

    async def aclose(self) -> None:
        await self.session.close()


class RnetClient:
    """rnet.Client (Rust: a hyper/reqwest fork on tokio)."""

    def __init__(self, url: str, conc: int) -> None:
        import rnet

        self.url = url
        self.client = rnet.Client(pool_max_idle_per_host=conc, pool_max_size=conc, http1_only=True, default_headers=HEADERS, timeout=60)

    async def request(self, body: bytes) -> bytes:
        r = await self.client.post(self.url, body=body)
        _touch(r.status, r.headers.items())
        return await r.bytes()

    async def stream(self, body: bytes, on_chunk) -> None:
        r = await self.client.post(self.url, body=body)
        _touch(r.status, r.headers.items())
        try:
            async with r.stream() as chunks:
                async for chunk in chunks:
                    if on_chunk(chunk):
                        return
        finally:
            await r.close()

    async def aclose(self) -> None:
        pass


class PyreqwestClient:
    """pyreqwest's Client (Rust: reqwest on tokio). Chunks are its zero-copy ``Bytes``
    (buffer protocol), not ``bytes``. Streams read with no read-ahead buffer (see
    :meth:`stream`)."""

    def __init__(self, url: str, conc: int) -> None:
        from pyreqwest.client import ClientBuilder

        self.url = url
        self.client = ClientBuilder().max_connections(conc).pool_max_idle_per_host(conc).http1_only().default_headers(HEADERS).build()

    async def request(self, body: bytes) -> bytes:
        r = await self.client.post(self.url).body_bytes(body).build().send()
        _touch(r.status, r.headers.items())
        return memoryview(await r.bytes())  # its Bytes has the buffer protocol; orjson takes a memoryview

    async def stream(self, body: bytes, on_chunk) -> None:
        # streamed_read_buffer_limit(0): by default (64 KiB) it reads ahead that much, or
        # to the end, before the response is handed over: no chunk by chunk
        async with self.client.post(self.url).body_bytes(body).streamed_read_buffer_limit(0).build_streamed() as r:
            _touch(r.status, r.headers.items())
            reader = r.body_reader
            while (chunk := await reader.read_chunk()) is not None:
                if on_chunk(chunk):
                    return  # leaving the block drops the body

    async def aclose(self) -> None:
        await self.client.close()


class HttprClient:
    """httpr.AsyncClient: a blocking Rust (reqwest) client run on a thread pool, one
    executor hop per request and per chunk. Its ``close()`` of a stream (the end of
    ``client.stream()``) leaves the transfer running: the connection closes only when
    the response object is freed."""

    def __init__(self, url: str, conc: int) -> None:
        import httpr

        self.url = url
        self.client = httpr.AsyncClient(max_concurrency=conc, headers=HEADERS, timeout=60)

    async def request(self, body: bytes) -> bytes:
        r = await self.client.post(self.url, content=body)
        _touch(r.status_code, r.headers.items())
        return r.content

    async def stream(self, body: bytes, on_chunk) -> None:
        async with self.client.stream("POST", self.url, content=body) as r:
            _touch(r.status_code, r.headers.items())
            async for chunk in r.aiter_bytes():
                if on_chunk(chunk):
                    return

    async def aclose(self) -> None:
        await self.client.aclose()


class _RawConn(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None
        self.lost = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def connection_lost(self, exc) -> None:
        self.lost = True
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def more(self) -> None:
        if self.lost:
            raise ConnectionError("upstream closed the connection")
        self.waiter = asyncio.get_running_loop().create_future()
        await self.waiter
        self.waiter = None


class RawClient:
    """Not a candidate: the floor. HTTP/1.1 by hand on ``asyncio.Protocol``: a pool of
    idle connections, Content-Length and chunked answers, no timeouts, no redirects, no
    TLS, minimal checks."""

    def __init__(self, url: str, conc: int) -> None:
        rest = url.split("://", 1)[1]
        hostport, self.path = rest.split("/", 1)
        self.host, port = hostport.split(":")
        self.port = int(port)
        self.path = "/" + self.path
        self.head = "".join(f"{k}: {v}\r\n" for k, v in HEADERS.items())
        self.idle: list[_RawConn] = []

    async def _conn(self) -> _RawConn:
        while self.idle:
            c = self.idle.pop()
            if not c.lost:
                return c
        _, c = await asyncio.get_running_loop().create_connection(_RawConn, self.host, self.port)
        return c

    async def _send(self, body: bytes) -> tuple[_RawConn, int, list, int | None]:
        c = await self._conn()
        c.transport.write(
            f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{self.head}Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        while (end := c.buf.find(b"\r\n\r\n")) < 0:
            await c.more()
        lines = bytes(c.buf[:end]).decode("latin-1").split("\r\n")
        del c.buf[: end + 4]
        status = int(lines[0].split(" ", 2)[1])
        headers = [tuple(x.split(": ", 1)) for x in lines[1:]]
        length = None
        for k, v in headers:
            if k.lower() == "content-length":
                length = int(v)
        return c, status, headers, length

    async def request(self, body: bytes) -> bytes:
        c, status, headers, length = await self._send(body)
        _touch(status, headers)
        if length is None:
            out = bytearray()
            await self._chunks(c, out.extend)
            return bytes(out)
        while len(c.buf) < length:
            await c.more()
        data = bytes(c.buf[:length])
        del c.buf[:length]
        self.idle.append(c)
        return data

    async def _chunks(self, c: _RawConn, on_chunk) -> bool:
        """Decode a chunked body; hand over what each read completes. True: aborted."""
        buf = c.buf
        while True:
            out = []
            pos = 0
            done = False
            while True:
                nl = buf.find(b"\r\n", pos)
                if nl < 0:
                    break
                size = int(buf[pos:nl].split(b";", 1)[0], 16)
                if size == 0:
                    if len(buf) < nl + 4:
                        break
                    pos, done = nl + 4, True
                    break
                if len(buf) < nl + 2 + size + 2:
                    break
                out.append(bytes(buf[nl + 2 : nl + 2 + size]))
                pos = nl + 2 + size + 2
            del buf[:pos]
            if out and on_chunk(out[0] if len(out) == 1 else b"".join(out)):
                c.transport.close()
                return True
            if done:
                self.idle.append(c)
                return False
            await c.more()

    async def stream(self, body: bytes, on_chunk) -> None:
        c, status, headers, length = await self._send(body)
        _touch(status, headers)
        await self._chunks(c, on_chunk)

    async def aclose(self) -> None:
        for c in self.idle:
            c.transport.close()


ADAPTERS = {
    "aiohttp": AiohttpClient,
    "httpx": HttpxClient,
    "niquests": NiquestsClient,
    "curl_cffi": CurlCffiClient,
    "rnet": RnetClient,
    "pyreqwest": PyreqwestClient,
    "httpr": HttprClient,
    "raw": RawClient,
}


def _touch(status, headers) -> None:
    """What the proxy does with an answer's head: read the status, walk the headers."""
    if status != 200:
        raise RuntimeError(f"upstream answered {status}")
    for _ in headers:
        pass


# ---------------------------------------------------------------- child: one library


async def _closed_loop(n: int, conc: int, one) -> dict:
    """``n`` calls of ``one()`` by ``conc`` workers; CPU (this process, all threads) and
    wall time over the whole loop."""
    left = n
    errors: list[str] = []
    extra = 0

    async def worker() -> None:
        nonlocal left, extra
        while left > 0:
            left -= 1
            try:
                got = await one()  # not `extra += await one()`: that reads extra before the await
                extra += got
            except Exception as e:  # noqa: BLE001 - counted and reported
                errors.append(f"{type(e).__name__}: {e}"[:200])
                if len(errors) > 50:
                    raise

    c0, w0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    ok = n - len(errors)
    return {"n": n, "ok": ok, "errors": len(errors), "first_error": errors[0] if errors else None, "cpu_s": cpu, "wall_s": wall, "extra": extra}


async def child_main(lib: str, base: str, a) -> dict:
    import orjson

    url = base + "/v1/chat/completions"
    client = ADAPTERS[lib](url, a.concurrency)
    req_body, stream_body = _body(False, 16), _body(True, STREAM_TOKENS)
    out: dict = {"lib": lib, "threads_at_start": len(os.listdir("/proc/self/task"))}

    async def one_request() -> int:
        orjson.loads(await client.request(req_body))
        return 0

    async def one_stream() -> int:
        st = [0, None]

        def on_chunk(chunk) -> bool:
            st[0] += 1
            st[1] = chunk
            return False

        await client.stream(stream_body, on_chunk)
        if st[1] is None or not bytes(st[1]).endswith(b"data: [DONE]\n\n"):
            raise RuntimeError("stream did not end with [DONE]")
        return st[0]

    try:
        if a.checks:
            await client.request(req_body)  # a pooled connection first: the checks time chunks, not the connect
            out["checks"] = await _checks(client, base, stream_body)
        h.http_json(base + "/timing", {"stream_itl_s": 0.0})
        await _closed_loop(a.warmup, a.concurrency, one_request)
        await _closed_loop(max(a.warmup // 5, a.concurrency), a.concurrency, one_stream)
        out["requests"] = await _closed_loop(a.requests, a.concurrency, one_request)
        out["streams"] = await _closed_loop(a.streams, a.concurrency, one_stream)
        if a.paced_streams:
            h.http_json(base + "/timing", {"stream_itl_s": a.paced_itl_s})
            try:
                out["paced"] = await _closed_loop(a.paced_streams, a.concurrency, one_stream)
            finally:
                h.http_json(base + "/timing", {"stream_itl_s": None})
        out["threads_at_end"] = len(os.listdir("/proc/self/task"))
    finally:
        await client.aclose()
    return out


async def _checks(client, base: str, stream_body: bytes) -> dict:
    """Chunk-by-chunk delivery and abort-closes-the-connection, on one stream each."""
    res: dict = {}
    itl = 0.02
    h.http_json(base + "/timing", {"stream_itl_s": itl})
    try:
        # (1) chunk by chunk: 8 tokens 20 ms apart -> 10 events over >= 140 ms
        times: list[float] = []
        t0 = time.perf_counter()
        await asyncio.wait_for(client.stream(_body(True, 8), lambda c: times.append(time.perf_counter()) and False), 10)
        res["chunks_seen"] = len(times)
        res["first_chunk_ms"] = round((times[0] - t0) * 1000, 1) if times else None
        res["spread_ms"] = round((times[-1] - times[0]) * 1000, 1) if times else None
        res["chunk_by_chunk"] = bool(times) and times[0] - t0 < 5 * itl and times[-1] - times[0] >= 6 * itl and len(times) >= 8
        # (2) abort: read 3 chunks of a 1000-token stream (20 s), close, ask the upstream
        res.update(await _abort_check(client, base))
        if not res["abort_closes"] and hasattr(client, "internal_abort"):
            client.internal_abort = True
            res["internal_abort"] = await _abort_check(client, base)
            client.internal_abort = False
        # (3) the pool still works after an abort
        h.http_json(base + "/timing", {"stream_itl_s": 0.0})
        try:
            await asyncio.wait_for(client.request(_body(False, 4)), 10)
            res["request_after_abort"] = True
        except Exception as e:  # noqa: BLE001 - reported
            res["request_after_abort"] = f"{type(e).__name__}: {e}"[:200]
    except Exception as e:  # noqa: BLE001 - reported, the bench goes on
        res["error"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        h.http_json(base + "/timing", {"stream_itl_s": None})
    return res


async def _abort_check(client, base: str) -> dict:
    """Open a 1000-token stream (20 ms between tokens upstream), read 3 chunks, let the
    adapter close the response: did the close return (within 5 s), and did the upstream
    see the connection closed within 3 s of it?"""
    h.http_json(base + "/stats/reset", {})
    seen = 0

    def on_chunk(_c) -> bool:
        nonlocal seen
        seen += 1
        return seen >= 3

    res: dict = {}
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(client.stream(_body(True, 1000), on_chunk), 5)
        res["abort_returned_ms"] = round((time.perf_counter() - t0) * 1000, 1)
    except TimeoutError:
        res["abort_returned_ms"] = "no return within 5 s"
    t1 = time.perf_counter()
    stats: dict = {}
    while time.perf_counter() - t1 < 3:
        stats = await asyncio.to_thread(h.http_json, base + "/stats")
        if stats["aborted"] >= 1 and stats["active"] == 0:
            break
        await asyncio.sleep(0.02)
    # a close that did not return is no abort, even if the timeout's cancellation then closed it
    res["abort_closes"] = isinstance(res["abort_returned_ms"], float) and stats.get("aborted", 0) >= 1 and stats.get("active", 1) == 0
    res["abort_seen_upstream_ms"] = round((time.perf_counter() - t0) * 1000, 1) if res["abort_closes"] else None
    return res


def run_child(a) -> int:
    os.sched_setaffinity(0, {a.client_cpu})  # before any library starts its threads
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    out = asyncio.run(child_main(a.child, a.base, a))
    print("RESULT " + json.dumps(out), flush=True)
    return 0


# ---------------------------------------------------------------- parent


def _version(lib: str) -> str | None:
    mod, dist = LIBS[lib]
    if mod is None:
        return "-"
    try:
        __import__(mod)
        return importlib.metadata.version(dist)
    except Exception:  # noqa: BLE001 - not installed or broken: skipped
        return None


def _fmt(v, nd=0) -> str:
    return h.fmt(v, f",.{nd}f", "-")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--libs", default=",".join(LIBS), help="comma-separated, from: " + ",".join(LIBS))
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--paced-streams", type=int, default=500, help="streams with --paced-itl-s between tokens (0: skip)")
    ap.add_argument("--paced-itl-s", type=float, default=0.001)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--client-cpu", type=int, default=0)
    ap.add_argument("--upstream-cpu", type=int, default=1)
    ap.add_argument("--upstream-python", default=None, help="Python for the fake upstream (default: the repo's .venv, else this one)")
    ap.add_argument("--quick", action="store_true", help="1 round, 1000 requests, 200 streams, 100 paced")
    ap.add_argument("--out", default=None, help="write the raw results as JSON here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--base", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--checks", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return run_child(a)
    if a.quick:
        a.rounds, a.requests, a.streams, a.paced_streams, a.warmup = 1, 1000, 200, 100, 200

    libs, versions = [], {}
    for lib in a.libs.split(","):
        v = _version(lib)
        if v is None:
            print(f"note: {lib} is not installed in {sys.executable}: skipped", flush=True)
            continue
        libs.append(lib)
        versions[lib] = v

    venv_python = h.REPO_ROOT / ".venv/bin/python"
    up_python = a.upstream_python or (str(venv_python) if venv_python.exists() else sys.executable)
    port = h.free_port()
    base = f"http://127.0.0.1:{port}"
    workdir = Path(tempfile.mkdtemp(prefix="http-clients-"))  # the upstream's log stays there
    up = h.start_fake_upstream(port, workdir, cpus={a.upstream_cpu}, python=up_python)
    results: dict[str, list] = {lib: [] for lib in libs}
    checks: dict[str, dict] = {}
    try:
        for r in range(a.rounds):
            order = libs[r % len(libs):] + libs[: r % len(libs)]
            for lib in order:
                cmd = [sys.executable, "-m", "bench.http_clients", "--child", lib, "--base", base, "--client-cpu", str(a.client_cpu),
                       "--requests", str(a.requests), "--streams", str(a.streams), "--paced-streams", str(a.paced_streams),
                       "--paced-itl-s", str(a.paced_itl_s), "--warmup", str(a.warmup), "--concurrency", str(a.concurrency)]
                if r == 0:
                    cmd.append("--checks")
                try:
                    p = subprocess.run(cmd, cwd=h.REPO_ROOT, capture_output=True, text=True, timeout=600)
                except subprocess.TimeoutExpired:
                    print(f"round {r + 1} {lib}: timed out", flush=True)
                    h.http_json(base + "/timing", {"stream_itl_s": None})
                    continue
                line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    print(f"round {r + 1} {lib}: failed (rc {p.returncode}): {p.stderr.strip()[-800:]}", flush=True)
                    continue
                res = json.loads(line[len("RESULT "):])
                if "checks" in res:
                    checks[lib] = res["checks"]
                results[lib].append(res)
                rq, st, pc = res["requests"], res["streams"], res.get("paced")
                print(
                    f"round {r + 1} {lib:10s} req {rq['cpu_s'] * 1e6 / max(rq['ok'], 1):6.0f} us cpu, {rq['ok'] / rq['wall_s']:6.0f}/s"
                    f" err {rq['errors']} | stream {st['cpu_s'] * 1e6 / max(st['ok'], 1):6.0f} us, {st['ok'] / st['wall_s']:5.0f}/s,"
                    f" {st['extra'] / max(st['ok'], 1):4.1f} chunks err {st['errors']}"
                    + (f" | paced {pc['cpu_s'] * 1e6 / max(pc['ok'], 1):6.0f} us, {pc['extra'] / max(pc['ok'], 1):4.1f} chunks err {pc['errors']}" if pc else "")
                    + (f" | first error: {rq['first_error'] or st['first_error']}" if rq["errors"] or st["errors"] else ""),
                    flush=True,
                )
    finally:
        h.stop(up)

    rows = []
    for lib in libs:
        rs = results[lib]

        def per(key: str, f):
            return h.median([f(x[key]) for x in rs if x.get(key) and x[key]["ok"]])

        c = checks.get(lib, {})
        rows.append({
            "lib": lib, "version": versions[lib], "rounds": len(rs),
            "cpu_us_per_request": per("requests", lambda s: s["cpu_s"] * 1e6 / s["ok"]),
            "requests_per_s": per("requests", lambda s: s["ok"] / s["wall_s"]),
            "cpu_us_per_stream": per("streams", lambda s: s["cpu_s"] * 1e6 / s["ok"]),
            "streams_per_s": per("streams", lambda s: s["ok"] / s["wall_s"]),
            "chunks_per_stream": per("streams", lambda s: s["extra"] / s["ok"]),
            "cpu_us_per_paced_stream": per("paced", lambda s: s["cpu_s"] * 1e6 / s["ok"]),
            "chunks_per_paced_stream": per("paced", lambda s: s["extra"] / s["ok"]),
            "errors": sum(x[k]["errors"] for x in rs for k in ("requests", "streams", "paced") if x.get(k)),
            "chunk_by_chunk": c.get("chunk_by_chunk"), "abort_closes": c.get("abort_closes"), "checks": c,
            "threads": h.median([x.get("threads_at_end") for x in rs]),
        })
    print(f"\nmedians of {a.rounds} rounds; client on CPU {a.client_cpu}, fake upstream on CPU {a.upstream_cpu}; concurrency {a.concurrency}; "
          f"{a.requests} requests, {a.streams} streams (no pause), {a.paced_streams} paced streams ({a.paced_itl_s * 1000:g} ms between tokens)\n")
    print(h.markdown_table(
        ["library", "version", "CPU µs/request", "req/s", "CPU µs/stream (no pause)", "chunks", "streams/s", "CPU µs/stream (paced)", "chunks",
         "chunk by chunk", "abort closes", "errors", "threads"],
        [[x["lib"], x["version"], _fmt(x["cpu_us_per_request"]), _fmt(x["requests_per_s"]), _fmt(x["cpu_us_per_stream"]),
          _fmt(x["chunks_per_stream"], 1), _fmt(x["streams_per_s"]), _fmt(x["cpu_us_per_paced_stream"]), _fmt(x["chunks_per_paced_stream"], 1),
          x["chunk_by_chunk"], x["abort_closes"], x["errors"], _fmt(x["threads"])] for x in rows],
        "llrrrrrrrllrr",
    ))  # fmt: skip
    print("\nchecks (20 ms between tokens upstream):")
    for lib, c in checks.items():
        print(f"  {lib:10s} {c}")
    if a.out:
        h.write_json(Path(a.out), {"args": vars(a), "rows": rows, "raw": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
