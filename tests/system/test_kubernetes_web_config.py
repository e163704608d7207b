"""packaging/kubernetes/components/agent-web-config: TLS and basic auth on the agents without breaking a probe.

Rendered with kubectl kustomize on the gpu-operator overlay; the DaemonSet validates against the Kubernetes
schemas and the ServiceMonitor against the Prometheus Operator's CRD; the agent's own settings resolve the
DaemonSet's environment to the mounted web config; the probes are plain GETs (scheme HTTPS, no headers) of the
paths the server answers without credentials.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]
import yaml
from test_kubernetes import K8S_VERSIONS, KUBE, container, crd_schema, env, one, pod, tool

from gpufleet.agent import settings as agent_settings
from gpufleet.serving.responder import PROBE_PATHS


def test_the_web_config_component(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(KUBE / "overlays" / "gpu-operator", tmp_path)],
        "components": [os.path.relpath(KUBE / "components" / "agent-web-config", tmp_path)]}))
    out = subprocess.run([tool("kubectl"), "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    objs = tuple(d for d in yaml.safe_load_all(out.stdout) if d)
    ds = one(objs, "DaemonSet", "gpufleet-agent")
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(ds, version, strict=True)
    spec = pod(objs, "DaemonSet", "gpufleet-agent")
    c = container(spec)
    values = {k: e["value"] for k, e in env(c).items() if k.startswith("GPUFLEET_")}
    cfg = agent_settings.resolve([], env=values).config
    assert cfg.web_config_file == "/etc/gpufleet/web/web-config.yml"
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/etc/gpufleet/web")
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "gpufleet-agent-web-config" and mount["readOnly"] is True
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = c[probe]["httpGet"]
        assert get["scheme"] == "HTTPS" and get["path"] in PROBE_PATHS and "httpHeaders" not in get
    sm = one(objs, "ServiceMonitor", "gpufleet-agent")
    errors = list(jsonschema.Draft7Validator(crd_schema("ServiceMonitor")).iter_errors(sm))
    assert not errors, errors
    ep = sm["spec"]["endpoints"][0]
    assert ep["scheme"] == "https" and ep["basicAuth"]["password"]["name"] == "gpufleet-agent-scrape"
    assert one(objs, "ServiceMonitor", "gpufleet-detector")["spec"]["endpoints"][0].get("scheme") is None
