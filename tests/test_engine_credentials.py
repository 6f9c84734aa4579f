"""An engine URL with a credential (``http://user:password@host``, issue 21.4): the
credential is sent as Basic auth, and nothing any client, scraper or log reader sees shows
the password: not ``GET /ready``, not the ``/metrics`` labels (an engine's name defaults to
its URL), not ``/admin/status`` or ``/admin/config``, not the start-up or log lines."""

from __future__ import annotations

import base64

import aiohttp
import pytest
import yaml
from aiohttp import web

from bench.fake_upstream import make_app
from proxy.config.loading import ConfigError, parse_config
from tests.conftest import base_config
from tests.proc_util import free_port
from tests.proxy_process import start_proxy, stop_proxy

PASSWORD = "s3cret-pw"
ADMIN = {"Authorization": "Bearer admin-key"}


def _basic_only(seen: list) -> web.middleware:
    expected = "Basic " + base64.b64encode(f"engine-user:{PASSWORD}".encode()).decode()

    @web.middleware
    async def check(request: web.Request, handler):
        seen.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") != expected:
            return web.json_response({"error": "unauthorized"}, status=401)
        return await handler(request)

    return check


async def test_an_engine_password_is_used_but_never_shown(aiohttp_server, tmp_path):
    seen: list = []
    app = make_app(0.0, 0.0)
    app.middlewares.append(_basic_only(seen))
    engine = await aiohttp_server(app)
    host = f"127.0.0.1:{engine.port}"
    cfg = base_config(f"http://engine-user:{PASSWORD}@{host}")
    cfg["upstream"]["load_signal"] = {"enabled": False}
    cfg["admin"] = {"api_key": "admin-key"}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = free_port()
    proc = start_proxy(path, port)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            async with s.post(f"{url}/v1/chat/completions", json=body, headers={"X-User-Id": "carl"}) as r:
                assert r.status == 200, await r.text()
            assert seen and all(a and a.startswith("Basic ") for a in seen)  # the credential is used
            async with s.get(f"{url}/ready") as r:
                ready = await r.json()
            assert r.status == 200 and ready["upstream"] == f"http://***@{host}"
            texts = {"/ready": yaml.safe_dump(ready)}
            for route, headers in (("/metrics", {}), ("/admin/status", ADMIN), ("/admin/config", ADMIN)):
                async with s.get(f"{url}{route}", headers=headers) as r:
                    assert r.status == 200
                    texts[route] = await r.text()
            assert f'engine="http://***@{host}"' in texts["/metrics"]  # the default name
            for route, text in texts.items():
                assert PASSWORD not in text, f"{route} shows the engine's password"
    finally:
        assert stop_proxy(proc) == 0
    log = proc.log_path.read_text()
    assert PASSWORD not in log, "a log line shows the engine's password"


def test_pool_engines_are_named_without_their_password():
    cfg = base_config("http://127.0.0.1:9")
    del cfg["upstream"]["url"]
    cfg["pools"] = [{"name": "p", "models": ["*"], "engines": [{"url": f"http://u:{PASSWORD}@10.0.0.1:8000"}, {"url": "http://10.0.0.2:8000"}]}]
    spec = parse_config(yaml.safe_dump(cfg)).effective_pools()[0]
    assert [e.name for e in spec.engines] == ["http://***@10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert spec.engines[0].url == f"http://u:{PASSWORD}@10.0.0.1:8000"  # still sent
    # a repeated URL is named in the error without its password
    cfg["pools"][0]["engines"][1] = {"url": f"http://u:{PASSWORD}@10.0.0.1:8000", "name": "other"}
    with pytest.raises(ConfigError) as err:
        parse_config(yaml.safe_dump(cfg))
    assert "repeated" in str(err.value) and PASSWORD not in str(err.value)
