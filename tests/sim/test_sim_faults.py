"""Every fault's signature appears in the recording at the labelled onset, and not before."""

from __future__ import annotations

import json
import tomllib
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from gpufleet.sim.faults import FAULTS
from gpufleet.sim.recording import record
from gpufleet.sim.scenario import builtin_text, parse_scenario
from gpufleet.sim.simulator import Simulator

START = 1_750_000_000.0
STEP = 30.0
ONSET = 600.0
WINDOW = 300.0  # the signature must show within 5 minutes of the onset

Series = dict[tuple[str, frozenset[tuple[str, str]]], list[tuple[float, float]]]


def parse(path: Path, names: set[str]) -> Series:
    """The samples of the families in ``names`` (sample names without _total are fine)."""
    keep: list[str] = []
    for line in path.read_text().splitlines():
        if line.startswith("# EOF"):
            keep.append(line)
        elif line.startswith("#"):
            if line.split()[2] in names:
                keep.append(line)
        elif line.split("{", 1)[0].removesuffix("_total") in names:
            keep.append(line)
    out: Series = defaultdict(list)
    # prometheus_client's OpenMetrics parser carries no annotations (its text-format one does).
    for fam in text_string_to_metric_families("\n".join(keep) + "\n"):  # type: ignore[no-untyped-call]
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))].append((float(s.timestamp), float(s.value)))
    return out


def one(series: Series, name: str, **labels: str) -> tuple[np.ndarray, np.ndarray]:
    found = [v for (n, ls), v in series.items() if n == name and set(labels.items()) <= ls]
    assert len(found) == 1, f"expected one series {name}{labels}, found {len(found)}"
    ts, vals = zip(*found[0], strict=True)
    return np.array(ts), np.array(vals)


def make(name: str, tmp: Path, profile: str = "gpufleet", severity: object = None) -> tuple[Path, dict[str, Any]]:
    data = tomllib.loads(builtin_text(name))
    data["hours"] = 0.5
    data["step"] = STEP
    data["sites"][0]["nodes"] = 4
    data["jobs"]["fixed"] = data["jobs"]["fixed"][:1]  # job-a: node-000..node-003
    for f in data["faults"]:
        f["onset"] = ONSET
        f.pop("end", None)
        f.pop("precursor", None)  # the signature at the onset, without an early warning (test_sim_precursor.py)
        if severity is not None:
            f["severity"] = severity
    sim = Simulator(parse_scenario(data, name), start=START)
    rec = record(sim, tmp, (profile,))
    return rec.files[profile], json.loads(rec.labels.read_text())


N2 = {"instance": "node-002:9445"}
Check = Callable[[Series], tuple[np.ndarray, np.ndarray]]


def _active(reason: str, gpu: str) -> Check:
    return lambda s: _eq(one(s, "gpufleet_gpu_clock_event_active", gpu=gpu, reason=reason, **N2), 1)


def _eq(tv: tuple[np.ndarray, np.ndarray], value: float) -> tuple[np.ndarray, np.ndarray]:
    return tv[0], tv[1] == value


def _below(tv: tuple[np.ndarray, np.ndarray], value: float) -> tuple[np.ndarray, np.ndarray]:
    return tv[0], tv[1] < value


