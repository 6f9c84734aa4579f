"""A stream preempted after its client was shown tokens, and resumed where it stopped
(``pools[].preemption.resume``; ``docs/scheduling.md``, "Resuming a shown stream").

While a resumable stream is relayed, :class:`StreamResume` follows the events the
client is sent (complete events only: a partial one is held back until it ends) and
keeps the text of its one choice (chat: ``delta.content``; completions: ``text``), and
the count of tokens sent (one per event that carried text: the engines named below send
one event per decoding step). When the request is preempted, the proxy closes its
upstream request (which aborts the generation) and keeps the client's response open;
when it is dispatched again it sends :meth:`StreamResume.body`:

* chat: the same ``messages`` plus the text so far as a last ``assistant`` message, with
  ``continue_final_message: true`` and ``add_generation_prompt: false`` (vLLM's and
  SGLang's chat extensions: the chat template renders that message unterminated and the
  model continues it; vLLM ``ChatCompletionRequest``, SGLang ``ChatCompletionRequest``);
* completions: ``prompt`` + the text so far;
* ``max_tokens`` / ``max_completion_tokens`` (each one the request names) less the
  tokens sent.

The later part's events are rewritten so the client reads one stream: ``id``,
``created`` and ``model`` are the first part's; its role delta (``"role":
"assistant"``), already sent, is dropped (an event left with nothing else is dropped
whole); a ``usage`` object (the client asked ``stream_options.include_usage``) reports
the original prompt (the resumed prompt less the tokens sent before it) and the
completion tokens of every part.

A stream is resumable only while that can be done without loss: one choice (``n`` 1),
no ``logprobs``, no ``echo``, a chat request that does not continue a message itself, a
completions prompt that is one string without ``suffix``
(:func:`resume_refusal`); and only until its events show anything the text alone cannot
carry (a tool call, reasoning, logprobs, more than one choice), its end (a
``finish_reason``, ``[DONE]``, an error), or all of its ``max_tokens``: then it is
*pinned* (the ``pin`` callback marks the ticket shown, :attr:`qos.Ticket.shown`) and
never preempted again.
"""

from __future__ import annotations

from collections.abc import Callable

import orjson
from aiohttp import web

from ..wire.errors import sse_error_event
from ..wire.request_body import ParsedRequest
from ..wire.sse import DONE, parse_event, split_events

#: the chat delta keys that the text alone carries; any other one set pins the stream
_TEXT_KEYS = frozenset({"role", "content"})
#: the request kinds (:attr:`proxy.relay.request_kinds.RequestKind.name`) that resume
RESUMABLE_KINDS = frozenset({"chat", "completion"})
_CAPS = ("max_tokens", "max_completion_tokens")
#: what pins every resumable stream at its end (not worth an access-log note)
UNPINNED_ENDS = frozenset({"finished", "the upstream answer ended", "max_tokens reached"})


def resume_refusal(kind: str, parsed: ParsedRequest) -> str | None:
    """Why the stream of ``parsed`` (a request of kind ``kind``) cannot be resumed after
    a preemption, or ``None`` when it can (see the module docstring). Each reason is a
    short phrase for the access log's ``resume`` field."""
    f = parsed.fields
    if kind not in RESUMABLE_KINDS:
        return "kind"
    if not parsed.stream:
        return "not a stream"
    if parsed.choices != 1:
        return "more than one choice"
    if f.get("logprobs") not in (None, False) or f.get("top_logprobs") is not None:
        return "logprobs"
    if f.get("echo"):
        return "echo"
    if kind == "chat":
        msgs = f.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return "messages"
        if f.get("continue_final_message") or f.get("add_generation_prompt") is False:
            return "continues a message itself"
    else:
        if not isinstance(f.get("prompt"), str):
            return "prompt not one string"
        if f.get("suffix") is not None:
            return "suffix"
    for cap in _CAPS:
        v = f.get(cap)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            return cap
    return None


