"""Detector core: robust statistics, straggler scoring and causes, findings hysteresis, replay JSON.

Recordings here are small synthetic OpenMetrics files written by :func:`synth`, with the simulator's target
labels (``instance="<node>:9445"``, ``job``, ``site``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from gpufleet.detector.config import DetectorConfig, parse
from gpufleet.detector.core.candidate import DIRECT, Candidate, Evidence
from gpufleet.detector.frame.features import GpuFrame
from gpufleet.detector.incidents.tracker import Tracker
from gpufleet.detector.rules import robust, straggler
from gpufleet.detector.rules.straggler import StragglerParams
from gpufleet.detector.service.cli import main as cli_main
from gpufleet.detector.service.replay import replay
from gpufleet.detector.sources.profiles import Query
from gpufleet.detector.sources.prometheus import PrometheusSource
from gpufleet.detector.sources.source import SourceError

STEP = 15.0
T0 = 1_700_000_000.0


@dataclass
class Fault:
    kind: str  # "clock", "thermal", "power", "host", "pcie", "link"
    node: int
    gpu: int
    onset: float  # seconds after T0
    end: float | None = None


@dataclass
class Synth:
    nodes: int = 4
    gpus: int = 8
    seconds: float = 1800.0
    faults: list[Fault] = field(default_factory=list)
    idle_nodes: tuple[int, ...] = ()
    gap: tuple[int, float, float] | None = None  # node, start, end without scrapes
    dcgm: bool = False
    seed: int = 0
    job_start: float = 0.0
    jobs: int = 1  # > 1: node n runs job-<n % jobs> (several jobs, e.g. for sharding)


def synth(path: Path, s: Synth) -> Path:
    """Write a synthetic fleet recording: one synchronous job over all non-idle nodes."""
    rng = np.random.default_rng(s.seed)
    times = T0 + np.arange(0.0, s.seconds + 1e-9, STEP)
    fams: dict[str, tuple[str, dict[str, list[str]]]] = {}

    def add(name: str, typ: str, labels: dict[str, str], value: float, t: float) -> None:
        fam = name.removesuffix("_total") if typ == "counter" else name
        lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
        series = f"{name}{{{lab}}}"
        fams.setdefault(fam, (typ, {}))[1].setdefault(series, []).append(f"{series} {value:.6g} {t:.3f}")

    base_clock = 1980.0 + rng.normal(0, 5, (s.nodes, s.gpus))
    energy = np.zeros((s.nodes, s.gpus))
    replay_ctr = np.zeros((s.nodes, s.gpus))
    xmit = np.zeros((s.nodes, s.gpus))
    txb = np.zeros((s.nodes, s.gpus))
    for t in times:
        rel = t - T0
        active = {(f.node, f.gpu, f.kind) for f in s.faults if rel >= f.onset and (f.end is None or rel < f.end)}
        slow = any(k in ("clock", "thermal", "power", "host", "pcie") for _, _, k in active)
        for n in range(s.nodes):
            inst = f"node-{n:03d}:9445"
            if s.gap and s.gap[0] == n and s.gap[1] <= rel < s.gap[2]:
                continue
            common = {"instance": inst, "job": "gpufleet-agent", "site": "dc1"}
            for g in range(s.gpus):
                idle = n in s.idle_nodes or rel < s.job_start
                mine = {k for nn, gg, k in active if nn == n and (gg == g or gg < 0)}
                clock = base_clock[n, g] + rng.normal(0, 3)
                util = 0.97 + rng.normal(0, 0.01)
                tensor = (0.62 if not slow else 0.45) + rng.normal(0, 0.015)
                power = (620 if not slow else 520) + rng.normal(0, 8)
                temp = 62 + rng.normal(0, 1.5)
                thermal = power_cap = 0.0
                gen = 5
                if "clock" in mine:
                    clock, tensor, power = 1300 + rng.normal(0, 3), 0.74 + rng.normal(0, 0.01), 480 + rng.normal(0, 5)
                if "thermal" in mine:
                    clock, tensor, temp, thermal = 1500 + rng.normal(0, 20), 0.72, 89 + rng.normal(0, 0.5), 1.0
                if "power" in mine:
                    clock, tensor, power_cap = 1450 + rng.normal(0, 10), 0.73, 1.0
                if "host" in mine:
                    util, tensor, power = 0.55 + rng.normal(0, 0.02), 0.30 + rng.normal(0, 0.01), 400.0
                if "pcie" in mine:
                    clock, tensor, gen = base_clock[n, g], 0.73, 3
                    replay_ctr[n, g] += 50
                if idle:
                    util, tensor, power, clock, temp = 0.0, 0.0, 70.0, 345.0, 35.0
                energy[n, g] += power * STEP
                txb[n, g] += 2e10 * STEP * (0 if idle else 1)
                xmit[n, g] += (5e8 if "link" in mine else 1e6 * (1 + rng.random())) * STEP
                lg = {**common, "gpu": str(g)}
                if s.dcgm:
                    dl = {"gpu": str(g), "UUID": f"GPU-{n}-{g}", "device": f"nvidia{g}", "modelName": "NVIDIA H100",
                          "Hostname": f"node-{n:03d}", **common}
                    if not idle:
                        dl["hpc_job"] = "job-a" if s.jobs == 1 else f"job-{n % s.jobs}"
                    add("DCGM_FI_DEV_GPU_UTIL", "gauge", dl, round(util * 100), t)
                    add("DCGM_FI_DEV_SM_CLOCK", "gauge", dl, round(clock), t)
                    add("DCGM_FI_DEV_POWER_USAGE", "gauge", dl, power, t)
                    add("DCGM_FI_DEV_GPU_TEMP", "gauge", dl, round(temp), t)
                    add("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge", dl, tensor, t)
                    mask = (0x20 if thermal else 0) | (0x4 if power_cap else 0)
                    add("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "gauge", dl, mask, t)
                    add("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "gauge", dl, energy[n, g] * 1000, t)
                    continue
                add("gpufleet_gpu_utilization_ratio", "gauge", lg, util, t)
                add("gpufleet_gpu_clock_hertz", "gauge", {**lg, "clock": "sm"}, clock * 1e6, t)
                add("gpufleet_gpu_power_watts", "gauge", lg, power, t)
                add("gpufleet_gpu_temperature_celsius", "gauge", {**lg, "sensor": "gpu"}, temp, t)
                add("gpufleet_gpu_tensor_active_ratio", "gauge", lg, tensor, t)
                add("gpufleet_gpu_energy_joules_total", "counter", lg, energy[n, g], t)
                add("gpufleet_gpu_pcie_link_generation", "gauge", lg, gen, t)
                add("gpufleet_gpu_pcie_link_generation_max", "gauge", lg, 5, t)
                add("gpufleet_gpu_pcie_replay_total", "counter", lg, replay_ctr[n, g], t)
                for reason, v in (("sw_thermal_slowdown", thermal), ("sw_power_cap", power_cap),
                                  ("hw_slowdown", 0.0)):
                    add("gpufleet_gpu_clock_event_active", "gauge", {**lg, "reason": reason}, v, t)
                if not idle:
                    add("gpufleet_gpu_job_info", "gauge",
                        {**lg, "job_id": "job-a" if s.jobs == 1 else f"job-{n % s.jobs}"}, 1, t)
                nl = {**common, "device": f"mlx5_{g}", "port": "1"}
                add("gpufleet_ib_port_transmit_bytes_total", "counter", nl, txb[n, g], t)
                add("gpufleet_ib_port_transmit_wait_total", "counter", nl, xmit[n, g], t)
                add("gpufleet_ib_port_rate_bytes_per_second", "gauge", nl, 5e10, t)
                add("gpufleet_nic_gpu_info", "gauge", {**nl, "gpu": str(g), "pci_bus_id": "x",
                                                       "common_ancestor": "y"}, 1, t)
    lines: list[str] = []
    for fam, (typ, samples) in fams.items():
        lines.append(f"# TYPE {fam} {typ}")
        for series_lines in samples.values():
            lines.extend(series_lines)
    lines.append("# EOF")
    path.write_text("\n".join(lines) + "\n")
    return path


def fast_cfg(**over: object) -> DetectorConfig:
    data: dict[str, dict[str, object]] = {"detector": {"window_seconds": 120.0, "interval_seconds": 60.0},
                                          "findings": {"open_after": 2, "close_after": 2}}
    for k, v in over.items():
        sec, key = k.split("__")
        data.setdefault(sec, {})[key] = v
    return parse(data)


# ---------------------------------------------------------------- robust statistics

def test_robust_z_uses_median_and_mad_and_ignores_one_outlier() -> None:
    x = np.array([10.0, 11.0, 9.0, 10.0, 10.5, 9.5, 100.0])
    z = robust.robust_z(x)
    assert abs(z[0]) < 0.1
    assert z[-1] > 50  # a mean/std z-score would be ~2.3 here
    med, mad = robust.median_mad(x)
    assert med == 10.0 and mad == 0.5


def test_robust_z_floor_keeps_flat_groups_calm() -> None:
    x = np.array([1980.0] * 15 + [1981.0])
    assert robust.robust_z(x)[-1] > 1e6  # MAD is 0: without a floor one MHz explodes
    assert robust.robust_z(x, rel_floor=0.02)[-1] < 0.05


def test_grouped_robust_z_is_per_group_and_nan_for_ungrouped() -> None:
    x = np.array([1.0, 1.1, 0.9, 1.0, 100.0, 101.0, 99.0, 100.0, 5.0])
    g = np.array([0, 0, 0, 0, 1, 1, 1, 1, -1])
    z = robust.grouped_robust_z(x, g)
    assert np.all(np.abs(z[:8]) < 2) and np.isnan(z[8])


# ---------------------------------------------------------------- findings hysteresis

def _c(score: float = 9.0, cause: str = "thermal") -> Candidate:
    return Candidate("node-001", "3", "job-a", "dc1", cause, score)


def test_findings_open_after_consecutive_and_close_after_clear() -> None:
    tr = Tracker(open_after=3, close_after=2, merge_seconds=0)
    seen = lambda k: True  # noqa: E731
    for t in (0, 60):
        tr.update(t, [("straggler", _c())], seen)
    assert not tr.active
    tr.update(120, [], seen)  # one clear evaluation resets the run: no flapping open
    for t in (180, 240):
        tr.update(t, [("straggler", _c())], seen)
    assert not tr.active
    tr.update(300, [("straggler", _c())], seen)
    (f,) = tr.active.values()
    assert f.start == 180 and f.end is None
    tr.update(360, [], seen)
    tr.update(420, [("straggler", _c())], seen)  # a single clear evaluation does not close it
    assert tr.active
    tr.update(480, [], seen)
    tr.update(540, [], seen)
    assert not tr.active and tr.closed[0].end == 480
    assert f.detected == 300 and f.to_json()["detected"] == 300 and f.to_json()["start"] == 180


def test_direct_evidence_opens_after_open_after_direct_and_a_deviation_alone_after_open_after() -> None:
    # issue 31: a state the hardware reports (here applications clocks set below the peers') is enough to open at
    # its first evaluation; a cause read from deviations alone still needs open_after consecutive evaluations.
    tr = Tracker(open_after=3, close_after=2, merge_seconds=0, open_after_direct=1)
    seen = lambda k: True  # noqa: E731
    direct = Candidate("node-001", "3", "job-a", "dc1", "clock", 9.0,
                       Evidence(causes={"clock": DIRECT + 5.0}, rules=("thr_app", "sm_clock_low")))
    inferred = Candidate("node-001", "4", "job-a", "dc1", "clock", 9.0,
                         Evidence(causes={"clock": 6.0}, rules=("sm_clock_low",)))
    # a direct rule naming another cause than the candidate's own does not count as direct for it
    other = Candidate("node-001", "5", "job-a", "dc1", "clock", 9.0,
                      Evidence(causes={"clock": 6.0, "power": DIRECT + 1.0}, rules=("sm_clock_low", "thr_power")))
    tr.update(0, [("straggler", direct), ("straggler", inferred), ("straggler", other)], seen)
    assert {f.gpu for f in tr.active.values()} == {"3"}
    tr.update(60, [("straggler", direct), ("straggler", inferred), ("straggler", other)], seen)
    assert {f.gpu for f in tr.active.values()} == {"3"}
    tr.update(120, [("straggler", direct), ("straggler", inferred), ("straggler", other)], seen)
    assert {f.gpu for f in tr.active.values()} == {"3", "4", "5"}
    # kinds whose evidence is always the entity's own report (a throttle reason, a port's counters) open at once too
    tr.update(180, [("throttling", _c(cause="thermal")), ("network", Candidate("node-002", "1", None, "dc1",
                                                                             "network", 12.0, nic="mlx5_1/1"))],
              seen)
    assert {f.kind for f in tr.active.values()} >= {"throttling", "network"}
    # and by default (open_after_direct unset) every finding waits for open_after
    slow = Tracker(open_after=2, close_after=2, merge_seconds=0)
    slow.update(0, [("straggler", direct)], seen)
    assert not slow.active


def test_an_intermittent_problem_is_one_finding_through_gaps_shorter_than_the_merge_window() -> None:
    tr = Tracker(open_after=2, close_after=2, merge_seconds=300)
    seen = lambda k: True  # noqa: E731
    for t in (0, 60):
        tr.update(t, [("straggler", _c())], seen)
    for t in (120, 180, 240, 300):  # 4 clear minutes: shorter than the merge window
        tr.update(t, [], seen)
    assert tr.active
    for t in (360, 420):
        tr.update(t, [("straggler", _c())], seen)
    for t in (480, 540, 600, 660, 720, 780):  # clear for 5 minutes of observed time: it closes
        tr.update(t, [], seen)
    assert not tr.active
    assert [(f.start, f.detected, f.end) for f in tr.all_findings()] == [(0, 60, 480)]


def test_a_pause_is_no_clear_evidence() -> None:
    tr = Tracker(open_after=2, close_after=2, stale_after=100, merge_seconds=120)
    for t in (0, 60):
        tr.update(t, [("straggler", _c())], lambda k: True)
    for t in range(120, 1200, 60):  # the job pauses for 18 minutes: the GPU cannot be judged
        tr.update(t, [], lambda k: False)
    assert tr.active
    tr.update(1200, [("straggler", _c())], lambda k: True)
    assert len(tr.all_findings()) == 1


def test_incidents_link_kinds_and_the_node_absorbs_its_gpus() -> None:
    tr = Tracker(open_after=2, close_after=2, merge_seconds=0)
    seen = lambda k: True  # noqa: E731
    gpu3 = Candidate("node-001", "3", "job-a", "dc1", "clock", 6.0)
    gpu4 = Candidate("node-001", "4", "job-a", "dc1", "host", 5.0)
    throttled = Candidate("node-001", "3", "job-a", "dc1", "clock", 8.0)
    for t in (0, 60):
        tr.update(t, [("straggler", gpu3), ("straggler", gpu4), ("throttling", throttled)], seen)
    by = {(f.kind, f.gpu): f for f in tr.active.values()}
    assert by[("straggler", "3")].incident == by[("throttling", "3")].incident  # one GPU, one incident
    node = Candidate("node-001", None, "job-a", "dc1", "power", 9.0)
    for t in (120, 180):
        tr.update(t, [("straggler", node), ("straggler", gpu3), ("throttling", throttled)], seen)
    strag = [f for f in tr.all_findings() if f.kind == "straggler"]
    assert [(f.gpu, f.cause) for f in strag] == [(None, "power")]  # the GPUs' findings are absorbed
    assert strag[0].incident == by[("straggler", "3")].incident and strag[0].detected == 60
    assert {f.absorbed_by for f in tr.closed} == {strag[0].incident}


def test_a_tray_out_of_thermal_margin_absorbs_what_it_explains_on_its_tray() -> None:
    """One physical problem, one finding (issue 31): a tray's thermal finding takes in its GPUs' thermal throttling
    and lag (opened before it, detected when they were), holds new ones back while open, and leaves the rest: a
    power-capped GPU on the tray, another tray's thermal throttling, a NIC."""
    tr = Tracker(open_after=2, close_after=2, merge_seconds=0)
    seen = lambda k: True  # noqa: E731
    hot = Candidate("tray-02", "1", "job-a", "dc1", "thermal", 8.0)
    lag = Candidate("tray-02", None, "job-a", "dc1", "thermal", 6.0)
    capped = Candidate("tray-02", "2", "job-a", "dc1", "power", 7.0)
    other = Candidate("tray-03", "0", "job-a", "dc1", "thermal", 8.0)
    nic = Candidate("tray-02", None, "job-a", "dc1", "thermal", 5.0, nic="mlx5_0/1")
    before = [("throttling", hot), ("straggler", lag), ("throttling", capped), ("throttling", other), ("network", nic)]
    for t in (0, 60):
        tr.update(t, before, seen)
    assert len(tr.all_findings()) == 5
    tray = Candidate("tray-02", None, None, "dc1", "thermal", 12.0)
    late = Candidate("tray-02", "3", "job-a", "dc1", "thermal", 8.0)  # throttles only once the tray's finding is open
    for t in (120, 180, 240, 300):
        tr.update(t, [*before, ("tray_health", tray), *([("throttling", late)] if t >= 240 else [])], seen)
    got = sorted((f.kind, f.node, f.gpu, f.cause, f.nic) for f in tr.all_findings())
    assert got == [("network", "tray-02", None, "thermal", "mlx5_0/1"), ("throttling", "tray-02", "2", "power", ""),
                   ("throttling", "tray-03", "0", "thermal", ""), ("tray_health", "tray-02", None, "thermal", "")], got
    (f,) = [f for f in tr.all_findings() if f.kind == "tray_health"]
    assert f.detected == 60, "detected when the first of what it explains was"
    assert {(c.kind, c.absorbed_by) for c in tr.closed} == {("throttling", f.incident), ("straggler", f.incident)}
    # the control: a tray finding of a cause it does not explain (none of its kind's) absorbs nothing
    tr2 = Tracker(open_after=2, close_after=2, merge_seconds=0)
    for t in (0, 60, 120, 180):
        tr2.update(t, [("throttling", hot), *([("tray_health", Candidate("tray-02", None, None, "dc1", "fabric", 9.0))]
                                            if t >= 120 else [])], seen)
    assert sorted(x.kind for x in tr2.all_findings()) == ["throttling", "tray_health"]


