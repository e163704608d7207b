"""The real-GPU check's own code, exercised without a GPU: comparison, report, error probes, the script.

tests/gpu/test_real_gpu.py runs on a machine with the driver; the check script (tests/gpu/check.sh)
runs here as a self-test with a fake NVML in the driver's place.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pynvml
import pytest
from calltime import probe_calls
from gpucheck import calls_md, compare, differences_md, probe_errors
from support import REPO

REAL = """\
# TYPE gpufleet_gpu_up gauge
gpufleet_gpu_up{gpu="0"} 1
gpufleet_gpu_up{gpu="1"} 1
# TYPE gpufleet_gpu_info gauge
gpufleet_gpu_info{gpu="0",uuid="GPU-a",name="NVIDIA H100",serial="1",pci_bus_id="x",vbios_version="v",architecture="hopper"} 1
# TYPE gpufleet_gpu_temperature_celsius gauge
gpufleet_gpu_temperature_celsius{gpu="0",sensor="gpu"} 40
gpufleet_gpu_temperature_celsius{gpu="0",sensor="memory"} 50
# TYPE gpufleet_gpu_fan_speed_ratio gauge
gpufleet_gpu_fan_speed_ratio{gpu="0",fan="0"} 0.3
# TYPE gpufleet_host_cpus gauge
gpufleet_host_cpus 64
"""
FAKE = """\
# TYPE gpufleet_gpu_up gauge
gpufleet_gpu_up{gpu="0"} 1
gpufleet_gpu_up{gpu="1"} 1
# TYPE gpufleet_gpu_info gauge
gpufleet_gpu_info{gpu="0",uuid="GPU-b",name="NVIDIA H100 80GB HBM3",serial="2",pci_bus_id="y",vbios_version="w",architecture="hopper"} 1
# TYPE gpufleet_gpu_temperature_celsius gauge
gpufleet_gpu_temperature_celsius{gpu="0",sensor="gpu"} 41
# TYPE gpufleet_gpu_power_watts gauge
gpufleet_gpu_power_watts{gpu="0"} 100
# TYPE gpufleet_host_cpus gauge
gpufleet_host_cpus 8
"""


def test_compare_lists_every_difference_and_ignores_identity_values() -> None:
    diff = compare(REAL, FAKE)
    assert not diff["same"]
    assert diff["only_real"] == ["gpufleet_gpu_fan_speed_ratio"]
    assert diff["only_fake"] == ["gpufleet_gpu_power_watts"]
    assert diff["labels"] == {"gpufleet_gpu_temperature_celsius": {"sensor": {"only_real": ["memory"], "only_fake": []}}}
    assert diff["series"] == {"gpufleet_gpu_temperature_celsius": {"real": 2, "fake": 1}}
    assert "gpufleet_host_cpus" not in json.dumps(diff), "host families are not the fake's model"
    md = differences_md(diff)
    assert "`gpufleet_gpu_fan_speed_ratio`" in md and "only real: ['memory']" in md
    assert compare(REAL, REAL)["same"] and "No differences" in differences_md(compare(REAL, REAL))


def test_error_probes_on_the_fake() -> None:
    got = probe_errors("sim:2")
    assert got["nvmlDeviceGetHandleByIndex(count)"] == "INVALID_ARGUMENT"
    assert got["nvmlDeviceGetName(1-byte buffer)"] == "INSUFFICIENT_SIZE"
    assert got["nvmlEventSetWait_v2(empty set, 1 ms)"] == "TIMEOUT"
    assert got["nvmlDeviceGetCount(after shutdown)"] == "UNINITIALIZED"
    # as the real H200's driver answered (tests/gpu/results/h200-gvisor-580/errors.json)
    assert got["nvmlDeviceGetFieldValues(unknown field) nvmlReturn"] == "INVALID_ARGUMENT"
    assert got["nvmlDeviceGetHandleByUUID(unknown)"] == "NOT_FOUND"
    assert got["nvmlDeviceGetHandleByPciBusId(unknown)"] == "INVALID_ARGUMENT"
    assert got["nvmlDeviceGetClockInfo(type 99)"] == "NOT_SUPPORTED"
    assert got["nvmlDeviceGetNvLinkState(link 63)"] == "INVALID_ARGUMENT", "out of range on a GPU with 18 NVLinks"
    assert len(got) == 10 and not any(v.startswith("EXCEPTION") for v in got.values()), got


def test_call_timing_counts_every_entry_point_per_scrape() -> None:
    before = pynvml._nvmlGetFunctionPointer
    got = probe_calls("sim:2", 3)
    assert pynvml._nvmlGetFunctionPointer is before, "the timing wrappers are removed"
    rows = {e["name"]: e for e in got["entry_points"]}
    assert rows["nvmlDeviceGetPowerUsage"]["calls_per_scrape"] == 2  # once per GPU
    assert rows["nvmlDeviceGetFieldValues"]["calls_per_scrape"] >= 2
    assert got["cpu_ms_per_scrape"] == pytest.approx(sum(e["cpu_ms_per_scrape"] for e in rows.values()))
    assert all(e["cpu_ms_per_scrape"] >= 0 for e in rows.values())
    # a call's wall time holds its CPU time (less the clocks' granularity)
    assert all(e["wall_ms_per_scrape"] >= 0.9 * e["cpu_ms_per_scrape"] - 0.01 for e in rows.values())
    assert got["wall_ms_per_scrape"] == pytest.approx(sum(e["wall_ms_per_scrape"] for e in rows.values()))
    costs = [e["cpu_ms_per_scrape"] for e in got["entry_points"]]
    assert costs == sorted(costs, reverse=True)
    md = calls_md(got, got)
    assert "| `nvmlDeviceGetPowerUsage` | 2.0 |" in md


@pytest.mark.slow
def test_check_script_runs_as_a_self_test(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "GPUCHECK_REAL_SPEC": "trace:tests/fixtures/traces/h100x8-sim.jsonl.gz@0",
           "GPUCHECK_FAKE_SPEC": "sim:8,hang=nvmlDeviceGetPowerUsage@3", "PYTHON": str(REPO / ".venv/bin/python"), "GPUCHECK_QUICK": "1"}
    p = subprocess.run(["bash", "tests/gpu/check.sh"], cwd=REPO, env=env, capture_output=True, timeout=280, check=False)
    assert p.returncode == 0, p.stdout.decode() + p.stderr.decode()
    report = (out / "report.md").read_text()
    for step in ("environment", "once", "compare", "cpu", "calls", "errors", "record"):
        assert f"| {step} |" in report
    assert "FAILED" not in report
    diff = json.loads((out / "differences.json").read_text())
    # the "fake" side has GPU 3 hung: its readings are missing there, and the stall is named
    assert "gpufleet_nvml_call_stalled_seconds" in diff["only_fake"]
    assert diff["series"]["gpufleet_gpu_up"] == {"real": 8, "fake": 7}
    cpu = json.loads((out / "cpu.json").read_text())
    assert cpu["real"]["cpu_ms_median"] > 0 and cpu["fake"]["agent_cpu_ms_median"] > 0
    assert (out / "trace.jsonl.gz").stat().st_size > 0 and (out / "replay.prom").stat().st_size > 0
    calls = json.loads((out / "calls.json").read_text())
    assert {"nvmlDeviceGetPowerUsage", "nvmlDeviceGetFieldValues"} <= {e["name"] for e in calls["real"]["entry_points"]}
    assert "| `nvmlDeviceGetPowerUsage` |" in (out / "calls.md").read_text()
