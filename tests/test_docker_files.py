"""The container files, checked without a Docker engine: docker-compose.yml against the
Compose Specification's JSON schema (vendored in tests/data), the stack's wiring (GPU
reservation, health-gated start, one published port, the config mounted as a directory, a
``cpu`` profile), and every Dockerfile's COPY sources and base images."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from proxy.config import load_config

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


def _errors(schema: dict, doc: dict) -> list[str]:
    v = jsonschema.Draft7Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in v.iter_errors(doc)]


def test_compose_file_is_valid_against_the_compose_spec(schema, compose):
    assert _errors(schema, compose) == []
    assert _errors(schema, interpolate(compose)) == []  # as compose sees it, defaults applied


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
    assert "profiles" not in engine


def test_proxy_waits_for_a_healthy_engine_publishes_one_port_and_mounts_its_config_dir(compose):
    for proxy, engine, config_file, kind in (
        ("proxy", "engine", "config.yaml", "lightllm"),
        ("proxy-cpu", "engine-cpu", "config.cpu.yaml", "openai"),
    ):
        svc = compose["services"][proxy]
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
        assert cfg.upstream.url == f"http://{engine}:8001"
        assert "healthcheck" in svc


def test_cpu_profile_runs_the_cpu_engine_instead(compose):
    services = compose["services"]
    cpu = {name for name, s in services.items() if "cpu" in s.get("profiles", [])}
    assert cpu == {"engine-cpu", "proxy-cpu"}
    assert all("profiles" not in services[n] for n in ("engine", "proxy"))
    assert "deploy" not in services["engine-cpu"]  # no GPU asked for
    assert "Dockerfile.cpu-engine" in services["engine-cpu"]["build"]["dockerfile"]


def test_every_build_points_at_an_existing_dockerfile(compose):
    for name, svc in compose["services"].items():
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