def test_a_trays_own_report_opens_at_once_its_gpus_fabric_flags_wait_for_the_rack() -> None:
    """A tray's C2C links down or its thermal margin gone is its own report (direct: one evaluation, and fenceable);
    a GPU's NVLink fabric health flags wait an evaluation, in which a switch tray's rack-wide finding can show."""
    from gpufleet.detector.incidents.tracker import Finding
    from gpufleet.detector.remediate.direct_evidence import direct

    tr = Tracker(open_after=2, close_after=2, merge_seconds=0, open_after_direct=1)
    seen = lambda k: True  # noqa: E731
    c2c = Candidate("tray-02", None, None, "dc1", "c2c", 12.0)
    flags = Candidate("tray-05", "1", None, "dc1", "nvlink", 12.0)
    tr.update(0, [("tray_health", c2c), ("tray_health", flags)], seen)
    assert [(f.node, f.cause) for f in tr.all_findings()] == [("tray-02", "c2c")]
    tr.update(15, [("tray_health", c2c), ("tray_health", flags)], seen)
    assert sorted((f.node, f.cause) for f in tr.all_findings()) == [("tray-02", "c2c"), ("tray-05", "nvlink")]
    by = {f.cause: f for f in tr.all_findings()}
    assert direct(by["c2c"]) and not direct(by["nvlink"])
    assert not direct(Finding("nvlink_domain", "nvlink", "rack 1", None, None, "dc1", 0.0, None, 9.0, ""))


