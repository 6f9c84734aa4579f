"""The live dashboard's page and its routes: the page, its script and style, and the data
(``GET /admin/dashboard.json``, built by :mod:`proxy.api.dashboard_data`).

The page (``GET /admin/dashboard``, with ``dashboard.js`` and ``dashboard.css``; package
data under ``proxy/static/``) is the same static text for everyone and holds no data: a
browser cannot attach a bearer header to a page it navigates to, and gating the page
would mean a cookie session (open to cross-site requests) or the key in the URL (kept in
history, logs and ``Referer``). The page asks for the admin key, keeps it in the tab's
``sessionStorage`` and sends it as ``Authorization: Bearer`` on every ``fetch`` of the
data, which, like every ``/admin/*`` route, answers 401 without it (403 when no admin key
is configured). A strict Content-Security-Policy lets the page run only its own script
and talk only to its own origin; every figure is written with ``textContent``.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

from .admin import check_admin
from .dashboard_data import Dashboard
from .handlers import STATE
from ..runtime.load_signal import LOAD_SIGNAL

# the page's security headers: its own script, style and origin only; never framed
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
_STATIC = {"dashboard": ("dashboard.html", "text/html"), "dashboard.js": ("dashboard.js", "text/javascript"), "dashboard.css": ("dashboard.css", "text/css")}


DASHBOARD = web.AppKey("llm_qos_dashboard", Dashboard)


def _static(name: str) -> tuple[bytes, str]:
    filename, content_type = _STATIC[name]
    return resources.files("proxy").joinpath("static", filename).read_bytes(), content_type


def add_routes(app: web.Application) -> None:
    """Register ``GET /admin/dashboard`` (the page), its script and style (no key: static
    text, no data) and ``GET /admin/dashboard.json[?since=SEQ&history=ID]`` (admin key),
    and create the :class:`Dashboard`, sampling from start-up to cleanup."""
    state = app[STATE]
    dashboard = app[DASHBOARD] = Dashboard(state, app[LOAD_SIGNAL], state.admission.clock)
    for route in _STATIC:
        body, content_type = _static(route)

        async def page(request: web.Request, body: bytes = body, content_type: str = content_type) -> web.Response:
            return web.Response(body=body, content_type=content_type, charset="utf-8", headers=PAGE_HEADERS)

        app.router.add_get(f"/admin/{route}", page)

    async def data(request: web.Request) -> web.Response:
        """``GET /admin/dashboard.json``: the dashboard's data (admin key)."""
        if (denied := check_admin(request)) is not None:
            return denied
        raw = request.query.get("since", "")
        since = int(raw[:18]) if raw.isdigit() else None
        body = request.app[DASHBOARD].data(since, request.query.get("history"))
        return web.json_response(body, headers={"Cache-Control": "no-store"})

    async def start(app: web.Application) -> None:
        dashboard.start()

    async def stop(app: web.Application) -> None:
        dashboard.stop()

    app.router.add_get("/admin/dashboard.json", data)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
