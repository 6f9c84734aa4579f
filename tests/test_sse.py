"""The SSE reader and the usage stripper give the same answer however the bytes are cut
into chunks (engines, proxies and TCP cut them anywhere), for every framing the SSE
grammar allows."""

from __future__ import annotations

import json
import random

import pytest

from proxy.wire import sse
from proxy.wire.sse import EventTooLarge, SSEScanner, parse_event
from proxy.wire.usage_strip import UsageStripper, strip_usage

NULL_USAGE = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"h\xc3\xa9"},"finish_reason":null}],"usage":null}\n\n'
USAGE_ONLY = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":31,"total_tokens":40}}\n\n'
FINISH = b'data: {"id":"c","usage":null,"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'

STREAMS = {
    "openai with usage": NULL_USAGE + FINISH + USAGE_ONLY + b"data: [DONE]\n\n",
    "crlf, comments, fields, multi-line data": (
        b": ping\r\n\r\n"
        b'event: message\r\nid: 7\r\ndata: {"choices":[{"index":0,\r\ndata: "delta":{"content":"x"},"finish_reason":null}]}\r\n\r\n'
        b'data:{"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\r\n\r\n'
    ),
    "vllm, compact, one event per token": b"".join(
        b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"t%d"},"logprobs":null,"finish_reason":null}]}\n\n' % i for i in range(5)
    )
    + b'data: {"id":"c","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"length"}]}\n\n',
    "lone CR line ends": b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\r\rdata: {"choices":[{"index":0,"finish_reason":"stop"}]}\r\r',
}


def cuts(raw: bytes, rng: random.Random):
    yield [raw]
    for k in range(len(raw) + 1):
        yield [raw[:k], raw[k:]]
    for _ in range(100):
        pieces, i = [], 0
        while i < len(raw):
            n = rng.randint(1, 12)
            pieces.append(raw[i : i + n])
            i += n
        yield pieces


def scan(pieces: list[bytes]) -> SSEScanner:
    sc = SSEScanner()
    for p in pieces:
        sc.feed(p)
    sc.end()
    return sc


@pytest.mark.parametrize("name", list(STREAMS))
def test_the_scanner_reads_every_cut_alike(name):
    raw = STREAMS[name]
    whole = scan([raw])
    assert whole.complete() and whole.error is None
    expect = (whole.tokens, whole.prompt_tokens, whole.done, frozenset(whole.ended_choices), whole.events)
    for pieces in cuts(raw, random.Random(1)):
        sc = scan(pieces)
        assert (sc.tokens, sc.prompt_tokens, sc.done, frozenset(sc.ended_choices), sc.events) == expect, pieces


def test_usage_counts_from_the_engine_win():
    sc = scan([STREAMS["openai with usage"]])
    assert (sc.tokens, sc.prompt_tokens, sc.done) == (31, 9, True)


@pytest.mark.parametrize("name", list(STREAMS))
def test_the_stripper_gives_the_same_bytes_for_every_cut(name):
    raw = STREAMS[name]
    st = UsageStripper()
    whole = st.feed(raw) + st.flush()
    for pieces in cuts(raw, random.Random(2)):
        st = UsageStripper()
        assert b"".join(st.feed(p) for p in pieces) + st.flush() == whole, pieces


def test_the_stripper_removes_only_what_include_usage_added():
    st = UsageStripper()
    out = st.feed(STREAMS["openai with usage"]) + st.flush()
    assert out == (
        b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"h\xc3\xa9"},"finish_reason":null}]}\n\n'
        b'data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
        b"data: [DONE]\n\n"
    )
    # a usage object on a chunk with choices (engines without a usage-only chunk; transformers
    # serve, unasked) is cut out of it, byte for byte, wherever it stands in the object
    for sent, left in [
        (b'data: {"choices":[{"index":0,"finish_reason":"stop"}],"usage":{"completion_tokens":3}}\n\n', b'data: {"choices":[{"index":0,"finish_reason":"stop"}]}\n\n'),
        (b'data: {"usage": {"a": {"b": "}{\\"x"}}, "id": "c", "choices": [{"index": 0}]}\n\n', b'data: {"id": "c", "choices": [{"index": 0}]}\n\n'),
        (b'data: {"id":"c",\r\ndata: "usage":{"n":[1,{"m":2}]},"choices":[{"index":0,"delta":{"content":"\\"usage\\": 1"}}]}\r\n\r\n',
         b'data: {"id":"c",\r\ndata: "choices":[{"index":0,"delta":{"content":"\\"usage\\": 1"}}]}\r\n\r\n'),
    ]:
        assert UsageStripper().feed(sent) == left
    # "usage": null as the only member, or beside a nested "usage": only the top one goes
    assert strip_usage(b'data: {"usage":null}\n\n') == b"data: {}\n\n"
    nested = strip_usage(b'data: {"a":{"usage":null},"usage":null}\n\n')
    assert json.loads(parse_event(nested)[1]) == {"a": {"usage": None}}


