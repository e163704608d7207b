"""Golden exposition: `gpufleet-agent once` on a recorded trace must match a committed file byte for byte.

The input is deterministic: the recorded 8-GPU H100 trace
(``tests/fixtures/traces/h100x8-sim.jsonl.gz``) pinned at its sample line 5 with the
``trace:PATH@N`` spec, so the wall clock does not matter; the real H100 InfiniBand sysfs
capture as ``--path.sysfs``; and a job mapping directory written by the test. The host
collector (live psutil) is off; Ethernet counters (psutil, host-dependent) are dropped and
collector durations and interpreter versions are masked before comparing.

To regenerate the golden file after an intended change of the exposition::

    GPUFLEET_UPDATE_GOLDEN=1 .venv/bin/pytest tests/agent/test_golden_exposition.py

then review ``git diff tests/fixtures/golden/agent-h100x8.prom`` before committing it.
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess
from pathlib import Path

import pytest
from support import BIN, FIXTURES

TRACE = FIXTURES / "traces" / "h100x8-sim.jsonl.gz"
GOLDEN = FIXTURES / "golden" / "agent-h100x8.prom"
PIN = 5
UPDATE = os.environ.get("GPUFLEET_UPDATE_GOLDEN", "") not in ("", "0")

_MASKS = (
    (re.compile(r'^(gpufleet_scrape_collector_duration_seconds\{collector="[a-z]+"\}) \S+$', re.M), r"\1 <duration>"),
    (re.compile(r'python_version="[^"]*"'), 'python_version="<python>"'),
    (re.compile(r'nvml_binding_version="[^"]*"'), 'nvml_binding_version="<binding>"'),
)


def normalize(text: str) -> str:
    lines = [ln for ln in text.splitlines() if not ln.startswith("gpufleet_net_")]
    out = "\n".join(lines) + "\n"
    for pattern, repl in _MASKS:
        out = pattern.sub(repl, out)
    return out


def exposition(tmp_path: Path) -> str:
    root = tmp_path / "sys"
    (root / "class").mkdir(parents=True)
    (root / "class" / "infiniband").symlink_to(FIXTURES / "sysfs-infiniband-h100")
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    for gpu in range(8):
        (jobs / str(gpu)).write_text("llm-pretrain-0042\n" if gpu < 6 else "eval-0007\n")
    # pressure stall information of the host and of one job's cgroup (fixed, not the real /proc)
    psi = "some avg10=1.00 avg60=0.50 avg300=0.25 total=12345678\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=2500\n"
    (tmp_path / "proc" / "pressure").mkdir(parents=True)
    job_cg = tmp_path / "cgroup" / "system.slice" / "slurmstepd.scope" / "job_llm-pretrain-0042"
    job_cg.mkdir(parents=True)
    for resource in ("cpu", "memory", "io"):
        (tmp_path / "proc" / "pressure" / resource).write_text(psi)
        (job_cg / f"{resource}.pressure").write_text(psi)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    r = subprocess.run(
        [str(BIN / "gpufleet-agent"), "once", f"--nvml.fake=trace:{TRACE}@{PIN}", "--no-collector.host",
         f"--path.sysfs={root}", f"--collector.jobs.mapping-dir={jobs}", f"--path.procfs={tmp_path / 'proc'}",
         f"--path.cgroupfs={tmp_path / 'cgroup'}"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert r.returncode == 0, r.stderr
    return normalize(r.stdout)


def test_golden_exposition(tmp_path: Path) -> None:
    if not TRACE.exists():
        pytest.fail(f"missing fixture trace {TRACE}")
    got = exposition(tmp_path)
    if UPDATE:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(got)
    assert GOLDEN.exists(), "no golden file: run with GPUFLEET_UPDATE_GOLDEN=1 (see the module docstring)"
    want = GOLDEN.read_text()
    if got != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), "golden", "agent", n=1))
        pytest.fail(f"exposition differs from {GOLDEN} (regenerate with GPUFLEET_UPDATE_GOLDEN=1 if intended):\n"
                    + diff[:6000])
    # The golden file is itself a meaningful exposition, not an empty one.
    for needle in ('gpufleet_gpus 8.0', 'gpufleet_gpu_info{', 'gpufleet_ib_port_info{',
                   'gpufleet_gpu_job_info{gpu="7",job_id="eval-0007"} 1.0',
                   'gpufleet_scrape_collector_success{collector="gpu"} 1.0'):
        assert needle in want, needle


def test_run_is_repeatable(tmp_path: Path) -> None:
    """Two runs give the same normalized exposition (the golden comparison is meaningful)."""
    if not TRACE.exists():
        pytest.fail(f"missing fixture trace {TRACE}")
    assert exposition(tmp_path / "a") == exposition(tmp_path / "b")
