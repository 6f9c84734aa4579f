"""The aiohttp application: routes, JSON error middleware, startup and cleanup."""

from __future__ import annotations

import logging

from aiohttp import web

from . import admin, dashboard, openapi, routes
from ..config.schema import Config
from ..wire.errors import error_response
from .handlers import STATE
from ..runtime.load_signal import LOAD_SIGNAL, LoadSignal
from ..runtime.state import ProxyState

log = logging.getLogger("llm_qos.proxy")


@web.middleware
async def guard(request: web.Request, handler):
    """Cap the requests handled at once (``limits.max_concurrent_requests``: 503 beyond),
    and answer routing errors (404, 405, 413) with OpenAI-style JSON instead of aiohttp's
    HTML pages; the process keeps serving."""
    state = request.app[STATE]
    if state.open_requests >= state.active.config.limits.max_concurrent_requests:
        return error_response(503, "too many concurrent requests", code="too_many_requests", retry_after_s=1)
    state.open_requests += 1
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(e.status)
        msg = {404: f"no route {request.method} {request.path}", 405: f"method {request.method} not allowed on {request.path}"}.get(e.status, e.reason)
        resp = error_response(e.status, msg, code=code)
        if "Allow" in e.headers:  # a 405 must say which methods the route takes (RFC 9110 §15.5.6)
            resp.headers["Allow"] = e.headers["Allow"]
        return resp
    finally:
        state.open_requests -= 1


def create_app(
    config: Config,
    digest: str = "",
    config_path: str | None = None,
    upstream_override: str | list[str] | None = None,
    worker: tuple[int, int] | None = None,
) -> web.Application:
    """Build the proxy application for ``config``.

    Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/embeddings``,
    ``POST /v1/responses``, ``POST /generate``, ``POST /generate_stream`` (LightLLM native),
    ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``, ``GET /ready``,
    ``GET /metrics``, ``GET /openapi.json``, ``/admin/*`` (see :mod:`proxy.api.admin`), the live
    dashboard ``/admin/dashboard`` (see :mod:`proxy.api.dashboard`), and every other path under
    ``/v1/`` (pass-through, 404 unless ``passthrough.enabled``).

    The app must be served with ``handler_cancellation=True`` (see :mod:`proxy.server`):
    that is how a client's disconnect reaches the handler and aborts the upstream.
    ``worker``: (index, count) for one of ``--workers`` processes (:mod:`proxy.runtime.workers`).
    """
    app = web.Application(middlewares=[guard], client_max_size=config.limits.max_body_bytes)
    state = ProxyState(config, digest, config_path, upstream_override, worker)
    app[STATE] = state
    app[LOAD_SIGNAL] = load_signal = LoadSignal(state)
    app.router.add_post("/v1/chat/completions", routes.chat_completions)
    app.router.add_post("/v1/completions", routes.completions)
    app.router.add_post("/generate", routes.generate)
    app.router.add_post("/generate_stream", routes.generate_stream)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_get("/v1/models/{model:.+}", routes.model)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/ready", routes.ready)
    app.router.add_get("/metrics", routes.metrics)
    app.router.add_post("/v1/embeddings", routes.embeddings)
    app.router.add_post("/v1/responses", routes.responses)
    app.router.add_get("/openapi.json", openapi.openapi)
    admin.add_routes(app)
    dashboard.add_routes(app)
    app[routes.OWN_RESOURCES] = tuple(app.router.resources())  # for pass-through's 405s
    app.router.add_route("*", "/v1/{path:.*}", routes.passthrough)  # last: every other /v1/ path

    async def start_upstream(app: web.Application) -> None:
        state.start()  # every engine's connections and health checks
        load_signal.start()
        await state.shared.start()

    async def close_upstream(app: web.Application) -> None:
        await state.shared.stop()  # after the drain: gives this replica's grants back
        await load_signal.stop()
        await state.close()

    app.on_startup.append(start_upstream)
    app.on_cleanup.append(close_upstream)
    return app
