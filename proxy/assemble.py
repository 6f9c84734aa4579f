"""Assemble a non-streaming OpenAI answer from the upstream's stream.

With ``upstream.stream_non_streaming: true`` the proxy asks the upstream to stream every
request and rebuilds the whole answer for clients that did not ask for a stream. Why: some
engines abort a generation when its connection closes only while streaming (the bundled
CPU engine, ``transformers serve`` 5.24, finishes a non-streamed generation whose client
left, and stops a stream's; docs/configuration.md, ``stream_non_streaming``). Streaming
upstream makes a departed client's abort
reach the engine in that window too.

Every field the upstream sends is kept: the first chunk's top-level fields; per choice,
the concatenated ``content`` / ``refusal`` / ``reasoning_content`` (chat) or ``text``
(completions), ``tool_calls`` merged by their ``index`` (ids, names and argument
fragments joined, as the OpenAI streaming format splits them), ``logprobs`` lists joined,
the last non-null ``finish_reason``, any other choice field as last seen; and ``usage``.

The answer tells the truth about the stream it came from: an in-band error event
becomes an error answer (the engine's error object, with the engine's numeric ``code``
as the status when it is one, else 502), and a stream that ended before every choice
got its ``finish_reason`` (and without ``[DONE]``) becomes a 502
``upstream_stream_incomplete``: never a 200 with partial text. One that had finished and
then broke before its end lost nothing, and is answered whole. The request body the
proxy sends upstream instead is built by :mod:`proxy.upstream_body`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from .errors import engine_error_response, error_response
from .metrics import OUTCOME_OK, OUTCOME_UPSTREAM_ERROR
from .relay import UPSTREAM_FAILURES, Exchange, note_engine_error, note_upstream_id
from .relay_headers import client_headers
from .sse import SSEScanner, event_payloads

_TEXT_FIELDS = ("content", "refusal", "reasoning_content")


class Assembler:
    """Folds the stream's ``data:`` payloads (parsed JSON objects) into one answer.

    Args:
        chat: True for ``/v1/chat/completions``, False for ``/v1/completions``.
    """

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.top: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.usage: dict | None = None

    def add(self, chunk: Any) -> None:
        """Fold one parsed chunk in; anything that is not an object is ignored."""
        if not isinstance(chunk, dict):
            return
        for k, v in chunk.items():
            if k == "choices":
                continue
            if k == "usage":
                if isinstance(v, dict):
                    self.usage = v
                continue
            self.top.setdefault(k, v)
        for ch in chunk.get("choices") or ():
            if isinstance(ch, dict):
                self._choice(ch)

    def _choice(self, ch: dict) -> None:
        idx = ch.get("index", 0)
        idx = idx if isinstance(idx, int) else 0
        acc = self.choices.setdefault(idx, {"index": idx, "finish_reason": None, "_tools": {}, "_text": {}, "_logprobs": None})
        for k, v in ch.items():
            if k in ("index", "delta", "text", "logprobs"):
                continue
            if k == "finish_reason":
                if v is not None:
                    acc["finish_reason"] = v
                continue
            acc[k] = v
        if self.chat:
            delta = ch.get("delta")
            if isinstance(delta, dict):
                self._delta(acc, delta)
        elif isinstance(ch.get("text"), str):
            acc["_text"]["text"] = acc["_text"].get("text", "") + ch["text"]
        lp = ch.get("logprobs")
        if isinstance(lp, dict):
            acc["_logprobs"] = _merge_logprobs(acc["_logprobs"], lp)

    def _delta(self, acc: dict, delta: dict) -> None:
        for k, v in delta.items():
            if k in _TEXT_FIELDS and isinstance(v, str):
                acc["_text"][k] = acc["_text"].get(k, "") + v
            elif k == "tool_calls" and isinstance(v, list):
                for tc in v:
                    if isinstance(tc, dict):
                        _merge_tool_call(acc["_tools"], tc)
            elif k == "role":
                acc.setdefault("_role", v)
            elif v is not None:
                acc.setdefault("_extra", {})[k] = v

    def result(self) -> dict:
        """The assembled ``chat.completion`` / ``text_completion`` object."""
        out = dict(self.top)
        out["object"] = "chat.completion" if self.chat else "text_completion"
        choices = []
        for idx in sorted(self.choices):
            acc = dict(self.choices[idx])
            tools, text, lp = acc.pop("_tools"), acc.pop("_text"), acc.pop("_logprobs")
            role, extra = acc.pop("_role", "assistant"), acc.pop("_extra", {})
            if self.chat:
                msg: dict[str, Any] = {"role": role, "content": text.get("content")}
                for k in ("refusal", "reasoning_content"):
                    if k in text:
                        msg[k] = text[k]
                if tools:
                    msg["tool_calls"] = [tools[i] for i in sorted(tools)]
                msg.update(extra)
                acc["message"] = msg
            else:
                acc["text"] = text.get("text", "")
            acc["logprobs"] = lp
            choices.append(acc)
        out["choices"] = choices
        if self.usage is not None:
            out["usage"] = self.usage
        return out


def _merge_tool_call(tools: dict[int, dict], tc: dict) -> None:
    i = tc.get("index", len(tools))
    cur = tools.setdefault(i, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
    if tc.get("id"):
        cur["id"] = tc["id"]
    if tc.get("type"):
        cur["type"] = tc["type"]
    fn = tc.get("function")
    if isinstance(fn, dict):
        for k in ("name", "arguments"):
            if isinstance(fn.get(k), str):
                cur["function"][k] += fn[k]


def _merge_logprobs(acc: dict | None, lp: dict) -> dict:
    if acc is None:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in lp.items()}
    for k, v in lp.items():
        if isinstance(v, list) and isinstance(acc.get(k), list):
            acc[k].extend(v)
        elif k not in acc or acc[k] is None:
            acc[k] = v
    return acc


async def relay_assembled(upstream: aiohttp.ClientResponse, ex: Exchange, chat: bool, choices: int = 1, base_url: str | None = None) -> web.Response:
    """Read the upstream's SSE answer to the end and answer with the assembled JSON.

    Args:
        upstream: the upstream response (status 200, ``text/event-stream``).
        ex: the :class:`proxy.relay.Exchange`; status, token counts and outcome are set.
        chat: chat completions (True) or text completions (False).
        choices: how many choices the client asked for (``n``).
        base_url: the engine's base URL (:func:`proxy.relay_headers.client_headers`).

    Returns:
        The assembled answer (200, with the upstream's end-to-end headers); or an error
        answer: the engine's in-band error, or 502 ``upstream_stream_incomplete``.

    A stream that had finished (every choice got its ``finish_reason``, or ``[DONE]``)
    or carried the engine's error, and then broke or went idle before its end, is
    answered as if it had ended there: nothing was lost.

    Raises:
        aiohttp.ClientError, TimeoutError: the upstream broke before the answer was
            whole (the caller answers 502).
        EventTooLarge: one event grew past ``proxy.sse.MAX_EVENT_BYTES`` (likewise).
        asyncio.CancelledError: the client went away (the caller aborts the upstream,
            which now aborts the generation).
    """
    asm = Assembler(chat)
    scanner = SSEScanner()
    buf = bytearray()
    broke: Exception | None = None
    try:
        async for chunk in upstream.content.iter_any():
            scanner.feed(chunk)
            buf += chunk
            _fold(asm, event_payloads(buf))
    except UPSTREAM_FAILURES as e:
        if scanner.error is None and not scanner.complete(choices):
            raise  # the answer is not whole: the caller answers 502
        broke = e
    ex.upstream_ended = True
    if broke is None:
        scanner.end()
        buf += b"\n\n"  # an unterminated last event
        _fold(asm, event_payloads(buf))
    else:
        # the engine had ended its answer (every choice's finish, or its own error) when
        # the connection broke or went idle before its end: nothing was lost, the answer
        # is assembled from what came (an unterminated event, what broke, is left out).
        # The connection is closed, never reused; there is no generation left to abort.
        upstream.close()
    ex.first_byte_at = asyncio.get_running_loop().time()
    note_upstream_id(ex, upstream.headers)
    headers = client_headers(upstream.headers, ex.request_id, base_url, transformed=True)
    for h in ("Content-Type", "Cache-Control", "X-Accel-Buffering", "ETag"):  # those of the stream
        headers.popall(h, None)
    if scanner.error is not None:
        note_engine_error(ex, scanner.error)
        ex.output_tokens = scanner.tokens
        resp = engine_error_response(scanner.error)
    elif not scanner.complete(choices):
        ex.outcome = OUTCOME_UPSTREAM_ERROR
        ex.detail = "stream ended without any event" if scanner.events == 0 else "stream ended without finish_reason or [DONE]"
        ex.output_tokens = scanner.tokens
        resp = error_response(502, "the upstream stream ended before it finished", code="upstream_stream_incomplete")
    else:
        body = asm.result()
        usage = body.get("usage") or {}
        out, prompt = usage.get("completion_tokens"), usage.get("prompt_tokens")
        ex.output_tokens = out if isinstance(out, int) else scanner.tokens
        ex.prompt_tokens = prompt if isinstance(prompt, int) else None
        ex.outcome = OUTCOME_OK
        if broke is not None:
            ex.detail = f"the upstream broke after the stream finished: {type(broke).__name__}"
        resp = web.Response(body=orjson.dumps(body), content_type="application/json")
    for k, v in headers.items():
        if k not in resp.headers:
            resp.headers.add(k, v)
    ex.status = resp.status
    return resp


def _fold(asm: Assembler, payloads: list[bytes]) -> None:
    for payload in payloads:
        try:
            asm.add(orjson.loads(payload))
        except orjson.JSONDecodeError:
            continue
