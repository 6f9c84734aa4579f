"""proxy.relay.resume on its own: what makes a stream resumable, what it keeps of the
events the client is sent, how a later part's events are rewritten, what is sent and
charged. The whole path through the proxy: tests/test_resume_process.py."""

from __future__ import annotations

import orjson

from proxy.relay.resume import StreamResume, resume_refusal
from proxy.wire.request_body import ParsedRequest


def _ev(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _chunk(content: str | None = None, role: bool = False, finish: str | None = None, cid: str = "c1", created: int = 1, **delta) -> bytes:
    d = dict(delta)
    if role:
        d["role"] = "assistant"
    if content is not None:
        d["content"] = content
    return _ev({"id": cid, "object": "chat.completion.chunk", "created": created, "model": "m", "choices": [{"index": 0, "delta": d, "finish_reason": finish}]})


def _parsed(fields: dict) -> ParsedRequest:
    return ParsedRequest(orjson.dumps(fields), bool(fields.get("stream")), fields.get("max_tokens"), 10, fields, fields.get("n", 1))


def _resume(max_tokens: int | None = 10) -> tuple[StreamResume, list[int]]:
    pins: list[int] = []
    return StreamResume(True, max_tokens, lambda: pins.append(1), prompt_estimate=7), pins


def test_what_cannot_be_resumed_says_why():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 5}
    assert resume_refusal("chat", _parsed(chat)) is None
    assert resume_refusal("chat", _parsed({**chat, "n": 2})) == "more than one choice"
    assert resume_refusal("chat", _parsed({**chat, "logprobs": True})) == "logprobs"
    assert resume_refusal("chat", _parsed({**chat, "stream": False})) == "not a stream"
    assert resume_refusal("chat", _parsed({**chat, "continue_final_message": True})) == "continues a message itself"
    assert resume_refusal("responses", _parsed(chat)) == "kind"
    comp = {"model": "m", "prompt": "once", "stream": True}
    assert resume_refusal("completion", _parsed(comp)) is None
    assert resume_refusal("completion", _parsed({**comp, "prompt": ["a", "b"]})) == "prompt not one string"
    assert resume_refusal("completion", _parsed({**comp, "suffix": "x"})) == "suffix"
    assert resume_refusal("completion", _parsed({**comp, "echo": True})) == "echo"


def test_the_text_sent_is_kept_and_a_later_part_reads_as_the_first():
    r, pins = _resume()
    first = _chunk("", role=True) + _chunk("Hel") + _chunk("lo")
    assert r.feed(first[:10]) == b""  # a partial event is held back until it ends
    assert r.feed(first[10:]) == first  # the first part's events go as they are
    assert r.text == "Hello" and r.tokens == 2 and r.sent and not pins
    r.feed(_chunk(" wor")[:12])  # cut mid-event by the preemption: never sent
    r.next_part()
    assert r.done_tokens == 2
    body = r.body(_parsed({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 10}))
    assert body.fields["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert body.fields["continue_final_message"] is True and body.fields["add_generation_prompt"] is False
    assert body.fields["max_tokens"] == 8 and body.max_tokens == 8 and orjson.loads(body.body) == body.fields
    # the resumed part: its own id and created, a role event of its own, usage of its own
    out = r.feed(_chunk("", role=True, cid="c2", created=9) + _chunk(" world", cid="c2", created=9) + _chunk(finish="length", cid="c2", created=9))
    usage = _ev({"id": "c2", "created": 9, "model": "m", "object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 14, "completion_tokens": 2, "total_tokens": 16}})
    out += r.feed(usage)
    objs = [orjson.loads(e[6:]) for e in out.split(b"\n\n") if e]
    assert [o["id"] for o in objs] == ["c1"] * 3 and {o["created"] for o in objs} == {1}
    assert not any("role" in (c.get("delta") or {}) for o in objs for c in o["choices"])  # dropped
    assert objs[-1]["usage"] == {"prompt_tokens": 12, "completion_tokens": 4, "total_tokens": 16}
    assert r.text == "Hello world" and pins == [1] and r.why_pinned == "finished"
    # charged: the original prompt (14 - 2) and that plus the 2 tokens sent, all 2 + 2 outputs
    assert r.charge(14, 2) == (12 + 14, 4)
    assert r.charge(None, 2) == (7 + 9, 4)  # no report: the proxy's estimate as the original


def test_a_tool_call_or_reasoning_pins_the_stream():
    for delta in ({"tool_calls": [{"index": 0, "id": "t", "function": {"name": "f", "arguments": ""}}]}, {"reasoning_content": "hmm"}):
        r, pins = _resume()
        r.feed(_chunk("a"))
        assert not pins
        r.feed(_chunk(**delta))
        assert pins == [1] and r.pinned
    r, pins = _resume()
    r.feed(_chunk("a", reasoning_content=None))  # a null extra field is nothing shown
    assert not pins


def test_max_tokens_reached_and_errors_pin():
    r, pins = _resume(max_tokens=2)
    r.feed(_chunk("a") + _chunk("b"))
    assert pins == [1] and r.why_pinned == "max_tokens reached"
    r, pins = _resume()
    r.feed(b'data: {"error": {"message": "boom"}}\n\n')
    assert pins == [1]
    r, pins = _resume()
    r.feed(b"data: [DONE]\n\n")
    assert pins == [1]


def test_completions_continue_the_prompt():
    r = StreamResume(False, None, lambda: None)
    r.feed(_ev({"id": "x", "created": 1, "model": "m", "choices": [{"index": 0, "text": " once", "finish_reason": None}]}))
    r.next_part()
    body = r.body(_parsed({"model": "m", "prompt": "Tell:", "stream": True, "max_completion_tokens": 5}))
    assert body.fields["prompt"] == "Tell: once" and body.fields["max_completion_tokens"] == 4 and "max_tokens" not in body.fields


def test_a_restart_before_anything_was_shown_forgets_everything():
    r, _pins = _resume()
    r.feed(_chunk("a"))
    r.restart()
    assert r.text == "" and r.tokens == 0 and r.part == 0 and r.response is None and not r.sent
