"""Who is asking, and when they may go: the asyncio face of the :mod:`qos` schedulers.

* :mod:`.identity`: API key or trusted header -> (user, group).
* :mod:`.admission`: one scheduler per pool, whose capacity is the pool's router: wait
  for a slot on an engine, give it back exactly once.
* :mod:`.pool`: one pool as admission holds it (router, scheduler, timers), a ticket's
  context while admission holds it, and :class:`~.pool.NoEngine` (no engine in rotation).
* :mod:`.preemption`: ``admission.preemption``: when a lower class's request is taken
  out of flight for a higher class's waiting head, and what happens to its task.
* :mod:`.objective_protection`: ``objectives.protection`` and ``on_miss: reject``: each
  pool's checks for a group at risk of missing its objective, the steps that follow
  (hold, preempt, shed), a group's drain rate.
* :mod:`.pool_snapshot`: the pools' scheduler snapshots summed, a row per pool and engine.
* :mod:`.admitted`: one request's hold on admission, an ``async with``
  (:class:`~.admitted.Admitted`): its ticket and engine place, released exactly once
  however the request ends; reroute, requeue after a preemption, the health verdict.
* :mod:`.rate_reservation`: a request's rate-limit take reserved in the shared state
  before it reaches the scheduler, and handed to the scheduler to refund or settle
  (:class:`~.rate_reservation.SharedRateLimiter`). The buckets themselves, the Redis
  scripts and their local mirror, are :mod:`proxy.shared.rate_limits`.
* :mod:`.lease_binding`: what binds the shared state's capacity leases
  (:mod:`proxy.shared.leases`, the lease table in Redis) to the schedulers and the
  engines: the units each engine has in flight, per class, and the lease each may use.

May import: config, wire, routing, shared.
"""
