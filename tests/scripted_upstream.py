"""A scripted upstream on a real socket: each request is answered with the exact bytes a
test wrote (status line, headers, chunking, pauses, a dropped connection), so a test can
assert what the proxy makes of any wire shape an engine may send.

Requests are routed to a script by the JSON body's ``model`` (each test names its own),
or by the path when there is no such body. Every request is recorded as received.

It runs in a background thread (blocking sockets, one thread per connection), so the
tests' own event loop and the proxy process stay independent of it.
"""

from __future__ import annotations

import gzip
import json
import socket
import socketserver
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Seen:
    """A request as the upstream received it."""

    method: str
    target: str  # path and query, as sent
    headers: dict[str, str]  # lower-cased names
    body: bytes

    @property
    def json(self) -> dict:
        return json.loads(self.body)


Script = Callable[[socket.socket, Seen], bool | None]  # returns True to keep the connection


@dataclass
class ScriptedUpstream:
    """``with ScriptedUpstream() as up: up.on("model-x", script); ... up.seen_for("model-x")``."""

    scripts: dict[str, Script] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)  # keys whose connection the proxy closed mid-script
    _server: socketserver.ThreadingTCPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def on(self, key: str, script: Script) -> None:
        """Answer requests whose body's ``model`` (or path) is ``key`` with ``script``."""
        self.scripts[key] = script

    def seen_for(self, key: str) -> list[Seen]:
        return [s for s in list(self.seen) if _key(s) == key]

    def __enter__(self) -> "ScriptedUpstream":
        owner = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                owner._serve(self.request)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()

    def _serve(self, sock: socket.socket) -> None:
        reader = sock.makefile("rb")
        try:
            while True:
                seen = _read_request(reader)
                if seen is None:
                    return
                self.seen.append(seen)
                script = self.scripts.get(_key(seen))
                if script is None:
                    sock.sendall(response(404, [("Content-Type", "application/json")], b'{"error":{"message":"no script"}}'))
                    continue
                try:
                    if not script(sock, seen):
                        return
                except (BrokenPipeError, ConnectionResetError):
                    self.closed.append(_key(seen))
                    return
        except OSError:
            return
        finally:
            try:
                sock.close()
            except OSError:
                pass


def _key(seen: Seen) -> str:
    try:
        model = json.loads(seen.body).get("model")
    except (ValueError, AttributeError):
        model = None
    return model if isinstance(model, str) else seen.target.split("?")[0]


def _read_request(reader) -> Seen | None:
    line = reader.readline()
    if not line:
        return None
    method, target, _ = line.decode("latin-1").split(" ", 2)
    headers: dict[str, str] = {}
    while True:
        h = reader.readline()
        if h in (b"\r\n", b"\n", b""):
            break
        name, _, value = h.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    body = reader.read(int(headers.get("content-length", "0")))
    return Seen(method, target, headers, body)


# ------------------------------------------------------------------ answer builders


def response(status: int, headers: list[tuple[str, str]], body: bytes, reason: str = "X", close: bool = True) -> bytes:
    """A whole HTTP/1.1 response with ``Content-Length`` (and ``Connection: close``
    unless ``close`` is false: say so when the script will close the connection, as
    HTTP/1.1 servers must)."""
    if close and not any(k.lower() == "connection" for k, _ in headers):
        headers = [*headers, ("Connection", "close")]
    head = f"HTTP/1.1 {status} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
    return head.encode("latin-1") + b"Content-Length: %d\r\n\r\n" % len(body) + body


def head(status: int, headers: list[tuple[str, str]], chunked: bool = True, reason: str = "X") -> bytes:
    """A status line and headers for a body written after (chunked, or ended by close)."""
    lines = f"HTTP/1.1 {status} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
    if chunked:
        lines += "Transfer-Encoding: chunked\r\n"
    lines += "Connection: close\r\n"  # the scripts close the connection after the answer
    return (lines + "\r\n").encode("latin-1")


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"
SSE = [("Content-Type", "text/event-stream")]


def reply(data: bytes, keep: bool = False) -> Script:
    """Answer with exactly ``data``; close the connection after unless ``keep``."""

    def script(sock: socket.socket, seen: Seen) -> bool:
        sock.sendall(data)
        return keep

    return script


def stream(parts: list[bytes | float], headers: list[tuple[str, str]] | None = None, status: int = 200, end: bool = True) -> Script:
    """A chunked answer: each bytes item is one chunk written on its own, each float a
    pause (seconds); the terminating chunk when ``end`` (else the connection just closes)."""

    def script(sock: socket.socket, seen: Seen) -> bool:
        sock.sendall(head(status, SSE if headers is None else headers))
        for p in parts:
            if isinstance(p, float):
                time.sleep(p)
            else:
                sock.sendall(chunk(p))
        if end:
            sock.sendall(LAST_CHUNK)
        return False

    return script


def reset_after(data: bytes, pause: float = 0.0) -> Script:
    """Answer ``data``, wait ``pause`` seconds, then reset the connection (an RST, not a
    FIN: ``SO_LINGER`` 0), as a crashed engine's kernel does."""

    def script(sock: socket.socket, seen: Seen) -> bool:
        sock.sendall(data)
        if pause:
            time.sleep(pause)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return False

    return script


def drop_after_read() -> Script:
    """Read the request, then close the connection without answering."""

    def script(sock: socket.socket, seen: Seen) -> bool:
        return False

    return script


def hang(seconds: float) -> Script:
    """Read the request and answer nothing for ``seconds`` (noting when the proxy closes)."""

    def script(sock: socket.socket, seen: Seen) -> bool:
        sock.settimeout(seconds)
        try:
            if sock.recv(1) == b"":
                raise ConnectionResetError  # the proxy closed the connection
        except TimeoutError:
            pass
        return False

    return script


def gzipped(data: bytes) -> bytes:
    return gzip.compress(data)


def chat_chunk(content: str | None = None, finish: str | None = None, index: int = 0, **extra) -> bytes:
    """One OpenAI chat chunk event, compact JSON as vLLM writes it."""
    delta = {} if content is None else {"content": content}
    obj = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [{"index": index, "delta": delta, "finish_reason": finish}], **extra}
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
