"""A scripted OpenAI-compatible engine, one of several behind a pool, for tests and benchmarks.

It serves what :mod:`bench.fake_upstream` serves (chat and completions, streaming and not,
with the same per-request ``fake`` overrides, ``GET /stats``), and besides:

* ``GET /v1/models``: the models given with ``--model`` (default ``fake-model``);
* ``GET /health`` and ``GET /token_load`` (LightLLM's load report, ``--load``);
* ``POST /v1/embeddings`` and ``POST /v1/responses`` (OpenAI's Responses API: typed SSE
  events ``response.created`` ... ``response.output_text.delta`` ... ending with
  ``response.completed``, or ``response.incomplete`` with ``"fake": {"incomplete": true}``;
  no ``[DONE]``);
* ``POST /script``: change how it behaves from now on, a JSON object with any of
  ``checks`` (``ok``, ``fail``: 503, ``hang``: never answers) for ``/health``,
  ``/v1/models`` and ``/token_load``; ``generations`` (``ok``, or an HTTP status such as
  500 answered to every generation request, or ``reset``: the connection is closed
  before any byte); ``load`` (the ``current_load`` reported); ``ttft_s`` / ``itl_s``
  (default timing). ``GET /script`` shows it, with ``checks_seen``, the number of check
  requests received, and ``check_authorization``, the last one's ``Authorization``.

Every answer carries ``X-Engine: <--name>``, so a test sees which engine served it.

Run it standalone (tests start it as a process, to kill it with SIGKILL)::

    python -m bench.scripted_engine --port 9001 --name a --model small --itl-s 0.01
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import asdict, dataclass, field

import orjson
from aiohttp import web

from bench import fake_upstream
from bench.fake_upstream import STATS, TIMING, Stats, Timing


@dataclass
class Script:
    """The engine's current behaviour (see the module docstring)."""

    name: str = "engine"
    models: list[str] = field(default_factory=lambda: [fake_upstream.MODEL])
    checks: str = "ok"
    generations: str | int = "ok"
    load: float = 0.0
    checks_seen: int = 0
    check_authorization: str | None = None  # the Authorization header of the last check


SCRIPT = web.AppKey("script", Script)
_GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")


@web.middleware
async def _engine(request: web.Request, handler):
    script = request.app[SCRIPT]
    if request.method == "POST" and request.path in _GENERATION_PATHS:
        gen = script.generations
        if gen == "reset":
            await request.read()
            request.transport.close()  # no status line, no byte: a reset before the answer
            raise asyncio.CancelledError
        if isinstance(gen, int):
            return web.json_response({"error": {"message": f"scripted {gen}", "type": "server_error"}}, status=gen)
    return await handler(request)


async def _tag(request: web.Request, resp: web.StreamResponse) -> None:
    """``X-Engine`` on every answer, streams included (their headers go out at prepare)."""
    resp.headers["X-Engine"] = request.app[SCRIPT].name


async def _check(request: web.Request, answer) -> web.StreamResponse:
    script = request.app[SCRIPT]
    script.checks_seen += 1
    script.check_authorization = request.headers.get("Authorization")
    if script.checks == "hang":
        await asyncio.Event().wait()  # until the client gives up
    if script.checks == "fail":
        return web.json_response({"error": {"message": "scripted check failure"}}, status=503)
    return web.json_response(answer(script))


async def health(request: web.Request) -> web.StreamResponse:
    return await _check(request, lambda s: {"status": "ok"})


async def models(request: web.Request) -> web.StreamResponse:
    return await _check(request, lambda s: {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": s.name} for m in s.models]})


async def token_load(request: web.Request) -> web.StreamResponse:
    return await _check(request, lambda s: {"current_load": s.load, "logical_max_load": s.load, "dynamic_max_load": s.load})


async def get_script(request: web.Request) -> web.Response:
    return web.json_response(asdict(request.app[SCRIPT]))


async def set_script(request: web.Request) -> web.Response:
    script, timing = request.app[SCRIPT], request.app[TIMING]
    for k, v in (await request.json()).items():
        if k in ("ttft_s", "itl_s"):
            setattr(timing, k, float(v))
        elif k in ("checks", "generations", "load"):
            setattr(script, k, v)
        else:
            raise web.HTTPBadRequest(text=f"unknown script key {k!r}")
    return web.json_response(asdict(script))


def _text_tokens(s: str) -> int:
    return max(1, (len(s) + 3) // 4)


async def embeddings(request: web.Request) -> web.Response:
    body = orjson.loads(await request.read())
    inp = body.get("input")
    items = [inp] if isinstance(inp, str) or (isinstance(inp, list) and inp and isinstance(inp[0], int)) else list(inp or [])
    prompt = sum(_text_tokens(x) if isinstance(x, str) else len(x) for x in items)
    stats = request.app[STATS]
    stats.started += 1
    stats.completed += 1
    data = [{"object": "embedding", "index": i, "embedding": [float(i), 0.5, -0.5, 1.0]} for i in range(len(items))]
    model = body.get("model", request.app[SCRIPT].models[0])
    return web.json_response({"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": prompt, "total_tokens": prompt}})


def _sse(seq: int, kind: str, **payload) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, "sequence_number": seq, **payload}) + b"\n\n"


