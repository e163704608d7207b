"""With basic auth on, the probes answer a plain GET as a kubelet sends it; everything else still needs credentials.

The server both daemons use (serving): the detector's exposer has a readiness state (not ready until its
state is rebuilt), the agent's has none; both are served here through a real listening socket.
"""

from __future__ import annotations

import base64

import bcrypt
import pytest
import requests
from test_web_abuse import Static, serving

from gpufleet.serving.responder import PROBE_PATHS
from gpufleet.serving.server import MetricsServer
from gpufleet.serving.webconfig import parse_web_config

HASH = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
AUTH = "Basic " + base64.b64encode(b"prometheus:s3cret").decode()


class Warming(Static):
    """A detector rebuilding its state: degraded health, not ready."""

    def health(self) -> str:
        return "degraded: node-007 GPU 3 unreadable"

    def ready(self) -> str:
        return "rebuilding state from Prometheus (12/40 queries)"


@pytest.mark.parametrize(("exposer", "health", "ready"), [(Static(), "OK\n", (200, "ready\n")),
                                                           (Warming(), "DEGRADED\n", (503, "not ready\n"))])
def test_probes_without_credentials_and_metrics_with(exposer: Static, health: str, ready: tuple[int, str]) -> None:
    web = parse_web_config(f"basic_auth_users:\n  prometheus: '{HASH}'\n")
    assert {"/health", "/ready"} == PROBE_PATHS
    server = MetricsServer("127.0.0.1:0", exposer, web)
    server.serve_in_thread()
    try:
        base = f"http://127.0.0.1:{server.port}"
        h = requests.get(base + "/health", timeout=10)  # the kubelet's livenessProbe: httpGet, no credentials
        assert (h.status_code, h.text) == (200, health)  # the verdict only: the reasons name hardware
        r = requests.get(base + "/ready", timeout=10)
        assert (r.status_code, r.text) == ready
        for path in ("/metrics", "/", "/health/", "/readyz"):
            assert requests.get(base + path, timeout=10).status_code == 401, path
        ok = requests.get(base + "/metrics", headers={"Authorization": AUTH}, timeout=10)
        assert ok.status_code == 200 and "up 1" in ok.text
    finally:
        server.shutdown()
        server.server_close()


def test_without_auth_the_probes_keep_their_details() -> None:
    with serving(None) as server:
        h = requests.get(f"http://127.0.0.1:{server.port}/health", timeout=10)
        assert h.text == "OK\nnvml: up\n"


def test_the_manifests_probe_only_paths_that_answer_without_credentials() -> None:
    """The DaemonSet's and the Deployment's probes (plain httpGet, no headers) hit PROBE_PATHS, so a web config
    with basic auth never fails them."""
    import yaml
    from support import REPO

    probes = []
    for name in ("agent-daemonset.yaml", "detector-deployment.yaml"):
        doc = yaml.safe_load((REPO / "packaging/kubernetes/base" / name).read_text())
        for c in doc["spec"]["template"]["spec"]["containers"]:
            probes += [c[k]["httpGet"] for k in ("startupProbe", "livenessProbe", "readinessProbe") if k in c]
    assert len(probes) == 5
    for get in probes:
        assert get["path"] in PROBE_PATHS and "httpHeaders" not in get, get
