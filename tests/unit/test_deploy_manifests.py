"""The Kubernetes manifests (deploy/kubernetes): valid against Kubernetes' own schema (strict, by
kubernetes-validate), and consistent with what kunserve needs of them: the front end's --engine-url
names every engine container of the StatefulSet by its pod's DNS name and port, its command and the
engines' kunserve configs parse as kunserve parses them, the engines that may group share a pod's
/dev/shm, one front end, and every readiness probe on /health."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
VERSIONS = ("1.33.0", "1.37.0")   # an older supported release and the newest the validator knows


def _docs() -> dict[str, dict]:
    out = {}
    for f in sorted(DEPLOY.glob("*.yaml")):
        for d in yaml.safe_load_all(f.read_text()):
            out[f"{d['kind']}/{d['metadata']['name']}"] = d
    return out


def test_every_manifest_is_valid_kubernetes():
    docs = _docs()
    assert set(docs) == {"Service/kunserve-engine", "StatefulSet/kunserve-engine", "Service/kunserve",
                         "Deployment/kunserve-frontend"}
    for version in VERSIONS:
        for name, d in docs.items():
            kubernetes_validate.validate(d, version, strict=True)   # raises on any error


def _option(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_the_front_end_fronts_every_engine_container_and_the_configs_parse(monkeypatch):
    from vllm_kunserve.cli import serve
    from vllm_kunserve.config import config_from_additional, parse_kunserve_config

    docs = _docs()
    sts, headless = docs["StatefulSet/kunserve-engine"], docs["Service/kunserve-engine"]
    pod = sts["spec"]["template"]["spec"]
    assert headless["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == headless["metadata"]["name"]
    expected = []
    for i in range(sts["spec"]["replicas"]):
        for c in pod["containers"]:
            port = int(_option(c["command"], "--port"))
            assert port in [p["containerPort"] for p in c["ports"]]
            expected.append(f"http://{sts['metadata']['name']}-{i}.{headless['metadata']['name']}:{port}")
    front = docs["Deployment/kunserve-frontend"]
    assert front["spec"]["replicas"] == 1   # cluster drop: one front end sees every request
    cmd = front["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[:2] == ["kunserve", "serve"]
    assert [cmd[k + 1] for k, a in enumerate(cmd) if a == "--engine-url"] == expected
    monkeypatch.setenv("KUNSERVE_CONTROL_TOKEN", "t")   # from the Secret: --host 0.0.0.0 needs it
    opts, _ = serve.parse(argparse.Namespace(model=cmd[2], rest=cmd[3:]))
    assert opts.instances == len(expected) and opts.host == "0.0.0.0"
    parse_kunserve_config(opts.kunserve_config)
    service_ports = {p["port"] for p in headless["spec"]["ports"]}
    for c in pod["containers"]:
        cfg = config_from_additional(json.loads(_option(c["command"], "--additional-config")))
        assert cfg.drop.group_member and cfg.control.host == "0.0.0.0"
        assert {int(_option(c["command"], "--port")), cfg.control.port} <= service_ports
        assert {"VLLM_PLUGINS", "VLLM_API_KEY", "KUNSERVE_CONTROL_TOKEN"} <= {e["name"] for e in c["env"]}
        shm = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
        vol = next(v for v in pod["volumes"] if v["name"] == shm["name"])
        assert vol["emptyDir"]["medium"] == "Memory"   # one /dev/shm for the pod's engines (the stage link)
        assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": int(_option(c["command"], "--port"))}
    assert front["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/health"
