"""A LightLLM stand-in for tests: a real aiohttp server on a real socket that speaks
LightLLM's HTTP wire format byte for byte, without a GPU.

Two flavors, read from LightLLM's source (summarised in docs/deploy.md, "LightLLM"):

* ``"v1.2.0"`` (the default; the release our images pin, tag of 2026-08-10:
  ``lightllm/server/api_http.py``, ``api_lightllm.py``, ``api_openai.py``, ``api_errors.py``,
  ``httpserver/manager.py``, ``core/objs/sampling_params.py``);
* ``"0.0.1"`` (the only PyPI release, 2024), for operators who run an old LightLLM themselves.

What it reproduces:

* ``POST /generate``: ``generated_text`` (always a list), ``count_output_tokens``,
  ``finish_reason`` (v1.2.0 adds ``prompt_tokens`` and per-token ``logprobs``), sent with NO
  Content-Type header (FastAPI's bare ``Response``). 0.0.1 writes stdlib ``json.dumps``
  (spaces after ``:`` and ``,``), v1.2.0 ujson (compact).
* ``POST /generate_stream``: ``text/event-stream``, one event per token written as
  ``data:{json}\\n\\n`` with no space after the colon, each in its own HTTP chunk; the last
  has ``"finished": true`` and a ``finish_reason`` (``length`` or ``stop``); every fourth
  token's text is ``""`` (an incomplete multibyte character, completed by the next); no
  ``[DONE]``. v1.2.0's token carries ``prompt_tokens`` and ``logprobs``, the event
  ``input_usage``.
* Sampling parameters. 0.0.1: an unknown ``parameters`` key or a value ``verify`` rejects
  answers 417 ``{"message": "..."}``; ``max_new_tokens`` defaults to 16. v1.2.0: unknown
  keys are ignored; a value ``verify`` rejects (a ``ValueError``) answers 400 and any other
  failure 417, both as ``{"error": {"message", "type": "BadRequestError", "param": null,
  "code"}}``; ``max_new_tokens`` defaults to 65535 and is cut to what the length limit
  leaves; with ``do_sample`` false (the default) temperature/top_p/top_k are not checked.
* Length limits. 0.0.1: a prompt over ``max_req_input_len`` or a request over
  ``max_req_total_len`` fails after a stream's 200 headers by a dropped connection (uvicorn's
  behaviour when a stream's generator raises), and with 417 on ``/generate``. v1.2.0 (no
  input limit): a prompt that leaves no room under ``min(max_total_token_num - 36,
  max_req_total_len)`` answers 400 on ``/generate``; on a stream, after the 200 headers, one
  ``data: {"error": {"message", "type": "invalid_request_error"}}`` event, then a clean end.
* ``POST /v1/chat/completions``. 0.0.1: chunks written ``data: {json}\\n\\n`` (with a space),
  ``finish_reason`` always null, no ``[DONE]``. v1.2.0: a role chunk first, one chunk per
  non-empty token text (the last one carries ``finish_reason``, or an empty-delta chunk does),
  a usage chunk (``choices: []``), then ``data: [DONE]``. Non-streaming answers carry ``usage``.
* v1.2.0 only: ``POST /v1/completions`` (same stream shape with ``text`` choices, usage chunk,
  ``[DONE]``) and ``GET /v1/models``.
* ``GET /token_load``: ``{"current_load", "logical_max_load", "dynamic_max_load"}``,
  fractions of the KV budget, computed from the requests running; with ``dp`` > 1 (v1.2.0's
  ``--dp``) each is a list, one entry per data-parallel rank (each rank holds
  ``max_total_token_num / dp`` tokens; requests are spread over the ranks in turn).
* ``GET|HEAD /health``, ``/healthz``, ``/liveness``, ``/readiness``, ``GET /metrics``
  (LightLLM's own names, no vLLM/SGLang ones).
* The engine: a KV budget of ``max_total_token_num`` tokens; a request reserves
  ``prompt + max_new_tokens`` and waits in an unbounded FIFO queue until that fits (it
  never answers 429/503). Cancellation is LightLLM's: no abort endpoint; a request is
  dropped when its connection has closed, checked at each token and every
  ``disconnect_poll_s`` while none comes (LightLLM: 5 s). Every such drop is counted.
* Idle keep-alive of 10 s and ``Server: hypercorn-h11`` (v1.2.0 runs hypercorn with
  ``--keep-alive 10``); 5 s and ``Server: uvicorn`` for 0.0.1.

Tokens: a prompt of ``c`` characters is ``c // 4 + 1`` tokens; token ``i`` of an answer has
id ``1000 + i`` and text ``" w{i}"``, ``""`` (``i % 4 == 2``) or ``" é"`` (``i % 4 == 3``).

Test controls ride at the top level of the body under ``"wire"`` (LightLLM ignores
top-level keys other than ``inputs``, ``parameters`` and ``multimodal_params``):
``{"wire": {"ttft_s": 0.5, "itl_s": 0.01, "stop_after": 3, "end_after": 3, "break_after": 3,
"split": true, "tag": "x"}}``. ``stop_after``: an EOS after that many tokens
(``finish_reason: stop``); ``end_after``: the stream ends cleanly after that many events,
without its final one; ``break_after``: the connection is cut after that many events;
``split``: each event is written in several pieces (cut inside ``data:``, inside the JSON
and between the two newlines) so that readers see events split across chunks.

Control routes: ``GET /_wire/stats``, ``POST /_wire/reset``, ``POST /_wire/token_load``
(``{"current_load": f or [f, ...], ...}`` fixes the answer, ``{"status": 500}`` fails it,
``{"hang_s": 5}`` delays it, ``{}`` returns to the computed load).

Run standalone: ``python -m tests.lightllm_wire --port 8001 [--flavor 0.0.1] [--dp 2]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from aiohttp import hdrs, web

# keyword arguments of LightLLM 0.0.1's SamplingParams.__init__ (return_details is popped first)
ALLOWED_PARAMETERS = frozenset(
    {
        "best_of",
        "n",
        "do_sample",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "exponential_decay_length_penalty",
        "temperature",
        "top_p",
        "top_k",
        "ignore_eos",
        "max_new_tokens",
        "min_new_tokens",
        "stop_sequences",
        "skip_special_tokens",
        "add_spaces_between_special_tokens",
        "print_eos_token",
        "input_penalty",
    }
)
#: The ``Server`` header: LightLLM v1.2.0 serves with hypercorn (``--keep-alive 10``), 0.0.1 with uvicorn.
SERVER_HEADERS = {"v1.2.0": "hypercorn-h11", "0.0.1": "uvicorn"}
KEEPALIVE_S = {"v1.2.0": 10.0, "0.0.1": 5.0}
MODEL_NAME = "wire-llama"


@dataclass
class WireConfig:
    """How the stand-in behaves.

    Attributes:
        flavor: ``"v1.2.0"`` or ``"0.0.1"`` (see the module docstring).
        max_total_token_num: the KV budget in tokens (over all data-parallel ranks).
        max_req_input_len: 0.0.1's prompt limit (v1.2.0 has none).
        max_req_total_len: the limit on prompt + output tokens.
        dp: data-parallel ranks (v1.2.0 ``--dp``); above 1, ``/token_load`` answers lists.
        ttft_s, itl_s: default delay before the first token and between tokens.
        disconnect_poll_s: how often a request that gets no token checks its connection.
        keepalive_timeout_s: idle keep-alive of the HTTP server; None: the flavor's (v1.2.0's
            hypercorn 10 s, 0.0.1's uvicorn 5 s).
    """

    flavor: str = "v1.2.0"
    max_total_token_num: int = 6000
    max_req_input_len: int = 2048
    max_req_total_len: int = 3072
    dp: int = 1
    ttft_s: float = 0.0
    itl_s: float = 0.0
    disconnect_poll_s: float = 5.0
    keepalive_timeout_s: float | None = None


@dataclass
class WireStats:
    """Counters (read them from the server's loop, or between requests)."""

    started: int = 0  # requests accepted by the engine (queued or running)
    completed: int = 0
    aborted: int = 0  # dropped because the client's connection closed
    aborted_queued: int = 0  # ... of which while still waiting for KV room
    failed: int = 0  # streams that failed after their headers (too long, end_after, break_after)
    rejected: int = 0  # 400s, 417s and other 4xx
    tokens_sent: int = 0
    running: int = 0
    waiting: int = 0
    max_running: int = 0
    max_waiting: int = 0
    had_to_wait: int = 0  # requests that found no KV room and queued inside the engine
    token_load_polls: int = 0
    metrics_polls: int = 0
    routes: dict = field(default_factory=dict)  # "POST /generate" -> count
    tags: list = field(default_factory=list)
    request_content_types: list = field(default_factory=list)


def prompt_tokens_of(text: str) -> int:
    """The stand-in's tokenizer: ``len(text) // 4 + 1`` tokens."""
    return len(text) // 4 + 1


def token_text(i: int) -> str:
    """Text of output token ``i`` (``""`` for the first half of a multibyte character)."""
    r = i % 4
    return "" if r == 2 else (" é" if r == 3 else f" w{i}")


class _Abort(Exception):
    """The client's connection closed (LightLLM aborts the request)."""


class _Rejected(Exception):
    """A request LightLLM refuses before generating: ``status`` 417 (any failure in 0.0.1;
    in v1.2.0 a failure that is not a ``ValueError``) or 400 (v1.2.0's ``ValueError``)."""

    def __init__(self, message: str, status: int = 417) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


V1 = "v1.2.0"
FLAVORS = (V1, "0.0.1")


class _BareResponse(web.Response):
    """A response with no Content-Type header at all, like FastAPI's ``Response(content=...)``."""

    async def _prepare_headers(self) -> None:
        await super()._prepare_headers()
        self._headers.popall(hdrs.CONTENT_TYPE, None)


def _disconnected(request: web.Request) -> bool:
    t = request.transport
    return t is None or t.is_closing()


@dataclass
class _Req:
    need: int
    admitted: asyncio.Event = field(default_factory=asyncio.Event)
    prompt: int = 0
    generated: int = 0
    rank: int = 0  # data-parallel rank


class WireEngine:
    """The engine's state: KV budget, FIFO queue, counters, and the ``/token_load`` override."""

    def __init__(self, config: WireConfig) -> None:
        if config.flavor not in FLAVORS:
            raise ValueError(f"flavor must be one of {FLAVORS}, got {config.flavor!r}")
        self.config = config
        self.stats = WireStats()
        self._queue: deque[_Req] = deque()
        self._running: list[_Req] = []
        self._next_rank = 0
        self.token_load_override: dict | None = None

    @property
    def v1(self) -> bool:
        """The v1.2.0 flavor."""
        return self.config.flavor == V1

    @property
    def keepalive_s(self) -> float:
        """Idle keep-alive of the HTTP server, seconds."""
        c = self.config
        return c.keepalive_timeout_s if c.keepalive_timeout_s is not None else KEEPALIVE_S[c.flavor]

    # ----------------------------------------------------------- serialising

    def native_json(self, obj: Any) -> str:
        """LightLLM's ``json.dumps(obj, ensure_ascii=False)`` (0.0.1) or ujson's (v1.2.0)."""
        if self.v1:
            return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        return json.dumps(obj, ensure_ascii=False)

    @staticmethod
    def json_response(obj: Any, status: int = 200) -> web.Response:
        """Starlette's ``JSONResponse``: compact JSON, ``application/json``."""
        body = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
        return web.Response(status=status, body=body, headers={hdrs.CONTENT_TYPE: "application/json"})

    def error(self, message: str, status: int = 417) -> web.Response:
        """0.0.1: ``{"message"}``; v1.2.0: ``api_errors.create_error_response``'s body."""
        self.stats.rejected += 1
        if not self.v1:
            return self.json_response({"message": message}, status)
        kind = ("InternalServerError" if status >= 500 else "NotFoundError" if status == 404
                else "RateLimitError" if status == 429 else "BadRequestError")
        return self.json_response({"error": {"message": message, "type": kind, "param": None, "code": status}}, status)

    def stream_error_event(self, message: str) -> bytes:
        """v1.2.0's ``_safe_stream_wrapper``: a ``ValueError`` raised after a stream's headers."""
        return ("data: " + self.native_json({"error": {"message": message, "type": "invalid_request_error"}}) + "\n\n").encode()

    # ------------------------------------------------------------------ load

    def token_load(self) -> dict:
        """The three fractions; lists of ``dp`` entries when ``dp`` > 1 (v1.2.0)."""
        dp = self.config.dp
        budget = self.config.max_total_token_num / dp
        current = [sum(r.prompt + r.generated for r in self._running if r.rank == k) / budget for k in range(dp)]
        peak = [sum(r.need for r in self._running if r.rank == k) / budget for k in range(dp)]
        load = {"current_load": current, "logical_max_load": peak, "dynamic_max_load": peak}
        if dp == 1:
            return {k: float(v[0]) for k, v in load.items()}
        return {k: [float(x) for x in v] for k, v in load.items()}

    def reset(self) -> None:
        """Zero the counters and drop the ``/token_load`` override."""
        running, waiting = self.stats.running, self.stats.waiting
        self.stats = WireStats(running=running, waiting=waiting)
        self.token_load_override = None

    # ------------------------------------------------------------ validation

    def check(self, params: dict, prompt_tokens: int) -> int:
        """LightLLM's ``SamplingParams`` set-up and ``verify()``; returns ``max_new_tokens``
        as asked (see :meth:`fit` for the length limits).

        Raises:
            _Rejected: with LightLLM's message and status.
        """
        if not self.v1:
            for key in params:
                if key not in ALLOWED_PARAMETERS:
                    raise _Rejected(f"SamplingParams.__init__() got an unexpected keyword argument '{key}'")
        bad = 400 if self.v1 else 417  # v1.2.0: verify()'s ValueError -> 400
        do_sample = params.get("do_sample", False)
        top_p = params.get("top_p", 1.0) if do_sample else 1.0
        top_k = params.get("top_k", -1) if do_sample else 1
        temperature = params.get("temperature", 1.0) if do_sample else 1.0
        if self.v1 and 0.0 <= temperature < 1e-5:  # v1.2.0: "too low": greedy
            temperature, top_k = 1.0, 1
        max_new = params.get("max_new_tokens", 65535 if self.v1 else 16)
        if not isinstance(max_new, int) or isinstance(max_new, bool):
            raise _Rejected(f"'<' not supported between instances of '{type(max_new).__name__}' and 'int'")
        for name in ("presence_penalty", "frequency_penalty"):
            if params.get(name, 0.0) < 0.0:
                raise _Rejected(f"{name} must >= 0.0, got {params[name]}", bad)
        if params.get("repetition_penalty", 1.0) < 1.0:
            raise _Rejected(f"repetition_penalty must >= 1.0, got {params['repetition_penalty']}", bad)
        if temperature <= 0.0:
            raise _Rejected(f"temperature must > 0.0, got {temperature}", bad)
        if top_p <= 0.0 or top_p > 1.0:
            raise _Rejected(f"top_p must {'be ' if self.v1 else ''}in (0.0, 1.0], got {top_p}", bad)
        if top_k < -1 or top_k == 0:
            raise _Rejected(f"top_k must be -1 (disable), or at least 1, got {top_k}.", bad)
        if max_new < 1:
            raise _Rejected(f"max_new_tokens must be at least 1 , got {max_new}.", bad)
        return max_new

    def fit(self, prompt_tokens: int, max_new: int) -> tuple[int, str | None]:
        """LightLLM's length checks, done inside its generator (so after a stream's
        headers): ``(max_new_tokens to generate, None)`` or ``(max_new, message)`` when the
        request cannot run. v1.2.0 cuts ``max_new_tokens`` to the room left
        (``_check_and_repair_length``)."""
        c = self.config
        if self.v1:
            real = min(c.max_total_token_num - 36, c.max_req_total_len)
            if prompt_tokens + max_new > real:
                if real - prompt_tokens <= 0:
                    return max_new, f"the input prompt token len {prompt_tokens} + max_new_tokens {max_new} > {real}"
                max_new = real - prompt_tokens
            return max_new, None
        if prompt_tokens > c.max_req_input_len:
            return max_new, f"the input prompt token len {prompt_tokens} is too long > {c.max_req_input_len}"
        total = prompt_tokens + max_new
        if total > c.max_req_total_len:
            return max_new, f"the req total len (input len + output len) is too long > max_req_total_len:{c.max_req_total_len}"
        if total + 1 > c.max_total_token_num:
            return max_new, f"the req token total len + 1 is too long > max_total_token_num:{c.max_total_token_num}"
        return max_new, None

    # ------------------------------------------------------------- scheduling

    def _admit(self) -> None:
        budget = self.config.max_total_token_num
        while self._queue:
            head = self._queue[0]
            if sum(r.need for r in self._running) + head.need > budget:
                return
            self._queue.popleft()
            self.stats.waiting -= 1
            self._running.append(head)
            self.stats.running += 1
            self.stats.max_running = max(self.stats.max_running, self.stats.running)
            head.admitted.set()

    async def _sleep_watching(self, request: web.Request, seconds: float) -> None:
        """Sleep ``seconds``, checking the connection every ``disconnect_poll_s``."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            await asyncio.sleep(min(left, self.config.disconnect_poll_s))
            if _disconnected(request):
                raise _Abort()

    async def generate(self, request: web.Request, prompt_tokens: int, max_new: int, wire: dict):
        """Queue, then yield ``(index, text, finished, finish_reason)`` per token.

        Raises:
            _Abort: the client's connection closed (counted).
        """
        st = self.stats
        req = _Req(need=prompt_tokens + max_new, prompt=prompt_tokens, rank=self._next_rank)
        self._next_rank = (self._next_rank + 1) % self.config.dp
        st.started += 1
        self._queue.append(req)
        st.waiting += 1
        st.max_waiting = max(st.max_waiting, st.waiting)
        self._admit()
        if not req.admitted.is_set():
            st.had_to_wait += 1
        try:
            while not req.admitted.is_set():
                try:
                    await asyncio.wait_for(req.admitted.wait(), self.config.disconnect_poll_s)
                except TimeoutError:
                    pass
                if _disconnected(request):
                    st.aborted_queued += 1
                    raise _Abort()
            ttft = float(wire.get("ttft_s", self.config.ttft_s))
            itl = float(wire.get("itl_s", self.config.itl_s))
            stop_after = wire.get("stop_after")
            n = max_new if stop_after is None else min(max_new, int(stop_after))
            if ttft:
                await self._sleep_watching(request, ttft)
            for i in range(n):
                if i and itl:
                    await self._sleep_watching(request, itl)
                if _disconnected(request):  # LightLLM checks each time a token is ready
                    raise _Abort()
                req.generated = i + 1
                finished = i == n - 1
                reason = ("stop" if n < max_new else "length") if finished else None
                yield i, token_text(i), finished, reason
        except _Abort:
            st.aborted += 1
            raise
        finally:
            if req.admitted.is_set():
                self._running.remove(req)
                st.running -= 1
            else:
                self._queue.remove(req)
                st.waiting -= 1
            self._admit()


# ----------------------------------------------------------------- handlers

ENGINE = web.AppKey("wire_engine", WireEngine)


def _count(request: web.Request) -> WireEngine:
    engine = request.app[ENGINE]
    key = f"{request.method} {request.path}"
    engine.stats.routes[key] = engine.stats.routes.get(key, 0) + 1
    return engine


async def _body(request: web.Request, engine: WireEngine) -> dict:
    engine.stats.request_content_types.append(request.headers.get(hdrs.CONTENT_TYPE))
    return json.loads(await request.read())


async def _native_request(request: web.Request, engine: "WireEngine") -> tuple[dict, str, dict, int, int]:
    """Read a native request as LightLLM does: (wire knobs, prompt, parameters, prompt
    tokens, max new tokens); raises what :meth:`WireEngine.check` raises."""
    body = await _body(request, engine)
    wire = body.pop("wire", None) or {}
    engine.stats.tags.append(wire.get("tag"))
    prompt = body.pop("inputs")
    params = dict(body["parameters"])
    params.pop("return_details", False)
    prompt_tokens = prompt_tokens_of(prompt)
    return wire, prompt, params, prompt_tokens, engine.check(params, prompt_tokens)


def _logprobs(i: int) -> dict:
    """v1.2.0's per-token ``logprobs`` metadata: ``{token_id: logprob_info}`` (ujson writes
    the id as a string key)."""
    return {str(1000 + i): {"logprob": -0.5, "rank": None, "decoded_token": token_text(i)}}


async def generate(request: web.Request) -> web.StreamResponse:
    """``POST /generate``."""
    engine = _count(request)
    try:
        wire, prompt, params, prompt_tokens, max_new = await _native_request(request, engine)
        n = params.get("n") or params.get("best_of") or 1
        max_new, msg = engine.fit(prompt_tokens, max_new)
        if msg:
            raise _Rejected(msg, 400 if engine.v1 else 417)
    except _Rejected as e:
        return engine.error(e.message, e.status)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return engine.error(str(e))
    try:
        texts, reason = await _collect(request, engine, prompt_tokens, max_new, wire)
    except _Abort:
        return _gone()
    ret: dict[str, Any] = {
        "generated_text": ["".join(texts)] * n,
        "count_output_tokens": len(texts) if n == 1 else [len(texts)] * n,
        "finish_reason": reason if n == 1 else [reason] * n,
    }
    if engine.v1:
        ret["prompt_tokens"] = prompt_tokens
        logprobs = [_logprobs(i) for i in range(len(texts))]
        ret["logprobs"] = logprobs if n == 1 else [logprobs] * n
    engine.stats.completed += 1
    return _BareResponse(body=engine.native_json(ret).encode())


async def _event_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(
        status=200, headers={hdrs.CONTENT_TYPE: "text/event-stream; charset=utf-8"}
    )
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    return resp


async def _write_event(resp: web.StreamResponse, data: bytes, split: bool) -> None:
    if not split:
        await resp.write(data)
        return
    cuts = sorted({2, len(data) // 2, len(data) - 1})  # inside "data:", the JSON, "\n\n"
    start = 0
    for cut in cuts + [len(data)]:
        await resp.write(data[start:cut])
        await asyncio.sleep(0.002)  # separate TCP segments, separate reads upstream
        start = cut


async def _run_stream(
    request: web.Request, engine: WireEngine, prompt_tokens: int, max_new: int, wire: dict, render, tail=None
) -> web.StreamResponse:
    """Stream ``render(i, text, finished, reason)`` (bytes, possibly empty) per token, then
    ``tail(tokens)`` (bytes) after a complete stream; the control knobs apply."""
    resp = await _event_stream(request)
    max_new, msg = engine.fit(prompt_tokens, max_new)
    if msg:  # raised inside LightLLM's generator, after the headers
        engine.stats.failed += 1
        if engine.v1:  # _safe_stream_wrapper: one error event, then a clean end
            await resp.write(engine.stream_error_event(msg))
            await resp.write_eof()
        else:  # 0.0.1: uvicorn drops the connection
            request.transport.close()
        return resp
    end_after, break_after = wire.get("end_after"), wire.get("break_after")
    split = bool(wire.get("split"))
    tokens = engine.generate(request, prompt_tokens, max_new, wire)
    sent = 0
    try:
        async for i, text, finished, reason in tokens:
            if end_after is not None and i >= int(end_after):
                engine.stats.failed += 1
                await resp.write_eof()  # a clean end, but without the final event
                return resp
            if break_after is not None and i >= int(break_after):
                engine.stats.failed += 1
                request.transport.close()
                return resp
            data = render(i, text, finished, reason)
            try:
                if data:
                    await _write_event(resp, data, split)
            except ConnectionResetError:  # the client left between two checks
                engine.stats.aborted += 1
                return resp
            engine.stats.tokens_sent += 1
            sent += 1
    except _Abort:
        return resp
    finally:
        await tokens.aclose()  # frees the KV reservation now, not at garbage collection
    if tail is not None:
        await resp.write(tail(sent))
    engine.stats.completed += 1
    await resp.write_eof()
    return resp


async def _collect(request: web.Request, engine: WireEngine, prompt_tokens: int, max_new: int, wire: dict) -> tuple[list[str], str | None]:
    """Run a non-streaming request to its end: (token texts, finish_reason).

    Raises:
        _Abort: the client left (counted).
    """
    texts: list[str] = []
    reason = None
    tokens = engine.generate(request, prompt_tokens, max_new, wire)
    try:
        async for _i, text, finished, fr in tokens:
            texts.append(text)
            engine.stats.tokens_sent += 1
            if finished:
                reason = fr
    finally:
        await tokens.aclose()
    return texts, reason


def _gone() -> web.Response:
    """What a handler returns once its client has left (nothing reaches anyone)."""
    return web.Response(status=499)


async def generate_stream(request: web.Request) -> web.StreamResponse:
    """``POST /generate_stream``."""
    engine = _count(request)
    try:
        wire, prompt, params, prompt_tokens, max_new = await _native_request(request, engine)
        if (params.get("best_of") or 1) != 1:
            raise _Rejected("stream api only support best_of == 1")  # a bare Exception: 417
    except _Rejected as e:
        return engine.error(e.message, e.status)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return engine.error(str(e))
    v1 = engine.v1

    def render(i: int, text: str, finished: bool, reason: str | None) -> bytes:
        token: dict[str, Any] = {"id": 1000 + i, "text": text, "logprob": -0.5, "special": False, "count_output_tokens": i + 1}
        if v1:
            token["prompt_tokens"] = prompt_tokens
        ret: dict[str, Any] = {"token": token, "generated_text": None, "finished": finished, "finish_reason": reason, "details": None}
        if v1:
            ret["input_usage"] = None
            token["logprobs"] = _logprobs(i)
        return ("data:" + engine.native_json(ret) + "\n\n").encode("utf-8")

    return await _run_stream(request, engine, prompt_tokens, max_new, wire, render)


def _validation_error(engine: WireEngine, field: str, body: Any) -> web.Response:
    """FastAPI's 422 for a request model that does not validate (pydantic v1 in 0.0.1, v2 in v1.2.0)."""
    engine.stats.rejected += 1
    if engine.v1:
        detail = [{"type": "missing", "loc": ["body", field], "msg": "Field required", "input": body}]
    else:
        detail = [{"loc": ["body", field], "msg": "field required", "type": "value_error.missing"}]
    return engine.json_response({"detail": detail}, 422)


