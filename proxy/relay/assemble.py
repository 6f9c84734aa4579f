"""Assemble a non-streaming OpenAI answer from the upstream's stream.

One concept over 400 lines: one non-streaming answer rebuilt from a stream, for the chat,
completion and Responses formats; most of it is the merge rules for fragments (tool calls,
logprobs) that engines send differently, listed below and applied here.

With ``upstream.stream_non_streaming: true`` the proxy asks the upstream to stream every
request and rebuilds the whole answer for clients that did not ask for a stream. Why: some
engines abort a generation when its connection closes only while streaming (the bundled
CPU engine, ``transformers serve`` 5.24, finishes a non-streamed generation whose client
left, and stops a stream's; docs/configuration.md, ``stream_non_streaming``). Streaming
upstream makes a departed client's abort
reach the engine in that window too.

Every field the upstream sends is kept: the first chunk's top-level fields; per choice,
the concatenated ``content`` / ``refusal`` / ``reasoning_content`` / ``reasoning`` (chat)
or ``text`` (completions), ``tool_calls`` assembled as below, ``logprobs`` lists joined,
the last non-null ``finish_reason``, any other choice field as last seen; and ``usage``.

Tool calls follow the OpenAI Python SDK's stream accumulator (``openai`` 3.x,
``lib/streaming/_deltas.py`` ``accumulate_delta``): fragments are merged into the call
their ``index`` names, ``arguments`` fragments joined in order, ``type`` replaced, any
other member kept. Two rules differ, for engines whose chunks the SDK's accumulator
itself gets wrong (it joins every string and raises on a fragment without ``index``):

* ``id`` and ``function.name`` arrive whole, once (OpenAI, vLLM, SGLang), or whole again
  in every fragment (MiniMax through NVIDIA NIM, Fireworks): a name equal to the one
  already held is a repeat, not a fragment; a different one is joined to it, as the SDK
  joins it. The first ``id`` is the call's: LM Studio sends a new one with every
  argument fragment of one call (reported against NousResearch/hermes-agent, PR 106943).
  An empty or null value is nothing.
* a fragment without ``index`` (Gemini's OpenAI-compatible API) continues the last call
  that came without one, unless it starts another: it carries an ``id`` other than that
  call's, or a name when that call has another one.

The same rules assemble the legacy ``function_call`` delta.

A Responses API stream (:func:`relay_assembled` with kind ``responses``: an engine that
streams a request that asked for no stream, as transformers serve does) is answered
with the response object its terminal event carries (``response.completed`` or
``.incomplete``), its ``output`` filled from the ``response.output_item.done`` events
when the terminal event has none.

The answer tells the truth about the stream it came from: an in-band error event
(for Responses, ``response.failed`` and ``error``) becomes an error answer (the engine's
error object, with the engine's numeric ``code`` as the status when it is one, else 502),
and a stream that ended before every choice got its ``finish_reason`` (and without
``[DONE]``; for Responses, before its terminal event) becomes a 502
``upstream_stream_incomplete``: never a 200 with partial text. One that had finished and
then broke before its end lost nothing, and is answered whole. The request body the
proxy sends upstream instead is built by :mod:`proxy.relay.upstream_body`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from ..wire.errors import engine_error_response, error_response
from ..telemetry.metrics import OUTCOME_OK, OUTCOME_UPSTREAM_ERROR
from .relay import UPSTREAM_FAILURES, Exchange, note_engine_error, note_upstream_id, usage_of
from ..wire.headers import client_headers
from ..wire.responses_answer import ResponsesStreamScanner
from ..wire.sse import SSEScanner, event_payloads

# text a delta streams in pieces: ``reasoning`` is vLLM's newer name for ``reasoning_content``
_TEXT_FIELDS = ("content", "refusal", "reasoning_content", "reasoning")


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
        acc = self.choices.setdefault(idx, {"index": idx, "finish_reason": None, "_tools": _ToolCalls(), "_text": {}, "_logprobs": None})
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
                        acc["_tools"].add(tc)
            elif k == "function_call" and isinstance(v, dict):  # the legacy functions API
                extra = acc.setdefault("_extra", {})
                extra["function_call"] = _merge_call(extra.get("function_call") or {}, v)
            elif k == "role":
                if v is not None:
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
                if tools.calls:
                    msg["tool_calls"] = tools.result()
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


class _ToolCalls:
    """The tool calls of one choice, assembled from their fragments (the module
    docstring's rules).

    Attributes:
        calls: slot -> the call so far (``id``, ``type``, ``function`` and any other
            member the engine sends); a slot is the fragment's ``index``, or one past
            the highest slot for a call that came without one.
    """

    __slots__ = ("calls", "_unindexed")

    def __init__(self) -> None:
        self.calls: dict[int, dict[str, Any]] = {}
        self._unindexed: int | None = None  # the slot of the last call without an index

    def add(self, tc: dict) -> None:
        """Merge one fragment (an element of a delta's ``tool_calls``)."""
        idx = tc.get("index")
        if isinstance(idx, int) and not isinstance(idx, bool):
            slot = idx
        else:
            slot = self._unindexed
            if slot is None or _starts_another(self.calls[slot], tc):
                slot = max(self.calls, default=-1) + 1
            self._unindexed = slot
        cur = self.calls.get(slot)
        if cur is None:
            cur = self.calls[slot] = {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        _merge_call(cur, tc)

    def result(self) -> list[dict]:
        """The calls in slot order, as a non-streaming ``message.tool_calls``."""
        return [self.calls[i] for i in sorted(self.calls)]


def _starts_another(cur: dict, tc: dict) -> bool:
    """Whether a fragment without ``index`` starts a call after ``cur``: it carries an id
    other than ``cur``'s, or a function name when ``cur`` has another one."""
    tid = tc.get("id")
    if isinstance(tid, str) and tid and cur.get("id") and tid != cur["id"]:
        return True
    fn = tc.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    held = cur["function"].get("name") if isinstance(cur.get("function"), dict) else None
    return isinstance(name, str) and bool(name) and bool(held) and name != held


def _whole(held: object, value: str) -> str:
    """A value sent whole, once or again in every fragment (``function.name``): a repeat
    of the held value is nothing new; anything else is joined to it."""
    if not isinstance(held, str) or not held:
        return value
    return held if value == held else held + value


def _merge_call(cur: dict, tc: dict) -> dict:
    """Merge a tool-call (or legacy ``function_call``) fragment into ``cur``; returns
    ``cur``. ``index`` is the slot, never kept."""
    for k, v in tc.items():
        if k == "index" or v is None:
            continue
        if k == "id":
            if isinstance(v, str) and v:
                cur["id"] = cur.get("id") or v
        elif k == "type":
            if isinstance(v, str) and v:
                cur["type"] = v
        elif k in ("function", "name", "arguments"):
            fn = cur if k != "function" else cur.setdefault("function", {"name": "", "arguments": ""})
            parts = v if k == "function" else {k: v}
            if not isinstance(parts, dict):
                continue
            for fk, fv in parts.items():
                if fk == "name" and isinstance(fv, str):
                    if fv:
                        fn["name"] = _whole(fn.get("name"), fv)
                elif fk == "arguments" and isinstance(fv, str):
                    fn["arguments"] = (fn.get("arguments") or "") + fv
                elif fv is not None:
                    fn[fk] = _merge_other(fn.get(fk), fv)
        else:
            cur[k] = _merge_other(cur.get(k), v)
    return cur


def _merge_other(held: object, value: object) -> object:
    """Any other member (Gemini's ``extra_content``): objects merged member by member, a
    value kept as first sent."""
    if isinstance(held, dict) and isinstance(value, dict):
        for k, v in value.items():
            held[k] = _merge_other(held.get(k), v)
        return held
    return value if held is None else held


def _merge_logprobs(acc: dict | None, lp: dict) -> dict:
    if acc is None:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in lp.items()}
    for k, v in lp.items():
        if isinstance(v, list) and isinstance(acc.get(k), list):
            acc[k].extend(v)
        elif k not in acc or acc[k] is None:
            acc[k] = v
    return acc


class ResponsesAssembler:
    """Folds a Responses API stream's event objects into the response object a
    non-streaming request gets: the terminal event's ``response`` (``response.completed``,
    ``.incomplete`` or ``.failed``; before it, ``response.created``'s), its ``output``
    filled from the ``response.output_item.done`` items, by ``output_index``, when it
    carries none (OpenAI's Responses streaming reference: each of those events holds one
    whole output item). Same interface as :class:`Assembler`.
    """

    def __init__(self) -> None:
        self.response: dict[str, Any] = {}
        self.items: dict[int, Any] = {}

    def add(self, event: Any) -> None:
        """Fold one parsed event in; anything that is not an object is ignored."""
        if not isinstance(event, dict):
            return
        kind = event.get("type")
        resp = event.get("response")
        if kind in ("response.created", "response.in_progress", "response.completed", "response.incomplete", "response.failed") and isinstance(resp, dict):
            self.response = resp
        elif kind == "response.output_item.done" and isinstance(event.get("item"), dict):
            idx = event.get("output_index")
            self.items[idx if isinstance(idx, int) else len(self.items)] = event["item"]

    def result(self) -> dict:
        """The ``response`` object."""
        out = dict(self.response)
        if not out.get("output") and self.items:
            out["output"] = [self.items[i] for i in sorted(self.items)]
        out.setdefault("object", "response")
        return out


#: The kinds whose streams :func:`relay_assembled` can answer as one JSON object.
ASSEMBLED_KINDS = frozenset({"chat", "completion", "responses"})


async def relay_assembled(upstream: aiohttp.ClientResponse, ex: Exchange, kind: str, choices: int = 1, base_url: str | None = None) -> web.Response:
    """Read the upstream's SSE answer to the end and answer with the assembled JSON.

    Args:
        upstream: the upstream response (status 200, ``text/event-stream``).
        ex: the :class:`proxy.relay.relay.Exchange`; status, token counts and outcome are set.
        kind: the request's kind, one of :data:`ASSEMBLED_KINDS`
            (:attr:`proxy.relay.request_kinds.RequestKind.name`): ``chat``, ``completion``
            (:class:`Assembler`) or ``responses`` (:class:`ResponsesAssembler`).
        choices: how many choices the client asked for (``n``).
        base_url: the engine's base URL (:func:`proxy.wire.headers.client_headers`).

    Returns:
        The assembled answer (200, with the upstream's end-to-end headers); or an error
        answer: the engine's in-band error, or 502 ``upstream_stream_incomplete``.

    A stream that had finished (every choice got its ``finish_reason``, or ``[DONE]``;
    a Responses stream's terminal event) or carried the engine's error, and then broke
    or went idle before its end, is answered as if it had ended there: nothing was lost.

    Raises:
        aiohttp.ClientError, TimeoutError: the upstream broke before the answer was
            whole (the caller answers 502).
        EventTooLarge: one event grew past ``proxy.wire.sse.MAX_EVENT_BYTES`` (likewise).
        asyncio.CancelledError: the client went away (the caller aborts the upstream,
            which now aborts the generation).
    """
    scanner: SSEScanner | ResponsesStreamScanner
    if kind == "responses":
        asm: Assembler | ResponsesAssembler = ResponsesAssembler()
        scanner = ResponsesStreamScanner()
    else:
        asm, scanner = Assembler(chat=kind == "chat"), SSEScanner()
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
        ex.detail = scanner.unfinished()
        ex.output_tokens = scanner.tokens
        resp = error_response(502, "the upstream stream ended before it finished", code="upstream_stream_incomplete")
    else:
        data = orjson.dumps(asm.result())
        prompt, out = usage_of(data, native=False)
        ex.output_tokens = out if out is not None else scanner.tokens
        ex.prompt_tokens = prompt if prompt is not None else scanner.prompt_tokens
        ex.outcome = OUTCOME_OK
        if broke is not None:
            ex.detail = f"the upstream broke after the stream finished: {type(broke).__name__}"
        resp = web.Response(body=data, content_type="application/json")
    for k, v in headers.items():
        if k not in resp.headers:
            resp.headers.add(k, v)
    ex.status = resp.status
    return resp


def _fold(asm: Assembler | ResponsesAssembler, payloads: list[bytes]) -> None:
    for payload in payloads:
        try:
            asm.add(orjson.loads(payload))
        except orjson.JSONDecodeError:
            continue
