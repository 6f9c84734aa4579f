"""Engine supervision faults found by review, each reproduced with real processes: the fake
engine of tests/fake_engine.py stands in for LightLLM behind the real launcher
(``python -m engine_server --backend lightllm`` with ``LLM_QOS_LIGHTLLM_PYTHON`` pointing at
it) and behind ``llm-qos up``. Every wait is bounded."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import select
import signal
import socket
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from engine_server.readiness import LightLLMProbe, wait_ready
from engine_server.supervisor import EXIT_GAVE_UP, RestartPolicy, Supervisor
from tests.fake_engine import starts, write_fake_python
from tests.proc_util import die_with_parent, free_port, wait_for_line
from tests.proxy_process import REPO_ROOT

READY = "engine ready at "


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers kill(0): it is gone for our purpose once it has exited
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def _wait_gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return False


def _env(tmp_path: Path, **fake: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["LLM_QOS_LIGHTLLM_PYTHON"] = str(write_fake_python(tmp_path))
    env["FAKE_ENGINE_LOG"] = str(tmp_path / "starts.jsonl")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(fake)
    return env


def _launcher(tmp_path: Path, port: int, *extra: str, preexec=die_with_parent, **fake: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "engine_server", "--backend", "lightllm", "--host", "127.0.0.1",
           "--port", str(port), "--model", str(tmp_path / "model"), "--grace", "5", *extra]
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=_env(tmp_path, **fake), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=open(tmp_path / "launcher.log", "w"), text=True,
                            preexec_fn=preexec)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def _log(tmp_path: Path) -> str:
    return (tmp_path / "launcher.log").read_text(errors="replace")


# ------------------------------------------------- crash window counted from readiness


def test_engine_crashing_while_loading_longer_than_the_window_hits_the_limit(tmp_path):
    """Each load takes 0.6 s, longer than the 0.3 s crash window, and ends in a crash: the
    supervisor must still give up at the limit (it restarted forever when it counted
    up-time from the start) and keep doubling its backoff."""
    port = free_port()
    env = _env(tmp_path, FAKE_ENGINE_LOAD_S="0.6", FAKE_ENGINE_CRASH_CODE="3")
    argv = [env["LLM_QOS_LIGHTLLM_PYTHON"], "-m", "lightllm.server.api_server", "--port", str(port)]
    policy = RestartPolicy(initial_backoff_s=0.05, max_backoff_s=1.0, crash_limit=3, crash_window_s=0.3, grace_s=2)
    sup = Supervisor(argv, env=env, probe=LightLLMProbe(f"http://127.0.0.1:{port}"), ready_timeout_s=30, policy=policy)
    assert asyncio.run(asyncio.wait_for(sup.run(), 40)) == EXIT_GAVE_UP
    assert sup.stats.starts == 3 and sup.stats.exit_codes == [3, 3, 3]
    assert sup.stats.backoffs == [0.05, 0.1]  # never reset: no child was ever ready
    assert len(starts(tmp_path / "starts.jsonl")) == 3


def test_a_child_ready_for_the_window_starts_a_fresh_count(tmp_path):
    """The other side of the rule: crashes of children that had been ready for the window
    never add up, and the backoff starts again at its initial value."""
    child = [sys.executable, "-c", "import sys, time; time.sleep(0.4); sys.exit(5)"]  # ready at once, up 0.4 s
    sup: Supervisor

    def on_ready(_took: float) -> None:
        if sup.stats.starts == 4:
            sup.request_stop()

    sup = Supervisor(child, policy=RestartPolicy(initial_backoff_s=0.05, max_backoff_s=1, crash_limit=2,
                                                 crash_window_s=0.2, grace_s=2), on_ready=on_ready)
    assert asyncio.run(asyncio.wait_for(sup.run(), 30)) == 0
    assert sup.stats.starts == 4 and sup.stats.exit_codes == [5, 5, 5]
    assert sup.stats.backoffs == [0.05, 0.05, 0.05]


def test_a_zero_window_still_counts_crashes_before_readiness(tmp_path):
    port = free_port()
    env = _env(tmp_path, FAKE_ENGINE_CRASH_CODE="3")
    argv = [env["LLM_QOS_LIGHTLLM_PYTHON"], "-m", "lightllm.server.api_server", "--port", str(port)]
    policy = RestartPolicy(initial_backoff_s=0.05, max_backoff_s=1.0, crash_limit=2, crash_window_s=0.0, grace_s=2)
    sup = Supervisor(argv, env=env, probe=LightLLMProbe(f"http://127.0.0.1:{port}"), ready_timeout_s=30, policy=policy)
    assert asyncio.run(asyncio.wait_for(sup.run(), 30)) == EXIT_GAVE_UP
    assert sup.stats.starts == 2


def test_engine_command_takes_the_crash_limit_and_window(tmp_path):
    t0 = time.monotonic()
    proc = _launcher(tmp_path, free_port(), "--crash-limit", "2", "--crash-window", "0.2",
                     FAKE_ENGINE_LOAD_S="0.5", FAKE_ENGINE_CRASH_CODE="3")
    try:
        assert proc.wait(60) == EXIT_GAVE_UP, _log(tmp_path)
    finally:
        _stop(proc)
    assert len(starts(tmp_path / "starts.jsonl")) == 2
    assert "giving up after 2 crashes in a row" in _log(tmp_path)
    assert time.monotonic() - t0 < 60


def test_engine_command_rejects_a_bad_crash_limit(tmp_path):
    proc = _launcher(tmp_path, free_port(), "--crash-limit", "0")
    try:
        assert proc.wait(30) == 2
    finally:
        _stop(proc)
    assert "--crash-limit" in _log(tmp_path)


def test_up_passes_the_crash_limit_to_the_engine_and_fails_when_it_gives_up(tmp_path):
    cmd = [sys.executable, "-m", "proxy", "up", "--backend", "lightllm", "--model", str(tmp_path / "model"),
           "--port", str(free_port()), "--engine-port", str(free_port()), "--crash-limit", "2", "--crash-window", "0.2"]
    env = _env(tmp_path, FAKE_ENGINE_LOAD_S="0.5", FAKE_ENGINE_CRASH_CODE="3")
    out = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=90, preexec_fn=die_with_parent)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "the engine exited with status 3 before it was ready" in out.stderr
    assert len(starts(tmp_path / "starts.jsonl")) == 2


def _start_up(tmp_path, *extra: str) -> tuple[subprocess.Popen, int]:
    """``llm-qos up`` over the fake LightLLM engine, once its proxy answers ``/health``:
    ``(process, proxy port)``. The caller stops the process."""
    proxy_port = free_port()
    cmd = [sys.executable, "-m", "proxy", "up", "--backend", "lightllm", "--model", str(tmp_path / "model"),
           "--port", str(proxy_port), "--engine-port", str(free_port()), *extra]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=_env(tmp_path), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=open(tmp_path / "launcher.log", "w"), text=True, preexec_fn=die_with_parent)
    try:
        wait_for_line(proc, "llm-qos up: starting the proxy", 60, "up", lambda: _log(tmp_path))
        deadline = time.monotonic() + 30
        while not _http_ok(f"http://127.0.0.1:{proxy_port}/health"):
            assert time.monotonic() < deadline, "the proxy never answered /health"
            time.sleep(0.2)
    except BaseException:
        _stop(proc)
        raise
    return proc, proxy_port


def test_up_names_the_process_that_exited_and_its_status(tmp_path):
    """The engine gives up after it was ready (here: one crash with --crash-limit 1): ``up``
    says which process ended and how, then stops the proxy."""
    proc, proxy_port = _start_up(tmp_path, "--crash-limit", "1")
    try:
        (engine,) = starts(tmp_path / "starts.jsonl")
        os.kill(engine["pid"], signal.SIGKILL)
        assert proc.wait(60) == 1, _log(tmp_path)
        assert ("llm-qos up: the engine exited with status 3 (its supervisor gave up after repeated crashes, "
                "see --crash-limit); stopping the proxy") in _log(tmp_path)
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", proxy_port)) != 0, "the proxy outlived llm-qos up"
    finally:
        _stop(proc)


# ------------------------------------------------------------------------ SIGHUP


def test_sighup_to_the_engine_command_stops_the_engine_too(tmp_path):
    proc = _launcher(tmp_path, free_port())
    try:
        wait_for_line(proc, READY, 60, "launcher", lambda: _log(tmp_path))
        (engine,) = starts(tmp_path / "starts.jsonl")
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(20) == 0, _log(tmp_path)
        assert _wait_gone(engine["pid"]), "the engine outlived its launcher"
    finally:
        _stop(proc)


def _ignore_sighup() -> None:
    die_with_parent()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what nohup does


def test_under_nohup_sighup_is_ignored_by_the_launcher_and_the_engine(tmp_path):
    port = free_port()
    proc = _launcher(tmp_path, port, preexec=_ignore_sighup)
    try:
        wait_for_line(proc, READY, 60, "launcher", lambda: _log(tmp_path))
        (engine,) = starts(tmp_path / "starts.jsonl")
        proc.send_signal(signal.SIGHUP)  # the engine, in a session of its own, gets no hang-up
        time.sleep(1.0)
        assert proc.poll() is None and not _gone(engine["pid"])

        async def probe() -> None:
            await wait_ready(LightLLMProbe(f"http://127.0.0.1:{port}"), deadline_s=10)

        asyncio.run(probe())  # still serving
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert _wait_gone(engine["pid"])
    finally:
        _stop(proc)


def _http_ok(url: str) -> bool:
    async def get() -> bool:
        try:
            async with aiohttp.ClientSession() as s, s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    return asyncio.run(get())


def test_sighup_to_up_stops_the_proxy_and_the_engine(tmp_path):
    proc, proxy_port = _start_up(tmp_path)
    try:
        (engine,) = starts(tmp_path / "starts.jsonl")
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(60) == 0, _log(tmp_path)
        assert _wait_gone(engine["pid"]), "the engine outlived llm-qos up"
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", proxy_port)) != 0, "the proxy outlived llm-qos up"
    finally:
        _stop(proc)


def _on_a_terminal_of_its_own(slave: int):
    """``preexec_fn``: the child leads a new session whose controlling terminal is the pty
    ``slave`` (as a shell's job on a terminal), so closing the master hangs it up."""

    def setup() -> None:
        die_with_parent()
        os.setsid()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)

    return setup


