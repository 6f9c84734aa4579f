"""Resuming a preempted stream (``preemption.resume``) through the real proxy process,
against the fake engine of bench/fake_upstream.py on a real socket: its answer is the
tokens `` t0 t1 ...``, and a request that continues them (``continue_final_message``
with the partial answer, or a completions prompt ending with them) goes on from there,
deterministically, under another ``id`` and ``created``. So a resumed stream must give
its client exactly the bytes' content an unpreempted one gives: one stream, the same
text, no token twice, one role, one ``finish_reason``, one usage adding both parts.

The same on the real vLLM engine: tests/test_resume_vllm.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import orjson
import pytest
import yaml

from bench.fake_upstream import STATS, make_app
from proxy.config.loading import parse_config
from tests.conftest import base_config, wait_until
from tests.proc_util import free_port
from tests.proxy_process import start_proxy, stop_proxy
from tests.scripted_upstream import ScriptedUpstream, chat_chunk, stream

AFTER_S = 0.2
N = 12  # tokens of the bronze stream
ITL_S = 0.1  # between its tokens: ~1.2 s of work


def _config(upstream_url: str, resume: bool = True) -> dict:
    return {
        "upstream": {"url": upstream_url, "kind": "openai", "server": "vllm", "load_signal": {"enabled": False}},
        "admission": {"max_inflight": 1, "queue_timeout_s": 30, "capacity": {"mode": "fixed"}, "preemption": {"after_s": AFTER_S, "resume": resume}},
        "identity": {"header": "X-User-Id"},
        "default_group": "bronze",
        "groups": [{"name": "platinum", "users": [{"id": "alice"}]}, {"name": "bronze"}],
    }


@pytest.fixture
async def fake(aiohttp_server):
    app = make_app()
    server = await aiohttp_server(app)
    app.url = str(server.make_url("")).rstrip("/")  # type: ignore[attr-defined]
    return app


@pytest.fixture
def proxy_of(tmp_path: Path):
    procs = []

    def start(cfg: dict):
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(cfg))
        access = tmp_path / "access.log"
        port = free_port()
        proc = start_proxy(path, port, extra_args=["--access-log", str(access)])
        proc.url, proc.access = f"http://127.0.0.1:{port}", access  # type: ignore[attr-defined]
        procs.append(proc)
        return proc

    yield start
    for p in procs:
        stop_proxy(p)


def _events(raw: bytes) -> list[object]:
    """The ``data`` payloads of an SSE body: JSON objects, or the bytes ``[DONE]``."""
    out: list[object] = []
    for ev in raw.split(b"\n\n"):
        ev = ev.strip()
        if not ev or ev.startswith(b":"):  # empty, or a comment (the queue status)
            continue
        assert ev.startswith(b"data: "), ev
        data = ev[6:]
        out.append(data if data == b"[DONE]" else orjson.loads(data))
    return out


def _text(events: list[object], chat: bool) -> str:
    out = []
    for e in events:
        if isinstance(e, dict):
            for ch in e.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                out.append(piece or "")
    return "".join(out)


async def _stream(http: aiohttp.ClientSession, url: str, path: str, body: dict, user: str, rid: str) -> tuple[int, bytes, list[float]]:
    """Status, body and the times each chunk came (monotonic seconds)."""
    async with http.post(url + path, json=body, headers={"X-User-Id": user, "X-Request-Id": rid}) as r:
        raw, times = b"", []
        async for chunk in r.content.iter_any():
            raw += chunk
            times.append(time.monotonic())
        return r.status, raw, times


async def _access(path: Path, rid: str, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            for raw in path.read_text().splitlines():
                if raw.startswith("{") and (line := json.loads(raw))["request_id"] == rid:
                    return line
        await asyncio.sleep(0.1)
    raise AssertionError(f"no access line for {rid}")


async def _metric(http: aiohttp.ClientSession, url: str, name: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    return {line.rpartition(" ")[0][len(name) :]: float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(name + "{")}


async def _preempted_run(fake, px, path: str, body: dict) -> tuple[bytes, bytes, list[float]]:
    """The unpreempted reference answer of ``body``, then the same stream preempted by a
    platinum request once it has shown 3 tokens: (reference body, resumed body, chunk times)."""
    stats = fake[STATS]
    async with aiohttp.ClientSession() as http:
        st, ref, _t = await asyncio.wait_for(_stream(http, px.url, path, {**body, "fake": {**body["fake"], "tag": "ref"}}, "carl", "ref"), 20)
        assert st == 200
        sent_before = stats.tokens_sent
        low = asyncio.create_task(_stream(http, px.url, path, body, "carl", "low"))
        await wait_until(lambda: stats.tokens_sent >= sent_before + 3, timeout=10, what="the bronze stream's first tokens")
        high_body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "fake": {"tag": "high"}}
        async with http.post(px.url + "/v1/chat/completions", json=high_body, headers={"X-User-Id": "alice"}) as r:
            assert r.status == 200
            high_done = time.monotonic()
        st, raw, times = await asyncio.wait_for(low, 20)
        assert st == 200
        # the platinum request ran inside the bronze stream's pause
        assert any(t > high_done for t in times) and any(t < high_done for t in times)
        assert stats.tags == ["ref", "low", "high", "low"] and stats.aborted == 1
        resumes = await _metric(http, px.url, "llm_qos_resumes_total")
        assert list(resumes.values()) == [1.0] and 'group="bronze"' in next(iter(resumes))
    return ref, raw, times


async def test_a_resumed_chat_stream_is_the_unpreempted_answer_for_its_client(fake, proxy_of):
    px = proxy_of(_config(fake.url))
    body = {
        "model": "fake-model", "messages": [{"role": "user", "content": "count"}], "max_tokens": N, "stream": True,
        "stream_options": {"include_usage": True}, "fake": {"itl_s": ITL_S, "role": True, "tag": "low"},
    }  # fmt: skip
    ref, raw, _times = await _preempted_run(fake, px, "/v1/chat/completions", body)
    ref_ev, ev = _events(ref), _events(raw)
    expected = "".join(f" t{i}" for i in range(N))
    assert _text(ref_ev, True) == expected
    assert _text(ev, True) == expected  # no token lost, none twice
    objs = [e for e in ev if isinstance(e, dict)]
    assert ev[-1] == b"[DONE]" and ev.count(b"[DONE]") == 1
    assert not any("error" in e for e in objs)
    # one stream: the first part's id, created and model throughout
    assert {e["id"] for e in objs} == {"chatcmpl-fake"}  # the usage chunk's too
    assert {(e["created"], e["model"]) for e in objs} == {(objs[0]["created"], objs[0]["model"])}
    assert not any("continued" in e["id"] for e in objs)
    roles = [e for e in objs for ch in e["choices"] if "role" in (ch.get("delta") or {})]
    assert len(roles) == 1 and objs[0] is roles[0]
    finishes = [ch["finish_reason"] for e in objs for ch in e["choices"] if ch.get("finish_reason")]
    assert finishes == ["length"]
    usages = [e["usage"] for e in objs if e.get("usage")]
    ref_usage = [e["usage"] for e in ref_ev if isinstance(e, dict) and e.get("usage")]
    assert usages == ref_usage == [{"prompt_tokens": 10, "completion_tokens": N, "total_tokens": 10 + N}]
    line = await _access(px.access, "low")
    assert line["resumes"] == 1 and line["preemptions"] == 1 and line["status"] == 200 and line["outcome"] == "ok"
    assert line["resume"] == "resumable" and line["output_tokens"] == N
    # charged: both parts' prompts (the second is the first plus the tokens sent, k) and all output
    k = line["prompt_tokens"] - 2 * 10
    assert 3 <= k < N


async def test_a_stream_told_its_queue_status_is_resumed_as_one_stream_too(fake, proxy_of):
    """A stream that asked for its queue status and waited got its 200 and SSE comments
    before its answer (``x-llm-qos-queue-status``): preempted after its first tokens, it
    is resumed on that same response, its comments and answer in one stream."""
    px = proxy_of(_config(fake.url))
    stats = fake[STATS]
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "count"}], "max_tokens": N, "stream": True, "fake": {"itl_s": ITL_S, "role": True, "tag": "low"}}
    async with aiohttp.ClientSession() as http:
        first = asyncio.create_task(http.post(px.url + "/v1/chat/completions", json={"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "fake": {"itl_s": 0.1, "tag": "first"}}))
        await wait_until(lambda: stats.started == 1, timeout=10, what="the slot taken")

        async def low_stream() -> tuple[int, bytes]:
            headers = {"X-User-Id": "carl", "X-Request-Id": "low-q", "x-llm-qos-queue-status": "1"}
            async with http.post(px.url + "/v1/chat/completions", json=body, headers=headers) as r:
                return r.status, await r.read()

        low = asyncio.create_task(low_stream())
        (await asyncio.wait_for(first, 10)).release()
        await wait_until(lambda: stats.tokens_sent >= 3 + 3, timeout=10, what="the bronze stream's first tokens")
        async with http.post(px.url + "/v1/chat/completions", json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "fake": {"tag": "high"}}, headers={"X-User-Id": "alice"}) as r:
            assert r.status == 200
        st, raw = await asyncio.wait_for(low, 20)
    assert st == 200 and raw.startswith(b": queue position=")
    ev = _events(raw)
    assert _text(ev, True) == "".join(f" t{i}" for i in range(N))
    objs = [e for e in ev if isinstance(e, dict)]
    assert {e["id"] for e in objs} == {"chatcmpl-fake"} and not any("error" in e for e in objs)
    assert sum("role" in (ch.get("delta") or {}) for e in objs for ch in e["choices"]) == 1
    assert [ch["finish_reason"] for e in objs for ch in e["choices"] if ch.get("finish_reason")] == ["length"]
    assert stats.tags == ["first", "low", "high", "low"] and stats.aborted == 1
    line = await _access(px.access, "low-q")
    assert line["resumes"] == 1 and line["status"] == 200


async def test_a_stream_told_its_queue_status_and_preempted_before_its_first_token_starts_over(tmp_path, proxy_of):
    """Its 200 and comments went out while it waited, then the engine sent its headers at
    once and nothing more for 2 s (as vLLM before a first token; the scripted engine of
    tests/scripted_upstream.py): nothing of its answer was shown, so a preemption then
    restarts it, as any unshown request, instead of resuming an empty answer."""
    events = [chat_chunk("Hello"), chat_chunk(" there", finish="stop"), b"data: [DONE]\n\n"]
    with ScriptedUpstream() as up:
        up.on("first", stream([0.3, *events]))
        up.on("low", stream([2.0, *events]))
        up.on("high", stream(events))
        cfg = _config(up.url)
        px = proxy_of(cfg)
        async with aiohttp.ClientSession() as http:

            async def chat(model: str, user: str, rid: str, **headers: str) -> tuple[int, bytes]:
                body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
                async with http.post(px.url + "/v1/chat/completions", json=body, headers={"X-User-Id": user, "X-Request-Id": rid, **headers}) as r:
                    return r.status, await r.read()

            first = asyncio.create_task(chat("first", "carl", "first"))
            await wait_until(lambda: len(up.seen_for("first")) == 1, timeout=10, what="the slot taken")
            low = asyncio.create_task(chat("low", "carl", "low-q0", **{"x-llm-qos-queue-status": "1"}))
            assert (await asyncio.wait_for(first, 10))[0] == 200
            await wait_until(lambda: len(up.seen_for("low")) == 1, timeout=10, what="the bronze stream sent to the engine")
            assert (await asyncio.wait_for(chat("high", "alice", "high"), 10))[0] == 200
            st, raw = await asyncio.wait_for(low, 20)
        seen = up.seen_for("low")
    assert st == 200 and raw.startswith(b": queue position=") and raw.count(b"Hello") == 1
    assert len(seen) == 2 and "continue_final_message" not in seen[1].json  # sent again as it was
    line = await _access(px.access, "low-q0")
    assert line["preemptions"] == 1 and line["resumes"] == 0 and line["status"] == 200


async def test_a_resumed_completions_stream_continues_the_prompt(fake, proxy_of):
    px = proxy_of(_config(fake.url))
    body = {"model": "fake-model", "prompt": "count", "max_tokens": N, "stream": True, "fake": {"itl_s": ITL_S, "tag": "low"}}
    ref, raw, _times = await _preempted_run(fake, px, "/v1/completions", body)
    ev = _events(raw)
    expected = "".join(f" t{i}" for i in range(N))
    assert _text(_events(ref), False) == _text(ev, False) == expected
    objs = [e for e in ev if isinstance(e, dict)]
    assert {e["id"] for e in objs} == {"cmpl-fake"}  # the usage the proxy asked for is stripped
    assert [ch["finish_reason"] for e in objs for ch in e["choices"] if ch.get("finish_reason")] == ["length"]
    assert ev.count(b"[DONE]") == 1 and not any("usage" in e and e["usage"] for e in objs)


async def test_without_resume_a_shown_stream_is_not_preempted(fake, proxy_of):
    px = proxy_of(_config(fake.url, resume=False))
    stats = fake[STATS]
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "count"}], "max_tokens": 6, "stream": True, "fake": {"itl_s": ITL_S, "tag": "low"}}
    async with aiohttp.ClientSession() as http:
        low = asyncio.create_task(_stream(http, px.url, "/v1/chat/completions", body, "carl", "low"))
        await wait_until(lambda: stats.tokens_sent >= 2, timeout=10, what="the bronze stream's first tokens")
        async with http.post(px.url + "/v1/chat/completions", json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "fake": {"tag": "high"}}, headers={"X-User-Id": "alice"}) as r:
            assert r.status == 200
        st, raw, _t = await asyncio.wait_for(low, 20)
    assert st == 200 and _text(_events(raw), True) == "".join(f" t{i}" for i in range(6))
    assert stats.tags == ["low", "high"] and stats.aborted == 0


async def test_a_stream_that_cannot_resume_says_why_and_is_never_preempted_shown(fake, proxy_of):
    """``n`` 2 cannot be resumed: the stream runs on as without resume, and its access
    line says why."""
    px = proxy_of(_config(fake.url))
    stats = fake[STATS]
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "count"}], "max_tokens": 6, "n": 2, "stream": True, "fake": {"itl_s": ITL_S, "tag": "low"}}
    async with aiohttp.ClientSession() as http:
        low = asyncio.create_task(_stream(http, px.url, "/v1/chat/completions", body, "carl", "low-n2"))
        await wait_until(lambda: stats.tokens_sent >= 2, timeout=10, what="the bronze stream's first tokens")
        async with http.post(px.url + "/v1/chat/completions", json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "fake": {"tag": "high"}}, headers={"X-User-Id": "alice"}) as r:
            assert r.status == 200
        st, _raw, _t = await asyncio.wait_for(low, 20)
    assert st == 200 and stats.tags == ["low", "high"] and stats.aborted == 0
    line = await _access(px.access, "low-n2")
    assert line["resume"] == "not resumable: more than one choice" and line["resumes"] == 0


async def test_a_client_that_leaves_while_its_resumed_stream_waits_frees_everything(make_stack, http):
    """In the proxy's own process (its scheduler and router read directly): the bronze
    stream, preempted after 3 tokens, waits again while platinum runs; its client leaves;
    its ticket, slot and upstream are all gone."""
    st = await make_stack(config=_config("http://unused"))
    sched, stats = st.state.admission.scheduler, st.stats
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "count"}], "max_tokens": N, "stream": True, "fake": {"itl_s": ITL_S, "tag": "low"}}
    seen = []

    async def low_stream() -> None:
        async with http.post(st.proxy_url + "/v1/chat/completions", json=body, headers={"X-User-Id": "leaver"}) as r:
            async for chunk in r.content.iter_any():
                seen.append(chunk)

    low = asyncio.create_task(low_stream())
    await wait_until(lambda: stats.tokens_sent >= 3, timeout=10, what="the bronze stream's first tokens")
    high_body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "fake": {"itl_s": 0.1, "tag": "high"}}
    high = asyncio.create_task(http.post(st.proxy_url + "/v1/chat/completions", json=high_body, headers={"X-User-Id": "alice"}))
    await wait_until(lambda: stats.started == 2 and sched.queued == 1, timeout=10, what="bronze preempted and waiting again")
    assert stats.aborted == 1 and seen  # its client had been shown tokens
    low.cancel()  # the client leaves while its stream waits to be resumed
    await wait_until(lambda: sched.queued == 0, timeout=5, what="the waiting stream gone from the queue")
    assert sched.user_state("leaver")["inflight"] == 0 and sched.user_state("leaver")["queued"] == 0
    resp = await asyncio.wait_for(high, 10)
    assert resp.status == 200
    resp.release()
    await wait_until(lambda: not sched.inflight and st.state.admission.default.router.inflight == 0, timeout=5, what="every slot free")
    assert stats.tags == ["low", "high"] and stats.active == 0  # never sent again; nothing left upstream


def test_resume_is_refused_for_engines_that_cannot_continue_a_message():
    cfg = _config("http://127.0.0.1:9")
    for server, ok in (("vllm", True), ("sglang", True), ("transformers", False), ("hosted", False), (None, False)):
        cfg["upstream"]["server"] = server
        text = yaml.safe_dump(cfg)
        if ok:
            assert parse_config(text, "c.yaml").effective_pools()[0].resume
        else:
            with pytest.raises(Exception, match="preemption.resume needs engines that continue a final assistant message"):
                parse_config(text, "c.yaml")
    pools = {
        **base_config("http://x"),
        "upstream": {"kind": "openai"},
        "pools": [
            {"name": "a", "models": ["m1"], "engines": [{"url": "http://127.0.0.1:1", "server": "sglang"}], "preemption": {"resume": True}},
            {"name": "b", "models": ["m2"], "engines": [{"url": "http://127.0.0.1:2", "kind": "lightllm"}]},
        ],
    }
    assert [p.resume for p in parse_config(yaml.safe_dump(pools), "c.yaml").effective_pools()] == [True, False]
    pools["pools"][1]["preemption"] = {"resume": True}
    with pytest.raises(Exception, match="engine 'http://127.0.0.1:2' has kind lightllm"):
        parse_config(yaml.safe_dump(pools), "c.yaml")
