"""Which engine serves a request: model -> pool, pool -> engine (bound late), and whether
an engine is fit to serve.

* :mod:`.model_routing`: the ``model`` a request names picks its pool; the models list.
* :mod:`.router`: :class:`~.router.PoolRouter`, a pool's capacity as its scheduler sees
  it (does the head of the queue fit? place it on the engine with the most room; free
  it), and rerouting to another engine.
* :mod:`.pool_capacity`: :class:`~.pool_capacity.PoolCapacity`, the router's face to the
  pool's :class:`qos.Scheduler`.
* :mod:`.engine_state`: one engine as the router sees it (capacity, rotation, fit,
  headroom, load, status row).
* :mod:`.placement`: which of the engines that fit a request goes to (``least_headroom``,
  ``round_robin``, affinity by rendezvous hashing).
* :mod:`.engine_health`: when an engine leaves rotation and comes back (a pure state
  machine); :mod:`.health_checker`: the tasks that send its active checks and probes;
  :mod:`.exchange_verdict`: the verdict one request's outcome is for its engine
  (:func:`~.exchange_verdict.exchange_verdict`).
* :mod:`.engine_meter`: each engine's time to first token and per output token, as the
  proxy measures them (the capacity controller's input).
* :mod:`.engine_metrics`: the engines' Prometheus series, read from the routers.

Routing holds no queue (admission asks the router whether a ticket fits) and sends no
request (the relay does).

May import: config, wire.
"""
