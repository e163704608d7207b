"""`promtool check metrics` on the real output of `gpufleet-agent once --nvml.fake=sim` must be clean."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from support import BIN, FIXTURES, need_binary


def sysfs_root(tmp_path: Path) -> Path:
    """A sysfs root whose class/infiniband is the real H100 node capture."""
    root = tmp_path / "sys"
    (root / "class").mkdir(parents=True)
    (root / "class" / "infiniband").symlink_to(FIXTURES / "sysfs-infiniband-h100")
    return root


@pytest.mark.slow
def test_promtool_check_metrics_is_clean(tmp_path: Path) -> None:
    promtool = need_binary("promtool")
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "0").write_text("train-42\n")
    (jobs / "1").write_text("train-42\neval-7\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    # Two configurations: the simulator's own sysfs tree, and the real H100 IB capture plus jobs.
    for extra in ([], [f"--path.sysfs={sysfs_root(tmp_path)}", f"--collector.jobs.mapping-dir={jobs}"]):
        out = subprocess.run([str(BIN / "gpufleet-agent"), "once", "--nvml.fake=sim", *extra],
                             capture_output=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr.decode()
        text = out.stdout
        assert b"gpufleet_gpu_power_watts{" in text
        assert b'gpufleet_scrape_collector_success{collector="gpu"} 1.0' in text
        if extra:
            assert b"gpufleet_ib_port_transmit_bytes_total{" in text
            assert b'job_id="eval-7"' in text
        check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=60)
        problems = (check.stdout + check.stderr).decode()
        assert check.returncode == 0 and not problems.strip(), problems
