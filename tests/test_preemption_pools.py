"""Preemption per engine with ``pools`` (:class:`proxy.admission.admission.Admission` in process,
its timer on the running loop): the waiting request takes the room of a lower request on
an engine it can use, and only there."""

from __future__ import annotations

import asyncio

from proxy.admission.admission import Admission, Preemption
from qos import TicketState
from tests.conftest import wait_until
from tests.test_pool_admission import config, pool

AFTER_S = 0.05


def admission(*engines: str, **extra) -> Admission:
    cfg = config([pool("p", *engines, **extra)])
    adm = Admission(cfg.to_policy(), cfg.effective_pools())
    adm.preemption = Preemption(True, AFTER_S, 2)
    return adm


class Handler:
    """What a request handler does with its ticket: hold it until ``done``, and when
    preempted, wait to be dispatched again (``log`` records each engine it ran on)."""

    def __init__(self, adm: Admission, user: str) -> None:
        self.adm, self.user = adm, user
        self.done = asyncio.Event()
        self.ticket = None
        self.log: list[str] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        t = self.ticket = await self.adm.acquire(self.user, None, 10, 10, pool="p")
        try:
            while True:
                self.log.append(t.placement.name)
                try:
                    await self.done.wait()
                    return
                except asyncio.CancelledError:
                    if not self.adm.preempted(t):
                        raise
                    self.log.append("preempted")
                    await self.adm.wait_requeued(t)
        finally:
            self.adm.release(t)


async def test_the_waiting_request_takes_the_newest_lower_requests_engine():
    adm = admission("e1", "e2")
    carl = Handler(adm, "carl")  # bronze
    await wait_until(lambda: carl.log, what="carl on an engine")
    dora = Handler(adm, "dora")  # bronze, the newest
    await wait_until(lambda: dora.log, what="dora on the other engine")
    alice = Handler(adm, "alice")  # platinum: both engines full of bronze
    await wait_until(lambda: alice.log, what="alice dispatched", timeout=2)
    assert dora.log == [dora.log[0], "preempted"] and dora.ticket.state is TicketState.QUEUED
    assert alice.log == [dora.log[0]]  # on the engine dora left
    assert len(carl.log) == 1 and adm.pools["p"].preemptions == 1
    alice.done.set()
    await alice.task
    await wait_until(lambda: len(dora.log) == 3, what="dora dispatched again")
    for h in (carl, dora):
        h.done.set()
        await h.task
    assert not adm.pools["p"].scheduler.inflight and adm.pools["p"].router.inflight == 0


async def test_no_preemption_where_the_waiting_request_could_not_run():
    """The bronze request runs on an engine that has left rotation (ejected): taking its
    room would not let the platinum request in there, so nothing is preempted."""
    adm = admission("e1", "e2", health={"checks_to_eject": 1, "eject_base_s": 5, "eject_max_s": 10})
    carl = Handler(adm, "carl")
    await wait_until(lambda: carl.log, what="carl on an engine")
    bob = Handler(adm, "bob")  # platinum, on the other engine
    await wait_until(lambda: bob.log, what="bob on the other engine")
    adm.pools["p"].router.engines[carl.log[0]].health.record_check(False, "refused")  # carl's engine ejected
    alice = Handler(adm, "alice")
    await asyncio.sleep(AFTER_S * 6)
    assert not alice.log and carl.log == [carl.log[0]] and adm.pools["p"].preemptions == 0
    for h in (carl, bob, alice):
        h.done.set()
    await asyncio.gather(carl.task, bob.task)
    await wait_until(lambda: alice.log, what="alice dispatched once bob's engine is free")
    await alice.task


async def test_a_client_leaving_while_its_preempted_request_waits_frees_everything():
    adm = admission("e1")
    carl = Handler(adm, "carl")
    await wait_until(lambda: carl.log, what="carl on the engine")
    alice = Handler(adm, "alice")
    await wait_until(lambda: alice.log, what="alice dispatched", timeout=2)
    assert carl.log[-1] == "preempted"
    carl.task.cancel()  # its client leaves while it waits again
    await asyncio.gather(carl.task, return_exceptions=True)
    sched = adm.pools["p"].scheduler
    assert sched.queued == 0 and sched.user_state("carl")["inflight"] == 0 and carl.ticket.state is TicketState.REFUSED
    alice.done.set()
    await alice.task
    assert not sched.inflight and adm.pools["p"].router.inflight == 0
