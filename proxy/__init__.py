"""The llm-qos proxy: an aiohttp reverse proxy that admits requests through the
:mod:`qos` scheduler and relays answers from OpenAI-compatible or LightLLM engines.

A request's way (``docs/architecture.md``): it enters by a route of :mod:`proxy.api`,
which resolves it (its kind, :mod:`proxy.relay.request_kinds`; who is asking,
:mod:`proxy.admission.identity`; its pool, :mod:`proxy.routing.model_routing`), admits it
(:mod:`proxy.admission`, whose schedulers place it on an engine through
:mod:`proxy.routing`), opens it on that engine and relays the answer
(:mod:`proxy.relay`), and accounts for it (:mod:`proxy.telemetry`).

Subpackages, bottom up; each says at its top what it owns and which of the others it may
import (``tests/test_architecture.py`` holds them to it):

* ``config``: the operator's YAML, its schema and loading;
* ``wire``: what crosses the wire, as data (error bodies, request bodies, SSE, headers);
* ``telemetry``: Prometheus series and log formats;
* ``shared``: the QoS state replicas share through Redis;
* ``routing``: model -> pool -> engine, engine health;
* ``admission``: who is asking, and waiting for a slot;
* ``relay``: the exchange with the engine, and the answer relayed back;
* ``runtime``: one process's live state, hot reload, load polling, workers;
* ``api``: the routes and the app that wires them.

At the top, the entry points, which no subpackage imports: :mod:`proxy.cli` (the
``llm-qos`` command; ``python -m proxy``) and :mod:`proxy.server` (running one process).
Package data here, read with :mod:`importlib.resources` from ``proxy``:
``default_config.yaml`` (the CLI's default config) and ``static/`` (the dashboard's page).
"""