class _Terminal:
    """The master side of a pty, read in a thread (a full pty buffer would block the
    writer); :meth:`hang_up` closes it, as a closed terminal window does."""

    def __init__(self, master: int) -> None:
        self.master = master
        self.text = ""
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while not self._closing.is_set():
            ready, _, _ = select.select([self.master], [], [], 0.05)
            if not ready:
                continue
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: no process holds the slave open any more
                return
            if not chunk:
                return
            self.text += chunk.decode(errors="replace")

    def wait_for(self, marker: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while marker not in self.text:
            assert time.monotonic() < deadline, f"no {marker!r} on the terminal:\n{self.text[-3000:]}"
            time.sleep(0.05)

    def hang_up(self) -> None:
        self._closing.set()
        self._thread.join(5)
        os.close(self.master)


def test_up_on_a_terminal_that_hangs_up_stops_the_proxy_and_the_engine(tmp_path):
    """A closed terminal: every write of ``up`` to it fails with EIO from then on, and
    SIGHUP arrives. ``up`` used to print "stopping the proxy" before signalling it, so the
    write's OSError left its clean-up before any kill, and the proxy and the engine (in
    sessions of their own) lived on."""
    proxy_port = free_port()
    cmd = [sys.executable, "-m", "proxy", "up", "--backend", "lightllm", "--model", str(tmp_path / "model"),
           "--port", str(proxy_port), "--engine-port", str(free_port())]
    master, slave = os.openpty()
    try:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=_env(tmp_path), stdin=slave, stdout=slave, stderr=slave,
                                preexec_fn=_on_a_terminal_of_its_own(slave))
    finally:
        os.close(slave)
    term = _Terminal(master)
    try:
        term.wait_for("llm-qos up: starting the proxy", 60)
        deadline = time.monotonic() + 30
        while not _http_ok(f"http://127.0.0.1:{proxy_port}/health"):
            assert time.monotonic() < deadline, "the proxy never answered /health"
            time.sleep(0.2)
        (engine,) = starts(tmp_path / "starts.jsonl")
        term.hang_up()  # the kernel sends SIGHUP to the session's leader, ``up``
        proc.send_signal(signal.SIGHUP)  # and again, in case this kernel did not
        try:
            assert proc.wait(60) == 0  # a stop asked for, not a failure (no exit 120 from a failed final flush)
        except subprocess.TimeoutExpired:
            pytest.fail("llm-qos up did not exit after its terminal hung up")
        assert _wait_gone(engine["pid"], 30), "the engine outlived llm-qos up"
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", proxy_port)) != 0:
                    break
            assert time.monotonic() < deadline, "the proxy outlived llm-qos up"
            time.sleep(0.1)
    finally:
        if not term._closing.is_set():
            term.hang_up()
        _stop(proc)
        for pid in _started_by_this_test(tmp_path):  # what would be orphans should it fail
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _started_by_this_test(tmp_path: Path) -> list[int]:
    """Pids of the live processes whose environment names this test's fake-engine log:
    ``up``, the proxy, the engine launcher and the fake engine all inherit it."""
    mark = f"FAKE_ENGINE_LOG={tmp_path / 'starts.jsonl'}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