class StreamResume:
    """One resumable stream's state across its parts (see the module docstring).

    Args:
        chat: a chat stream (else completions).
        max_tokens: the request's output cap (tokens), or ``None``: reaching it pins.
        pin: called once when the stream becomes not resumable (marks its ticket shown).
        prompt_estimate: the proxy's estimate of the prompt (tokens): the original
            prompt charged when no engine reported one.

    Attributes:
        response: the client's response once the relay made it (kept across parts).
        early: that response was sent before the answer (its status and headers while
            the request waited), so only events show the answer.
        sent: events of the answer have been written to the client.
        part: 0 for the first part, 1 after the first resume, ...
        pieces: the text sent to the client, in pieces.
        tokens: tokens sent to the client over every part (events with text).
        starts: ``tokens`` at the start of each part (``starts[0] == 0``).
        pinned: no longer resumable.
        why_pinned: what pinned it (a short phrase), ``""`` while not pinned.
        usage_prompt: the prompt tokens the last part's engine reported to the client
            (its resumed prompt), or ``None``.
    """

    __slots__ = ("chat", "prompt_estimate", "max_tokens", "_pin", "response", "early", "sent", "part", "pieces", "tokens", "starts", "pinned", "why_pinned", "_buf", "_id", "_created", "_model", "_role_sent", "usage_prompt")

    def __init__(self, chat: bool, max_tokens: int | None, pin: Callable[[], None], prompt_estimate: int = 0) -> None:
        self.chat = chat
        self.prompt_estimate = prompt_estimate
        self.max_tokens = max_tokens
        self._pin = pin
        self.response: web.StreamResponse | None = None
        self.early = self.sent = False
        self.part = 0
        self.pieces: list[str] = []
        self.tokens = 0
        self.starts = [0]
        self.pinned = False
        self.why_pinned = ""
        self._buf = bytearray()
        self._id = self._created = self._model = None
        self._role_sent = False
        self.usage_prompt: int | None = None

    @property
    def shown(self) -> bool:
        """Whether the client has been shown the answer's status line or any of its
        events (a preemption from now on is resumed, not restarted). A response sent
        early, while the request waited (``early``), shows nothing of the answer until
        its first event."""
        return self.response is not None and self.response.prepared and (self.sent or not self.early)

    @property
    def text(self) -> str:
        """The text sent to the client so far."""
        return "".join(self.pieces)

    @property
    def done_tokens(self) -> int:
        """Tokens sent to the client before the current part began."""
        return self.starts[-1]

    def pin(self, why: str) -> None:
        """Make the stream not resumable from now on (``why``: for the access log)."""
        if not self.pinned:
            self.pinned, self.why_pinned = True, why
            self._pin()

    def next_part(self) -> None:
        """The stream was preempted: the next part starts with the tokens sent so far.
        A partial event held back was never sent: it is dropped."""
        self.part += 1
        self.starts.append(self.tokens)
        self._buf.clear()

    def restart(self) -> None:
        """The stream was preempted before its client was shown anything: the next
        attempt is a fresh one (nothing to continue)."""
        self.response = None
        self.early = self.sent = False
        self._buf.clear()
        self.pieces.clear()
        self.tokens, self.starts, self.part = 0, [0], 0
        self._id = self._created = self._model = None
        self._role_sent = False

    def feed(self, data: bytes) -> bytes:
        """The bytes to write to the client for ``data`` (bytes the relay was about to
        write): its complete events, rewritten in a later part; a partial event is held
        until it ends. Called right before the write, so what it records is what the
        client is sent."""
        buf = self._buf
        buf += data
        events = split_events(buf)
        if not events:
            return b""
        out = self._event(events[0]) if len(events) == 1 else b"".join(self._event(ev) for ev in events)
        if out:
            self.sent = True
        return out

    def flush(self) -> bytes:
        """At the stream's end: an unterminated last event, as it is."""
        out = bytes(self._buf)
        self._buf.clear()
        return out

    def _event(self, ev: bytes) -> bytes:
        name, payload = parse_event(ev)
        if payload is None:
            return ev  # a comment, a keep-alive
        payload = payload.strip()
        if payload == DONE:
            self.pin("finished")
            return ev
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self.pin("an event that is not JSON")
            return ev
        if not isinstance(obj, dict) or name is not None or "error" in obj or obj.get("object") == "error":
            self.pin("an error event")
            return ev
        later = self.part > 0
        changed = False
        if self._id is None and "id" in obj:
            self._id, self._created, self._model = obj.get("id"), obj.get("created"), obj.get("model")
        elif later:
            for key, value in (("id", self._id), ("created", self._created), ("model", self._model)):
                if key in obj and obj[key] != value:
                    obj[key] = value
                    changed = True
        drop = False
        choices = obj.get("choices")
        if isinstance(choices, list) and choices:
            if len(choices) > 1:
                self.pin("more than one choice")
            ch = choices[0]
            if isinstance(ch, dict):
                changed, drop = self._choice(ch, later, changed)
        usage = obj.get("usage")
        if isinstance(usage, dict) and later:
            self._usage(usage)
            changed, drop = True, False
        if drop:
            return b""
        return b"data: " + orjson.dumps(obj) + b"\n\n" if changed else ev

    def _choice(self, ch: dict, later: bool, changed: bool) -> tuple[bool, bool]:
        """Follow one choice's event; returns (the event changed, drop it)."""
        if ch.get("logprobs") is not None:
            self.pin("logprobs")
        drop = False
        if self.chat:
            delta = ch.get("delta")
            text = None
            if isinstance(delta, dict):
                if any(v is not None for k, v in delta.items() if k not in _TEXT_KEYS):
                    self.pin("a tool call or reasoning")
                if "role" in delta:
                    if self._role_sent and later:
                        del delta["role"]
                        changed = True
                        # the resumed part's opening event, nothing but the role: dropped
                        drop = not delta.get("content") and ch.get("finish_reason") is None
                    self._role_sent = True
                text = delta.get("content")
        else:
            text = ch.get("text")
        if isinstance(text, str) and text:
            self.pieces.append(text)
            self.tokens += 1
            if self.max_tokens is not None and self.tokens >= self.max_tokens:
                self.pin("max_tokens reached")
        if ch.get("finish_reason") is not None:
            self.pin("finished")
        return changed, drop

    def _usage(self, usage: dict) -> None:
        """A later part's usage, as the client reads it: the original prompt, every
        part's completion tokens."""
        p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(p, int):
            self.usage_prompt = p
            usage["prompt_tokens"] = max(0, p - self.done_tokens)
        if isinstance(c, int):
            usage["completion_tokens"] = c + self.done_tokens
        if isinstance(usage.get("prompt_tokens"), int) and isinstance(usage.get("completion_tokens"), int):
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        usage.pop("prompt_tokens_details", None)  # cached counts of the resumed prompt: not the original's

    def body(self, parsed: ParsedRequest) -> ParsedRequest:
        """The request to send for the next part: ``parsed`` continued with the text
        sent so far, its output caps less the tokens sent (at least 1)."""
        f = dict(parsed.fields)
        text = self.text
        if self.chat:
            f["messages"] = [*f["messages"], {"role": "assistant", "content": text}]
            f["continue_final_message"] = True
            f["add_generation_prompt"] = False
        else:
            f["prompt"] = f["prompt"] + text
        for cap in _CAPS:
            if isinstance(f.get(cap), int):
                f[cap] = max(1, f[cap] - self.tokens)
        max_tokens = None if parsed.max_tokens is None else max(1, parsed.max_tokens - self.tokens)
        return ParsedRequest(orjson.dumps(f), parsed.stream, max_tokens, parsed.prompt_tokens, f, parsed.choices)

    def charge(self, reported_prompt: int | None, part_output: int) -> tuple[int, int]:
        """(prompt, output) tokens the engines computed over every part, for the
        fairness account: each part's prompt is the original prompt plus the text sent
        before it (the original: the last part's reported prompt less the tokens sent
        before that part; :attr:`prompt_estimate` when none was reported), and the
        output is every part's."""
        last = self.starts[-1]
        original = max(0, reported_prompt - last) if reported_prompt is not None else self.prompt_estimate
        return sum(original + s for s in self.starts), last + part_output

    async def fail(self, message: str, code: str) -> web.StreamResponse:
        """End the client's stream, already shown, with a terminal error event
        (``data: {"error": ...}``, as :meth:`proxy.wire.sse.SSEScanner.cut`): a resumed
        part that could not be opened, was refused, or never got its turn. Returns the
        response."""
        resp = self.response
        assert resp is not None
        self._buf.clear()
        try:
            await resp.write(sse_error_event(message, code))
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client left meanwhile
        return resp