def test_a_resubmitted_job_keeps_the_finding_and_history_is_bounded() -> None:
    tr = Tracker(open_after=1, close_after=1, merge_seconds=0, history=3, reopen_seconds=0)
    seen = lambda k: True  # noqa: E731
    tr.update(0, [("straggler", _c())], seen)
    tr.update(60, [("straggler", Candidate("node-001", "3", "job-a-r1", "dc1", "thermal", 9.0))], seen)
    (f,) = tr.active.values()
    assert f.job == "job-a-r1" and f.start == 0
    for k in range(10):
        tr.update(120 + 120 * k, [("straggler", _c())], seen)
        tr.update(180 + 120 * k, [], seen)
    assert len(tr.closed) == 3


def test_a_fault_that_comes_back_soon_is_the_same_finding() -> None:
    """An intermittent fault (a thermal fault in bursts) is one finding, one incident, one start: it opens again
    when it comes back within reopen_seconds, and from then on stays open through a longer clear gap."""
    tr = Tracker(open_after=2, close_after=2, merge_seconds=120, reopen_seconds=1800)
    seen = lambda k: True  # noqa: E731

    def burst(t0: float, n: int) -> None:
        for i in range(n):
            tr.update(t0 + 15 * i, [("throttling", _c())], seen)

    def clear(t0: float, n: int) -> None:
        for i in range(n):
            tr.update(t0 + 15 * i, [], seen)

    burst(0, 6)
    (f,) = tr.active.values()
    incident = f.incident
    clear(90, 12)  # 180 s clear: closes (merge 120 s)
    assert not tr.active and tr.closed[-1].end == 90
    burst(300, 6)  # back 210 s later: the same finding again, open
    (g,) = tr.active.values()
    assert g is f and g.incident == incident and g.start == 0 and g.end is None and g.recurrences == 1
    clear(390, 12)  # 180 s clear: not enough any more (merge 120 s x 2)
    assert tr.active
    clear(570, 6)  # 270 s clear in all: closes
    assert not tr.active and len(tr.all_findings()) == 1
    burst(3000, 6)  # much later (> reopen_seconds): a new finding
    assert len(tr.all_findings()) == 2 and next(iter(tr.active.values())).incident != incident


