"""The Slurm world (issue 31) has each property it is built for: the jobs' and the site's intent, its faults."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpufleet.sim import quality, quality_slurm, slurm_world
from gpufleet.sim.simulator import Simulator
from gpufleet.vocab.nvml import CLOCK_EVENT_BITS

START = 1_782_864_000.0  # 2026-07-01T00:00:00Z
STEP = 15.0
MIN = 60.0


@dataclass
class Trace:
    """Per tick (the state at ``t`` seconds from the start): the arrays the tests read."""

    sim: Simulator
    t: np.ndarray
    arrays: dict[str, np.ndarray]
    jobs: list[list[list[str | None]]]  # tick -> node -> local GPU -> job id
    step_s: list[dict[str, float]]

    def at(self, minute: float) -> int:
        return int(np.argmin(np.abs(self.t - minute * MIN)))

    def gpu(self, node: int, local: int) -> int:
        return node * slurm_world.GPUS + local


@pytest.fixture(scope="module")
def trace() -> Trace:
    sim = slurm_world.simulator(seed=1, step=STEP, start=START)
    p = sim.physics
    keys = ("limit", "reasons", "pcie_gen", "pcie_width", "pcie_replay", "clock_sm", "util", "nic_wait", "nic_bytes",
            "nic_hw", "host_psi_cpu", "nvl_rate", "power")
    rows: dict[str, list[np.ndarray]] = {k: [] for k in keys}
    times, jobs, steps = [], [], []
    for _ in range(int(slurm_world.DURATION_S / STEP)):
        sim.step()
        times.append(p.t)
        for k in keys:
            rows[k].append(np.array(getattr(p, k), copy=True))
        jobs.append([sim.gpu_jobs(i) for i in range(len(sim.nodes))])
        steps.append(dict(p.job_step_s))
    return Trace(sim, np.array(times), {k: np.stack(v) for k, v in rows.items()}, jobs, steps)


def test_the_fleet_is_h200_and_b200_hgx_with_a_nic_per_gpu(trace: Trace) -> None:
    f = trace.sim.fleet
    models = [n.model.key for n in f.nodes]
    assert models == ["H200-SXM"] * slurm_world.H200_NODES + ["B200"] * slurm_world.B200_NODES
    assert f.nics_per_node == f.gpus_per_node + 1  # one rail NIC per GPU plus the storage NIC
    limits = f.gpu_param("power_limit_w")
    assert set(limits[f.gpu_node < slurm_world.H200_NODES]) == {700.0}
    assert set(limits[f.gpu_node >= slurm_world.H200_NODES]) == {1000.0}


def _wait_per_byte(tr: Trace, a: float, b: float) -> np.ndarray:
    i, j = tr.at(a), tr.at(b)
    wait = tr.arrays["nic_wait"][j] - tr.arrays["nic_wait"][i]
    sent = tr.arrays["nic_bytes"][j, :, 0] - tr.arrays["nic_bytes"][i, :, 0]
    return np.where(sent > 1e9, wait / np.maximum(sent, 1.0), np.nan)


def test_all_to_all_job_ports_wait_alike_and_the_job_runs_at_its_own_pace(trace: Trace) -> None:
    f = trace.sim.fleet
    per_byte = _wait_per_byte(trace, 2, 14)
    rails = ~f.nic_is_host
    a2a = rails & np.isin(f.nic_node, [7, 8])
    others = rails & ~a2a & np.isfinite(per_byte)
    assert others.sum() >= 16  # alike ports of all-reduce jobs, busy
    mine = per_byte[a2a]
    assert np.isfinite(mine).all()
    assert mine.max() / mine.min() < 1.05  # every port of the job alike
    assert mine.min() > 20 * np.nanmedian(per_byte[others])  # far above all-reduce ports
    # no ECN/CNP storm (incast, not congestion) and the job is not slowed by it
    hw = trace.arrays["nic_hw"]
    assert (hw[trace.at(14)][a2a] == hw[trace.at(2)][a2a]).all()
    k = trace.at(10)
    assert trace.step_s[k][slurm_world.ALL_TO_ALL_JOB] == pytest.approx(trace.step_s[trace.at(5)][slurm_world.ALL_TO_ALL_JOB],
                                                                        rel=0.05)


def test_congestion_on_one_port_of_the_all_to_all_job_stands_out_from_the_job(trace: Trace) -> None:
    f = trace.sim.fleet
    per_byte = _wait_per_byte(trace, 42, 54)
    a2a = ~f.nic_is_host & np.isin(f.nic_node, [7, 8])
    hot = 8 * f.nics_per_node + 3
    rest = per_byte[a2a & (np.arange(f.n_nics) != hot)]
    assert per_byte[hot] > 5 * rest.max()
    assert rest.max() / rest.min() < 1.05


def test_site_power_cap_on_every_gpu_of_the_job_enforced_below_the_default(trace: Trace) -> None:
    k = trace.at(20)
    capped = [trace.gpu(n, g) for n in (14, 15, 16) for g in range(8)]
    idle_b200 = [trace.gpu(19, g) for g in range(8)]
    limit = trace.arrays["limit"][k]
    assert set(limit[capped]) == {slurm_world.SITE_CAP_W}
    assert set(limit[idle_b200]) == {1000.0}
    bit = CLOCK_EVENT_BITS["sw_power_cap"]
    assert ((trace.arrays["reasons"][k][capped] & bit) > 0).all()  # every GPU of the job at its cap, alike


def test_one_gpu_capped_below_its_job_peers(trace: Trace) -> None:
    k = trace.at(40)
    fault = trace.gpu(15, 4)
    peers = [trace.gpu(n, g) for n in (14, 15, 16) for g in range(8) if trace.gpu(n, g) != fault]
    assert trace.arrays["limit"][k][fault] == pytest.approx(600.0)
    assert set(trace.arrays["limit"][k][peers]) == {slurm_world.SITE_CAP_W}
    assert trace.arrays["clock_sm"][k][fault] < trace.arrays["clock_sm"][k][peers].min()
    assert trace.arrays["limit"][trace.at(25)][fault] == slurm_world.SITE_CAP_W  # not before the onset


def test_pcie_retrain_lowers_width_below_max_only_on_that_gpu_under_load(trace: Trace) -> None:
    g = trace.gpu(5, 2)
    width, gen = trace.arrays["pcie_width"], trace.arrays["pcie_gen"]
    during, before = trace.at(30), trace.at(19)
    assert width[during][g] == 8 and gen[during][g] == 5  # x8 of x16, its generation kept under load
    others = np.delete(np.arange(width.shape[1]), g)
    assert (width[:, others] == 16).all()
    assert width[before][g] == 16 and width[trace.at(45)][g] == 16  # before the onset, after the end
    replay = trace.arrays["pcie_replay"][:, g]
    burst = replay[trace.at(21)] - replay[trace.at(20)]
    assert burst > 600  # the burst of replays in the minute after the onset
    assert replay[trace.at(19)] == 0
    slower = trace.step_s[during]["40002"] / trace.step_s[before]["40002"]
    assert 1.05 < slower < 1.2  # the fine-tune about 10 % slower


def test_pcie_generation_drops_at_idle_everywhere_and_is_max_under_load(trace: Trace) -> None:
    gen = trace.arrays["pcie_gen"]
    for k in (trace.at(5), trace.at(30), trace.at(55)):
        idle = np.array([j is None for node in trace.jobs[k] for j in node])
        assert idle.any() and (~idle).any()
        assert (gen[k][idle] == slurm_world.IDLE_PCIE_GEN).all()
        assert (gen[k][~idle] == 5).all()
    node_011 = [trace.gpu(11, g) for g in range(8)]
    assert (gen[trace.at(10)][node_011] == 1).all() and (gen[trace.at(30)][node_011] == 5).all()


def test_application_clocks_locked_at_1200_mhz_on_one_gpu(trace: Trace) -> None:
    k = trace.at(55)
    g = trace.gpu(4, 6)
    peers = [trace.gpu(n, x) for n in (4, 5, 6) for x in range(8) if trace.gpu(n, x) != g]
    reasons = trace.arrays["reasons"][k]
    assert trace.arrays["clock_sm"][k][g] <= 1200
    assert reasons[g] & CLOCK_EVENT_BITS["applications_clocks_setting"]
    assert not reasons[g] & (CLOCK_EVENT_BITS["hw_slowdown"] | CLOCK_EVENT_BITS["sw_power_cap"])
    assert trace.arrays["clock_sm"][k][peers].min() > 1500
    assert not (trace.arrays["reasons"][:trace.at(47)] & CLOCK_EVENT_BITS["applications_clocks_setting"]).any()


def test_stray_process_starves_one_hosts_cpu(trace: Trace) -> None:
    psi = trace.arrays["host_psi_cpu"]
    during = (psi[trace.at(45)] - psi[trace.at(35)]) / 600.0
    assert during[2] > 0.3
    assert np.delete(during, 2).max() < 0.05


def test_preemption_requeue_and_drain_move_jobs_between_nodes(trace: Trace) -> None:
    def on(minute: float, node: int) -> set[str | None]:
        return set(trace.jobs[trace.at(minute)][node])

    assert on(10, 9) == on(10, 10) == {"40004"} and on(10, 11) == {None}
    assert on(21, 9) == {None} and on(21, 10) == {"40010"}  # preempted, the high-priority job runs
    assert on(25, 9) == on(25, 11) == {"40004"}  # requeued, partly on other nodes, same job id
    assert on(30, 12) == {"40005"} and on(35, 12) == {None} and on(55, 12) == {None}  # drained
    assert on(45, 10) == {"40005"}  # the drained job requeued elsewhere


def test_job_array_tasks_are_one_gpu_independent_jobs(trace: Trace) -> None:
    node = 17
    seen: set[str] = set()
    for k in range(len(trace.t)):
        ids = [j for j in trace.jobs[k][node] if j is not None]
        assert len(ids) == len(set(ids))  # one GPU per task
        seen.update(ids)
    assert len(seen) >= 16 and all(int(j) >= slurm_world.ARRAY_FIRST_ID for j in seen)
    gpus = [trace.gpu(node, g) for g in range(8)]
    assert (trace.arrays["nvl_rate"][:, gpus] == 0).all()  # no collectives
    k = trace.at(20)
    busy = [g for g in gpus if trace.arrays["util"][k][g] > 0]
    assert len(busy) >= 6
    assert trace.arrays["power"][k][busy].std() > 30.0  # each task its own work: their powers differ


def test_interactive_session_is_bursty_and_labelled(trace: Trace) -> None:
    node = 18
    window = slice(trace.at(12), trace.at(48))
    assert all(trace.jobs[k][node][:4] == [slurm_world.INTERACTIVE_ID] * 4 for k in range(*window.indices(10**6)))
    assert all(trace.jobs[k][node][4:] == [None] * 4 for k in range(len(trace.t)))
    util = trace.arrays["util"][window, [trace.gpu(node, g) for g in range(4)]]
    assert util.std(axis=0).min() > 8.0 and util.min() < 50 < util.max()


def test_checkpoints_of_the_4_node_job_every_15_minutes(trace: Trace) -> None:
    job = next(j for j in trace.sim.fleet.jobs if j.id == "40001")
    assert len(job.nodes) == 4
    ckpts = [(a, b) for a, b, what in job.phases if what == "checkpoint"]
    assert [a for a, _ in ckpts] == [900.0, 1800.0, 2700.0]
    k = trace.at(30.5)
    assert (trace.arrays["util"][k][[trace.gpu(n, g) for n in range(4) for g in range(8)]] == 0).all()


@pytest.mark.slow
def test_recording_carries_slurm_job_ids_limits_and_the_controls(tmp_path: Path) -> None:
    res = slurm_world.record(tmp_path, seed=1, step=60.0, start=START)
    labels = json.loads(res.labels.read_text())
    assert {c["name"] for c in labels["slurm"]["controls"]} == set(quality_slurm.CONTROL_NAMES) - {"other"}
    assert sorted(f["type"] for f in labels["faults"]) == ["app_clocks_locked", "network_congestion",
                                                           "pcie_retrain", "power_cap", "slow_host"]
    assert all(f["expected_findings"] and f["job_id"] for f in labels["faults"])
    assert [e for e in labels["confounders"] if e["type"] == "exporter_restart"]
    dcgm = res.files["dcgm"].read_text()
    hpc = set(re.findall(r'hpc_job="([^"]*)"', dcgm))
    assert {"40001", "40003", "40004", "40007", slurm_world.INTERACTIVE_ID} <= hpc
    assert all(j.isdigit() for j in hpc)
    gf = res.files["gpufleet"].read_text()
    info = set(re.findall(r'gpufleet_gpu_job_info\{[^}]*job_id="(\d+)"[^}]*instance="node-011:9445"', gf))
    assert info == {"40004"}  # requeued onto node-011
    assert re.search(r'gpufleet_gpu_power_limit_watts\{gpu="4",instance="node-015:9445"[^}]*\} 600(\.0*)? ', gf)
    assert re.search(r'gpufleet_gpu_clock_event_active\{[^}]*reason="applications_clocks_setting"', gf)
    assert re.search(r'gpufleet_gpu_pcie_link_width\{gpu="2",instance="node-005:9445"[^}]*\} 8(\.0*)? ', gf)
    assert re.search(r'DCGM_FI_DEV_POWER_MGMT_LIMIT\{[^}]*Hostname="node-014"[^}]*\} 800(\.0*)? ', dcgm)


def _finding(node: str, gpu: str | None, opened: float) -> dict[str, Any]:
    return {"node": node, "gpu": gpu, "opened": opened}


def test_false_findings_are_attributed_to_the_control_that_covers_them() -> None:
    sim = slurm_world.simulator(seed=1, step=STEP, start=START)
    sim.fleet.jobs.sort(key=lambda j: j.start)
    ctls = slurm_world.controls(sim)
    at = START + 10 * MIN
    assert quality_slurm.control_of(_finding("node-007", "3", at), ctls, STEP) == "all_to_all"
    assert quality_slurm.control_of(_finding("node-015", None, at), ctls, STEP) == "site_power_cap"
    assert quality_slurm.control_of(_finding("node-019", "0", at), ctls, STEP) == "idle_pcie_gen"
    assert quality_slurm.control_of(_finding("node-018", "5", at), ctls, STEP) == "idle_pcie_gen"
    assert quality_slurm.control_of(_finding("node-018", "1", at), ctls, STEP) == "interactive"
    assert quality_slurm.control_of(_finding("node-000", "1", START + 15 * MIN + 30), ctls, STEP) == "checkpoints"
    assert quality_slurm.control_of(_finding("node-010", None, START + 20 * MIN), ctls, STEP) == "preempt_requeue"
    assert quality_slurm.control_of(_finding("node-012", None, START + 32 * MIN), ctls, STEP) == "drain_requeue"
    assert quality_slurm.control_of(_finding("node-404", None, at), ctls, STEP) == "other"


def test_quality_fleet_slurm_hands_over_to_the_section(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Sequence[str]] = []

    def main(argv: Sequence[str]) -> int:
        seen.append(list(argv))
        return 0

    monkeypatch.setattr(quality_slurm, "main", main)
    assert quality.main(["--fleet", "slurm", "--quick", "--out", "x", "--jobs", "2"]) == 0
    assert seen == [["--out", "x", "--jobs", "2", "--scrape", "prometheus", "--quick"]]


def test_harness_config_evaluates_every_scrape_with_a_window_of_four() -> None:
    cfg = quality_slurm.config("dcgm", 60.0)
    assert (cfg.profile, cfg.interval_seconds, cfg.window_seconds) == ("dcgm", 60.0, 240.0)
    assert quality_slurm.config("gpufleet", 15.0).window_seconds == 120.0


@pytest.mark.slow
def test_the_section_scores_every_finding_and_attributes_each_false_one(tmp_path: Path) -> None:
    [run] = quality_slurm.plan(1, (60.0,))
    outs = quality_slurm.execute(run, str(tmp_path))
    assert [o.hw.profile for o in outs] == ["gpufleet", "dcgm"]
    for o in outs:
        assert o.step == 60.0 and len(o.hw.detected) == len(o.faults) == len(slurm_world.FAULTS)
        assert sum(o.false_by_control.values()) == len(o.hw.false_findings)
        assert o.hw.true_findings + len(o.hw.false_findings) == len(o.hw.findings)
        for fa in o.faults:  # a detected fault has a finding of an expected kind on its entity
            assert fa["latency"] is None or fa["found"]
    summary = quality_slurm.summarize(outs)
    assert set(summary) == {"60s/gpufleet", "60s/dcgm"}
    text = quality_slurm.slurm_markdown(summary)
    assert all(c in text for c in quality_slurm.CONTROL_NAMES) and "| pcie_retrain |" in text
    assert not list(tmp_path.rglob("*.om"))  # the recordings are removed once replayed


def test_the_world_records_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert slurm_world.main(["--out", str(tmp_path), "--step", "300"]) == 0
    out = capsys.readouterr().out
    assert "gpufleet:" in out and "dcgm:" in out and (tmp_path / "labels.json").exists()
    with pytest.raises(SystemExit):
        slurm_world.main(["--out", str(tmp_path), "--step", "0"])


def test_job_status_and_processes_follow_the_requeued_instance() -> None:
    from gpufleet.sim.slurm import SlurmNodes

    sim = slurm_world.simulator(seed=1, step=60.0, start=START)
    for _ in range(25):  # 25 minutes: 40004 requeued on node-009 and node-011
        sim.step()
    status = {s["job_id"]: s for s in sim.job_status()}
    assert status["40004"]["nodes"] == ["node-009", "node-011"] and status["40004"]["gpus"] == 16
    nodes = SlurmNodes(sim)
    ranks = [p.rank for i in (9, 11) for p in nodes.processes(i) if p is not None]
    assert sorted(ranks) == list(range(16))  # ranks of the running instance, none lost
    array = [p for p in nodes.processes(17) if p is not None]
    assert array and len({p.slurm_job for p in array}) == len(array)  # each task its own Slurm job


def test_other_seeds_draw_their_own_ids_cap_and_fault_places() -> None:
    one, two = slurm_world.variant(1), slurm_world.variant(2)
    assert one.faults == slurm_world.FAULTS and one.id(slurm_world.CAPPED) == slurm_world.CAPPED_JOB
    assert two.base != one.base and [f["kind"] for f in two.faults] == [f["kind"] for f in one.faults]
    assert two.faults != one.faults and two == slurm_world.variant(2)  # drawn, reproducibly
    sim = slurm_world.simulator(seed=2, step=60.0, start=START)
    for _ in range(24):
        sim.step()
    p = sim.physics
    capped = np.concatenate([sim.fleet.node_gpus(n) for n in (14, 15, 16)])
    limit = p.limit[capped]
    assert set(limit) <= {two.cap_w, 600.0} and (limit == two.cap_w).sum() >= 23
    assert ((p.reasons[capped] & CLOCK_EVENT_BITS["sw_power_cap"]) > 0).all()
    assert set(sim.gpu_jobs(14)) == {two.id(slurm_world.CAPPED)}
    labels = slurm_world.labels(sim)
    assert labels["slurm"]["site_power_cap"] == {"job_id": two.id(slurm_world.CAPPED), "limit_watts": two.cap_w}
    assert [(f["node"], f["onset"] - START) for f in labels["faults"]] == [(f["node"], f["onset"]) for f in two.faults]


def test_no_two_faults_of_a_variant_share_a_gpu() -> None:
    for seed in range(1, 30):
        places = [(f["node"], f.get("gpu")) for f in slurm_world.variant(seed).faults if f.get("gpu") is not None]
        assert len(places) == len(set(places)), seed
        nodes = [f["node"] for f in slurm_world.variant(seed).faults]
        assert nodes[0] != nodes[1]  # the fine-tune's two faults on different nodes: one answer each


@pytest.mark.parametrize("bad", ["0", "-15", "301", "x"])
def test_the_harness_refuses_a_dcgm_collect_interval_out_of_range(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        quality_slurm.main(["--dcgm-collect", bad, "--out", "/nonexistent/never-written"])
    assert e.value.code == 2 and "--dcgm-collect" in capsys.readouterr().err
    assert slurm_world.DCGM_COLLECT_S == 30.0  # nothing changed for the runs that follow


@pytest.mark.slow
def test_a_starved_host_opens_within_two_scrapes_from_its_latest_pressure(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The stray process of seed 3 (no checkpoint at its onset) at 15 s scrapes, in both profiles: with the pressure
    of the latest scrape interval (``host_cpu_pressure_now``) its host straggler opens within two scrapes; read over
    the window alone (the control), the pressure needs several scrapes to fill enough of it."""
    from gpufleet.detector import engine
    from gpufleet.detector.service.replay import replay
    from gpufleet.sim.scenario import parse_time

    res = slurm_world.record(tmp_path, seed=3, step=STEP, start=parse_time(quality.START),
                             profiles=("gpufleet", "dcgm"), scrape="prometheus")
    labels = json.loads(res.labels.read_text())
    [fault] = [f for f in labels["faults"] if f["type"] == "slow_host"]

    def latency(profile: str) -> float:
        _, found = replay([str(res.files[profile])], quality_slurm.config(profile, STEP), STEP)
        opened = [f.opened for f in found if f.kind == "straggler" and f.cause == "host" and f.node == fault["node"]
                  and fault["onset"] <= f.opened <= fault["end"]]
        assert opened, profile
        return float((min(opened) - fault["begins"]) / STEP)

    with_now = {p: latency(p) for p in ("gpufleet", "dcgm")}
    original = getattr(engine, "queries")  # noqa: B009 (the engine's own name, as quality_fabric swaps it)
    monkeypatch.setattr(engine, "queries",
                        lambda profile: tuple(q for q in original(profile) if q.feature != "host_cpu_pressure_now"))
    window_only = {p: latency(p) for p in ("gpufleet", "dcgm")}
    for p in ("gpufleet", "dcgm"):
        assert with_now[p] <= 2.0 < window_only[p], (p, with_now, window_only)
