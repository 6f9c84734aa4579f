"""The usage the proxy asked for and the client did not, taken out of a stream again.

The proxy adds ``stream_options.include_usage`` to a streamed request so it can count the
tokens (:mod:`proxy.relay.upstream_body`); a client that did not ask for usage must get
the stream as if it had not been added. :class:`UsageStripper` follows the stream's events
(:mod:`proxy.wire.sse`) and :func:`strip_usage` rewrites one event, every other byte
unchanged.
"""

from __future__ import annotations

import re

import orjson

from .sse import parse_event, take_events

_EVENT_ENDINGS = (b"\n\n", b"\r\n\r\n", b"\r\r")
_USAGE_KEY = re.compile(rb'"usage"\s*:\s*')
_BLANK = b" \t\r\n"


def _value_end(buf: bytes, i: int) -> int:
    """The index just past the JSON value that starts at ``buf[i]`` (an object, array,
    string or scalar; ``len(buf)`` when it does not end). Strings are skipped whole, so a
    brace inside one is not counted."""
    n = len(buf)
    if i >= n:
        return n
    if buf[i] == 0x22:  # a string
        j = i + 1
        while j < n:
            c = buf[j]
            if c == 0x5C:
                j += 2
                continue
            if c == 0x22:
                return j + 1
            j += 1
        return n
    if buf[i] in b"{[":
        depth = 0
        j = i
        while j < n:
            c = buf[j]
            if c == 0x22:
                j = _value_end(buf, j)
                continue
            if c in b"{[":
                depth += 1
            elif c in b"}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return n
    j = i
    while j < n and buf[j] not in b",}] \t\r\n":
        j += 1
    return j


def _member_cuts(ev: bytes):
    """Each way of cutting one ``"usage": VALUE`` member out of ``ev``'s bytes together
    with the comma that joins it (before it, else after it, else none: the only member)."""
    for m in _USAGE_KEY.finditer(ev):
        start, end = m.start(), _value_end(ev, m.end())
        before = start
        while before > 0 and ev[before - 1] in _BLANK:
            before -= 1
        after = end
        while after < len(ev) and ev[after] in _BLANK:
            after += 1
        if before > 0 and ev[before - 1] == 0x2C:  # ", "usage": v" (a later member)
            yield ev[: before - 1] + ev[end:]
        if after < len(ev) and ev[after] == 0x2C:  # ""usage": v, " (the first member)
            j = after + 1
            while j < len(ev) and ev[j] in _BLANK:
                j += 1
            yield ev[:start] + ev[j:]
        yield ev[:start] + ev[end:]


class UsageStripper:
    """Removes from a stream every ``usage`` the engine sent because the proxy added
    ``stream_options.include_usage`` (the client did not ask): the usage-only chunk
    (``choices: []`` with a ``usage`` object) is dropped, and a ``usage`` member of any
    other chunk (``"usage": null`` on every chunk, OpenAI and vLLM; a ``usage`` object on
    the chunk with the ``finish_reason``, engines that send no chunk of its own) is cut
    out of it; every other byte passes unchanged. A ``usage`` an engine sends unasked
    (transformers serve puts one on its last chunk always) cannot be told from the one
    the proxy asked for, and goes too: the client asked for none, and OpenAI's stream
    format carries ``usage`` only when asked (the API reference, "chat completion chunk":
    ``usage`` "only present when you set ``stream_options: {"include_usage": true}``").

    Events are passed on whole: an unterminated event is held until it ends (engines
    send whole events, so this delays nothing in practice).
    """

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, chunk: bytes) -> bytes:
        """The bytes of ``chunk`` to relay now (possibly empty)."""
        buf = self._buf
        if not buf and chunk.find(b'"usage"') < 0 and chunk.endswith(_EVENT_ENDINGS):  # find: see sse._needs_parse
            return chunk
        events = take_events(buf, chunk)
        return b"".join(strip_usage(ev) if b'"usage"' in ev else ev for ev in events)

    def flush(self) -> bytes:
        """What is still held at the end of the stream (an unterminated event)."""
        rest = bytes(self._buf)
        self._buf.clear()
        return strip_usage(rest) if b'"usage"' in rest else rest


def strip_usage(ev: bytes) -> bytes:
    """One event without what ``include_usage`` added (see :class:`UsageStripper`): ``b""``
    for the usage-only chunk; else the event with its top-level ``usage`` member cut out
    of its bytes (checked by parsing the result; when no cut parses to the same object
    less ``usage``, that object is written anew as one ``data:`` line)."""
    _, data = parse_event(ev)
    if data is None:
        return ev
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return ev
    if not isinstance(obj, dict) or "usage" not in obj:
        return ev
    usage = obj["usage"]
    if isinstance(usage, dict) and obj.get("choices") in ([], None):
        return b""  # the usage-only chunk
    want = {k: v for k, v in obj.items() if k != "usage"}
    for cut in _member_cuts(ev):
        _, cut_data = parse_event(cut)
        try:
            if cut_data is not None and orjson.loads(cut_data) == want:
                return cut  # every other byte as the engine sent it
        except orjson.JSONDecodeError:
            continue
    return b"data: " + orjson.dumps(want) + b"\n\n"


__all__ = ["UsageStripper", "strip_usage"]
