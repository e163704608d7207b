"""The container images, built by packaging/container/build.sh and run under podman, as a Kubernetes user runs them.

The build uses the base made from Debian packages (``--base debian``: mmdebstrap, cached in
packaging/container/.cache, so only the first run on a machine pays for it), since CI reaches no
registry. Then:

* both images: numeric non-root user, no pip/ensurepip/setuptools, no compiler, no source tree; the
  agent image without numpy or scikit-learn; sizes printed and within the targets (agent <= 150 MB,
  detector <= 400 MB);
* the agent on a read-only root filesystem: ``once --nvml.fake=sim`` prints an exposition promtool
  accepts; ``serve`` is scraped by a real Prometheus (host network, 127.0.0.1 only), and SIGTERM stops
  it cleanly (exit 0, well before podman's SIGKILL);
* the detector image, also read-only, evaluates against that Prometheus and its /metrics is read; SIGTERM
  stops it cleanly too.

tests/run.sh installs podman, buildah, runc and mmdebstrap from Debian.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import REPO, free_port, need_binary, running, wait_http

# The first test builds the images (build.sh): minutes on a fresh machine, beyond the suite's 300 s default.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

BUILD = REPO / "packaging" / "container" / "build.sh"
TARGET_MB = {"agent": 150, "detector": 400}


def _version() -> str:
    for line in (REPO / "pyproject.toml").read_text().splitlines():
        if line.startswith("version = "):
            return line.split('"')[1]
    raise AssertionError("no version in pyproject.toml")


VERSION = _version()
IMAGES = {name: f"gpufleet-{name}:{VERSION}" for name in TARGET_MB}


@functools.cache
def _podman() -> list[str]:
    """podman, with runc on a cgroup v1/hybrid host (crun fails there), as build.sh picks it."""
    argv = [need_binary("podman")]
    if not Path("/sys/fs/cgroup/cgroup.controllers").exists() and shutil.which("runc"):
        argv += ["--runtime", "runc"]
    return argv


#: podman's default rlimits exceed some hosts' hard limits (issue 22).
LIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096"]


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*_podman(), *args], capture_output=True, text=True, timeout=timeout, check=check)


def run_in(image: str, *args: str, entrypoint: str | None = None, timeout: float = 60) -> str:
    """Run a throw-away container on a read-only root, no network; its stdout."""
    ep = ["--entrypoint", entrypoint] if entrypoint else []
    r = podman("run", "--rm", "--read-only", "--network", "none", *LIMITS, *ep, image, *args,
               timeout=timeout, check=False)
    assert r.returncode == 0, f"{image} {args}: exit {r.returncode}\n{r.stderr[-2000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    need_binary("mmdebstrap")
    need_binary("podman")
    start = time.monotonic()
    r = subprocess.run(["bash", str(BUILD), "--base", "debian", "--engine", "podman"],
                       capture_output=True, text=True, timeout=1200, cwd=REPO)
    assert r.returncode == 0, f"build.sh failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    print(f"\nbuild.sh --base debian: {time.monotonic() - start:.0f} s")
    return IMAGES


def test_script_tags_the_images_the_kubernetes_manifests_name() -> None:
    """build.sh's names (gpufleet-NAME:VERSION) are the ones the kustomize base rewrites, at the package version."""
    import yaml

    for path in (REPO / "packaging/kubernetes/base/kustomization.yaml",
                 REPO / "packaging/kubernetes/overlays/gpu-operator/kustomization.yaml"):
        entries = yaml.safe_load(path.read_text())["images"]
        names = sorted(e["newName"].rsplit("/", 1)[-1] for e in entries)
        assert names == ["gpufleet-agent", "gpufleet-detector"], path
        assert {e["newTag"] for e in entries} == {VERSION}, f"{path}: tags differ from pyproject's {VERSION}"


def test_images_are_small_non_root_and_carry_no_installer(images: dict[str, str]) -> None:
    probe = (
        "import importlib.util as u, os, shutil, sys;"
        "print(os.getuid(), os.getgid());"
        "print(*[m for m in ('pip', 'ensurepip', 'setuptools', 'numpy', 'sklearn') if u.find_spec(m)]);"
        "print(*[c for c in ('gcc', 'cc', 'c++', 'pip', 'pip3', 'apt-get') if shutil.which(c)]);"
        "print(*[p for p in ('/src', '/wheels', '/opt/build') if os.path.exists(p)])"
    )
    for name, image in images.items():
        user = podman("image", "inspect", "--format", "{{.Config.User}}", image).stdout.strip()
        assert user == "65532:65532", f"{image}: user {user!r}"
        ids, modules, binaries, paths = (run_in(image, "-c", probe, entrypoint="python3").splitlines() + [""] * 4)[:4]
        assert ids == "65532 65532", f"{image} runs as {ids}"
        expected = "numpy sklearn" if name == "detector" else ""
        assert modules.strip() == expected, f"{image}: importable {modules!r}"
        assert binaries.strip() == "", f"{image}: carries {binaries}"
        assert paths.strip() == "", f"{image}: build leftovers {paths}"
        size_mb = int(podman("image", "inspect", "--format", "{{.Size}}", image).stdout) / 1e6
        print(f"{image}: {size_mb:.0f} MB (target <= {TARGET_MB[name]} MB)")
        assert size_mb <= TARGET_MB[name], f"{image}: {size_mb:.0f} MB > {TARGET_MB[name]} MB"


