"""Every ```sh block in docs/ runs as written, or says in the page why it cannot run here.

A block's first lines may carry a marker, a shell comment the reader sees and this harness reads::

    # doc-test: needs a GPU            (also: needs systemd as PID 1, needs a cluster, needs root, needs a
                                       #  registry, needs your files: the names are placeholders)
    # doc-test: long                   (minutes of CPU: a benchmark or the quality harness; run by hand)
    # doc-test: serves                 (each line is a daemon: started, alive after 3 s, then stopped)

An unmarked block runs with ``bash -euo pipefail`` in a scratch directory that links the repository's top
level (so ``alerts/...``, ``tests/...`` and ``.venv/bin/...`` resolve and nothing lands in the checkout), with
``.venv/bin`` first on PATH as after the README's first command; it must exit 0 within its time.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARK = re.compile(r"^#\s*doc-test:\s*(.+)$")
SKIPS = ("needs ", "long")
TIMEOUT = 180


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    text: str
    marker: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def blocks() -> list[Block]:
    out = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```sh":
                start, body = i + 1, []
                i += 1
                while i < len(lines) and lines[i].strip() != "```":
                    body.append(lines[i])
                    i += 1
                marks = [m.group(1).strip() for ln in body if (m := MARK.match(ln.strip()))]
                out.append(Block(page.name, start, "\n".join(body) + "\n", marks[0] if marks else ""))
            i += 1
    return out


def test_every_marker_is_one_the_harness_knows() -> None:
    for b in blocks():
        assert not b.marker or b.marker.startswith((*SKIPS, "serves")), f"{b.id}: unknown marker {b.marker!r}"


#: Blocks that run here (a floor, raised as pages gain runnable examples; a page that marks a block it could run
#: lowers the count and fails this).
RUNNING_AT_LEAST = 18


def test_the_blocks_that_run_are_not_marked_away() -> None:
    bs = blocks()
    running = [b for b in bs if not b.marker.startswith(SKIPS)]
    assert len(running) >= RUNNING_AT_LEAST, [b.id for b in bs if b not in running]


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A scratch directory linking the repository's top level; removed after the block, with whatever the
    block wrote under /tmp paths it names that did not exist before (recordings are hundreds of MB)."""
    with tempfile.TemporaryDirectory(prefix="gpufleet-doc-") as d:
        for entry in ROOT.iterdir():
            if entry.name != ".git":
                (Path(d) / entry.name).symlink_to(entry)
        yield Path(d)


def _tmp_paths(text: str) -> set[Path]:
    return {Path(m) for m in re.findall(r"/tmp/[A-Za-z0-9_.-]+", text)}


def _env(scratch: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env["TMPDIR"] = str(scratch)
    for k in [k for k in env if k.startswith("GPUFLEET_")]:
        del env[k]
    return env


def _serve_each_line(block: Block, scratch: Path, env: dict[str, str]) -> None:
    for line in (ln.split("  #")[0].strip() for ln in block.text.splitlines()):
        if not line or line.startswith("#"):
            continue
        proc = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=scratch, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            time.sleep(3)
            assert proc.poll() is None, f"{block.id}: {line!r} exited {proc.returncode}: {proc.stderr and proc.stderr.read()}"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("block", blocks(), ids=lambda b: b.id)
def test_the_block_runs_as_written(block: Block, scratch: Path) -> None:
    if block.marker.startswith(SKIPS):
        pytest.skip(f"{block.id}: {block.marker}")
    env = _env(scratch)
    fresh = {p for p in _tmp_paths(block.text) if not p.exists()}
    try:
        if block.marker.startswith("serves"):
            _serve_each_line(block, scratch, env)
            return
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", block.text], cwd=scratch, env=env, capture_output=True,
                           text=True, timeout=TIMEOUT)
    finally:
        for path in fresh:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
    assert r.returncode == 0, f"{block.id} exited {r.returncode}:\n{block.text}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
