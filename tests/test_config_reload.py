"""Hot reload on real files: every way a file changes, every way it can be broken."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from proxy.config.loading import ConfigError, load_config, parse_config
from proxy.runtime.config_watch import reload_config, watch_config
from tests.conftest import base_config, wait_until

REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ validation


def test_unknown_key_is_an_error_naming_its_path():
    cfg = base_config("http://127.0.0.1:1")
    cfg["admission"]["max_inflght"] = 3
    with pytest.raises(ConfigError) as e:
        parse_config(yaml.safe_dump(cfg))
    assert "admission.max_inflght" in str(e.value) and "Extra inputs are not permitted" in str(e.value)


def test_wrong_type_names_path_value_and_what_is_allowed():
    cfg = base_config("http://127.0.0.1:1")
    cfg["groups"][0]["users"][0]["weight"] = "heavy"
    with pytest.raises(ConfigError) as e:
        parse_config(yaml.safe_dump(cfg))
    msg = str(e.value)
    assert "groups.0.users.0.weight" in msg and "'heavy'" in msg and "number" in msg


@pytest.mark.parametrize(
    "text,needle",
    [("", "empty"), ("groups: [", "not valid YAML"), ("- a\n- b\n", "mapping"), ("default_group: x\ngroups: []\n", "groups")],
)
def test_broken_documents_are_rejected(text, needle):
    with pytest.raises(ConfigError) as e:
        parse_config(text)
    assert needle in str(e.value)


def test_default_group_must_exist_and_users_unique():
    cfg = base_config("http://127.0.0.1:1")
    cfg["default_group"] = "nope"
    with pytest.raises(ConfigError, match="default_group"):
        parse_config(yaml.safe_dump(cfg))
    cfg = base_config("http://127.0.0.1:1")
    cfg["groups"][1]["users"].append({"id": "alice"})
    with pytest.raises(ConfigError, match="unique"):
        parse_config(yaml.safe_dump(cfg))


def test_check_config_command(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(base_config("http://127.0.0.1:1")))
    bad = tmp_path / "bad.yaml"
    bad.write_text("default_group: bronze\ngroups: [{name: bronze, weight: 2}]\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ok = subprocess.run([sys.executable, "-m", "proxy", "check-config", str(good)], capture_output=True, text=True, env=env, timeout=60)
    assert ok.returncode == 0 and ok.stdout.startswith("ok:")
    ko = subprocess.run([sys.executable, "-m", "proxy", "check-config", str(bad)], capture_output=True, text=True, env=env, timeout=60)
    assert ko.returncode == 1 and "groups.0.weight" in ko.stderr


def test_shipped_default_config_is_valid():
    load_config(REPO / "proxy" / "default_config.yaml")


# ------------------------------------------------------------- watching files


def _write(path: Path, cfg: dict) -> None:
    path.write_text(yaml.safe_dump(cfg))


def _reloads(state, result: str) -> float:
    return state.metrics.registry.get_sample_value("llm_qos_config_reloads_total", {"result": result})


async def _watching(state):
    stop = asyncio.Event()
    task = asyncio.create_task(watch_config(state, stop))
    await asyncio.sleep(0.2)  # let the watcher register its inotify watch
    return stop, task


async def _stop(stop, task):
    stop.set()
    await asyncio.wait_for(task, 5)


def _cfg_with_inflight(st, n: int) -> dict:
    cfg = yaml.safe_load(st.config_path.read_text())
    cfg["admission"]["max_inflight"] = n
    return cfg


async def test_in_place_write_is_picked_up(make_stack):
    st = await make_stack()
    stop, task = await _watching(st.state)
    try:
        _write(st.config_path, _cfg_with_inflight(st, 7))
        await wait_until(lambda: st.state.active.config.admission.max_inflight == 7, timeout=3, what="reload")
    finally:
        await _stop(stop, task)


async def test_editor_rename_is_picked_up(make_stack):
    st = await make_stack()
    stop, task = await _watching(st.state)
    try:
        tmp = st.config_path.with_name(".config.yaml.swp")
        _write(tmp, _cfg_with_inflight(st, 5))
        os.replace(tmp, st.config_path)
        await wait_until(lambda: st.state.active.config.admission.max_inflight == 5, timeout=3, what="reload")
    finally:
        await _stop(stop, task)


async def test_kubernetes_configmap_symlink_swap_is_picked_up(make_stack, tmp_path):
    """ConfigMap layout: dir/config.yaml -> ..data/config.yaml, ..data -> ..2024_01 (swapped)."""
    st = await make_stack()
    cm = tmp_path / "cm"
    cm.mkdir()
    v1 = cm / "..v1"
    v1.mkdir()
    (v1 / "config.yaml").write_text(st.config_path.read_text())
    os.symlink("..v1", cm / "..data")
    os.symlink("..data/config.yaml", cm / "config.yaml")
    st.state.config_path = str(cm / "config.yaml")
    assert reload_config(st.state)
    stop, task = await _watching(st.state)
    try:
        v2 = cm / "..v2"
        v2.mkdir()
        _write(v2 / "config.yaml", _cfg_with_inflight(st, 6))
        os.symlink("..v2", cm / "..data_tmp")
        os.replace(cm / "..data_tmp", cm / "..data")  # the atomic swap kubelet does
        await wait_until(lambda: st.state.active.config.admission.max_inflight == 6, timeout=3, what="reload")
    finally:
        await _stop(stop, task)


@pytest.mark.parametrize(
    "broken",
    ["admission: {max_inflight: [", "admission: {max_inflight: many}\ndefault_group: bronze\ngroups: [{name: bronze}]\n", "", "upstream:\n  url: http://127.0.0.1:9\nadmis"],
    ids=["syntax", "wrong-type", "empty", "half-written"],
)
async def test_broken_file_keeps_old_config_and_counts_error(make_stack, broken):
    st = await make_stack()
    before = st.state.active
    errors = _reloads(st.state, "error")
    st.config_path.write_text(broken)
    assert reload_config(st.state) is False
    assert st.state.active is before
    assert _reloads(st.state, "error") == errors + 1
    assert st.state.last_error


async def test_admin_config_needs_admin_key_and_redacts_secrets(make_stack, http, monkeypatch):
    st = await make_stack()
    monkeypatch.setenv("LLM_QOS_ADMIN_KEY", "adm-secret")
    async with http.get(st.proxy_url + "/admin/config") as r:
        assert r.status == 401
    async with http.get(st.proxy_url + "/admin/config", headers={"Authorization": "Bearer adm-secret"}) as r:
        assert r.status == 200
        body = await r.json()
    text = str(body)
    assert "sk-alice" not in text and "***" in text
    assert body["hash"] == st.state.active.digest and body["last_error"] is None


# ------------------------------------------------------------- state carry-over


async def test_reload_keeps_counters_applies_capacity_and_moves_removed_group(make_stack, http):
    st = await make_stack(max_inflight=1)
    sched = st.state.admission.scheduler
    busy = asyncio.create_task(http.post(st.proxy_url + "/v1/chat/completions", json=st.chat_body(3, itl_s=0.3, tag="busy"), headers={"Authorization": "Bearer sk-alice"}))
    await wait_until(lambda: st.stats.started == 1, what="slot busy")
    waiting = [
        asyncio.create_task(http.post(st.proxy_url + "/v1/chat/completions", json=st.chat_body(1, tag=f"w{i}"), headers={"Authorization": "Bearer sk-carl"}))
        for i in range(3)
    ]
    await wait_until(lambda: sched.queued == 3, what="queued")
    counters = sched.counters()
    cfg = yaml.safe_load(st.config_path.read_text())
    cfg["admission"]["max_inflight"] = 4
    cfg["groups"] = [cfg["groups"][0], {"name": "standard", "users": []}]  # bronze (carl's group) removed
    cfg["default_group"] = "standard"
    _write(st.config_path, cfg)
    t0 = time.monotonic()
    assert reload_config(st.state)
    # the raised max_inflight admits the waiting requests at once, in their new group
    assert sched.queued == 0 and len(sched.inflight) == 4
    assert time.monotonic() - t0 < 0.1
    assert sched.counters()["alice"] == counters["alice"]
    for r in await asyncio.gather(busy, *waiting):
        assert r.status == 200
        r.release()


async def test_reload_under_load_loses_nothing_and_weight_shift_is_fast(make_stack, http):
    """50 reloads alternating valid and broken files under steady load: zero failed
    requests; a weight change (alice 3 -> 1, bob 1 -> 3) reverses their dispatch shares,
    effective within 1 s of the write."""
    st = await make_stack(max_inflight=2, itl_s=0.002)
    stop, task = await _watching(st.state)
    good = yaml.safe_load(st.config_path.read_text())
    failures = []
    done = asyncio.Event()

    async def client(user: str, headers: dict) -> None:
        while not done.is_set():
            async with http.post(st.proxy_url + "/v1/chat/completions", json=st.chat_body(4, stream=True, tag=user), headers=headers) as r:
                body = await r.read()
                if r.status != 200 or not body.endswith(b"data: [DONE]\n\n"):
                    failures.append((r.status, body[-200:]))

    clients = [asyncio.create_task(client("alice", {"Authorization": "Bearer sk-alice"})) for _ in range(4)]
    clients += [asyncio.create_task(client("bob", {"X-User-Id": "bob"})) for _ in range(4)]
    try:
        for i in range(50):
            if i % 2:
                st.config_path.write_text("groups: [ {name: broken")
            else:
                good["admission"]["queue_timeout_s"] = 10 + i
                _write(st.config_path, good)
            await asyncio.sleep(0.2)  # > the watcher's step (100 ms) + debounce, so each write is its own reload
        before = st.stats.tags[-200:]
        good["groups"][0]["users"][0]["weight"] = 1  # alice
        good["groups"][0]["users"][1]["weight"] = 3  # bob
        t_write = time.monotonic()
        _write(st.config_path, good)
        await wait_until(lambda: st.state.admission.scheduler.policy.users["bob"].weight == 3, timeout=1.0, what="weight applied")
        delay = time.monotonic() - t_write
        mark = len(st.stats.tags)
        await wait_until(lambda: len(st.stats.tags) >= mark + 200, timeout=10, what="200 more dispatches")
        after = st.stats.tags[mark : mark + 200]
    finally:
        done.set()
        await asyncio.wait_for(asyncio.gather(*clients), 30)
        await _stop(stop, task)
    print(f"weight change: write -> applied in {delay * 1000:.0f} ms; bob share {before.count('bob') / len(before):.2f} -> {after.count('bob') / len(after):.2f}")
    assert failures == []
    assert delay < 1.0
    assert before.count("alice") > 2 * before.count("bob")  # 3:1
    assert after.count("bob") > 2 * after.count("alice")  # now 1:3
    assert _reloads(st.state, "error") >= 20 and _reloads(st.state, "ok") >= 20


# ------------------------------------------------------ the real proxy process


def _get_json(url: str, headers: dict | None = None, method: str = "GET") -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _proxy_with_admin(tmp_path):
    """A proxy process on a written config with admin key ``adm-1``, not watching the file:
    ``(config path, config dict, process, base URL, admin auth headers)``. The caller stops
    the process (``tests.proxy_process.stop_proxy``)."""
    from tests.engine_fixture import free_port
    from tests.proxy_process import start_proxy

    path = tmp_path / "config.yaml"
    cfg = base_config("http://127.0.0.1:9")
    cfg["admin"] = {"api_key": "adm-1"}
    _write(path, cfg)
    port = free_port()
    proc = start_proxy(path, port, extra_args=["--no-watch"])
    return path, cfg, proc, f"http://127.0.0.1:{port}", {"Authorization": "Bearer adm-1"}


def test_sighup_and_admin_reload_in_the_proxy_process(tmp_path):
    import signal

    from tests.proxy_process import stop_proxy

    path, cfg, proc, url, auth = _proxy_with_admin(tmp_path)
    try:
        _, first = _get_json(url + "/admin/config", auth)
        cfg["admission"]["max_inflight"] = 3
        _write(path, cfg)
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 5
        while _get_json(url + "/admin/config", auth)[1]["config"]["admission"]["max_inflight"] != 3:
            assert time.monotonic() < deadline, "SIGHUP did not reload"
            time.sleep(0.05)
        path.write_text("admission: {max_inflight: [")
        status, body = _get_json(url + "/admin/reload", auth, method="POST")
        assert status == 400 and "not valid YAML" in body["error"]["message"]
        _, now = _get_json(url + "/admin/config", auth)
        assert now["config"]["admission"]["max_inflight"] == 3 and now["last_error"] and now["hash"] != first["hash"]
        cfg["admission"]["max_inflight"] = 5
        _write(path, cfg)
        status, body = _get_json(url + "/admin/reload", auth, method="POST")
        assert status == 200 and body["status"] == "reloaded"
        assert _get_json(url + "/admin/config", auth)[1]["config"]["admission"]["max_inflight"] == 5
        assert _get_json(url + "/admin/reload", method="POST")[0] == 401
    finally:
        assert stop_proxy(proc) == 0


def test_repeated_keys_and_infinite_weights_are_rejected():
    with pytest.raises(ConfigError, match="appears twice"):
        parse_config("default_group: b\nadmission: {max_inflight: 4}\nadmission: {max_queue: 5}\ngroups: [{name: b}]\n")
    with pytest.raises(ConfigError, match="finite"):
        parse_config("default_group: b\ngroups: [{name: b, users: [{id: x, weight: .inf}]}]\n")
    with pytest.raises(ConfigError, match="not both"):
        parse_config("default_group: b\ngroups: [{name: b, users: [{id: x, api_key: k, api_key_sha256: " + "a" * 64 + "}]}]\n")


async def test_undoing_a_bad_edit_clears_the_error(make_stack):
    st = await make_stack()
    good = st.config_path.read_bytes()
    st.config_path.write_text("groups: [")
    assert reload_config(st.state) is False and st.state.last_error
    st.config_path.write_bytes(good)
    assert reload_config(st.state) is True
    assert st.state.last_error is None


def test_shipped_config_trusts_no_identity_header():
    """Clients could forge a user-id header: only an operator behind a trusted gateway
    should turn it on, so the config `llm-qos up` uses by default does not."""
    assert load_config(REPO / "proxy" / "default_config.yaml").identity.header is None


def _wait_for_log(proc, needle: str, timeout_s: float = 15.0, retry=None) -> str:
    """Wait (bounded) for ``needle`` in the proxy's log; call ``retry()`` every second
    meanwhile, if given (a write the watcher may not have been watching for yet)."""
    deadline = time.monotonic() + timeout_s
    next_retry = time.monotonic() + 1.0
    while needle not in (log := proc.log_path.read_text()):
        assert time.monotonic() < deadline, f"no {needle!r} in the proxy's log:\n{log[-2000:]}"
        if retry is not None and time.monotonic() > next_retry:
            retry()
            next_retry = time.monotonic() + 1.0
        time.sleep(0.05)
    return log


def test_a_fixed_config_logs_one_line_saying_it_is_valid_again(tmp_path):
    """The watcher in a real proxy process: a broken save logs the error, the next good
    save logs once that the config is valid again; later saves log plain reloads."""
    from tests.engine_fixture import free_port
    from tests.proxy_process import start_proxy, stop_proxy

    path = tmp_path / "config.yaml"
    cfg = base_config("http://127.0.0.1:9")
    _write(path, cfg)
    proc = start_proxy(path, free_port())
    try:
        # the watcher registers its inotify watch just after the ready line: rewrite until seen
        path.write_text("admission: {max_inflight: [")
        _wait_for_log(proc, "config reload failed", retry=lambda: path.write_text("admission: {max_inflight: [ "))
        cfg["admission"]["max_inflight"] = 3
        _write(path, cfg)
        log = _wait_for_log(proc, "is valid again")
        assert log.count("is valid again") == 1 and "reloaded (hash" in log
        cfg["admission"]["max_inflight"] = 4
        _write(path, cfg)
        log = _wait_for_log(proc, "config reloaded from")
        assert log.count("is valid again") == 1
    finally:
        assert stop_proxy(proc) == 0


async def test_undoing_a_bad_edit_logs_that_the_config_is_valid_again(make_stack, caplog):
    st = await make_stack()
    good = st.config_path.read_bytes()
    st.config_path.write_text("groups: [")
    with caplog.at_level("INFO", logger="llm_qos.config"):
        assert reload_config(st.state) is False
        st.config_path.write_bytes(good)
        assert reload_config(st.state) is True
        assert reload_config(st.state) is True  # unchanged and still valid: no second line
    lines = [r.getMessage() for r in caplog.records if "valid again" in r.getMessage()]
    assert len(lines) == 1 and "it is the active config" in lines[0]


# ------------------------------------------------------ secrets in config errors

# a user's key in a file an operator broke: a quote left open (YAML syntax error, PyYAML
# quotes the line), a list where a string goes (pydantic's error carries the input)
_BROKEN_WITH_SECRETS = {
    "syntax": ('    api_key: "sk-alice-SECRET}\n', "sk-alice-SECRET", "line 7"),
    "wrong-type": ("    api_key: [sk-bob-SECRET2]\n", "sk-bob-SECRET2", "groups.0.users.0.api_key"),
    "misspelt-key": ("    api_kye: sk-carl-SECRET3\n", "sk-carl-SECRET3", "groups.0.users.0.api_kye"),
    "int-key": ("    api_key: 987654321\n", "987654321", "groups.0.users.0.api_key"),
}


def _broken_text(line: str) -> str:
    return "default_group: bronze\ngroups:\n- name: bronze\n  users:\n  - id: carl\n    weight: 1\n" + line + "  - id: dora\n"


@pytest.mark.parametrize("line,secret,where", _BROKEN_WITH_SECRETS.values(), ids=_BROKEN_WITH_SECRETS.keys())
def test_config_errors_never_quote_a_secret(line, secret, where):
    with pytest.raises(ConfigError) as e:
        parse_config(_broken_text(line), "c.yaml")
    msg = str(e.value)
    assert secret not in msg and where in msg, msg


def test_config_errors_still_quote_plain_values_and_hide_url_passwords():
    cfg = base_config("ftp://user:pw-SECRET4@host:1")
    cfg["groups"][0]["users"][0]["weight"] = "heavy"
    cfg["shared_state"] = {"url": "redis//:pw-SECRET5@redis:6379"}
    with pytest.raises(ConfigError) as e:
        parse_config(yaml.safe_dump(cfg))
    msg = str(e.value)
    assert "'heavy'" in msg and "'ftp://***@host:1'" in msg and "'***@redis:6379'" in msg and "SECRET" not in msg, msg
    with pytest.raises(ConfigError) as e:
        parse_config("default_group: b\ngroups: [{name: b, users: {id: x, api_key: sk-SECRET6}}]\n")
    assert "groups.0.users: Input should be a valid list (got a mapping)" in str(e.value) and "SECRET" not in str(e.value)


@pytest.mark.parametrize("line,secret,where", _BROKEN_WITH_SECRETS.values(), ids=_BROKEN_WITH_SECRETS.keys())
async def test_a_broken_reload_logs_and_shows_no_secret(make_stack, http, monkeypatch, caplog, line, secret, where):
    """The reload path end to end: the ERROR line and ``/admin/config``'s ``last_error``
    name the place (line, or key path) but not the key."""
    st = await make_stack()
    monkeypatch.setenv("LLM_QOS_ADMIN_KEY", "adm-secret")
    st.config_path.write_text(_broken_text(line))
    with caplog.at_level("INFO", logger="llm_qos.config"):
        assert reload_config(st.state) is False
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "llm_qos.config")
    assert "config reload failed" in logged and where in logged and secret not in logged, logged
    async with http.get(st.proxy_url + "/admin/config", headers={"Authorization": "Bearer adm-secret"}) as r:
        body = await r.json()
    assert where in body["last_error"] and secret not in str(body), body["last_error"]


def test_admin_reload_and_check_config_in_processes_show_no_secret(tmp_path):
    """``POST /admin/reload`` in a real proxy process (its stderr log, the 400's message,
    ``/admin/config``) and ``llm-qos check-config``'s output: no key, the line and the path."""
    from tests.proxy_process import stop_proxy

    path, cfg, proc, url, auth = _proxy_with_admin(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        for line, secret, where in _BROKEN_WITH_SECRETS.values():
            path.write_text(_broken_text(line))
            status, body = _get_json(url + "/admin/reload", auth, method="POST")
            assert status == 400 and where in body["error"]["message"] and secret not in str(body)
            _, now = _get_json(url + "/admin/config", auth)
            assert where in now["last_error"] and secret not in str(now)
            ko = subprocess.run([sys.executable, "-m", "proxy", "check-config", str(path)], capture_output=True, text=True, env=env, timeout=60)
            assert ko.returncode == 1 and where in ko.stderr and secret not in ko.stdout + ko.stderr, ko.stderr
        log = _wait_for_log(proc, "groups.0.users.0.api_kye")
        assert log.count("config reload failed") == len(_BROKEN_WITH_SECRETS)
        assert not [s for _, s, _ in _BROKEN_WITH_SECRETS.values() if s in log], log[-3000:]
    finally:
        assert stop_proxy(proc) == 0
