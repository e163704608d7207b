"""The wheel carries what a user needs at runtime; the sdist carries the whole project.

Builds both with ``python -m build`` (the wheel from the sdist, as CI does) into a temporary
directory. ``.ci/check-install.sh`` goes further: it installs the wheel per extra and runs it.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from importlib.resources import files
from pathlib import Path

import pytest
from support import REPO

#: Package data a user needs on an installed host, as paths inside the wheel.
WHEEL_DATA = [
    "gpufleet/sim/fake/data/h100-8gpu-idle.xml",  # the built-in nvidia-smi capture (--nvml.fake=sim)
    "gpufleet/sim/fake/data/NOTICE.md",
    "gpufleet/sim/scenarios/demo.toml",
    "gpufleet/sim/scenarios/clock_stuck_low.toml",
    "gpufleet/dashboards/boards/overview.py",
    "gpufleet/dashboards/json/gpufleet-overview.json",
    "gpufleet/alerts/__init__.py",
    "gpufleet/alerts/gpufleet.rules.yml",
    "gpufleet/alerts/alertmanager.yml",
    "gpufleet/alerts/runbook.md",
    "gpufleet/alerts/tests/gpu.test.yml",
]
#: What the sdist needs beyond the packages: the project as a newcomer runs it.
SDIST_FILES = [
    "pyproject.toml", "README.md", "MANIFEST.in", "alerts/gpufleet.rules.yml", "alerts/tests/gpu.test.yml",
    "packaging/demo.sh", "packaging/systemd/gpufleet-agent.service", "packaging/web-config.yml",
    "tests/run.sh", "tests/conftest.py", "tests/support.py", "tests/fixtures/traces/h100x8-sim.jsonl.gz",
    "tests/fixtures/nvidia-smi/h100-8gpu-idle.xml", ".ci/run", ".ci/check-install.sh",
    "docs/README.md", "docs/metrics.md", "docs/images.md", "packaging/container/Dockerfile",
    "packaging/container/build.sh",
]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(REPO)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # setuptools prints its deprecation and configuration warnings between "!!" lines
    assert "\n!!\n" not in r.stdout + r.stderr, r.stdout + r.stderr
    return out


@pytest.mark.slow
def test_the_wheel_carries_the_runtime_data(dist: Path) -> None:
    (wheel,) = dist.glob("gpufleet-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert [f for f in WHEEL_DATA if f not in names] == []
    scenarios = {n for n in names if n.startswith("gpufleet/sim/scenarios/")}
    assert len(scenarios) == len(list((REPO / "sim/scenarios").glob("*.toml")))
    dashboards = {n for n in names if n.startswith("gpufleet/dashboards/json/")}
    assert len(dashboards) == len(list((REPO / "dashboards/json").glob("*.json")))
    assert not [n for n in names if n.startswith(("tests/", "gpufleet/tests/", "packaging/"))]


@pytest.mark.slow
def test_the_sdist_carries_the_project(dist: Path) -> None:
    (sdist,) = dist.glob("gpufleet-*.tar.gz")
    with tarfile.open(sdist) as tar:
        top = sdist.name.removesuffix(".tar.gz")
        names = {n.removeprefix(top + "/") for n in tar.getnames()}
    assert [f for f in SDIST_FILES if f not in names] == []
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    # build.sh's cached Debian base tarballs (hundreds of MB, there after tests/system/test_images.py) stay out
    assert not [n for n in names if n.startswith("packaging/container/.cache")]


def test_the_alert_rules_are_package_data() -> None:
    """Installed, the rules are found by package, not by a path into a source checkout."""
    root = files("gpufleet.alerts")
    for name in ("gpufleet.rules.yml", "alertmanager.yml", "runbook.md"):
        assert (root / name).read_text(encoding="utf-8") == (REPO / "alerts" / name).read_text(encoding="utf-8")