def _openai_params(body: dict, v1: bool) -> dict:
    """The sampling parameters LightLLM's OpenAI routes build from a request."""
    if v1:
        max_new = body.get("max_completion_tokens") or body.get("max_tokens") or 65536
    else:
        max_new = body.get("max_tokens") or 16
    return {
        "do_sample": body.get("do_sample", False),
        "presence_penalty": body.get("presence_penalty", 0.0),
        "frequency_penalty": body.get("frequency_penalty", 0.0),
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "top_k": body.get("top_k", -1),
        "max_new_tokens": max_new,
    }


def _usage(prompt_tokens: int, completion: int, v1: bool) -> dict:
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}
    if v1:
        usage["prompt_tokens_details"] = {"cached_tokens": 0, "audio_tokens": 0}
    return usage


async def _openai_request(request: web.Request, engine: WireEngine, field: str):
    """Read an OpenAI-route body: ``(body, wire, prompt tokens, max_new, stream)`` or an
    error response."""
    try:
        body = await _body(request, engine)
    except ValueError as e:
        engine.stats.rejected += 1
        return engine.json_response({"detail": [{"msg": str(e), "type": "value_error.jsondecode"}]}, 422)
    if field == "messages":
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return _validation_error(engine, "messages", body)
        prompt = "".join(str(m.get("content") or "") for m in messages)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return _validation_error(engine, "prompt", body)
    if body.get("logit_bias") is not None:
        return engine.error("The logit_bias parameter is not currently supported", 400)
    wire = body.get("wire") or {}
    engine.stats.tags.append(wire.get("tag"))
    prompt_tokens = prompt_tokens_of(prompt)
    stream = bool(body.get("stream"))
    try:
        max_new = engine.check(_openai_params(body, engine.v1), prompt_tokens)
        if stream and (body.get("n") or 1) != 1:
            if engine.v1:  # v1.2.0 streams n choices; the stand-in does not
                return web.Response(status=501, text="the stand-in does not stream n > 1")
            raise _Rejected("stream api only support n = 1")
        if not stream:
            fitted, msg = engine.fit(prompt_tokens, max_new)
            if msg:
                raise _Rejected(msg, 400 if engine.v1 else 417)
    except _Rejected as e:
        return engine.error(e.message, e.status)
    return body, wire, prompt_tokens, max_new, stream


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions`` (LightLLM's OpenAI-like route)."""
    engine = _count(request)
    got = await _openai_request(request, engine, "messages")
    if isinstance(got, web.Response):
        return got
    body, wire, prompt_tokens, max_new, stream = got
    created = int(time.time())
    req_id = f"chatcmpl-{engine.stats.started + 1}"
    model = body.get("model", MODEL_NAME)
    v1 = engine.v1

    def chunk(choice: dict | None, **extra: Any) -> bytes:
        obj: dict[str, Any] = {"id": req_id, "object": "chat.completion.chunk", "created": created, "model": model,
                               "choices": [choice] if choice is not None else []}
        obj.update(extra)
        return ("data: " + engine.native_json(obj) + "\n\n").encode("utf-8")

    if stream and v1:

        def render(i: int, text: str, finished: bool, reason: str | None) -> bytes:
            out = b""
            if i == 0:  # the role-only first chunk
                out += chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None},
                             prompt_token_ids=None)
            if text and finished:
                out += chunk({"index": 0, "delta": {"content": text}, "finish_reason": reason, "logprobs": None,
                              "token_ids": None, "stop_reason": None})
            elif text:
                out += chunk({"index": 0, "delta": {"content": text}, "logprobs": None, "token_ids": None, "finish_reason": None})
            elif finished:
                out += chunk({"index": 0, "delta": {}, "finish_reason": reason, "logprobs": None, "token_ids": None,
                              "stop_reason": None})
            return out

        def tail(n: int) -> bytes:
            return chunk(None, usage=_usage(prompt_tokens, n, True)) + b"data: [DONE]\n\n"

        return await _run_stream(request, engine, prompt_tokens, max_new, wire, render, tail)
    if stream:

        def render_001(i: int, text: str, finished: bool, reason: str | None) -> bytes:
            return chunk({"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": None})

        return await _run_stream(request, engine, prompt_tokens, max_new, wire, render_001)
    max_new, _ = engine.fit(prompt_tokens, max_new)
    try:
        texts, reason = await _collect(request, engine, prompt_tokens, max_new, wire)
    except _Abort:
        return _gone()
    engine.stats.completed += 1
    return engine.json_response(
        {
            "id": req_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(texts)}, "finish_reason": reason}],
            "usage": _usage(prompt_tokens, len(texts), v1),
        }
    )


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions`` (v1.2.0)."""
    engine = _count(request)
    got = await _openai_request(request, engine, "prompt")
    if isinstance(got, web.Response):
        return got
    body, wire, prompt_tokens, max_new, stream = got
    created = int(time.time())
    req_id = f"cmpl-{engine.stats.started + 1}"
    model = body.get("model", MODEL_NAME)

    def chunk(choices: list, usage: dict | None = None) -> bytes:
        obj = {"id": req_id, "object": "text_completion", "created": created, "model": model, "choices": choices, "usage": usage}
        return ("data: " + engine.native_json(obj) + "\n\n").encode("utf-8")

    if stream:

        def render(i: int, text: str, finished: bool, reason: str | None) -> bytes:
            return chunk([{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}])

        def tail(n: int) -> bytes:
            return chunk([], _usage(prompt_tokens, n, True)) + b"data: [DONE]\n\n"

        return await _run_stream(request, engine, prompt_tokens, max_new, wire, render, tail)
    max_new, _ = engine.fit(prompt_tokens, max_new)
    try:
        texts, reason = await _collect(request, engine, prompt_tokens, max_new, wire)
    except _Abort:
        return _gone()
    engine.stats.completed += 1
    return engine.json_response(
        {
            "id": req_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "text": "".join(texts), "logprobs": None, "finish_reason": reason}],
            "usage": _usage(prompt_tokens, len(texts), True),
        }
    )


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models`` (v1.2.0): the model folder's name."""
    engine = _count(request)
    c = engine.config
    card = {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "lightllm",
            "max_model_len": min(c.max_total_token_num - 36, c.max_req_total_len)}
    return engine.json_response({"object": "list", "data": [card]})