# ------------------------------------------------------------------- readiness


class _ImpatientProbe(LightLLMProbe):
    """LightLLM's probe with a short timeout of aiohttp's own (aiohttp's default is 300 s)."""

    async def __call__(self, session: aiohttp.ClientSession) -> None:
        body = {"inputs": "a", "parameters": {"max_new_tokens": 1}}
        async with session.post(f"{self.base_url}/generate", json=body, timeout=aiohttp.ClientTimeout(total=0.5)) as r:
            assert r.status == 200
            await r.read()


@pytest.fixture
def hanging_engine(tmp_path):
    """A fake engine on a free port whose first two ``/generate`` requests never get an answer."""
    port = free_port()
    env = _env(tmp_path, FAKE_ENGINE_HANG_FIRST="2")
    proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "tests" / "fake_engine.py"), "--port", str(port)],
                            env=env, preexec_fn=die_with_parent)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(10)


def test_one_timed_out_probe_does_not_end_readiness(hanging_engine):
    """A probe attempt that times out (here by aiohttp's own timeout) while most of the
    deadline is left is retried; it used to end readiness at once."""

    async def go() -> float:
        t0 = time.monotonic()
        await wait_ready(_ImpatientProbe(hanging_engine), deadline_s=30, initial_delay_s=0.05)
        return time.monotonic() - t0

    assert asyncio.run(go()) < 25


