"""The HTTP surface: every route the proxy answers, and the app that wires them.

* :mod:`.routes`: every client route's entry point (chat, completions, embeddings,
  Responses, LightLLM's native routes, pass-through, models, health, readiness, metrics).
* :mod:`.handlers`: a generation request's way through the layers, as named steps:
  resolve, admit, open upstream, relay, account (:func:`.handlers.handle_generation`).
* :mod:`.admin`: ``/admin/*`` (status, the active config, reload), behind the admin key.
* :mod:`.dashboard`: the live dashboard's page (static files under ``proxy/static/``)
  and routes; :mod:`.dashboard_data`: its data and the sampler of its history;
  :mod:`.dashboard_samples`: one sample's readings of the counters, and their
  differences and quantiles.
* :mod:`.openapi`: the published OpenAPI document (``GET /openapi.json``).
* :mod:`.app`: the aiohttp application: the route table, the JSON error middleware,
  start-up and clean-up.

The top layer below the entry points (``proxy.cli``, ``proxy.server``), which alone
import it.

May import: config, wire, telemetry, routing, admission, relay, runtime.
"""
