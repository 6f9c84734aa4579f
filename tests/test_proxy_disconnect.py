"""A client that goes away frees its slot at once and aborts the upstream generation, in
each of the four windows: queued, before the first token, mid-stream, non-streaming."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.conftest import wait_until


async def _abandon(task: asyncio.Task) -> None:
    task.cancel()  # aiohttp closes the connection of a cancelled request
    try:
        await task
    except asyncio.CancelledError:
        pass


async def test_window1_queued_client_leaves_queue_at_once(make_stack):
    st = await make_stack(max_inflight=1)
    sched = st.state.admission.scheduler
    async with aiohttp.ClientSession() as busy_s, aiohttp.ClientSession() as gone_s:
        busy = asyncio.create_task(busy_s.post(st.proxy_url + "/v1/chat/completions", json=st.chat_body(3, itl_s=0.5)))
        await wait_until(lambda: st.stats.started == 1, what="slot busy")
        gone = asyncio.create_task(gone_s.post(st.proxy_url + "/v1/chat/completions", json=st.chat_body(1, tag="gone")))
        await wait_until(lambda: sched.queued == 1, what="queued")
        await _abandon(gone)
        await wait_until(lambda: sched.queued == 0, timeout=1.0, what="queue emptied by the disconnect")
        r = await busy
        await r.read()
    assert "gone" not in st.stats.tags  # never reached the upstream
    assert sched.inflight == set()


async def _window(st, body: dict, started_pred, read_some: bool) -> None:
    sched = st.state.admission.scheduler
    async with aiohttp.ClientSession() as s:

        async def client() -> None:
            async with s.post(st.proxy_url + "/v1/chat/completions", json=body) as r:
                if read_some:
                    for _ in range(3):
                        await r.content.readuntil(b"\n\n")
                await asyncio.sleep(30)  # stands for a client that would keep reading

        task = asyncio.create_task(client())
        await wait_until(started_pred, what="upstream working")
        await _abandon(task)
    await wait_until(lambda: st.stats.aborted == 1, timeout=2.0, what="upstream generation aborted")
    await wait_until(lambda: not sched.inflight, timeout=1.0, what="slot released")
    assert st.stats.active == 0 and st.stats.completed == 0


async def test_window2_before_first_token_aborts_upstream(make_stack):
    st = await make_stack(ttft_s=30)
    await _window(st, st.chat_body(10, stream=True), lambda: st.stats.active == 1, read_some=False)
    assert st.stats.tokens_sent == 0


async def test_window3_mid_stream_aborts_upstream(make_stack):
    st = await make_stack(itl_s=0.05)
    await _window(st, st.chat_body(400, stream=True), lambda: st.stats.tokens_sent >= 5, read_some=True)
    assert 5 <= st.stats.tokens_sent < 400


async def test_window4_non_streaming_aborts_upstream(make_stack):
    st = await make_stack(itl_s=0.05)
    await _window(st, st.chat_body(400, stream=False), lambda: st.stats.active == 1, read_some=False)
    assert st.stats.tokens_sent == 0


async def test_slot_is_reusable_after_disconnects(make_stack, http):
    """After clients vanish in every window, max_inflight=1 still admits new work."""
    st = await make_stack(max_inflight=1, itl_s=0.02)
    for stream in (True, False):
        async with aiohttp.ClientSession() as s:
            t = asyncio.create_task(s.post(st.proxy_url + "/v1/chat/completions", json=st.chat_body(200, stream=stream)))
            await wait_until(lambda: st.stats.active == 1, what="upstream working")
            await _abandon(t)
        await wait_until(lambda: st.stats.active == 0, what="upstream idle")
    async with http.post(st.proxy_url + "/v1/chat/completions", json=st.chat_body(2)) as r:
        assert r.status == 200
