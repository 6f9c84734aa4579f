"""Limits, upstream faults and graceful shutdown: the proxy keeps serving, nothing leaks."""

from __future__ import annotations

import asyncio
import json
import signal
import socket

import aiohttp
import pytest
import yaml

from bench.fake_upstream import STATS, make_app
from tests.conftest import base_config, wait_until
from tests.engine_fixture import free_port
from tests.proxy_process import start_proxy, stop_proxy

CHAT = "/v1/chat/completions"


# ---------------------------------------------------------------------- limits


async def test_body_over_limit_is_413(make_stack, http):
    cfg = base_config("")
    cfg["limits"] = {"max_body_bytes": 2048}
    st = await make_stack(config=cfg)
    body = st.chat_body(2)
    body["messages"][0]["content"] = "x" * 4000
    async with http.post(st.proxy_url + CHAT, json=body) as r:
        assert r.status == 413
        assert (await r.json())["error"]["code"] == "body_too_large"
    async with http.post(st.proxy_url + CHAT, json=st.chat_body(2)) as r:
        assert r.status == 200


@pytest.mark.parametrize("action", ["clamp", "reject"])
async def test_group_max_tokens_cap(make_stack, http, action):
    cfg = base_config("")
    cfg["groups"][1]["max_tokens"] = 5  # bronze
    cfg["limits"] = {"max_tokens_action": action}
    st = await make_stack(config=cfg)
    async with http.post(st.proxy_url + CHAT, json=st.chat_body(50)) as r:
        if action == "reject":
            assert r.status == 400 and (await r.json())["error"]["param"] == "max_tokens"
        else:
            assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 5
    # within the cap: untouched; other groups: uncapped
    async with http.post(st.proxy_url + CHAT, json=st.chat_body(3)) as r:
        assert (await r.json())["usage"]["completion_tokens"] == 3
    async with http.post(st.proxy_url + CHAT, json=st.chat_body(50), headers={"Authorization": "Bearer sk-alice"}) as r:
        assert (await r.json())["usage"]["completion_tokens"] == 50


async def test_concurrent_request_cap_answers_503(make_stack, http):
    cfg = base_config("")
    cfg["limits"] = {"max_concurrent_requests": 2}
    st = await make_stack(config=cfg, ttft_s=0.5)
    hung = [asyncio.create_task(http.post(st.proxy_url + CHAT, json=st.chat_body(1))) for _ in range(2)]
    await wait_until(lambda: st.state.open_requests == 2, what="two requests open")
    async with http.post(st.proxy_url + CHAT, json=st.chat_body(1)) as r:
        assert r.status == 503 and r.headers["Retry-After"] == "1"
    for t in hung:
        (await t).release()


async def test_oversized_header_is_rejected(make_stack, http):
    st = await make_stack()
    async with http.post(st.proxy_url + CHAT, json=st.chat_body(1), headers={"X-Big": "a" * 20000}) as r:
        assert r.status in (400, 431)
    async with http.post(st.proxy_url + CHAT, json=st.chat_body(1)) as r:
        assert r.status == 200


# -------------------------------------------------------------- upstream faults


class RawUpstream:
    """A real TCP server whose first ``drop`` connections are closed after reading the
    request (no response: a reset pooled connection), and which answers the rest with a
    small OpenAI JSON body after ``delay_s`` (``None``: never)."""

    def __init__(self, drop: int = 0, delay_s: float | None = 0.0, extra_headers: bytes = b"") -> None:
        self.drop = drop
        self.delay_s = delay_s
        self.extra_headers = extra_headers
        self.heads: list[bytes] = []  # request heads received
        self.connections = 0
        self.server: asyncio.base_events.Server | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = self.connections
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            self.heads.append(head)
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0)
            await reader.readexactly(length)
            if n <= self.drop:
                writer.transport.abort()
                return
            if self.delay_s is None:
                await asyncio.sleep(3600)
            await asyncio.sleep(self.delay_s)
            body = b'{"choices":[{"message":{"content":"ok"}}],"usage":{"prompt_tokens":1,"completion_tokens":1}}'
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (self.extra_headers, len(body), body))
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    last: "RawUpstream | None" = None

    async def __aenter__(self) -> str:
        RawUpstream.last = self
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()


