"""One proxy process's live state: what the routes use, built from the config and
swapped whole on reload.

* :mod:`.state`: :class:`~.state.ProxyState`: the active config's admission, routers,
  health checker, identity, model table, shared state, upstream and metrics; the atomic
  swap.
* :mod:`.config_watch`: hot reload: watch the file, validate, swap.
* :mod:`.load_signal`: the engines' own load reports, polled and turned into an
  admission hold: the pollers of the process and their series; what each engine kind
  reports and the limit it calls for (:mod:`.load_report`); one engine's polling task
  (:mod:`.load_poller`).
* :mod:`.workers`: ``--workers N``: the supervisor, each worker's metrics socket, and
  the whole server's metrics.

It assembles the layers below; only the routes and the entry points import it.

May import: config, wire, telemetry, shared, routing, admission, relay.
"""