def test_agent_once_on_a_read_only_root(images: dict[str, str]) -> None:
    text = run_in(images["agent"], "once", "--nvml.fake=sim")
    families = {f.name for f in text_string_to_metric_families(text)}
    assert "gpufleet_gpu_info" in families, sorted(families)[:20]
    r = subprocess.run([need_binary("promtool"), "check", "metrics"], input=text, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.fixture
def container_names() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for name in names:
        podman("rm", "-f", "-t", "0", name, check=False)


def _detached(names: list[str], image: str, *args: str, volumes: tuple[str, ...] = ()) -> str:
    name = f"gpufleet-test-{uuid.uuid4().hex[:8]}"
    names.append(name)
    vol = [a for v in volumes for a in ("--volume", v)]
    podman("run", "-d", "--name", name, "--read-only", "--network", "host", *LIMITS, *vol, image, *args)
    return name


def test_agent_serves_prometheus_and_the_detector_reads_it(
    images: dict[str, str], tmp_path: Path, container_names: list[str],
) -> None:
    agent_port, prom_port, det_port = free_port(), free_port(), free_port()
    agent = _detached(container_names, images["agent"], "serve", "--nvml.fake=sim",
                      f"--web.listen-address=127.0.0.1:{agent_port}")
    exposition = wait_http(f"http://127.0.0.1:{agent_port}/metrics", timeout=60).text
    r = subprocess.run([need_binary("promtool"), "check", "metrics"], input=exposition, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr

    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"scrape_configs:\n  - job_name: gpufleet-agent\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{agent_port}']\n"
    )
    argv = [need_binary("prometheus"), f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{prom_port}"]
    with running(argv, log=tmp_path / "prometheus.log"):
        prom = f"http://127.0.0.1:{prom_port}"
        wait_http(f"{prom}/-/ready", timeout=60)
        deadline = time.monotonic() + 60
        result: list[object] = []
        while time.monotonic() < deadline and not result:
            q = wait_http(f"{prom}/api/v1/query", params={"query": 'count(gpufleet_gpu_info{job="gpufleet-agent"})'})
            result = q.json()["data"]["result"]
            time.sleep(0.5)
        assert result, "Prometheus never scraped the agent container's GPUs"

        (tmp_path / "detector.toml").write_text(
            f'[detector]\ninterval_seconds = 2\nwindow_seconds = 12\nlisten = "127.0.0.1:{det_port}"\n'
            f'[prometheus]\nurl = "{prom}"\ntimeout_seconds = 5\n'
        )
        os.chmod(tmp_path / "detector.toml", 0o644)
        os.chmod(tmp_path, 0o755)
        detector = _detached(container_names, images["detector"],
                             volumes=(f"{tmp_path / 'detector.toml'}:/etc/gpufleet/detector.toml:ro",))
        deadline = time.monotonic() + 90
        evaluations = 0.0
        while time.monotonic() < deadline and evaluations < 2:
            try:
                text = wait_http(f"http://127.0.0.1:{det_port}/metrics", timeout=5).text
            except TimeoutError:
                time.sleep(1)
                continue
            for family in text_string_to_metric_families(text):
                if family.name == "gpufleet_detector_evaluations":
                    evaluations = sum(s.value for s in family.samples if s.name.endswith("_total"))
            time.sleep(1)
        logs = podman("logs", detector, check=False)
        assert evaluations >= 2, f"the detector container evaluated {evaluations} times:\n{logs.stderr[-2000:]}"
        errors = [f for f in text_string_to_metric_families(text) if f.name == "gpufleet_detector_query_errors"]
        assert sum(s.value for f in errors for s in f.samples if s.name.endswith("_total")) == 0, text

    for what, name in (("agent", agent), ("detector", detector)):
        start = time.monotonic()
        podman("stop", "-t", "20", name, timeout=60)
        stopped_in = time.monotonic() - start
        code = podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip()
        logs = podman("logs", name, check=False)
        assert code == "0", f"the {what} exited {code} on SIGTERM (137: killed):\n{logs.stderr[-2000:]}"
        assert stopped_in < 15, f"the {what} took {stopped_in:.1f} s to stop"
        assert "Traceback" not in logs.stderr, logs.stderr[-2000:]
