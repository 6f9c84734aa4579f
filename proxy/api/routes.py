"""Every client route's entry point, thin: the generation routes hand their request to
:func:`proxy.api.handlers.handle_generation` (chat, completions, embeddings, Responses,
LightLLM's native routes, pass-through); the others answer here: the models list, one
model, health, readiness, metrics.
"""

from __future__ import annotations

import aiohttp
from aiohttp import web

from ..config.pools import public_url
from ..relay import request_kinds as kinds
from ..relay.upstream import UpstreamError
from ..routing.engine_health import check_path_for
from ..routing.model_routing import model_error, parse_models_body
from ..routing.engine_state import EngineState
from ..runtime.workers import whole_server_metrics
from ..wire.errors import error_response
from ..wire.headers import DECODED_CODINGS, REQUEST_ID, client_headers, content_coding, origin_form, request_id_of, trace_headers
from .handlers import STATE, handle_generation

#: the proxy's own resources, every route but the pass-through catch-all (set by the app)
OWN_RESOURCES = web.AppKey("llm_qos_own_resources", tuple)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions`` (streaming and not)."""
    return await handle_generation(request, kinds.CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions`` (streaming and not)."""
    return await handle_generation(request, kinds.COMPLETION)


async def embeddings(request: web.Request) -> web.StreamResponse:
    """``POST /v1/embeddings``: admitted at its prompt's cost (it generates nothing),
    relayed as the engine answers; the engine's ``usage.prompt_tokens`` trues it up."""
    return await handle_generation(request, kinds.EMBEDDINGS)