async def token_load(request: web.Request) -> web.Response:
    """``GET /token_load``."""
    engine = _count(request)
    engine.stats.token_load_polls += 1
    o = engine.token_load_override
    if o is not None:
        if "hang_s" in o:
            await asyncio.sleep(float(o["hang_s"]))
        if "status" in o:
            return web.Response(status=int(o["status"]), text="Internal Server Error")
        if "current_load" in o or "dynamic_max_load" in o:
            return engine.json_response({k: o[k] for k in ("current_load", "logical_max_load", "dynamic_max_load") if k in o})
    return engine.json_response(engine.token_load())


async def health(request: web.Request) -> web.Response:
    """``GET|HEAD /health``, ``/healthz``: 200 (0.0.1 never said anything else, see the interop notes)."""
    return _count(request).json_response({"message": "Ok"})


async def status_ok(request: web.Request) -> web.Response:
    """``/liveness``, ``/readiness``."""
    return _count(request).json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: the API process's own Prometheus text, no Content-Type."""
    engine = _count(request)
    engine.stats.metrics_polls += 1
    s = engine.stats
    text = (
        "# HELP lightllm_request_count_total lightllm_request_count\n# TYPE lightllm_request_count_total counter\n"
        f"lightllm_request_count_total {float(s.started)}\n"
        "# HELP lightllm_request_success_total lightllm_request_success\n# TYPE lightllm_request_success_total counter\n"
        f"lightllm_request_success_total {float(s.completed)}\n"
    )
    return _BareResponse(body=text.encode())


