"""packaging/container/podman-run.sh: the container examples run as written on this host, whatever its cgroups
and limits (on a cgroup v1/hybrid host with low hard limits a plain `podman run` fails with "error setting rlimit
type 7", rc 126). A one-binary image (Debian's busybox-static, `podman import`) stands in for the agent's, so
no image build is needed; tests/system/test_images.py runs the real images."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import REPO, need_binary

SCRIPT = REPO / "packaging" / "container" / "podman-run.sh"


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    podman = need_binary("podman")
    busybox = shutil.which("busybox")
    if not busybox:
        pytest.skip("needs busybox (apt-get install busybox-static; tests/run.sh installs it)")
    tar = tmp_path_factory.mktemp("img") / "rootfs.tar"
    with tarfile.open(tar, "w") as t:
        t.add(busybox, arcname="bin/busybox")
    name = f"localhost/gpufleet-test-busybox:{uuid.uuid4().hex[:8]}"
    subprocess.run([podman, "import", "-q", str(tar), name], check=True, capture_output=True, timeout=120)
    try:
        yield name
    finally:
        subprocess.run([podman, "rmi", "-f", name], capture_output=True, timeout=120)


@pytest.mark.slow
def test_the_wrapper_runs_a_read_only_container_here(image: str) -> None:
    plain = subprocess.run(["podman", "run", "--rm", "--read-only", image, "/bin/busybox", "echo", "up"],
                           capture_output=True, text=True, timeout=120)
    explain = subprocess.run(["bash", str(SCRIPT), "--explain"], capture_output=True, text=True, timeout=30,
                             check=True).stdout
    if "rlimit type 7" in plain.stderr:  # this host needs the flag: the wrapper must say so and add it
        assert "--ulimit nofile=1024:1024" in explain and "rlimit type 7" in explain
    r = subprocess.run(["bash", str(SCRIPT), "--rm", "--read-only", image, "/bin/busybox", "echo", "up"],
                       capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout) == (0, "up\n"), r.stderr
    if plain.returncode == 0:
        assert plain.stdout == "up\n"


def test_explain_names_the_host_it_sees() -> None:
    need_binary("podman")
    out = subprocess.run(["bash", str(SCRIPT), "--explain"], capture_output=True, text=True, timeout=30,
                         check=True).stdout
    first, *reasons = out.splitlines()
    assert first.startswith("podman ") and first.endswith(" ...")
    v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    assert ("cgroup v1/hybrid" in out) != v2
    assert reasons, out
