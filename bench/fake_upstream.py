"""A fast fake OpenAI-compatible upstream with a fixed token rate, for tests and benchmarks.

It answers ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming and not)
with ``max_tokens`` tokens (default 16; a non-streaming answer, built whole, at most
:data:`MAX_TOKENS`; a stream, written a token at a time, as many as asked), after ``ttft_s`` seconds for the first token and
``itl_s`` between tokens. A stream's last token chunk carries ``usage`` (as transformers
serve sends it) unless the request asks ``stream_options.include_usage``: then, as vLLM
and OpenAI, a separate last chunk with ``choices: []`` carries it. Per-request overrides ride in the body (the proxy forwards the
body unchanged): ``"fake": {"ttft_s": 0.5, "itl_s": 0.01, "no_done": true,
"usage": false, "fail_after": 3, "status": 500, "prompt": 5000, "role": true}`` (``prompt``: the prompt
tokens to report in ``usage``, default 10; ``"usage": "asked"``: as vLLM, a stream reports
usage only when the request asks ``stream_options.include_usage``; ``role``: a chat stream
opens, as vLLM's, with a chunk carrying ``"role": "assistant"`` and no text). The answer's
tokens are `` t0 t1 ...``; a request that continues them (a chat request with
``continue_final_message`` whose last message is the assistant's partial answer, or a
completions prompt ending with them) goes on from where they stop (:func:`continued_from`),
with an ``id`` ending ``-continued``. With ``max_model_len`` set (``--max-model-len``),
a request whose ``max_tokens`` plus prompt exceeds it is refused at once with a 400, the way
vLLM refuses it.

``GET /stats`` returns counters: streams/requests started, completed, aborted (the client
closed the connection before the end), refused (400 for max_tokens), tokens sent, and how
many are active now and the most active at once (``max_active``).
``POST /stats/reset`` zeroes them. ``GET /v1/models`` lists one model. ``GET /health``
answers 200 with an empty body, as vLLM and SGLang do (the Rust routers poll it before
they route to a worker). ``GET /timing`` returns the default timing, ``POST /timing``
with a JSON object of some of ``ttft_s``, ``itl_s``, ``stream_itl_s`` sets it for the
requests that follow (``stream_itl_s``: the gap between a stream's tokens, ``null`` for
``itl_s``): a benchmark changes the timing between phases without per-request overrides,
which a proxy that rebuilds the body (sglang-router drops unknown fields) does not forward.

Run standalone: ``python -m bench.fake_upstream --port 9000 --itl-s 0.01``.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from dataclasses import asdict, dataclass, field

import orjson
from aiohttp import web

MODEL = "fake-model"
# the most tokens of an answer built whole, whatever it asks for (max_tokens 2**62 must
# not build a 2**62-token text); a stream holds one token at a time and ends when its
# client goes, so it keeps the count asked (tests drop clients of endless streams)
MAX_TOKENS = 4096


@dataclass
class Stats:
    """Counters of the fake upstream (all requests, streaming or not)."""

    started: int = 0
    completed: int = 0
    aborted: int = 0
    tokens_sent: int = 0
    active: int = 0
    max_active: int = 0  # the most active at once since start (or the last reset)
    refused: int = 0
    tags: list = field(default_factory=list)  # body "fake.tag" of each request, in start order
    authorization: list = field(default_factory=list)  # Authorization header of each request


@dataclass
class Timing:
    """Default timing: ``ttft_s`` before the first token, ``itl_s`` between tokens
    (seconds); ``stream_itl_s``, when set, between a stream's tokens instead (an answer
    built whole still waits ``itl_s`` per token)."""

    ttft_s: float = 0.0
    itl_s: float = 0.0
    max_model_len: int | None = None
    stream_itl_s: float | None = None  # between a stream's tokens; None: itl_s


STATS = web.AppKey("stats", Stats)
TIMING = web.AppKey("timing", Timing)
ABORTED = web.AppKey("aborted_event", object)


_TOKEN = re.compile(r" t\d+")
_TRAILING_TOKENS = re.compile(r"(?: t\d+)+$")


def continued_from(body: dict, chat: bool) -> int:
    """How many of this fake's tokens (`` t0 t1 ...``) the request already holds, so its
    answer goes on from there: a chat request with ``continue_final_message`` (vLLM's and
    SGLang's extension) and a last ``assistant`` message, the tokens in that message; a
    completions prompt, the tokens it ends with. 0 otherwise."""
    if chat:
        msgs = body.get("messages")
        if body.get("continue_final_message") and isinstance(msgs, list) and msgs and isinstance(msgs[-1], dict) and msgs[-1].get("role") == "assistant":
            return len(_TOKEN.findall(str(msgs[-1].get("content") or "")))
        return 0
    prompt = body.get("prompt")
    m = _TRAILING_TOKENS.search(prompt) if isinstance(prompt, str) else None
    return len(_TOKEN.findall(m.group(0))) if m else 0


def _chunk(i: int, created: int, chat: bool, last: bool, n: int, prompt: int, with_usage: bool, cid: str = "fake") -> bytes:
    if chat:
        choice = {"index": 0, "delta": {"content": f" t{i}"} if not last else {}, "finish_reason": "length" if last else None}
        obj = {"id": "chatcmpl-" + cid, "object": "chat.completion.chunk", "created": created, "model": MODEL, "choices": [choice]}
    else:
        choice = {"index": 0, "text": f" t{i}" if not last else "", "finish_reason": "length" if last else None}
        obj = {"id": "cmpl-" + cid, "object": "text_completion", "created": created, "model": MODEL, "choices": [choice]}
    if last and with_usage:
        obj["usage"] = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    stats, timing = request.app[STATS], request.app[TIMING]
    body = orjson.loads(await request.read())
    fake = body.get("fake") or {}
    if "status" in fake:
        return web.json_response({"error": {"message": "fake failure", "type": "server_error"}}, status=fake["status"])
    n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
    prompt = int(fake.get("prompt", 10))
    if timing.max_model_len is not None and prompt + n > timing.max_model_len:
        stats.refused += 1
        msg = (
            f"This model's maximum context length is {timing.max_model_len} tokens. However, you requested "
            f"{prompt + n} tokens ({prompt} in the messages, {n} in the completion)."
        )
        return web.json_response({"object": "error", "message": msg, "type": "BadRequestError", "param": None, "code": 400}, status=400)
    if not body.get("stream"):
        n = min(n, MAX_TOKENS)
    default_itl = timing.stream_itl_s if body.get("stream") and timing.stream_itl_s is not None else timing.itl_s
    ttft, itl = float(fake.get("ttft_s", timing.ttft_s)), float(fake.get("itl_s", default_itl))
    fail_after = fake.get("fail_after")
    created = int(time.time())
    # a continuation goes on from the tokens its request holds, which count as prompt;
    # its chunks carry an id and created of their own (a proxy resuming a stream rewrites them)
    start = continued_from(body, chat)
    cid = "fake" if not start else "fake-continued"
    if start:
        prompt += start
        created += 1
    stats.started += 1
    stats.active += 1
    stats.max_active = max(stats.max_active, stats.active)
    stats.tags.append(fake.get("tag"))
    stats.authorization.append(request.headers.get("Authorization"))
    try:
        if ttft:
            await asyncio.sleep(ttft)
        if not body.get("stream"):
            for _ in range(n):
                if itl:
                    await asyncio.sleep(itl)
            stats.tokens_sent += n
            text = "".join(f" t{i}" for i in range(start, start + n))
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
            else:
                choice = {"index": 0, "text": text, "finish_reason": "length"}
            resp = web.Response(
                body=orjson.dumps(
                    {
                        "id": "fake",
                        "object": "chat.completion" if chat else "text_completion",
                        "created": created,
                        "model": MODEL,
                        "choices": [choice],
                        "usage": {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n},
                    }
                ),
                content_type="application/json",
            )
            stats.completed += 1
            return resp
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if fake.get("role") and chat:  # as vLLM: a first chunk with the role and no text
            choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            await resp.write(b"data: " + orjson.dumps({"id": "chatcmpl-" + cid, "object": "chat.completion.chunk", "created": created, "model": MODEL, "choices": [choice]}) + b"\n\n")
        for i in range(n):
            if i and itl:
                await asyncio.sleep(itl)
            if fail_after is not None and i >= int(fail_after):
                request.transport.close()  # break the connection mid-stream
                stats.aborted += 1
                return resp
            await resp.write(_chunk(start + i, created, chat, False, n, prompt, False, cid))
            stats.tokens_sent += 1
        opts = body.get("stream_options")
        if isinstance(opts, dict) and opts.get("include_usage") and fake.get("usage", True):
            # as vLLM and OpenAI: the last chunk carries the finish_reason, then a
            # usage-only chunk with no choices
            await resp.write(_chunk(n, created, chat, True, n, prompt, False, cid))
            usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
            await resp.write(b"data: " + orjson.dumps({"id": cid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created, "model": MODEL, "choices": [], "usage": usage}) + b"\n\n")
        else:
            await resp.write(_chunk(n, created, chat, True, n, prompt, fake.get("usage", True) is True, cid))
        if not fake.get("no_done"):
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        stats.completed += 1
        return resp
    except (asyncio.CancelledError, ConnectionResetError):
        stats.aborted += 1
        raise
    finally:
        stats.active -= 1


async def chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, False)


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]})


async def health(request: web.Request) -> web.Response:
    return web.Response(text="")


async def timing(request: web.Request) -> web.Response:
    t = request.app[TIMING]
    if request.method == "POST":
        body = await request.json()
        unknown = set(body) - {"ttft_s", "itl_s", "stream_itl_s"}
        if unknown:
            return web.json_response({"error": f"unknown fields {sorted(unknown)}"}, status=400)
        for k, v in body.items():
            setattr(t, k, None if v is None and k == "stream_itl_s" else float(v))
    return web.json_response(asdict(t))


async def stats(request: web.Request) -> web.Response:
    return web.json_response(asdict(request.app[STATS]))


async def reset(request: web.Request) -> web.Response:
    s = request.app[STATS]
    s.started = s.completed = s.aborted = s.tokens_sent = s.refused = 0
    s.max_active = s.active
    s.tags.clear()
    s.authorization.clear()
    return web.json_response(asdict(s))


def make_app(ttft_s: float = 0.0, itl_s: float = 0.0, max_model_len: int | None = None) -> web.Application:
    """The fake upstream app (serve it with ``handler_cancellation=True`` so aborts are
    seen as soon as the client closes)."""
    app = web.Application()
    app[STATS] = Stats()
    app[TIMING] = Timing(ttft_s, itl_s, max_model_len)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/timing", timing)
    app.router.add_post("/timing", timing)
    app.router.add_get("/stats", stats)
    app.router.add_post("/stats/reset", reset)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--ttft-s", type=float, default=0.0)
    ap.add_argument("--itl-s", type=float, default=0.0)
    ap.add_argument("--max-model-len", type=int, default=None, help="refuse prompt + max_tokens beyond this with a 400")
    a = ap.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(make_app(a.ttft_s, a.itl_s, a.max_model_len), host=a.host, port=a.port, handler_cancellation=True, access_log=None, print=lambda *_: print(f"fake upstream ready on http://{a.host}:{a.port}", flush=True))


if __name__ == "__main__":
    main()