async def wire_stats(request: web.Request) -> web.Response:
    return web.json_response(asdict(request.app[ENGINE].stats))


async def wire_reset(request: web.Request) -> web.Response:
    request.app[ENGINE].reset()
    return web.json_response({"ok": True})


async def wire_token_load(request: web.Request) -> web.Response:
    o = await request.json()
    request.app[ENGINE].token_load_override = o or None
    return web.json_response({"ok": True})


def make_app(config: WireConfig | None = None) -> web.Application:
    """The stand-in's application. Serve it with ``handler_cancellation=False`` (as
    :class:`WireServer` does): LightLLM notices a closed connection by polling, not at once."""
    app = web.Application()
    app[ENGINE] = WireEngine(config or WireConfig())
    server = SERVER_HEADERS[app[ENGINE].config.flavor]

    async def server_header(_request: web.Request, response: web.StreamResponse) -> None:
        response.headers[hdrs.SERVER] = server

    app.on_response_prepare.append(server_header)
    app.router.add_post("/generate", generate)
    app.router.add_post("/generate_stream", generate_stream)
    app.router.add_post("/v1/chat/completions", chat_completions)
    if app[ENGINE].v1:
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/v1/models", models)
    app.router.add_get("/token_load", token_load)
    for path in ("/health", "/healthz"):
        app.router.add_get(path, health)  # GET routes answer HEAD too
    for path in ("/liveness", "/readiness"):
        app.router.add_get(path, status_ok)
        app.router.add_post(path, status_ok)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/_wire/stats", wire_stats)
    app.router.add_post("/_wire/reset", wire_reset)
    app.router.add_post("/_wire/token_load", wire_token_load)
    return app