def test_missing_data_neither_opens_nor_closes() -> None:
    tr = Tracker(open_after=2, close_after=2, stale_after=5)
    unseen = lambda k: False  # noqa: E731
    tr.update(0, [("straggler", _c())], lambda k: True)
    tr.update(60, [], unseen)  # data gap: the pending run is kept, not reset, and nothing opens
    assert not tr.active
    tr.update(120, [("straggler", _c())], lambda k: True)
    assert tr.active
    for t in (180, 240, 300, 360):
        tr.update(t, [], unseen)
    assert tr.active  # stale, but not yet stale_after evaluations
    tr.update(420, [], unseen)
    assert not tr.active and tr.closed[0].end == 120


# ---------------------------------------------------------------- straggler on synthetic peer groups

@pytest.mark.parametrize(("kind", "cause"), [("clock", "clock"), ("thermal", "thermal"), ("power", "power"),
                                             ("host", "host"), ("pcie", "pcie")])
def test_straggler_found_with_cause(tmp_path: Path, kind: str, cause: str) -> None:
    rec = synth(tmp_path / "r.om", Synth(faults=[Fault(kind, 2, 5, 900.0)]))
    _, findings = replay([str(rec)], fast_cfg())
    strag = [f for f in findings if f.kind == "straggler"]
    assert len(strag) == 1, [f.to_json() for f in findings]
    f = strag[0]
    assert (f.node, f.gpu, f.job, f.site, f.cause) == ("node-002", "5", "job-a", "dc1", cause)
    assert 900 <= f.start - T0 <= 900 + 4 * STEP + 120
    # healthy waiting peers have *lower* tensor activity; they are never flagged
    assert all(f.gpu == "5" for f in findings if f.kind == "straggler")


