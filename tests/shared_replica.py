"""A replica in its own process, for tests that kill one with SIGKILL:
``python -m tests.shared_replica URL PREFIX REPLICA_ID CAPACITY WAITING LEASE_S``.

It reports ``WAITING`` requests of class 0 waiting on the test capacity key, dispatches
up to its grant (never completing them: they hold the capacity until the process dies),
and prints ``grant N inflight M`` on every change."""

from __future__ import annotations

import asyncio
import sys

from proxy.shared import SharedState
from tests.shared_helpers import KEY, SimReplica, config


async def main(url: str, prefix: str, rid: str, capacity: int, waiting: int, lease_s: float) -> None:
    state = SharedState(config(url, key_prefix=prefix, lease_s=lease_s), replica_id=rid)
    sim = SimReplica(state, capacity)
    last = None

    def show() -> None:
        nonlocal last
        sim.fill()
        now = (state.grant(KEY), sim.total_inflight)
        if now != last:
            last = now
            print(f"grant {now[0]} inflight {now[1]}", flush=True)

    state.set_on_change(show)
    sim.waiting[0] = waiting
    await state.start()
    print("replica ready", flush=True)
    show()
    await asyncio.Event().wait()


if __name__ == "__main__":
    url, prefix, rid, capacity, waiting, lease_s = sys.argv[1:7]
    asyncio.run(main(url, prefix, rid, int(capacity), int(waiting), float(lease_s)))
