"""What the proxy reports about itself: Prometheus series and log lines.

* :mod:`.metrics`: every Prometheus name of the requests, groups, tokens, refusals and
  reloads, defined once, and the merge of the workers' expositions. (The engines' own
  series are read from the routers: :mod:`proxy.routing.engine_metrics`.)
* :mod:`.objectives`: the groups' latency objectives: a stream's time per output token,
  their series, their status.
* :mod:`.protection`: objective protection's series (steps, refusals, the step in force).
* :mod:`.access_log`: the access log's line, one JSON object per request.
* :mod:`.log_format`: how the access log (one JSON object a line) and the diagnostic log
  are written.
* :mod:`.log_filters`: filters that keep request data out of the logs.

A bottom layer: the relay and the routes count into it, the server sets the logs up with
it; it knows none of them.

May import: nothing of the proxy (only :mod:`qos`).
"""