def test_healthy_fleet_with_idle_node_and_job_start_has_no_findings(tmp_path: Path) -> None:
    rec = synth(tmp_path / "r.om", Synth(idle_nodes=(3,), job_start=600.0, seed=3))
    _, findings = replay([str(rec)], fast_cfg())
    assert findings == []


def test_scrape_gap_is_not_a_straggler(tmp_path: Path) -> None:
    rec = synth(tmp_path / "r.om", Synth(gap=(1, 600.0, 900.0), seed=4))
    _, findings = replay([str(rec)], fast_cfg())
    assert findings == []


def test_throttling_and_network_findings(tmp_path: Path) -> None:
    rec = synth(tmp_path / "r.om", Synth(faults=[Fault("thermal", 1, 2, 600.0), Fault("link", 3, 4, 600.0)]))
    _, findings = replay([str(rec)], fast_cfg())
    kinds = {(f.kind, f.node, f.gpu, f.cause) for f in findings}
    assert ("throttling", "node-001", "2", "thermal") in kinds
    assert ("network", "node-003", "4", "network") in kinds


def test_dcgm_profile_finds_the_straggler(tmp_path: Path) -> None:
    rec = synth(tmp_path / "r.om", Synth(faults=[Fault("thermal", 2, 5, 900.0)], dcgm=True))
    _, findings = replay([str(rec)], fast_cfg(detector__profile="dcgm"))
    strag = [f for f in findings if f.kind == "straggler"]
    assert [(f.node, f.gpu, f.job, f.cause) for f in strag] == [("node-002", "5", "job-a", "thermal")]