async def responses(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses`` (OpenAI's Responses API, streaming and not): admitted and
    relayed like chat; a stream ends with the engine's own terminal event (no
    ``[DONE]``), a cut one with a terminal ``error`` event."""
    return await handle_generation(request, kinds.RESPONSES)


async def passthrough(request: web.Request) -> web.StreamResponse:
    """Any other path under ``/v1/``, any method: with ``passthrough.enabled``, sent to
    an engine (the pool of a JSON body's ``model``, else the catch-all or only pool),
    admitted at ``passthrough.cost_tokens`` unless ``passthrough.admit`` is false, and
    relayed as the engine answers; off (the default), ``404`` as for any unknown route.
    A path with a ``.`` or ``..`` segment is never passed (``404``)."""
    allowed = await _own_methods(request)
    if allowed:  # one of the proxy's own routes, with another method
        resp = error_response(405, f"method {request.method} not allowed on {request.path}", code="method_not_allowed")
        resp.headers["Allow"] = ",".join(sorted(allowed))
        return resp
    if not request.app[STATE].active.config.passthrough.enabled or not _plain_v1_path(request.path):
        return error_response(404, f"no route {request.method} {request.path}", code="not_found")
    return await handle_generation(request, kinds.PASSTHROUGH)


async def _own_methods(request: web.Request) -> set[str]:
    """The methods the proxy's own routes take on this path (empty: none of them is
    this path), from the resources registered before the pass-through catch-all
    (:data:`OWN_RESOURCES`; ``aiohttp.web.AbstractResource.resolve``)."""
    allowed: set[str] = set()
    for resource in request.app[OWN_RESOURCES]:
        _match, methods = await resource.resolve(request)
        allowed |= methods
    return allowed


def _plain_v1_path(path: str) -> bool:
    """Whether ``path`` (decoded) is under ``/v1/`` with no dot segment (RFC 3986 §3.3:
    an engine or a server in front of it could resolve ``..`` out of ``/v1/``)."""
    return path.startswith("/v1/") and not any(seg in (".", "..") for seg in path.split("/"))


def _native_unavailable(request: web.Request) -> web.Response | None:
    state = request.app[STATE]
    if not any(e.kind == "lightllm" for pool in state.admission.pools.values() for e in pool.spec.engines):
        what = "this proxy's upstream.kind is not lightllm" if state.active.models.single_upstream else "no pool of this proxy has lightllm engines"
        return error_response(404, f"{request.path} is LightLLM's native route; {what}", code="not_found")
    return None


async def generate(request: web.Request) -> web.StreamResponse:
    """LightLLM native ``POST /generate`` (404 unless the request's pool, by ``model``
    if the body names a listed one, else the catch-all pool, has only lightllm engines)."""
    if (unavailable := _native_unavailable(request)) is not None:
        return unavailable
    return await handle_generation(request, kinds.GENERATE)


async def generate_stream(request: web.Request) -> web.StreamResponse:
    """LightLLM native ``POST /generate_stream`` (as :func:`generate`)."""
    if (unavailable := _native_unavailable(request)) is not None:
        return unavailable
    return await handle_generation(request, kinds.GENERATE_STREAM)


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models`` (and ``HEAD``): with the single ``upstream``, the upstream's own
    answer passed through with its query string and end-to-end headers; with pools, every
    model a pool lists, then what the catch-all pool's engine lists
    (:meth:`proxy.routing.model_routing.ModelTable.models_list`). 401 for a key the config does not
    know, or without a known key when ``identity.require_api_key`` is on; every answer
    carries ``X-Request-Id``."""
    rid = request_id_of(request.headers)
    resp = await _models(request, rid)
    if REQUEST_ID not in resp.headers:
        resp.headers[REQUEST_ID] = rid
    return resp


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{id}``: the entry of ``GET /v1/models`` for that id, or 404
    ``model_not_found`` (401 as for :func:`models`)."""
    rid = request_id_of(request.headers)
    resp = await _model(request, rid)
    resp.headers[REQUEST_ID] = rid
    return resp


def _unauthorized(request: web.Request) -> web.Response | None:
    active = request.app[STATE].active
    if (why := active.identity.refusal(active.identity.resolve(request.headers))) is not None:
        return error_response(401, why, code="invalid_api_key")
    return None


async def _engine_models(request: web.Request, engine: EngineState, rid: str) -> tuple[aiohttp.ClientResponse | None, bytes, web.Response | None]:
    """``GET /v1/models`` of one engine: ``(response, body, None)``, or ``(None, b"",
    error answer)``."""
    try:
        upstream = await engine.client.open("GET", "/v1/models", query=origin_form(request.raw_path)[1], request_id=rid, trace=trace_headers(request.headers))
    except UpstreamError as e:
        return None, b"", error_response(e.status, e.message, code=e.code)
    coding = content_coding(upstream.headers)
    if coding not in DECODED_CODINGS:
        upstream.close()
        return None, b"", error_response(502, f"the upstream answered with Content-Encoding {coding!r}, which the proxy cannot decode", code="upstream_bad_response")
    try:
        body = await upstream.read()
    except (aiohttp.ClientError, TimeoutError):
        upstream.close()
        return None, b"", error_response(502, "the upstream failed while sending its answer", code="upstream_error")
    upstream.release()
    return upstream, body, None


async def _catch_all_models(request: web.Request, rid: str) -> list[dict]:
    """What the catch-all pool's engine lists (the first engine in rotation that answers
    2xx), or ``[]``."""
    state = request.app[STATE]
    name = state.active.models.catch_all
    pool = state.admission.pools.get(name) if name is not None else None
    if pool is None:
        return []
    for e in list(pool.router.engines.values()):
        if not e.in_rotation or e.client is None:
            continue
        upstream, body, _err = await _engine_models(request, e, rid)
        if upstream is not None and 200 <= upstream.status < 300:
            return parse_models_body(body)
    return []


async def _models(request: web.Request, rid: str) -> web.Response:
    state = request.app[STATE]
    if (denied := _unauthorized(request)) is not None:
        return denied
    table = state.active.models
    if not table.single_upstream:
        return web.json_response(table.models_list(await _catch_all_models(request, rid)))
    engine = next(iter(state.admission.default.router.engines.values()))
    upstream, body, err = await _engine_models(request, engine, rid)
    if err is not None:
        return err
    headers = client_headers(upstream.headers, rid, engine.url)
    if "Content-Type" not in headers:
        headers["Content-Type"] = "application/json"
    return web.Response(status=upstream.status, body=body, headers=headers)


async def _model(request: web.Request, rid: str) -> web.Response:
    state = request.app[STATE]
    if (denied := _unauthorized(request)) is not None:
        return denied
    model_id = request.match_info["model"]
    obj = state.active.models.model(model_id, await _catch_all_models(request, rid))
    if obj is None:
        return model_error(model_id)
    return web.json_response(obj)


async def health(request: web.Request) -> web.Response:
    """``GET /health``: the proxy process is alive."""
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """``GET /ready``: 200 when some pool can serve now: one of its engines in rotation
    answers its check (``GET /v1/models`` for openai engines, ``GET /token_load`` for
    lightllm ones, or the pool's ``health.check_path``) with a 2xx; 503 otherwise, and
    while shutting down. Any pool, not every pool: a replica that can serve some models
    stays in its load balancer's rotation (a pool without engines answers its own
    requests 503 at once). The body lists every pool's engines in rotation."""
    state = request.app[STATE]
    if state.draining:
        return error_response(503, "the proxy is shutting down", code="shutting_down")
    pools = {p.name: sum(e.in_rotation for e in p.router.engines.values()) for p in state.admission.pools.values()}
    problems = []
    for pool in state.admission.pools.values():
        for e in list(pool.router.engines.values()):
            if not e.in_rotation or e.client is None:
                continue
            path = check_path_for(pool.spec.health, e.kind)
            try:
                upstream = await e.client.open("GET", path)
            except UpstreamError as err:
                problems.append(f"{e.name}: {err.message}")
                continue
            status = upstream.status
            upstream.close()
            if status < 300:
                return web.json_response({"status": "ready", "upstream": public_url(e.url), "pools": pools})
            problems.append(f"{e.name}: answered {status} on {path}")
    if not problems:
        return error_response(503, "upstream not ready: no engine is in rotation", code="upstream_not_ready")
    if len(problems) == 1 and state.active.models.single_upstream:
        msg = problems[0].split(": ", 1)[1]
        if msg.startswith("answered"):
            return error_response(503, f"upstream {msg}", code="upstream_not_ready")
        return error_response(503, f"upstream not ready: {msg}", code="upstream_not_ready")
    return error_response(503, "upstream not ready: " + "; ".join(problems[:10]), code="upstream_not_ready")


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text format; under ``--workers``, every worker's series
    (:func:`proxy.runtime.workers.whole_server_metrics`)."""
    body = await whole_server_metrics(request.app[STATE])
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
