"""A fake OpenAI upstream whose *aggregate* token rate is fixed and shared among the
requests it is generating: a continuous-batching engine in miniature, for benchmarks.

Every ``tick_s`` the engine hands out ``rate * dt`` output tokens, split equally among the
streams decoding (at most ``max_stream_rate * dt`` each); a request first "prefills" for
``prompt / prefill_rate`` seconds. So, unlike :mod:`bench.fake_upstream` (a fixed rate per
stream), more concurrent requests means slower ones, as on a real engine.

``POST /v1/chat/completions`` only, streaming (SSE, one event per token, several events per
write). The body's ``fake`` object carries the benchmark's bookkeeping: ``user`` (whose
tokens these are), ``n`` (tokens to generate, capped by ``max_tokens``), ``prompt`` (the
prompt tokens to prefill and report in ``usage``), ``usage`` (false: no usage in the last
event, as when a client did not ask for it) and ``rid`` (request id). With
``--max-model-len``, a request whose prompt plus ``max_tokens`` exceeds it is refused at
once with a 400, as vLLM refuses it. ``GET /stats`` returns, per
request, its arrival, first-token and end times (``time.monotonic()``, comparable across
processes on Linux) and token counts, and per user the cumulative weighted tokens
(prompt x1 when prefill ends, output x2 as generated) sampled every ``sample_s``.
``POST /stats/reset`` starts a new recording. ``GET /v1/models`` lists one model.

Run standalone: ``python -m bench.rate_upstream --port 0 --rate 16000`` (prints the
port it listens on).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time

import orjson
from aiohttp import web

MODEL = "fake-model"
_TOKEN = b'data: {"object":"chat.completion.chunk","model":"fake-model","choices":[{"index":0,"delta":{"content":" t"},"finish_reason":null}]}\n\n'


class _Stream:
    __slots__ = ("user", "n", "prompt", "rid", "progress", "ready", "sent", "event", "done", "arrived", "first", "ended")

    def __init__(self, user: str, n: int, prompt: int, rid: int, arrived: float) -> None:
        self.user, self.n, self.prompt, self.rid = user, n, prompt, rid
        self.progress = 0.0  # tokens decoded (fractional)
        self.ready = 0  # whole tokens decoded, not yet necessarily written
        self.sent = 0
        self.event = asyncio.Event()
        self.done = False
        self.arrived = arrived
        self.first: float | None = None
        self.ended: float | None = None


class RateEngine:
    """The shared-rate engine; one per app."""

    def __init__(
        self, rate: float, max_stream_rate: float, prefill_rate: float, tick_s: float = 0.01, sample_s: float = 0.1, max_model_len: int | None = None
    ) -> None:
        self.rate, self.max_stream_rate, self.prefill_rate = rate, max_stream_rate, prefill_rate
        self.max_model_len = max_model_len
        self.refused = 0
        self.tick_s, self.sample_s = tick_s, sample_s
        self.decoding: list[_Stream] = []
        self._task: asyncio.Task | None = None
        self.reset()

    def reset(self) -> None:
        self.t0 = time.monotonic()
        self.records: list[dict] = []
        self.cum: dict[str, float] = {}
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._next_sample = self.t0
        self.tokens_sent = 0

    def stream_rate(self) -> float:
        n = len(self.decoding)
        return 0.0 if n == 0 else min(self.max_stream_rate, self.rate / n)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def join(self, s: _Stream) -> None:
        """``s`` has finished prefill: count its prompt, start decoding it."""
        self.cum[s.user] = self.cum.get(s.user, 0.0) + s.prompt
        self.decoding.append(s)

    async def _run(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.tick_s)
            now = time.monotonic()
            dt, last = now - last, now
            r = self.stream_rate() * dt
            if self.decoding:
                keep = []
                for s in self.decoding:
                    s.progress = min(float(s.n), s.progress + r)
                    whole = int(s.progress)
                    if whole > s.ready:
                        self.cum[s.user] = self.cum.get(s.user, 0.0) + 2.0 * (whole - s.ready)
                        s.ready = whole
                        s.event.set()
                    if s.ready >= s.n:
                        s.done = True
                        s.event.set()
                    else:
                        keep.append(s)
                self.decoding = keep
            if now >= self._next_sample:
                self.samples.append((now, dict(self.cum)))
                self._next_sample = now + self.sample_s


ENGINE = web.AppKey("engine", RateEngine)


def _final(n: int, prompt: int, usage: bool = True) -> bytes:
    obj: dict = {
        "object": "chat.completion.chunk",
        "model": MODEL,
        "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
    }
    if usage:
        obj["usage"] = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
    return b"data: " + orjson.dumps(obj) + b"\n\ndata: [DONE]\n\n"


async def chat(request: web.Request) -> web.StreamResponse:
    eng = request.app[ENGINE]
    arrived = time.monotonic()
    body = orjson.loads(await request.read())
    fake = body.get("fake") or {}
    cap = body.get("max_tokens") or body.get("max_completion_tokens")
    prompt = int(fake.get("prompt", 10))
    if eng.max_model_len is not None and cap is not None and prompt + int(cap) > eng.max_model_len:
        eng.refused += 1
        msg = f"This model's maximum context length is {eng.max_model_len} tokens. However, you requested {prompt + int(cap)} tokens."
        return web.json_response({"object": "error", "message": msg, "type": "BadRequestError", "param": None, "code": 400}, status=400)
    n = int(fake.get("n", cap or 16))
    n = max(1, n if cap is None else min(int(cap), n))
    s = _Stream(str(fake.get("user", "?")), n, prompt, int(fake.get("rid", -1)), arrived)
    rec = {"rid": s.rid, "user": s.user, "arrived": arrived, "first": None, "ended": None, "tokens": 0, "prompt": prompt}
    eng.records.append(rec)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    joined = False
    try:
        if prompt and eng.prefill_rate:
            await asyncio.sleep(prompt / eng.prefill_rate)
        eng.join(s)
        joined = True
        while True:
            await s.event.wait()
            s.event.clear()
            k = s.ready - s.sent
            if k > 0:
                if s.sent == 0:
                    rec["first"] = time.monotonic()
                await resp.write(_TOKEN * k)
                s.sent += k
                eng.tokens_sent += k
                rec["tokens"] = s.sent
            if s.done and s.sent >= s.n:
                break
        await resp.write(_final(s.n, prompt, fake.get("usage", True) is not False))
        await resp.write_eof()
        rec["ended"] = time.monotonic()
        return resp
    except ConnectionResetError:  # the proxy aborted the request (its client went away)
        return resp
    finally:
        if joined and not s.done:
            s.done = True
            try:
                eng.decoding.remove(s)
            except ValueError:
                pass


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]})


async def stats(request: web.Request) -> web.Response:
    eng = request.app[ENGINE]
    return web.Response(
        body=orjson.dumps({"records": eng.records, "samples": eng.samples, "tokens_sent": eng.tokens_sent, "decoding": len(eng.decoding), "refused": eng.refused}),
        content_type="application/json",
    )


async def reset(request: web.Request) -> web.Response:
    request.app[ENGINE].reset()
    return web.json_response({"ok": True})


def make_app(
    rate: float, max_stream_rate: float = math.inf, prefill_rate: float = 0.0, tick_s: float = 0.01, sample_s: float = 0.1, max_model_len: int | None = None
) -> web.Application:
    """The upstream app (serve with ``handler_cancellation=True``)."""
    app = web.Application()
    eng = app[ENGINE] = RateEngine(rate, max_stream_rate, prefill_rate, tick_s, sample_s, max_model_len)

    async def on_startup(_app: web.Application) -> None:
        eng.start()

    async def on_cleanup(_app: web.Application) -> None:
        await eng.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/stats", stats)
    app.router.add_post("/stats/reset", reset)
    return app


async def _serve(a: argparse.Namespace) -> None:
    app = make_app(a.rate, a.max_stream_rate, a.prefill_rate, a.tick_s, a.sample_s, a.max_model_len)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", a.port, backlog=4096)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"rate upstream ready on http://127.0.0.1:{port}", flush=True)
    deadline = time.monotonic() + a.max_lifetime_s
    try:
        while time.monotonic() < deadline:  # bounded: exits on its own at the latest then
            await asyncio.sleep(1.0)
    finally:
        await runner.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    ap.add_argument("--rate", type=float, default=16000.0, help="aggregate output tokens per second")
    ap.add_argument("--max-stream-rate", type=float, default=math.inf, help="cap per stream (tokens/s)")
    ap.add_argument("--prefill-rate", type=float, default=0.0, help="prompt tokens per second (0: no prefill delay)")
    ap.add_argument("--tick-s", type=float, default=0.01)
    ap.add_argument("--sample-s", type=float, default=0.1)
    ap.add_argument("--max-lifetime-s", type=float, default=900.0)
    ap.add_argument("--max-model-len", type=int, default=None, help="refuse prompt + max_tokens beyond this with a 400")
    a = ap.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_serve(a))


if __name__ == "__main__":
    main()