# ---------------------------------------------------------------- replay CLI

REPLAY_KEYS: dict[str, type | tuple[type, ...]] = {
    "kind": str, "cause": (str, type(None)), "node": (str, type(None)), "gpu": (str, type(None)),
    "job": (str, type(None)), "site": (str, type(None)), "start": (int, float),
    "end": (int, float, type(None)), "score": (int, float), "summary": str, "detected": (int, float),
    "incident": str, "other_causes": list, "namespace": (str, type(None)), "pod": (str, type(None)),
    "route": str, "pattern": (str, type(None)), "owner": (str, type(None)), "impact": (dict, type(None))}


def test_replay_json_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rec = synth(tmp_path / "r.om", Synth(faults=[Fault("clock", 0, 1, 600.0, end=1200.0)]))
    cfg = tmp_path / "d.toml"
    cfg.write_text('[detector]\nwindow_seconds = 120\n[findings]\nopen_after = 2\nclose_after = 2\n')
    assert cli_main(["replay", str(rec), "--config", str(cfg), "--step", "60", "--format", "json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines, "no findings printed"
    for obj in lines:
        assert set(obj) == set(REPLAY_KEYS)
        for k, typ in REPLAY_KEYS.items():
            assert isinstance(obj[k], typ), (k, obj[k])
    strag = [o for o in lines if o["kind"] == "straggler"]
    assert strag[0]["node"] == "node-000" and strag[0]["gpu"] == "1" and strag[0]["cause"] == "clock"
    assert set(strag[0]["impact"]) == {"slowdown", "gpu_hours_lost", "job_gpus"}  # detector.incidents.impact
    assert strag[0]["end"] is not None and 1200 <= strag[0]["end"] - T0 <= 1200 + 240
    assert strag[0]["start"] <= strag[0]["detected"] <= strag[0]["start"] + 2 * 60 and strag[0]["incident"]


def test_replay_entry_point_reports_missing_inputs(tmp_path: Path) -> None:
    rec = synth(tmp_path / "r.om", Synth(seconds=600.0))
    out = subprocess.run([sys.executable, "-m", "gpufleet.detector.service.cli", "replay", str(rec), "--step", "60",
                          "--format", "json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "gpufleet_gpu_dram_active_ratio" in out.stderr  # the synthetic fleet has no DRAM activity
    assert "gpufleet_gpu_utilization_ratio" not in out.stderr


@pytest.mark.parametrize(("text", "msg"), [
    ("[detector]\nprofile = 'nvidia'\n", "profile must be one of"),
    ("[detector]\nwindow_seconds = 'five'\n", "window_seconds: expected float"),
    ("[detectr]\n", "unknown section [detectr]"),
    ("[findings]\nopen_afterr = 2\n", "unknown key 'open_afterr'"),
    ("[detector\n", "invalid TOML"),
    ("[prometheus]\nurl = 'localhost:9090'\n", "must start with http"),
    ("[[sites]]\nname = 'a'\n", "facility_power is required"),
])
def test_bad_config_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, msg: str) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    rec = synth(tmp_path / "r.om", Synth(nodes=1, seconds=300.0))
    assert cli_main(["replay", str(rec), "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert msg in err and "bad.toml" in err


def test_bad_recording_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.om"
    series = 'gpufleet_gpu_power_watts{gpu="0",instance="n:9445"}'
    for body in (f"{series} notanumber 1\n", f"{series} 1 1\n{series} 2\n", f"{series} 1 1\n{series} x 2\n"):
        bad.write_text(f"# TYPE gpufleet_gpu_power_watts gauge\n{body}# EOF\n")
        assert cli_main(["replay", str(bad)]) == 2
        err = capsys.readouterr().err
        assert "not valid OpenMetrics" in err or "without a timestamp" in err, err
    bad.write_text("# TYPE other gauge\nother 1 1\n# EOF\n")
    assert cli_main(["replay", str(bad)]) == 2
    assert "no samples of the profile's metrics" in capsys.readouterr().err
    assert cli_main(["replay", str(tmp_path / "nope.om")]) == 2
    assert "cannot read" in capsys.readouterr().err


# ---------------------------------------------------------------- scoring on a hand-built peer group

def _frame(n: int = 16) -> GpuFrame:
    rng = np.random.default_rng(1)
    vals = {"util": 0.97 + rng.normal(0, 0.005, n), "samples": np.full(n, 8.0),
            "sm_clock": 1.98e9 + rng.normal(0, 2e6, n), "tensor": 0.45 + rng.normal(0, 0.01, n),
            "power": 520 + rng.normal(0, 5, n), "temp": 60 + rng.normal(0, 1, n)}
    vals["util"][3] = 0.90  # the lowest utilization in the job: a healthy rank, not the straggler
    vals["util"][7], vals["tensor"][7], vals["power"][7] = 0.99, 0.78, 640  # busier than its waiting peers
    return GpuFrame([f"n{i // 8}" for i in range(n)], [str(i % 8) for i in range(n)], ["dc1"] * n, ["j"] * n,
                    ["H100"] * n, vals, np.ones(n, dtype=bool), np.zeros(n, dtype=bool))


def test_the_straggler_is_the_busier_gpu_not_the_least_utilized() -> None:
    res = straggler.score(_frame(), StragglerParams())
    assert [(c.node, c.gpu) for c in res.candidates] == [("n0", "7")]
    assert res.score[7] > 4 > res.score[3]


def test_idle_and_churning_gpus_are_not_scored() -> None:
    f = _frame()
    f.values["util"][7] = 0.0  # idle
    f.churn[5] = True  # its job started within the window
    res = straggler.score(f, StragglerParams())
    assert not res.scored[7] and not res.scored[5] and res.candidates == []


class _Resp:
    def __init__(self, status: int, body: object) -> None:
        self.status_code, self._body, self.text = status, body, str(body)

    def json(self) -> object:
        if isinstance(self._body, Exception):
            raise self._body
        return self._body


class _Session:
    def __init__(self, resp: _Resp) -> None:
        self.resp, self.auth, self.verify = resp, None, True
        self.headers: dict[str, str] = {}
        self.calls: list[dict[str, str]] = []

    def post(self, url: str, data: dict[str, str], timeout: float) -> _Resp:
        self.calls.append(data)
        return self.resp


def test_prometheus_source_with_a_mock_transport() -> None:
    ok = {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"__name__": "x", "gpu": "0", "instance": "n:9445"}, "value": [1.0, "1500"]},
        {"metric": {"gpu": "1", "instance": "n:9445"}, "value": [1.0, "NaN"]}]}}
    sess = _Session(_Resp(200, ok))
    src = PrometheusSource("http://prom:9090/", session=sess)  # type: ignore[arg-type]
    q = Query("sm_clock", "DCGM_FI_DEV_SM_CLOCK", "avg", scale=1e6)
    assert src.query(q, 100.0, 300.0) == [({"gpu": "0", "instance": "n:9445"}, 1.5e9)]
    assert sess.calls[0] == {"query": "avg_over_time(DCGM_FI_DEV_SM_CLOCK[300s])", "time": "100.000"}
    for bad in (_Resp(503, ValueError("not json")), _Resp(200, {"status": "success", "data": {"resultType": "matrix"}}),
                _Resp(200, {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}}]}})):
        src.session = _Session(bad)  # type: ignore[assignment]
        with pytest.raises(SourceError):
            src.query(q, 100.0, 300.0)
    assert src.query_errors == 3


