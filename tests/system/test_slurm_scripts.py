"""The example Slurm prolog/epilog (packaging/slurm): the mapping files they write are what the jobs collector reads."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from support import REPO

from gpufleet.agent.collectors.jobs import JobsCollector

SLURM = REPO / "packaging" / "slurm"


def run(script: str, mapping: Path, job: str, gpus: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GPUFLEET_JOB_MAPPING_DIR": str(mapping),
           "SLURM_JOB_ID": job, "SLURM_JOB_GPUS": gpus}
    return subprocess.run(["bash", str(SLURM / script)], env=env, capture_output=True, text=True, timeout=30)


def test_prolog_and_epilog_keep_the_mapping_right(tmp_path: Path) -> None:
    mapping = tmp_path / "job-mapping"
    assert run("gpufleet-prolog.sh", mapping, "1001", "0,1").returncode == 0
    assert run("gpufleet-prolog.sh", mapping, "1002", "1,3").returncode == 0  # GPU 1 shared (MIG, sharding)
    assert run("gpufleet-prolog.sh", mapping, "1002", "1").returncode == 0  # a requeue: no duplicate line
    assert JobsCollector(str(mapping)).mapping() == {"0": ["1001"], "1": ["1001", "1002"], "3": ["1002"]}
    assert run("gpufleet-epilog.sh", mapping, "1001", "0,1").returncode == 0
    assert JobsCollector(str(mapping)).mapping() == {"1": ["1002"], "3": ["1002"]}
    assert not (mapping / "0").exists()  # a file left without a job is removed
    assert run("gpufleet-epilog.sh", mapping, "1002", "1,3").returncode == 0
    assert JobsCollector(str(mapping)).mapping() == {}


def test_bad_input_never_fails_the_job_nor_writes_garbage(tmp_path: Path) -> None:
    mapping = tmp_path / "job-mapping"
    for job, gpus in (("1;rm -rf /", "0"), ("1003", "../../etc/x,07,-1,0"), ("", "0"), ("1004", "")):
        r = run("gpufleet-prolog.sh", mapping, job, gpus)
        assert r.returncode == 0, r.stderr
    assert JobsCollector(str(mapping)).mapping() == {"0": ["1003"]}
    assert "not an index" in run("gpufleet-prolog.sh", mapping, "1005", "x").stderr
    r = run("gpufleet-epilog.sh", tmp_path / "missing", "1003", "0")
    assert r.returncode == 0 and r.stderr == ""