@pytest.mark.parametrize(
    "event, error",
    [
        (b'data: {"error":{"message":"boom","code":500}}\n\n', {"message": "boom", "code": 500}),
        (b'data: {"object":"error","message":"bad","type":"BadRequestError","code":400}\n\n', {"object": "error", "message": "bad", "type": "BadRequestError", "code": 400}),
        (b"event: error\ndata: overloaded\n\n", {"message": "overloaded"}),
        (b'data: {"choices":[{"index":0,"delta":{"content":"\\"error\\""},"finish_reason":null}]}\n\n', None),  # the word in text
        (b'data: {"error":null,"choices":[]}\n\n', None),
    ],
)
def test_in_band_errors_are_recognized(event, error):
    sc = scan([event])
    assert sc.error == error
    if error is not None:
        assert sc.tokens == 0 and not sc.complete()


def test_choices_must_each_finish():
    two = b'data: {"choices":[{"index":0,"finish_reason":"stop"}]}\n\ndata: {"choices":[{"index":1,"finish_reason":null}]}\n\n'
    sc = scan([two])
    assert sc.complete(1) and not sc.complete(2)
    assert not scan([b"data: {\"choices\":[{\"index\":0,\"finish_reason\":\"\"}]}\n\n"]).complete()
    assert not scan([b""]).complete() and scan([b"data: [DONE]\n\n"]).complete()


def test_an_event_that_never_ends_is_bounded(monkeypatch):
    monkeypatch.setattr(sse, "MAX_EVENT_BYTES", 1000)
    sc = SSEScanner()
    sc.feed(b"data: " + b"x" * 900)
    with pytest.raises(EventTooLarge):
        sc.feed(b"x" * 200)
    st = UsageStripper()
    st.feed(b'data: {"usage":null,' + b"x" * 900)
    with pytest.raises(EventTooLarge):
        st.feed(b"x" * 200)


FAST_PATH_CASES = [
    NULL_USAGE,
    USAGE_ONLY,
    FINISH,
    b"data: [DONE]\n\n",
    b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\r\n\r\n',
    b'data: {"choices":[{"index":0,"finish_reason":null},{"index":1,"finish_reason":"stop"}]}\n\n',
    b'data: {"error":{"message":"boom","code":500}}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n' * 3,
    b'data: {"choices":[{"index":0,"delta":{"content":"[DONE] \\"usage\\""},"finish_reason":null}]}\n\n',
]


@pytest.mark.parametrize("chunk", FAST_PATH_CASES)
def test_a_whole_chunk_reads_as_its_bytes_one_by_one(chunk):
    """The scanner's per-chunk fast path (whole one-line events with nothing to parse,
    counted in place) decides as the general path does, byte by byte."""
    fast, slow = scan([chunk]), scan([chunk[i : i + 1] for i in range(len(chunk))])
    got = (fast.tokens, fast.prompt_tokens, fast.done, frozenset(fast.ended_choices), fast.events, fast.error)
    assert got == (slow.tokens, slow.prompt_tokens, slow.done, frozenset(slow.ended_choices), slow.events, slow.error)
    stripped = UsageStripper().feed(chunk)
    bytewise = UsageStripper()
    assert stripped == b"".join(bytewise.feed(chunk[i : i + 1]) for i in range(len(chunk))) + bytewise.flush()
