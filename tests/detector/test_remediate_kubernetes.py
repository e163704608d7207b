"""The Kubernetes half of the remediation service against an API server speaking the real PATCH contract.

No Kubernetes API server can be run here (Debian has etcd but no kube-apiserver; PyPI has none), so the test
serves a small one on 127.0.0.1 that does what the real one does with these requests: bearer-token
authentication, ``application/merge-patch+json`` on a node (RFC 7386: objects merged, lists replaced, null
deletes; a stale ``metadata.resourceVersion`` is a 409 Conflict), ``application/strategic-merge-patch+json`` on
its ``/status`` (conditions merged by ``type``), 415 for any other patch type. The decisions are the same tested
guard rails as Slurm's (test_remediate_policy.py).
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from gpufleet.detector.remediate.backends import CONDITION, TAINT_KEY, BackendError, Kubernetes

TOKEN = "s3cr3t-service-account-token"


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


class FakeApiServer:
    def __init__(self) -> None:
        self.nodes: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str, str]] = []
        self.version = 100

    def add(self, name: str, **spec: Any) -> None:
        self.version += 1
        self.nodes[name] = {"kind": "Node", "apiVersion": "v1",
                            "metadata": {"name": name, "resourceVersion": str(self.version), "annotations": {}},
                            "spec": dict(spec), "status": {"conditions": [{"type": "Ready", "status": "True"}]}}

    def handle(self, method: str, path: str, headers: Any, body: bytes) -> tuple[int, Any]:
        self.requests.append((method, path, headers.get("Content-Type", "")))
        if headers.get("Authorization") != f"Bearer {TOKEN}":
            return 401, {"kind": "Status", "status": "Failure", "reason": "Unauthorized", "code": 401}
        parts = path.strip("/").split("/")
        if parts[:3] != ["api", "v1", "nodes"]:
            return 404, {"kind": "Status", "code": 404}
        if len(parts) == 3 and method == "GET":
            return 200, {"kind": "NodeList", "items": list(self.nodes.values())}
        node = self.nodes.get(parts[3]) if len(parts) > 3 else None
        if node is None:
            return 404, {"kind": "Status", "reason": "NotFound", "code": 404}
        if method == "GET" and len(parts) == 4:
            return 200, node
        if method != "PATCH":
            return 405, {"kind": "Status", "code": 405}
        patch = json.loads(body)
        ctype = headers.get("Content-Type", "")
        if len(parts) == 5 and parts[4] == "status":
            if ctype != "application/strategic-merge-patch+json":
                return 415, {"kind": "Status", "code": 415}
            conds = {c["type"]: c for c in node["status"].get("conditions", [])}
            for c in patch.get("status", {}).get("conditions", []):
                conds[c["type"]] = {**conds.get(c["type"], {}), **c}
            node["status"]["conditions"] = list(conds.values())
        else:
            if ctype != "application/merge-patch+json":
                return 415, {"kind": "Status", "code": 415}
            rv = (patch.get("metadata") or {}).get("resourceVersion")
            if rv is not None and rv != node["metadata"]["resourceVersion"]:
                return 409, {"kind": "Status", "reason": "Conflict", "code": 409}
            node = merge_patch(node, patch)
        self.version += 1
        node["metadata"]["resourceVersion"] = str(self.version)
        self.nodes[parts[3]] = node
        return 200, node


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[FakeApiServer, Kubernetes]]:
    fake = FakeApiServer()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_: object) -> None:
            pass

        def _do(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, doc = fake.handle(self.command, self.path, self.headers, body)
            out = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        do_GET = do_PATCH = _do

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    try:
        yield fake, Kubernetes(f"http://127.0.0.1:{server.server_address[1]}", str(token), timeout=5.0)
    finally:
        server.shutdown()
        server.server_close()


def test_cordon_taint_condition_and_uncordon(api: tuple[FakeApiServer, Kubernetes]) -> None:
    fake, k8s = api
    other_taint = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    fake.add("gpu-07", taints=[other_taint])
    fake.add("gpu-08")
    assert not k8s.state("gpu-07").fenced
    k8s.fence("gpu-07", "abc123def456", "train", "straggler", "GPU 2 is a straggler (clock)")
    node = fake.nodes["gpu-07"]
    assert node["spec"]["unschedulable"] is True
    assert node["spec"]["taints"] == [other_taint, {"key": TAINT_KEY, "value": "straggler", "effect": "NoSchedule"}]
    cond = {c["type"]: c for c in node["status"]["conditions"]}
    assert cond[CONDITION]["status"] == "True" and "abc123def456" in cond[CONDITION]["message"]
    assert cond["Ready"]["status"] == "True"  # merged by type, not replaced
    st = k8s.state("gpu-07")
    assert (st.fenced, st.ours, st.incident, st.job) == (True, True, "abc123def456", "train")
    assert [s.node for s in k8s.fenced()] == ["gpu-07"]
    patches = [(p, c) for m, p, c in fake.requests if m == "PATCH"]
    assert patches == [("/api/v1/nodes/gpu-07", "application/merge-patch+json"),
                       ("/api/v1/nodes/gpu-07/status", "application/strategic-merge-patch+json")]
    k8s.resume("gpu-07")
    node = fake.nodes["gpu-07"]
    assert "unschedulable" not in node["spec"] and node["spec"]["taints"] == [other_taint]
    assert not node["metadata"]["annotations"]
    assert {c["type"]: c for c in node["status"]["conditions"]}[CONDITION]["status"] == "False"
    assert not k8s.state("gpu-07").fenced and k8s.fenced() == []


def test_someone_elses_cordon_is_not_ours(api: tuple[FakeApiServer, Kubernetes]) -> None:
    fake, k8s = api
    fake.add("gpu-09", unschedulable=True)
    st = k8s.state("gpu-09")
    assert st.fenced and not st.ours and k8s.fenced() == []


def test_api_errors_are_one_line_backend_errors(api: tuple[FakeApiServer, Kubernetes], tmp_path: Path) -> None:
    fake, k8s = api
    fake.add("gpu-10")
    with pytest.raises(BackendError, match="HTTP 404"):
        k8s.state("gpu-99")
    orig = fake.handle

    def racing(method: str, path: str, headers: Any, body: bytes) -> tuple[int, Any]:
        if method == "PATCH" and not path.endswith("/status"):  # someone changed the node since our GET
            fake.nodes["gpu-10"] = copy.deepcopy(fake.nodes["gpu-10"])
            fake.version += 1
            fake.nodes["gpu-10"]["metadata"]["resourceVersion"] = str(fake.version)
        return orig(method, path, headers, body)

    fake.handle = racing  # type: ignore[method-assign]
    with pytest.raises(BackendError, match="HTTP 409"):
        k8s.fence("gpu-10", "abc", "", "straggler", "x")
    assert "unschedulable" not in fake.nodes["gpu-10"]["spec"]
    fake.handle = orig  # type: ignore[method-assign]
    (tmp_path / "token").write_text("wrong\n")
    with pytest.raises(BackendError, match="HTTP 401"):
        k8s.state("gpu-10")
    (tmp_path / "token").unlink()
    with pytest.raises(BackendError, match="service-account token"):
        k8s.state("gpu-10")