async def test_upstream_that_reads_the_request_then_drops_it_is_not_sent_it_twice(make_stack, http):
    """The upstream read the whole POST and closed without answering: it may have started
    a generation, so the proxy answers 502 and never sends the request again."""
    async with RawUpstream(drop=1) as url:
        st = await make_stack()
        st.state.upstream.reconfigure(st.state.active.config.upstream.model_copy(update={"url": url}))
        async with http.post(st.proxy_url + CHAT, json=st.chat_body(1)) as r:
            assert r.status == 502 and (await r.json())["error"]["code"] == "upstream_disconnected"
        assert RawUpstream.last.connections == 1 and len(RawUpstream.last.heads) == 1
        async with http.post(st.proxy_url + CHAT, json=st.chat_body(1)) as r:  # the next one is served
            assert r.status == 200
    assert not st.state.admission.scheduler.inflight


async def test_upstream_cookies_are_not_replayed_and_identity_encoding_is_asked(make_stack, http):
    """The pool is shared by all users: a Set-Cookie from the upstream must never ride on
    another user's request, nor reach a client; and the relay reads every answer, so it
    asks for none compressed."""
    async with RawUpstream(extra_headers=b"Set-Cookie: session=alice-secret; Path=/\r\n") as url:
        st = await make_stack()
        # by host name: aiohttp's default cookie jar ignores cookies from IP addresses
        url = url.replace("127.0.0.1", "localhost")
        st.state.upstream.reconfigure(st.state.active.config.upstream.model_copy(update={"url": url}))
        for key in ("sk-alice", "sk-carl"):
            async with http.post(st.proxy_url + CHAT, json=st.chat_body(1), headers={"Authorization": f"Bearer {key}"}) as r:
                assert r.status == 200
                assert "Set-Cookie" not in r.headers
        raw = RawUpstream.last
    heads = [h.lower() for h in raw.heads]
    assert len(heads) == 2
    assert all(b"cookie:" not in h and b"accept-encoding: identity\r\n" in h and b"sk-" not in h for h in heads)


async def test_no_headers_in_time_is_504(make_stack, http):
    async with RawUpstream(delay_s=None) as url:
        st = await make_stack()
        up = st.state.active.config.upstream.model_copy(update={"url": url, "first_byte_timeout_s": 0.3})
        st.state.upstream.reconfigure(up)
        async with http.post(st.proxy_url + CHAT, json=st.chat_body(1)) as r:
            assert r.status == 504 and (await r.json())["error"]["code"] == "upstream_timeout"
    assert not st.state.admission.scheduler.inflight


async def test_upstream_idle_mid_stream_ends_with_error_and_aborts(aiohttp_server, tmp_path, http):
    up_app = make_app(itl_s=3.0)
    up = await aiohttp_server(up_app)
    cfg = base_config(str(up.make_url("")).rstrip("/"))
    cfg["upstream"]["idle_timeout_s"] = 0.3
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    from proxy.api.app import create_app
    from proxy.config.loading import load_config
    from proxy.api.handlers import STATE

    app = create_app(load_config(path))
    px = await aiohttp_server(app)
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "stream": True}
    async with http.post(str(px.make_url(CHAT)), json=body) as r:
        raw = await r.read()
    assert b" t0" in raw and b"upstream_idle_timeout" in raw and b"[DONE]" not in raw
    await wait_until(lambda: up_app[STATS].aborted == 1, what="upstream aborted")
    assert not app[STATE].admission.scheduler.inflight


# ----------------------------------------------------------- graceful shutdown


async def test_sigterm_refuses_queued_and_drains_inflight(aiohttp_server, tmp_path):
    up_app = make_app(itl_s=0.1)
    up = await aiohttp_server(up_app)
    cfg = base_config(str(up.make_url("")).rstrip("/"), max_inflight=1)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = free_port()
    proc = await asyncio.to_thread(start_proxy, path, port)
    url = f"http://127.0.0.1:{port}{CHAT}"
    try:
        async with aiohttp.ClientSession() as s:

            async def call(n: int) -> tuple[int, bytes]:
                async with s.post(url, json={"messages": [{"role": "user", "content": "x"}], "max_tokens": n, "stream": True}) as r:
                    return r.status, await r.read()

            inflight = asyncio.create_task(call(15))  # ~1.5 s of streaming
            await wait_until(lambda: up_app[STATS].started == 1, what="in flight")
            queued = asyncio.create_task(call(1))
            await asyncio.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            q_status, q_body = await queued
            f_status, f_body = await inflight
        assert q_status == 503 and b"shutting_down" in q_body
        assert f_status == 200 and f_body.endswith(b"data: [DONE]\n\n") and f_body.count(b'"content"') == 15
        assert await asyncio.to_thread(proc.wait, 10) == 0
        # one JSON access line per request, flushed at shutdown; never the prompt
        log = proc.log_path.read_text()
        access = [json.loads(line) for line in log.splitlines() if line.startswith("{")]  # pure JSON lines
        assert len(access) == 2, log[-2000:]
        assert sorted((a["status"], a["outcome"], a["detail"]) for a in access) == [(200, "ok", None), (503, "refused", "shutting_down")]
        assert '"content"' not in log and "messages" not in log
    finally:
        await asyncio.to_thread(stop_proxy, proc)