def test_site_selectors_from_config() -> None:
    cfg = parse({"sites": [{"name": "dc1",
                            "facility_power": {"metric": "bms_power_watts", "labels": {"meter": "main"}},
                            "it_power": {"metric": "ipmi_dcmi_power_consumption_watts", "labels": {"site": "dc1"}}}],
                 "pue": {"knots_celsius": [10, 20]}})
    (site,) = cfg.sites
    assert [(q.feature, q.metric, q.matchers, q.site) for q in site.queries] == [
        ("facility_power", "bms_power_watts", (("meter", "=", "main"),), "dc1"),
        ("it_power", "ipmi_dcmi_power_consumption_watts", (("site", "=", "dc1"),), "dc1")]
    assert site.queries[1].promql(300) == 'avg_over_time(ipmi_dcmi_power_consumption_watts{site="dc1"}[300s])'
    assert cfg.pue.knots_celsius == (10.0, 20.0)


def _nvlink_frame(replays: dict[int, float] | None) -> GpuFrame:
    f = _frame()
    f.values["util"][7], f.values["tensor"][7], f.values["power"][7] = 0.97, 0.45, 520.0  # all ranks healthy
    if replays is not None:  # dcgm's optional NVLink error counters (increase over the window)
        f.values["nvlink_replay"] = np.zeros(16)
        f.values["nvlink_recovery"] = np.zeros(16)
        for i, v in replays.items():
            f.values["nvlink_replay"][i] = v
            f.values["nvlink_recovery"][i] = 1.0
    return f