def _rises(tv: tuple[np.ndarray, np.ndarray], factor: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Per-tick increase above ``factor`` x the largest increase before the onset (or above 0)."""
    ts, v = tv
    d = np.diff(v, prepend=v[0])
    base = d[ts < ONSET + START].max() if factor > 1 else 0.0
    return ts, d > base * factor


SIGNATURES: dict[str, tuple[set[str], Check]] = {
    "cooling_failure": ({"gpufleet_gpu_clock_event_active"}, _active("sw_thermal_slowdown", "0")),
    # issue 31: the link retrains to x8 of x16 (after its replay burst); application clocks locked at 1200 MHz
    "pcie_retrain": ({"gpufleet_gpu_pcie_link_width"}, lambda s: _below(one(s, "gpufleet_gpu_pcie_link_width",
                                                                              gpu="1", **N2), 16)),
    "app_clocks_locked": ({"gpufleet_gpu_clock_event_active"}, _active("applications_clocks_setting", "3")),
    "intermittent_thermal": ({"gpufleet_gpu_clock_event_active"}, _active("sw_thermal_slowdown", "4")),
    "power_brake": ({"gpufleet_gpu_clock_event_active"}, _active("hw_power_brake_slowdown", "3")),
    "power_cap": ({"gpufleet_gpu_power_limit_watts"},
                  lambda s: _below(one(s, "gpufleet_gpu_power_limit_watts", gpu="0", **N2), 699)),
    "clock_stuck_low": ({"gpufleet_gpu_clock_event_active"}, _active("hw_slowdown", "5")),
    "ib_link_degraded": ({"gpufleet_ib_port_rate_bytes_per_second"},
                         lambda s: _below(one(s, "gpufleet_ib_port_rate_bytes_per_second", device="mlx5_3", **N2),
                                          50e9)),
    "ib_link_flapping": ({"gpufleet_ib_port_errors"},
                         lambda s: _rises(one(s, "gpufleet_ib_port_errors_total", device="mlx5_3", error="link_downed",
                                              **N2))),
    "network_congestion": ({"gpufleet_ib_port_transmit_wait"},
                           lambda s: _rises(one(s, "gpufleet_ib_port_transmit_wait_total", device="mlx5_0", **N2),
                                            5.0)),
    "pcie_downgrade": ({"gpufleet_gpu_pcie_link_width"},
                       lambda s: _below(one(s, "gpufleet_gpu_pcie_link_width", gpu="1", **N2), 16)),
    "nvlink_down": ({"gpufleet_gpu_nvlink_up"}, lambda s: _eq(one(s, "gpufleet_gpu_nvlink_up", gpu="6", link="0", **N2), 0)),
    "hbm_ecc": ({"gpufleet_gpu_ecc_errors"},
                lambda s: _rises(one(s, "gpufleet_gpu_ecc_errors_total", gpu="3", error="corrected",
                                     counter="aggregate", **N2))),
    "xid79": ({"gpufleet_gpu_up"}, lambda s: _eq(one(s, "gpufleet_gpu_up", gpu="4", **N2), 0)),
    "slow_host": ({"gpufleet_gpu_utilization_ratio"},
                  lambda s: _below(one(s, "gpufleet_gpu_utilization_ratio", gpu="2", **N2), 0.9)),
    # NVL72 racks (issue 21): GB200 trays of 4 GPUs
    "nvlink_fabric_degraded": ({"gpufleet_gpu_fabric_health"}, lambda s: _eq(one(
        s, "gpufleet_gpu_fabric_health", gpu="1", condition="bandwidth_degraded", **N2), 1)),
    "nvswitch_tray_failure": ({"gpufleet_gpu_fabric_health"}, lambda s: _eq(one(
        s, "gpufleet_gpu_fabric_health", gpu="0", condition="bandwidth_degraded", instance="node-000:9445"), 1)),
    "c2c_lost": ({"gpufleet_gpu_c2c_enabled"}, lambda s: _eq(one(s, "gpufleet_gpu_c2c_enabled", gpu="3", **N2), 0)),
    "tray_thermal_margin": ({"gpufleet_gpu_thermal_margin_celsius"},
                            lambda s: _below(one(s, "gpufleet_gpu_thermal_margin_celsius", gpu="2", **N2), 12)),
    "roce_pause_storm": ({"gpufleet_nic_pause_duration_seconds"},
                         lambda s: _rises(one(s, "gpufleet_nic_pause_duration_seconds_total", interface="ens1f0np0",
                                              **N2), 5.0)),
}


def test_every_fault_kind_has_a_signature_test() -> None:
    assert set(FAULTS) - {"pue_drift"} == set(SIGNATURES)


@pytest.mark.parametrize("kind", sorted(SIGNATURES))
def test_signature_at_labelled_onset(kind: str, tmp_path: Path) -> None:
    path, labels = make(kind, tmp_path)
    [fault] = labels["faults"]
    assert fault["type"] == kind and fault["node"] == "node-002"
    assert fault["onset"] == START + ONSET
    assert fault["expected_findings"] == [{"kind": k, "cause": c} for k, c in FAULTS[kind].findings]
    names, check = SIGNATURES[kind]
    ts, present = check(parse(path, names))
    onset = fault["onset"]
    assert not present[ts < onset].any(), f"{kind}: signature before the onset"
    assert present[(ts >= onset) & (ts <= onset + WINDOW)].any(), f"{kind}: no signature after the onset"


def test_xid79_event_and_missing_gpu_series(tmp_path: Path) -> None:
    path, _ = make("xid79", tmp_path)
    s = parse(path, {"gpufleet_gpu_xid_errors", "gpufleet_gpu_power_watts"})
    ts, v = one(s, "gpufleet_gpu_xid_errors_total", gpu="4", xid="79", **N2)
    assert ts.min() >= START + ONSET and v.max() == 1
    ts, _ = one(s, "gpufleet_gpu_power_watts", gpu="4", **N2)
    assert ts.max() < START + ONSET, "a GPU that fell off the bus has no readings, never zeros"


def test_dcgm_profile_shows_the_straggler(tmp_path: Path) -> None:
    path, _ = make("clock_stuck_low", tmp_path, profile="dcgm", severity="obvious")
    s = parse(path, {"DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "DCGM_FI_DEV_SM_CLOCK"})
    host = {"Hostname": "node-002", "instance": "node-002:9400", "hpc_job": "job-a"}
    ts, reasons = one(s, "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", gpu="5", **host)
    after = ts >= START + ONSET
    assert not (reasons[~after].astype(int) & 0x8).any()
    # the change reaches the node within an interval and dcgm-exporter serves it within its collect interval
    shown = ts >= START + ONSET + 2 * STEP
    assert (reasons[shown].astype(int) & 0x8).all()
    _, clock = one(s, "DCGM_FI_DEV_SM_CLOCK", gpu="5", **host)
    _, peer = one(s, "DCGM_FI_DEV_SM_CLOCK", gpu="4", **host)
    assert clock[shown].max() < 0.6 * peer[shown].min()


def test_dcgm_nvlink_error_counters_rise_on_the_faulty_gpu_only(tmp_path: Path) -> None:
    path, labels = make("nvlink_down", tmp_path, profile="dcgm", severity="moderate")
    [fault] = labels["faults"]
    names = {"DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
             "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL"}
    s = parse(path, names)
    assert {n for n, _ in s} == names
    onset = fault["onset"]
    for name in ("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL"):
        ts, v = one(s, name, gpu=str(fault["gpu"]), Hostname=fault["node"], hpc_job="job-a")
        assert not v[ts < onset].any(), f"{name} before the onset"
        # up once the change reached the node (< 1 interval), counted a tick's worth (1) and was collected (1)
        assert v[ts >= onset + 3 * STEP].min() > 0, f"{name} not up after the onset"
        assert np.all(np.diff(v) >= 0)
    for (name, ls), samples in s.items():
        labs = dict(ls)
        if (labs["Hostname"], labs["gpu"]) != (fault["node"], str(fault["gpu"])):
            assert not any(v for _, v in samples), f"{name} rises on healthy {labs['Hostname']} GPU {labs['gpu']}"


def test_pue_drift_not_explained_by_weather(tmp_path: Path) -> None:
    doc = {
        "name": "pue", "hours": 4, "step": 60,
        "sites": [{"name": "site-a", "nodes": 2, "outdoor_amplitude_c": 0.0},
                  {"name": "site-b", "nodes": 2, "outdoor_amplitude_c": 0.0}],
        "jobs": {"fixed": [{"id": "j1", "nodes": ["node-000", "node-001"]},
                           {"id": "j2", "nodes": ["node-002", "node-003"]}]},
        "faults": [{"kind": "pue_drift", "site": "site-b", "onset": "1h", "severity": "obvious"}],
    }
    rec = record(Simulator(parse_scenario(doc, "pue"), start=START), tmp_path, ("gpufleet",))
    s = parse(rec.files["gpufleet"], {"gpufleet_site_facility_power_watts", "gpufleet_site_it_power_watts"})

    def pue(site: str) -> tuple[np.ndarray, np.ndarray]:
        ts, fac = one(s, "gpufleet_site_facility_power_watts", site=site)
        _, it = one(s, "gpufleet_site_it_power_watts", site=site)
        return ts, fac / it

    ts, b = pue("site-b")
    _, a = pue("site-a")
    onset = START + 3600
    assert np.ptp(b[ts < onset]) < 0.02
    assert b[ts >= onset + 7200].min() - b[ts < onset].max() > 0.15
    assert np.ptp(a) < 0.02, "the healthy site does not drift"
    labels = json.loads(rec.labels.read_text())
    assert labels["faults"][0]["entity"] == "site" and labels["faults"][0]["expected_findings"][0]["kind"] == "pue_drift"
