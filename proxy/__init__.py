"""The llm-qos proxy: an aiohttp reverse proxy that admits requests through the
:mod:`qos` scheduler and relays answers from an OpenAI-compatible or LightLLM upstream.

Modules, by job: ``config`` (schema and loading), ``identity`` (who is asking),
``request_body`` (what is asked), ``admission`` (waiting for a slot), ``upstream``
(connection pool), ``relay`` (streaming answers back), ``handlers`` (routes),
``admin`` (``/admin/*``), ``config_watch`` (hot reload), ``metrics`` (Prometheus),
``app`` (wiring), ``server`` (running), ``cli`` (the ``llm-qos`` command).
Several engines and models: ``pool_config`` (the ``pools`` schema), ``model_routing``
(model -> pool), ``router`` (pool -> engine, bind late), ``engine_health`` (ejection and
probes), ``engine_metrics`` (per-engine series), ``request_kinds`` (embeddings, Responses,
pass-through), ``engine_body`` (what one engine is sent).
"""