def test_dcgm_nvlink_errors_on_one_rank_make_it_an_nvlink_straggler() -> None:
    res = straggler.score(_nvlink_frame({10: 40.0}), StragglerParams())
    assert [(c.node, c.gpu, c.cause) for c in res.candidates] == [("n1", "2", "nvlink")]
    assert res.candidates[0].evidence.values == {"nvlink_errors": 41.0}
    # without the counters, or with flat ones, or with errors on every rank alike: nothing
    for frame in (_nvlink_frame(None), _nvlink_frame({}), _nvlink_frame(dict.fromkeys(range(16), 40.0))):
        assert straggler.score(frame, StragglerParams()).candidates == []
    idle = _nvlink_frame({10: 40.0})
    idle.values["util"][10] = 0.0  # an idle GPU is not a straggler, whatever its links do
    assert straggler.score(idle, StragglerParams()).candidates == []


def test_dcgm_nvlink_error_fields_are_optional_and_reported_missing(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    rec = synth(tmp_path / "r.om", Synth(faults=[Fault("thermal", 2, 5, 900.0)], dcgm=True))
    _, findings = replay([str(rec)], fast_cfg(detector__profile="dcgm"))
    strag = [f for f in findings if f.kind == "straggler"]
    assert [(f.node, f.gpu, f.cause) for f in strag] == [("node-002", "5", "thermal")]
    err = capsys.readouterr().err
    for field_name in ("CRC_FLIT", "CRC_DATA", "REPLAY", "RECOVERY"):
        assert f"DCGM_FI_DEV_NVLINK_{field_name}_ERROR_COUNT_TOTAL" in err