async def responses(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses``: ``max_output_tokens`` (default 16, at most
    :data:`bench.fake_upstream.MAX_TOKENS`, streamed or not: a stream's last events
    carry the whole text) tokens ``" t0" " t1" ...``."""
    stats, timing, script = request.app[STATS], request.app[TIMING], request.app[SCRIPT]
    body = orjson.loads(await request.read())
    fake = body.get("fake") or {}
    if "status" in fake:
        return web.json_response({"error": {"message": "fake failure", "type": "server_error"}}, status=fake["status"])
    n = min(int(body.get("max_output_tokens") or 16), fake_upstream.MAX_TOKENS)
    ttft, itl = float(fake.get("ttft_s", timing.ttft_s)), float(fake.get("itl_s", timing.itl_s))
    fail_after = fake.get("fail_after")
    status = "incomplete" if fake.get("incomplete") else "completed"
    model = body.get("model", script.models[0])
    created = int(time.time())
    usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": n, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 10 + n}
    text = "".join(f" t{i}" for i in range(n))
    message = {"id": "msg_fake", "type": "message", "status": status, "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]}

    def response(state: str, done: bool) -> dict:
        return {
            "id": "resp_fake", "object": "response", "created_at": created, "model": model, "status": state,
            "output": [message] if done else [], "usage": usage if done else None,
            "incomplete_details": {"reason": "max_output_tokens"} if done and state == "incomplete" else None,
        }

    stats.started += 1
    stats.active += 1
    try:
        if ttft:
            await asyncio.sleep(ttft)
        if not body.get("stream"):
            if itl:
                await asyncio.sleep(itl * n)
            stats.tokens_sent += n
            stats.completed += 1
            return web.json_response(response(status, True))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        seq = 0
        for kind, payload in (
            ("response.created", {"response": response("in_progress", False)}),
            ("response.in_progress", {"response": response("in_progress", False)}),
            ("response.output_item.added", {"output_index": 0, "item": {**message, "status": "in_progress", "content": []}}),
            ("response.content_part.added", {"item_id": "msg_fake", "output_index": 0, "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}),
        ):
            await resp.write(_sse(seq, kind, **payload))
            seq += 1
        for i in range(n):
            if i and itl:
                await asyncio.sleep(itl)
            if fail_after is not None and i >= int(fail_after):
                request.transport.close()
                stats.aborted += 1
                return resp
            await resp.write(_sse(seq, "response.output_text.delta", item_id="msg_fake", output_index=0, content_index=0, delta=f" t{i}", logprobs=[]))
            seq += 1
            stats.tokens_sent += 1
        for kind, payload in (
            ("response.output_text.done", {"item_id": "msg_fake", "output_index": 0, "content_index": 0, "text": text, "logprobs": []}),
            ("response.content_part.done", {"item_id": "msg_fake", "output_index": 0, "content_index": 0, "part": message["content"][0]}),
            ("response.output_item.done", {"output_index": 0, "item": message}),
            (f"response.{status}", {"response": response(status, True)}),
        ):
            await resp.write(_sse(seq, kind, **payload))
            seq += 1
        await resp.write_eof()
        stats.completed += 1
        return resp
    except (asyncio.CancelledError, ConnectionResetError):
        stats.aborted += 1
        raise
    finally:
        stats.active -= 1


def make_app(name: str = "engine", models_served: list[str] | None = None, ttft_s: float = 0.0, itl_s: float = 0.0, load: float = 0.0) -> web.Application:
    """The scripted engine's app (serve it with ``handler_cancellation=True``)."""
    app = web.Application(middlewares=[_engine])
    app.on_response_prepare.append(_tag)
    app[STATS] = Stats()
    app[TIMING] = Timing(ttft_s, itl_s)
    app[SCRIPT] = Script(name=name, models=list(models_served or [fake_upstream.MODEL]), load=load)
    app.router.add_post("/v1/chat/completions", fake_upstream.chat)
    app.router.add_post("/v1/completions", fake_upstream.completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/token_load", token_load)
    app.router.add_get("/stats", fake_upstream.stats)
    app.router.add_post("/stats/reset", fake_upstream.reset)
    app.router.add_get("/script", get_script)
    app.router.add_post("/script", set_script)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9001)
    ap.add_argument("--name", default="engine")
    ap.add_argument("--model", action="append", default=None, help="a model it serves (repeatable; default fake-model)")
    ap.add_argument("--ttft-s", type=float, default=0.0)
    ap.add_argument("--itl-s", type=float, default=0.0)
    ap.add_argument("--load", type=float, default=0.0)
    a = ap.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(
        make_app(a.name, a.model, a.ttft_s, a.itl_s, a.load), host=a.host, port=a.port, handler_cancellation=True, access_log=None,
        print=lambda *_: print(f"scripted engine {a.name} ready on http://{a.host}:{a.port}", flush=True),
    )


if __name__ == "__main__":
    main()
