"""A request's hold on admission (:class:`proxy.admission.admitted.Admitted`), in process:
the ticket and the engine place are given back however the ``async with`` ends (a normal
end, an error, the client leaving), and a failed entry holds nothing; and what one
exchange's outcome tells its engine's health
(:func:`proxy.routing.exchange_verdict.exchange_verdict`). The request path around it is
covered through the real proxy process (``tests/test_proxy_disconnect.py``,
``tests/test_proxy_faults.py``, ``tests/test_preemption_process.py``)."""

from __future__ import annotations

import asyncio

import pytest

from proxy.admission.admitted import Admitted
from proxy.routing.exchange_verdict import ANSWERED, Verdict, exchange_verdict
from qos import RefusalReason, Refused
from tests.conftest import wait_until
from tests.test_pool_admission import admission, config, pool


def held(adm) -> tuple[int, int]:
    """(requests in flight in pool ``a``'s scheduler, requests placed on its engines)."""
    p = adm.pools["a"]
    return len(p.scheduler.inflight), sum(e.inflight for e in p.router.engines.values())


async def test_every_way_out_of_the_async_with_gives_the_slot_back():
    adm = admission(config([pool("a", "a1")]))  # one slot
    async with Admitted(adm, adm.pools["a"], "carl", 5, 5) as a:
        assert a.engine.name == "a1" and held(adm) == (1, 1)
        a.true_up(7, 3)
    assert held(adm) == (0, 0)

    with pytest.raises(RuntimeError):
        async with Admitted(adm, adm.pools["a"], "carl", 5, 5):
            raise RuntimeError("the relay failed")
    assert held(adm) == (0, 0)

    inside = asyncio.Event()

    async def client():
        async with Admitted(adm, adm.pools["a"], "carl", 5, 5):
            inside.set()
            await asyncio.Event().wait()  # streaming, until the client leaves

    task = asyncio.create_task(client())
    await asyncio.wait_for(inside.wait(), 5)
    task.cancel()  # the client disconnected
    with pytest.raises(asyncio.CancelledError):
        await task
    assert held(adm) == (0, 0)
    async with Admitted(adm, adm.pools["a"], "dana", 5, 5):  # the slot is free for the next
        assert held(adm) == (1, 1)


async def test_a_request_that_leaves_while_queued_or_is_refused_holds_nothing():
    adm = admission(config([pool("a", "a1")], requests_per_minute=1))  # carl's
    async with Admitted(adm, adm.pools["a"], "carl", 5, 5):
        waiting = Admitted(adm, adm.pools["a"], "dana", 5, 5)

        async def queued():
            async with waiting:
                raise AssertionError("never admitted")

        task = asyncio.create_task(queued())
        await wait_until(lambda: adm.pools["a"].scheduler.queued == 1, what="queued")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not waiting.entered and adm.pools["a"].scheduler.queued == 0
        assert held(adm) == (1, 1)  # the request inside still holds its slot
        with pytest.raises(Refused) as e:  # carl's second request this minute
            async with Admitted(adm, adm.pools["a"], "carl", 5, 5):
                raise AssertionError("never admitted")
        assert e.value.reason is RefusalReason.RATE_LIMITED
        assert held(adm) == (1, 1)
    assert held(adm) == (0, 0)


async def test_outside_admission_a_place_on_an_engine_is_held_and_given_back():
    adm = admission(config([pool("a", "a1", "a2")]))
    async with Admitted(adm, adm.pools["a"], "carl", 5, 5, admit=False) as a:
        assert a.ticket is None and held(adm) == (0, 1)
        first = a.engine
        moved = a.reroute([first])  # its connection failed before a byte was sent
        assert moved is not first and moved.inflight == 1 and first.inflight == 0
    assert held(adm) == (0, 0)
    for e in adm.pools["a"].router.engines.values():
        e.health.record_check(False, "down")
        e.health.record_check(False, "down")  # ejected by its checks
    with pytest.raises(Refused) as e:
        async with Admitted(adm, adm.pools["a"], "carl", 5, 5, admit=False):
            raise AssertionError("no engine to place it on")
    assert e.value.reason is RefusalReason.NO_ENGINE and held(adm) == (0, 0)


@pytest.mark.parametrize(
    ("outcome", "verdict"),
    [
        # no answer: the open failed, or nothing was opened
        ({"answered": None, "failed": True, "detail": "refused", "unsent": True}, Verdict(False, "connect", "refused")),
        ({"answered": None, "failed": True, "detail": "slow", "timed_out": True}, Verdict(False, "timeout", "slow")),
        ({"answered": None, "failed": True, "detail": "closed"}, Verdict(False, "reset", "closed")),
        ({"answered": None}, None),  # the client left (or it was preempted) before any answer: no claim
        # an answer
        ({"answered": 200}, ANSWERED),
        ({"answered": 404, "failed": True, "detail": "upstream answered 404"}, ANSWERED),  # the client's problem
        ({"answered": 503, "failed": True}, Verdict(False, "http_5xx", "answered 503", 503)),
        ({"answered": 200, "failed": True, "detail": "stream ended unfinished"}, Verdict(False, "stream_cut", "stream ended unfinished")),
        ({"answered": 200, "failed": True, "engine_error": True, "engine_error_status": 400}, ANSWERED),  # in-band 400
        (
            {"answered": 200, "failed": True, "engine_error": True, "engine_error_status": 500},
            Verdict(False, "http_5xx", "reported a 500 error in its answer", 500),
        ),
        # a pass-through path's answer: only a broken transfer counts
        ({"answered": 500, "opaque": True}, ANSWERED),
        ({"answered": 200, "failed": True, "detail": "ClientPayloadError", "opaque": True}, Verdict(False, "stream_cut", "ClientPayloadError")),
    ],
)
def test_what_one_exchange_tells_its_engines_health(outcome, verdict):
    assert exchange_verdict(**outcome) == verdict
