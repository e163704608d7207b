"""The README's shell examples work when pasted, and CI runs the Quickstart's commands as written."""

from __future__ import annotations

import re
import socket
import subprocess
import time

import pytest
from support import REPO, free_port

README = (REPO / "README.md").read_text(encoding="utf-8")


def sh_block_after(marker: str) -> str:
    """The first ```sh block after the paragraph that starts with ``marker``."""
    start = README.index(marker)
    m = re.compile(r"^```sh\n(.*?)^```$", re.S | re.M).search(README, start)
    assert m, f"no sh block after {marker!r}"
    return m.group(1)


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_the_single_host_curl_example_works_when_pasted() -> None:
    block = sh_block_after("A single simulated 8x H100 host, to curl")
    assert "--web.listen-address=127.0.0.1:9445 &" in block and "kill $!" in block
    if not (REPO / ".venv" / "bin" / "gpufleet-agent").exists():
        pytest.fail(".venv/bin/gpufleet-agent is missing: run tests/run.sh (or packaging/demo.sh) first")
    port = free_port()
    script = block.replace("9445", str(port))
    started = time.monotonic()
    r = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=90,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines and all("gpufleet_gpu_power_watts" in line for line in lines), r.stdout
    assert sum(line.startswith('gpufleet_gpu_power_watts{gpu="') for line in lines) == 8  # an 8-GPU host
    assert time.monotonic() - started < 60
    # `kill $!` stopped the agent: the port closes (SIGTERM: a clean shutdown within seconds)
    deadline = time.monotonic() + 15
    while port_open(port) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not port_open(port), f"the agent still listens on {port} after the README's kill $!"


def test_ci_runs_the_quickstart_commands_as_the_readme_gives_them() -> None:
    quickstart = sh_block_after("## Quickstart")
    commands = [line.split("#")[0].strip() for line in quickstart.splitlines()]
    assert commands == ["bash packaging/demo.sh", "bash tests/run.sh"]
    # .ci/run reads the same two lines (it does not keep its own copy of them)
    r = subprocess.run(
        ["bash", "-c", "source <(sed -n '/^quickstart() {/,/^}/p' .ci/run); quickstart 1; quickstart 2"],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == commands


def test_the_landing_page_and_the_guide_link_only_to_files_that_exist() -> None:
    """README.md stays a landing page, and every relative link in it and in docs/ resolves (anchors aside)."""
    assert len(README.splitlines()) < 120, "README.md is the landing page: the rest goes to docs/"
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    assert len(pages) > 8
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            path = target.split("#", 1)[0]
            if not path or re.match(r"[a-z]+:", path):
                continue
            resolved = (page.parent / path).resolve()
            if not resolved.exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, broken
    index = (REPO / "docs" / "README.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"\]\(([\w-]+\.md)\)", index))
    assert {p.name for p in pages[1:] if p.name != "README.md"} <= listed, "a guide page missing from the index"