async def test_client_that_stops_reading_is_dropped_and_upstream_aborted(make_stack):
    """A client that sends a streaming request and never reads: the relay's buffer does
    not grow without bound (writes wait for the client), and after
    client_write_timeout_s the client is dropped and the upstream aborted."""
    cfg = base_config("")
    cfg["limits"] = {"client_write_timeout_s": 0.5}
    st = await make_stack(config=cfg)
    payload = json.dumps(st.chat_body(2_000_000, stream=True)).encode()
    host, port = st.proxy_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload))
    await writer.drain()
    # never read
    await wait_until(lambda: st.stats.aborted == 1, timeout=20, what="upstream aborted after the write timeout")
    await wait_until(lambda: not st.state.admission.scheduler.inflight, what="slot released")
    assert st.stats.tokens_sent < 2_000_000
    writer.close()


async def test_undecodable_body_is_400(make_stack, http):
    st = await make_stack()
    async with http.post(st.proxy_url + CHAT, data=b"not gzip at all", headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}) as r:
        assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_body"
    async with aiohttp.ClientSession() as fresh:  # the broken connection itself is closed
        async with fresh.post(st.proxy_url + CHAT, json=st.chat_body(1)) as r:
            assert r.status == 200


async def test_upstream_error_answers_are_not_charged(make_stack, http):
    st = await make_stack()
    sched = st.state.admission.scheduler
    headers = {"Authorization": "Bearer sk-alice"}
    async with http.post(st.proxy_url + CHAT, json=st.chat_body(1), headers=headers) as r:
        assert r.status == 200
    before = sched.counters()["alice"]
    body = st.chat_body(500, status=413)
    body["messages"][0]["content"] = "x" * 40_000
    async with http.post(st.proxy_url + CHAT, json=body, headers=headers) as r:
        assert r.status == 413
    assert sched.counters()["alice"] == before


async def test_cap_rejection_names_the_field_over_the_cap(make_stack, http):
    cfg = base_config("")
    cfg["groups"][1]["max_tokens"] = 50
    cfg["limits"] = {"max_tokens_action": "reject"}
    st = await make_stack(config=cfg)
    body = st.chat_body(5)
    body["max_completion_tokens"] = 500
    async with http.post(st.proxy_url + CHAT, json=body) as r:
        err = (await r.json())["error"]
    assert r.status == 400 and err["param"] == "max_completion_tokens" and "500" in err["message"]


def _raw_post(port: int, path: str, headers: dict[str, str], body: bytes) -> bytes:
    """One request on a fresh socket (``Connection: close``); the whole answer."""
    head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": "x", "Connection": "close", "Content-Length": str(len(body)), **headers}.items())
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\n{head}\r\n".encode() + body)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_a_body_that_cannot_be_decoded_is_a_400_and_one_log_line(tmp_path):
    """A gzip body that is not gzip: 400 ``invalid_body`` (JSON), and one log line, not
    aiohttp's 36-line "Unhandled exception" traceback of its read of the rest of the body.
    ``br`` / ``zstd`` without their optional packages: aiohttp's parser refuses the
    request before the application sees it (a text/plain 400 the proxy cannot reach),
    logged in one line as any malformed request."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(base_config("http://127.0.0.1:9")))
    port = free_port()
    proc = start_proxy(path, port)
    try:
        bad_gzip = _raw_post(port, CHAT, {"Content-Type": "application/json", "Content-Encoding": "gzip"}, b"not gzip at all, sk-carl")
        status, _, body = bad_gzip.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 400") and json.loads(body)["error"]["code"] == "invalid_body", bad_gzip
        for enc in ("br", "zstd"):
            answer = _raw_post(port, CHAT, {"Content-Type": "application/json", "Content-Encoding": enc}, b"\x8b\x02\x80{}\x03")
            assert answer.split(b"\r\n", 1)[0].endswith(b" 400 Bad Request"), answer
        assert _raw_post(port, CHAT, {"Content-Type": "application/json"}, json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}).encode()).startswith(b"HTTP/1.1 502")  # still serving
    finally:
        stop_proxy(proc)
    log = proc.log_path.read_text()
    assert "Traceback" not in log and "Unhandled exception" not in log and "sk-carl" not in log, log[-3000:]
    assert log.count("request body could not be read (RequestPayloadError: ContentEncodingError)") == 1, log[-3000:]
    assert log.count("malformed request refused (ContentEncodingError, status 400)") == 2, log[-3000:]