class WireServer:
    """The stand-in on ``127.0.0.1``, in the running event loop.

    ``await WireServer(config).start()``; ``.url``, ``.engine``; ``await .stop()``.
    """

    def __init__(self, config: WireConfig | None = None, port: int = 0) -> None:
        self.app = make_app(config)
        self.engine = self.app[ENGINE]
        self._port = port
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> "WireServer":
        self._runner = web.AppRunner(
            self.app,
            handler_cancellation=False,
            access_log=None,
            keepalive_timeout=self.engine.keepalive_s,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self._port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


class WireThread:
    """The stand-in in a thread of its own (its own event loop), for fixtures that must
    outlive one test's loop: ``with WireThread(config) as w: w.url, w.stats``."""

    def __init__(self, config: WireConfig | None = None) -> None:
        self.config = config or WireConfig()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lightllm-wire", daemon=True)
        self.server: WireServer | None = None

    def __enter__(self) -> "WireThread":
        self._thread.start()
        self.server = self.call(WireServer(self.config).start())
        return self

    def __exit__(self, *exc: object) -> None:
        self.call(self.server.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def call(self, coro, timeout: float = 30.0):
        """Run ``coro`` on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def engine(self) -> WireEngine:
        return self.server.engine

    @property
    def stats(self) -> WireStats:
        return self.server.engine.stats

    def reset(self) -> None:
        async def _reset() -> None:
            self.engine.reset()

        self.call(_reset())

    def set_token_load(self, override: dict | None) -> None:
        async def _set() -> None:
            self.engine.token_load_override = override or None

        self.call(_set())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--flavor", choices=FLAVORS, default=V1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--max-total-token-num", type=int, default=6000)
    ap.add_argument("--itl-s", type=float, default=0.0)
    ap.add_argument("--ttft-s", type=float, default=0.0)
    ap.add_argument("--disconnect-poll-s", type=float, default=5.0)
    a = ap.parse_args()
    cfg = WireConfig(
        flavor=a.flavor, dp=a.dp, max_total_token_num=a.max_total_token_num, itl_s=a.itl_s, ttft_s=a.ttft_s,
        disconnect_poll_s=a.disconnect_poll_s,
    )
    web.run_app(
        make_app(cfg),
        host=a.host,
        port=a.port,
        handler_cancellation=False,
        keepalive_timeout=KEEPALIVE_S[cfg.flavor],
        access_log=None,
        print=lambda *_: print(f"lightllm wire stand-in ready on http://{a.host}:{a.port}", flush=True),
    )


if __name__ == "__main__":
    main()