def test_an_attempt_without_an_answer_is_abandoned_and_retried(hanging_engine):
    async def go() -> None:
        await wait_ready(LightLLMProbe(hanging_engine), deadline_s=30, initial_delay_s=0.05, attempt_timeout_s=0.3)

    asyncio.run(go())  # attempts of 0.3 s and 0.6 s hang, the third is answered


def test_readiness_ends_at_the_deadline_not_before(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "tests" / "fake_engine.py"), "--port", str(port)],
                            env=_env(tmp_path, FAKE_ENGINE_HANG_FIRST="1000"), preexec_fn=die_with_parent)
    try:
        async def go() -> float:
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match="not ready in time"):
                await wait_ready(LightLLMProbe(f"http://127.0.0.1:{port}"), deadline_s=2.0, attempt_timeout_s=0.2)
            return time.monotonic() - t0

        assert 1.9 <= asyncio.run(go()) < 10
    finally:
        proc.kill()
        proc.wait(10)


# ------------------------------------------------------------------- NCCL port


def test_nccl_port_left_to_lightllm_unless_given(tmp_path):
    nccl = free_port()
    proc = _launcher(tmp_path, free_port(), "--nccl-port", str(nccl))
    try:
        wait_for_line(proc, READY, 60, "launcher", lambda: _log(tmp_path))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    (first,) = starts(tmp_path / "starts.jsonl")
    argv = first["argv"]
    assert argv[argv.index("--nccl_port") + 1] == str(nccl)


def test_busy_nccl_port_fails_at_once_with_a_clear_message(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        proc = _launcher(tmp_path, free_port(), "--nccl-port", str(busy.getsockname()[1]))
        try:
            assert proc.wait(30) == 2
        finally:
            _stop(proc)
    assert "already in use" in _log(tmp_path)
    assert starts(tmp_path / "starts.jsonl") == []  # nothing was started
