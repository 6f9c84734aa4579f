"""``/admin/*`` routes: live status, the active config (secrets redacted), reload.

Every admin route needs ``Authorization: Bearer <admin key>`` (``admin.api_key`` or the
variable named by ``admin.api_key_env``); with no admin key configured they answer 403.
"""

from __future__ import annotations

import hashlib
import hmac
import time

from aiohttp import web

from ..config.schema import SECRET_FIELDS
from ..wire.errors import error_response
from ..config.pools import public_url
from ..telemetry.objectives import objectives_status
from .handlers import STATE

REDACTED = "***"


def check_admin(request: web.Request) -> web.Response | None:
    """``None`` when ``request`` carries the admin key (``Authorization: Bearer KEY``);
    otherwise the error answer to send: 403 ``admin_disabled`` when no admin key is
    configured, 401 ``invalid_admin_key`` when it is missing or wrong (compared by
    SHA-256 digests in constant time)."""
    key = request.app[STATE].active.config.admin.credential()
    if not key:
        return error_response(403, "admin routes are disabled: set admin.api_key or LLM_QOS_ADMIN_KEY", code="admin_disabled")
    auth = request.headers.get("Authorization", "")
    given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    if not hmac.compare_digest(hashlib.sha256(given.encode("utf-8", "surrogateescape")).digest(), hashlib.sha256(key.encode()).digest()):
        return error_response(401, "the admin key is required", code="invalid_admin_key")
    return None


def redacted_config(config) -> dict:
    """The config as a dict with every key and credential replaced by ``***``: the value
    of every key named in :data:`proxy.config.schema.SECRET_FIELDS`, wherever it is, and the
    ``user:password@`` of ``shared_state.url`` and of every engine's URL
    (:func:`proxy.config.pools.public_url`)."""
    data = _redacted(config.model_dump(mode="json"))
    if isinstance(data.get("upstream"), dict) and data["upstream"].get("url"):
        data["upstream"]["url"] = public_url(data["upstream"]["url"])
    for pool in data.get("pools") or ():
        for engine in pool.get("engines") or ():
            engine["url"] = public_url(engine["url"])
    shared = data.get("shared_state")
    if shared and "@" in shared["url"]:  # redis://user:password@host
        scheme, _, rest = shared["url"].partition("://")
        shared["url"] = f"{scheme}://{REDACTED}@{rest.rpartition('@')[2]}"
    return data


def _redacted(value):
    if isinstance(value, dict):
        return {k: REDACTED if k in SECRET_FIELDS and v else _redacted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redacted(v) for v in value]
    return value


STATUS_TOP_USERS = 20  # users listed by /admin/status unless ?top= says otherwise
STATUS_MAX_TOP_USERS = 1000


async def status(request: web.Request) -> web.Response:
    """``GET /admin/status[?top=N]``: queues, in-flight requests, per-class virtual
    time, and the ``N`` users with the most recent service (default 20, at most 1000)
    with the count of all users tracked; never every user (their number is bounded
    only by ``admission.max_users``). Summed over the pools, with ``pools`` (each pool's
    queue and in flight) and ``engines`` (each engine's health state, in flight, tokens
    in flight, load, routed requests, ejections: :meth:`proxy.routing.engine_state.EngineState.status`);
    see :meth:`proxy.admission.admission.Admission.snapshot`; and ``shared_state``: the shared
    state's mode, live replicas, grants per capacity key, syncs and the last sync's age
    and round trip (``docs/scaling.md``); and ``objectives``: each group's latency
    objectives over their window, overall and per engine
    (:func:`proxy.telemetry.objectives.objectives_status`)."""
    if (denied := check_admin(request)) is not None:
        return denied
    raw = request.query.get("top", "")
    top = STATUS_TOP_USERS
    if raw:
        if not raw.isdigit():
            return error_response(400, "'top' must be a whole number", code="invalid_request", param="top")
        top = min(int(raw[:6]), STATUS_MAX_TOP_USERS)
    state = request.app[STATE]
    snap = state.admission.snapshot(top_users=top)
    snap["shared_state"] = state.shared.status()  # mode, grants per key, last sync age
    snap["objectives"] = objectives_status(state.objectives.report(time.monotonic()))
    return web.json_response(snap)


async def config(request: web.Request) -> web.Response:
    """``GET /admin/config``: the active config (secrets redacted), its hash, load time,
    and the last reload error."""
    if (denied := check_admin(request)) is not None:
        return denied
    state = request.app[STATE]
    active = state.active
    return web.json_response(
        {
            "config": redacted_config(active.config),
            "hash": active.digest,
            "loaded_at": active.loaded_at,
            "age_s": round(time.time() - active.loaded_at, 3),
            "path": state.config_path,
            "last_error": state.last_error,
        }
    )


async def reload(request: web.Request) -> web.Response:
    """``POST /admin/reload``: re-read the config file now. 200 with the new hash, or
    400 with the validation error (the old config stays active)."""
    if (denied := check_admin(request)) is not None:
        return denied
    reloader = request.app.get(RELOADER)
    if reloader is None:
        return error_response(409, "the proxy was not started from a config file", code="no_config_file")
    ok = reloader()
    state = request.app[STATE]
    if not ok:
        return error_response(400, state.last_error or "reload failed", code="invalid_config")
    return web.json_response({"status": "reloaded", "hash": state.active.digest})


RELOADER = web.AppKey("llm_qos_reloader", object)


def add_routes(app: web.Application) -> None:
    """Register the admin routes on ``app``."""
    app.router.add_get("/admin/status", status)
    app.router.add_get("/admin/config", config)
    app.router.add_post("/admin/reload", reload)
