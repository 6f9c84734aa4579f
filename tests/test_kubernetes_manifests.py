"""deploy/kubernetes/, checked offline: every manifest against the Kubernetes API's own
schemas (kubernetes-validate, strict: unknown fields are errors), pinned to one Kubernetes
version, and the wiring an operator relies on: the proxy's replicas, probes, disruption
budget, config mounted as a directory and valid by the proxy's own loader, the admin key
from a Secret, Redis as configured, the engine's GPU and shared memory."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from proxy.config.loading import parse_config

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
KUBERNETES_VERSION = "1.30"  # the oldest minor release still commonly supported


def _docs() -> list[tuple[str, dict]]:
    out = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


def _one(kind: str, name: str) -> dict:
    (doc,) = [d for _, d in _docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _validate(doc: dict) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_there_are_manifests():
    assert {p.name for p in MANIFESTS} >= {"proxy.yaml", "proxy-config.yaml", "redis.yaml", "engine.yaml"}


@pytest.mark.parametrize("name,doc", _docs(), ids=lambda v: v if isinstance(v, str) else f"{v['kind']}/{v['metadata']['name']}")
def test_manifest_is_valid_against_the_kubernetes_api_schema(name, doc):
    _validate(doc)


def test_the_schema_check_is_not_vacuous():
    dep = copy.deepcopy(_one("Deployment", "llm-qos-proxy"))
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/ready"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(dep)
    dep = copy.deepcopy(_one("Deployment", "llm-qos-proxy"))
    dep["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(dep)


def _labels_match(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_proxy_runs_two_replicas_with_probes_a_budget_and_its_service():
    dep = _one("Deployment", "llm-qos-proxy")
    spec = dep["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["replicas"] >= 2
    assert _labels_match(spec["selector"]["matchLabels"], labels)
    (c,) = spec["template"]["spec"]["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    args = c["args"]
    assert args[args.index("--port") + 1] == "8000" and args[args.index("--host") + 1] == "0.0.0.0"
    # the drain (30 s) and the pre-stop pause fit in the grace period
    assert spec["template"]["spec"]["terminationGracePeriodSeconds"] >= 30 + 5
    pdb = _one("PodDisruptionBudget", "llm-qos-proxy")
    assert _labels_match(pdb["spec"]["selector"]["matchLabels"], labels)
    assert 1 <= pdb["spec"]["minAvailable"] < spec["replicas"]
    svc = _one("Service", "llm-qos")
    assert _labels_match(svc["spec"]["selector"], labels)


def test_proxy_config_is_a_mounted_directory_and_valid_for_the_proxy():
    dep = _one("Deployment", "llm-qos-proxy")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "config"]
    assert "subPath" not in mount, "a subPath mount never sees ConfigMap updates"
    (vol,) = [v for v in pod["volumes"] if v["name"] == "config"]
    cm = _one("ConfigMap", vol["configMap"]["name"])
    args = c["args"]
    path = Path(args[args.index("--config") + 1])
    assert path.parent == Path(mount["mountPath"])
    cfg = parse_config(cm["data"][path.name], "configmap")  # by the proxy's own loader
    engine_svc = _one("Service", "llm-qos-engine")
    assert cfg.upstream.url == f"http://llm-qos-engine:{engine_svc['spec']['ports'][0]['port']}"
    redis_svc = _one("Service", "llm-qos-redis")
    assert cfg.shared_state is not None
    assert cfg.shared_state.url.startswith(f"redis://llm-qos-redis:{redis_svc['spec']['ports'][0]['port']}/")
    # without Redis each replica takes capacity ÷ N, N never below the replicas that run
    assert cfg.shared_state.expected_replicas == dep["spec"]["replicas"]


def test_admin_key_comes_from_a_secret():
    (c,) = _one("Deployment", "llm-qos-proxy")["spec"]["template"]["spec"]["containers"]
    (env,) = [e for e in c["env"] if e["name"] == "LLM_QOS_ADMIN_KEY"]
    assert env["valueFrom"]["secretKeyRef"]["name"] == "llm-qos-admin"


def test_redis_keeps_nothing_and_evicts_nothing():
    dep = _one("Deployment", "llm-qos-redis")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    args = c["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert args[args.index("--appendonly") + 1] == "no" and args[args.index("--save") + 1] == ""
    assert _labels_match(_one("Service", "llm-qos-redis")["spec"]["selector"], dep["spec"]["template"]["metadata"]["labels"])


def test_engine_is_lightllm_on_a_gpu_with_shared_memory_and_a_readiness_probe():
    dep = _one("Deployment", "llm-qos-engine")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "ghcr.io/modeltc/lightllm:v1.2.0"
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    (shm_mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (shm,) = [v for v in pod["volumes"] if v["name"] == shm_mount["name"]]
    assert shm["emptyDir"]["medium"] == "Memory"
    size = shm["emptyDir"]["sizeLimit"]
    assert size.endswith("Gi") and int(size[:-2]) >= 2  # LightLLM asks for at least 2g
    args = c["args"]
    assert args[args.index("--port") + 1] == "8001"
    assert _labels_match(_one("Service", "llm-qos-engine")["spec"]["selector"], dep["spec"]["template"]["metadata"]["labels"])
