"""The live simulated fleet: real agent processes serve the simulator's state; the demo command.

Every agent listens on 127.0.0.1 only; every fleet is stopped at the end of its test and
the tests check that no agent process outlives it.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from support import BIN, free_port, need_binary

from gpufleet.agent.nvml.model import Snapshot
from gpufleet.sim.live import LiveFleet, LiveFleetError
from gpufleet.sim.simulator import Simulator

pytestmark = pytest.mark.timeout(120)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    r = requests.get(url, timeout=5)
    r.raise_for_status()
    out: Samples = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def processes_mentioning(text: str) -> list[psutil.Process]:
    """Live processes whose command line mentions ``text`` (our run directory)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and any(text in a for a in p.info["cmdline"] or []):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def wait_gone(text: str, timeout: float = 10.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while (left := processes_mentioning(text)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


SCENARIO = """
name = "live-test"
description = "2 nodes x 8 GPUs, one job, GPU 5 of node-001 gets its clock stuck low 60 s in"
duration = "1h"
step = 1

[[sites]]
name = "site-t"
nodes = 2
gpus_per_node = 8

[jobs]
[[jobs.fixed]]
id = "job-t"
nodes = "all"
start = 0

[[faults]]
kind = "clock_stuck_low"
node = "node-001"
gpu = 5
onset = "60s"
severity = 0.8
"""


@pytest.mark.slow
def test_live_fleet_agents_serve_the_simulator(tmp_path: Path) -> None:
    run = tmp_path / "run"
    scenario = tmp_path / "live-test.toml"
    scenario.write_text(SCENARIO)
    fleet = LiveFleet(scenario, seed=3, speed=30, tick=0.5, run_dir=run)
    with fleet:
        sim = fleet.simulator
        assert isinstance(sim, Simulator)  # built from the scenario file (the fleet types it as SimulatorLike)
        assert [n for n, _ in fleet.targets] == list(sim.nodes)
        assert len(fleet.targets) == 2
        pids = [a.proc.pid for a in fleet.agents if a.proc is not None]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)

        # Prometheus file_sd targets: one group per node with the fleet's target labels.
        groups = json.loads(fleet.targets_file.read_text())
        assert [g["targets"] for g in groups] == [[url.split("/")[2]] for _, url in fleet.targets]
        assert [g["labels"]["instance"] for g in groups] == [f"{n}:9445" for n, _ in fleet.targets]
        assert all(g["labels"]["site"] for g in groups)
        check = subprocess.run([need_binary("promtool"), "check", "config", str(fleet.prometheus_config)],
                               capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stdout + check.stderr

        # The agents serve exactly the snapshot the simulator wrote (the ticker is paused while we hold the lock).
        with fleet.lock:
            for (node, url), agent in zip(fleet.targets, fleet.agents, strict=True):
                snap = Snapshot.from_json(agent.snapshot.read_text())
                got = scrape(url)
                assert len(snap.samples) == 8
                for inv, s in zip(snap.gpus, snap.samples, strict=True):
                    gpu = str(inv.index)
                    assert s.clock_sm_mhz is not None and s.power_mw is not None
                    assert value(got, "gpufleet_gpu_clock_hertz", gpu=gpu, clock="sm") == s.clock_sm_mhz * 1e6, node
                    assert value(got, "gpufleet_gpu_power_watts", gpu=gpu) == pytest.approx(s.power_mw / 1000)
                    assert value(got, "gpufleet_gpu_temperature_celsius", gpu=gpu, sensor="gpu") == \
                        s.temperature_gpu_c
                # the job mapping and sysfs tree reach the agent's jobs and NIC collectors
                jobs = {dict(k[1])["gpu"]: dict(k[1])["job_id"] for k in got if k[0] == "gpufleet_gpu_job_info"}
                want = {str(g): j for g, j in enumerate(sim.gpu_jobs(sim.nodes.index(node)))
                        if j}
                assert jobs == want
                assert any(k[0] == "gpufleet_ib_port_transmit_bytes_total" for k in got)

        # Energy counters grow as the simulation runs.
        before = {url: scrape(url) for _, url in fleet.targets}
        fault = sim.labels()["faults"][0]
        deadline = time.monotonic() + 30
        while fleet.sim_time < fault["onset"] + 20 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert fleet.sim_time >= fault["onset"] + 20, "the simulated fleet did not advance"
        assert fleet.error is None
        for node, url in fleet.targets:
            after = scrape(url)
            for g in range(8):
                e0 = value(before[url], "gpufleet_gpu_energy_joules_total", gpu=str(g))
                e1 = value(after, "gpufleet_gpu_energy_joules_total", gpu=str(g))
                assert e1 > e0, (node, g)

        # After the onset the injected straggler's SM clock is below every healthy peer's.
        clocks: dict[tuple[str, str], float] = {}
        for node, url in fleet.targets:
            got = scrape(url)
            for g in range(8):
                clocks[(node, str(g))] = value(got, "gpufleet_gpu_clock_hertz", gpu=str(g), clock="sm")
        bad = (fault["node"], fault["gpu"])
        assert bad in clocks
        assert clocks[bad] < min(v for k, v in clocks.items() if k != bad)

        # An agent that dies is reported, naming its node.
        fleet.check()
        victim = fleet.agents[1]
        assert victim.proc is not None
        victim.proc.kill()
        victim.proc.wait(timeout=10)
        with pytest.raises(LiveFleetError, match=victim.node):
            fleet.check()

    # Shutdown: every agent gone, ports closed, nothing mentions the run directory any more.
    assert not wait_gone(str(run))
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    assert not any(port_open(int(url.split(":")[2].split("/")[0])) for _, url in fleet.targets)


SLURM_SCENARIO = """
name = "live-slurm"
description = "3 nodes x 2 GPUs: train-a ends at 30 s, train-c follows at 40 s, job 4242 dies with a GPU at 50 s"
duration = "1h"
step = 1

[[sites]]
name = "site-s"
nodes = 3
gpus_per_node = 2

[jobs]
[[jobs.fixed]]
id = "train-a"
nodes = ["node-000", "node-001"]
end = "30s"
[[jobs.fixed]]
id = "4242"
nodes = ["node-002"]
[[jobs.fixed]]
id = "train-c"
nodes = ["node-000"]
start = "40s"

[[faults]]
kind = "xid79"
node = "node-002"
gpu = 1
onset = "50s"
end = "2h"
"""


def owners_and_jobs(got: Samples) -> tuple[dict[str, set[tuple[str, str]]], dict[str, set[str]], dict[str, float]]:
    """(GPU -> {(owner_kind, owner)}, GPU -> {job_id} of gpufleet_gpu_job_info, GPU -> gpufleet_gpu_processes)."""
    owners: dict[str, set[tuple[str, str]]] = {}
    jobs: dict[str, set[str]] = {}
    count: dict[str, float] = {}
    for (name, labels), v in got.items():
        d = dict(labels)
        if name == "gpufleet_gpu_owner_processes":
            assert v == 1, (d, v)  # one rank per GPU
            owners.setdefault(d["gpu"], set()).add((d["owner_kind"], d["owner"]))
        elif name == "gpufleet_gpu_job_info":
            jobs.setdefault(d["gpu"], set()).add(d["job_id"])
        elif name == "gpufleet_gpu_processes":
            count[d["gpu"]] = v
    return owners, jobs, count


@pytest.mark.slow
def test_live_fleet_runs_jobs_as_slurm_processes(tmp_path: Path) -> None:
    """``processes=True``: each busy GPU lists its rank's process, whose /proc/PID/cgroup names the Slurm job;
    the agents attribute exactly the simulator's jobs from the cgroups, with no mapping files, as jobs start,
    end and die."""
    scenario = tmp_path / "live-slurm.toml"
    scenario.write_text(SLURM_SCENARIO)
    # A tick far longer than the test: the simulation moves only when the test advances it.
    with LiveFleet(scenario, seed=5, tick=3600, run_dir=tmp_path / "run", processes=True) as fleet:
        sim, slurm = fleet.simulator, fleet.slurm
        assert isinstance(sim, Simulator) and slurm is not None
        ids = slurm.slurm_ids
        assert ids == {"train-a": "4243", "4242": "4242", "train-c": "4244"}  # numeric ids kept, others numbered

        def truth(i: int) -> dict[str, str]:
            return {str(k): ids[j] for k, j in enumerate(sim.gpu_jobs(i)) if j is not None}

        def check_all() -> None:
            for i, (node, url) in enumerate(fleet.targets):
                want = truth(i)
                deadline = time.monotonic() + 15
                while True:  # the agent re-reads the snapshot within its cache time
                    owners, jobs, count = owners_and_jobs(got := scrape(url))
                    if ({g: {o for _, o in v} for g, v in owners.items()} == {g: {j} for g, j in want.items()}
                            or time.monotonic() > deadline):
                        break
                    time.sleep(0.2)
                assert owners == {g: {("slurm_job", j)} for g, j in want.items()}, (node, sim.t)
                assert jobs == {g: {j} for g, j in want.items()}, (node, sim.t)  # from the cgroups alone
                assert count == {g: float(g in want) for g in ("0", "1") if g in count}, (node, count)
                samples = Snapshot.from_json(fleet.agents[i].snapshot.read_text()).samples
                lost = [s.lost for s in samples]
                for g in want:  # the rank's memory is its GPU's simulated memory use (NVML's MiB granularity)
                    mem = got[("gpufleet_gpu_owner_memory_used_bytes", (("gpu", g), ("gpu_instance", ""),
                                                                        ("owner", want[g]), ("owner_kind", "slurm_job")))]
                    used = samples[int(g)].memory_used_bytes
                    assert used is not None and 0 <= used - mem < 2**20, (node, g, used, mem)
                assert set(count) == {str(k) for k, gone in enumerate(lost) if not gone}  # idle GPUs: 0, not absent
                assert ("gpufleet_gpu_process_owner_errors_total", (("error", "not_found"),)) not in got
                # the fake /proc: one cgroup file per rank process, nothing left of ended ones
                procfs = fleet.agents[i].procfs
                assert procfs is not None
                pids = {p.pid: p for p in slurm.processes(i) if p is not None}
                assert {int(d.name) for d in procfs.iterdir() if d.name.isdigit()} == set(pids)
                for pid, p in pids.items():
                    assert (procfs / str(pid) / "cgroup").read_text() == \
                        f"0::/system.slice/slurmstepd.scope/job_{p.slurm_job}/step_0/user/task_{p.gpu}\n"
                assert not any(fleet.agents[i].job_mapping.iterdir()) or i == 1  # no mapping files written

        check_all()  # before the first step: every GPU idle
        assert truth(0) == truth(1) == truth(2) == {}
        fleet.advance(1.0)
        check_all()  # train-a on node-000 and node-001, 4242 on node-002
        assert truth(0) == {"0": "4243", "1": "4243"} and truth(2) == {"0": "4242", "1": "4242"}
        for i, (_, url) in enumerate(fleet.targets):  # --path.procfs is the node's: its simulated CPU pressure
            psi = {k: v for k, v in scrape(url).items() if k[0] == "gpufleet_host_pressure_stalled_seconds_total"}
            assert psi == {("gpufleet_host_pressure_stalled_seconds_total", (("kind", "some"), ("resource", "cpu"))):
                           pytest.approx(float(sim.physics.host_psi_cpu[i]), abs=1e-6)}  # memory, io: not modelled
            assert psi and next(iter(psi.values())) > 0
        # A mapping file left behind by a job that is gone (no process, no cgroup): counted as stale, not exported.
        (fleet.agents[1].job_mapping / "1").write_text("4241\n")
        fleet.advance(34.0)  # train-a ended
        check_all()
        assert truth(0) == {} and truth(1) == {}
        stale = scrape(fleet.targets[1][1])
        assert value(stale, "gpufleet_gpu_job_mapping_stale_files") == 1
        fleet.advance(10.0)  # train-c started on node-000
        check_all()
        assert truth(0) == {"0": "4244", "1": "4244"}
        fleet.advance(10.0)  # node-002's GPU 1 fell off the bus: job 4242 died with it
        check_all()
        assert truth(2) == {}
        assert value(scrape(fleet.targets[2][1]), "gpufleet_gpu_processes", gpu="0") == 0


@pytest.mark.slow
def test_demo_no_ui_prints_what_the_agents_report(tmp_path: Path) -> None:
    run = tmp_path / "run"
    started = time.monotonic()
    proc = subprocess.run(
        [str(BIN / "gpufleet-sim"), "demo", "--duration", "12", "--no-ui", "--speed", "30", "--interval", "2",
         "--seed", "2", "--run-dir", str(run)],
        capture_output=True, text=True, timeout=90,
    )
    took = time.monotonic() - started
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert took < 45
    urls = re.findall(r"curl (http://127\.0\.0\.1:\d+/metrics)", out)
    assert len(urls) == 4  # the demo scenario: 4 nodes x 8 GPUs
    # per-node lines from the scraped agents, the ground-truth line kept apart
    for node in ("node-000", "node-001", "node-002", "node-003"):
        assert re.search(node + r": 8 GPUs up=8 sm_clock min/median \d+/\d+ MHz util median \d+%", out), node
    truth = re.findall(r"injected fault \(ground truth\): \S+ on (node-\d+) GPU (\d+)", out)
    assert truth, out
    node, gpu = truth[-1]
    # by the end (sim time >= 60 s onset) the agents' clocks show that very GPU lagging its peers ...
    assert f"slow GPU: {node} gpu {gpu} " in out, out
    assert re.search(rf"job: job \S+ on 32 GPUs: step time [\d.]+s( \(was [\d.]+s, [+-]\d+%\))?; {node} GPU {gpu} ", out)
    # ... and the in-process detector, fed only with what the agents served, finds it as a straggler
    assert re.search(rf"detector finding: straggler/\w+ since \+\d+s .*GPU {gpu} on {node}", out), out
    assert "Traceback" not in proc.stderr
    assert not wait_gone(str(run))


def test_serve_stops_on_sigterm_without_orphans(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [str(BIN / "gpufleet-sim"), "serve", "--scenario", "healthy", "--nodes", "1", "--gpus-per-node", "2", "--run-dir", str(run)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert proc.stdout is not None
        lines = []
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Prometheus config" in line:
                break
        url = re.search(r"curl (\S+)", "".join(lines))
        assert url, "".join(lines)
        assert "gpufleet_gpu_power_watts" in requests.get(url.group(1), timeout=5).text
        assert processes_mentioning(str(run))
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0  # stopped by a signal, not finished
    assert not wait_gone(str(run))


def test_bad_flags_are_clear_errors(tmp_path: Path) -> None:
    r = subprocess.run([str(BIN / "gpufleet-sim"), "demo", "--speed", "0"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2 and "--speed" in r.stderr and "positive" in r.stderr
    with socket.socket() as s:
        port = free_port()
        s.bind(("127.0.0.1", port))
        s.listen()
        r = subprocess.run(
            [sys.executable, "-m", "gpufleet.sim.demo", "serve", "--scenario", "healthy", "--nodes", "1", "--base-port", str(port),
             "--duration", "1"],
            capture_output=True, text=True, timeout=30,
        )
    assert r.returncode == 1
    assert f"{port}" in r.stderr and "in use" in r.stderr
    assert "Traceback" not in r.stderr


EXPOSITION = """\
# TYPE gpufleet_gpu_clock_hertz gauge
gpufleet_gpu_clock_hertz{gpu="0",clock="sm"} 1.98e+09
gpufleet_gpu_clock_hertz{gpu="1",clock="sm"} 1.98e+09
gpufleet_gpu_clock_hertz{gpu="2",clock="sm"} 9.9e+08
gpufleet_gpu_clock_hertz{gpu="2",clock="memory"} 2.619e+09
# TYPE gpufleet_gpu_tensor_active_ratio gauge
gpufleet_gpu_tensor_active_ratio{gpu="0"} 0.4
gpufleet_gpu_tensor_active_ratio{gpu="1"} 0.38
# TYPE gpufleet_gpu_clock_event_active gauge
gpufleet_gpu_clock_event_active{gpu="0",reason="gpu_idle"} 1
gpufleet_gpu_clock_event_active{gpu="2",reason="hw_slowdown"} 1
gpufleet_gpu_clock_event_active{gpu="1",reason="hw_slowdown"} 0
# TYPE gpufleet_gpu_job_info gauge
gpufleet_gpu_job_info{gpu="0",job_id="j1"} 1
gpufleet_gpu_job_info{gpu="1",job_id="j1"} 1
gpufleet_gpu_job_info{gpu="2",job_id="j1"} 1
"""


def test_demo_view_of_an_exposition() -> None:
    from gpufleet.sim.demo_detector import lagging_gpus
    from gpufleet.sim.demo_scrape import parse_node
    from gpufleet.sim.demo_view import log_lines

    view = parse_node("node-007", "http://127.0.0.1:1/metrics", EXPOSITION)
    assert list(view.gpus) == ["0", "1", "2"]
    g0, g1, g2 = view.gpus.values()
    assert g2.sm_clock_mhz == pytest.approx(990)
    assert g0.tensor_pct == pytest.approx(40)
    assert g2.tensor_pct is None and g2.power_w is None  # no series: shown as "-", never as 0
    assert g0.throttle == [] and g1.throttle == [] and g2.throttle == ["hw_slowdown"]  # gpu_idle is not trouble
    # the demo calls out only the detector's stragglers: a slow clock alone is not one
    assert lagging_gpus(set(), [view]) == []
    slow = lagging_gpus({("node-007", "2")}, [view])
    assert [(s.node, s.gpu, s.clock_mhz, s.peer_median_mhz) for s in slow] == [("node-007", "2", 990, 1980)]
    lines = log_lines([view], slow)
    assert "power - W" in lines[0] and "throttle: HW slowdown" in lines[0]
    assert "slow GPU: node-007 gpu 2 sm_clock 990 MHz vs peers 1980 MHz (hw_slowdown)" in lines[1]


def test_a_fault_injected_into_a_running_fleet_and_a_frozen_node(tmp_path: Path) -> None:
    from gpufleet.sim.live_agents import AgentProcess

    sim = Simulator("demo", seed=1, start=1_750_000_000.0)
    fleet = LiveFleet(simulator=sim, tick=1.0)
    nodes = list(sim.nodes)
    fleet.agents = [AgentProcess(n, 0, tmp_path / n / "snap.json", tmp_path / n / "sysfs", tmp_path / n / "jobs",
                                 tmp_path / f"{n}.log") for n in nodes[:2]]
    for a in fleet.agents:
        a.sysfs.mkdir(parents=True)
        a.job_mapping.mkdir(parents=True)
    def clock(g: int) -> int:
        mhz = sim.gpu_sample(g).clock_sm_mhz
        assert mhz is not None
        return mhz

    fleet.advance(30.0)
    busy = [g for g in range(sim.fleet.gpus_per_node) if clock(g) > 1500]
    assert busy, "node 0 has busy GPUs at full clocks"
    onset = fleet.inject("clock_stuck_low", nodes[0], busy[0], 1.0, duration=20.0)
    assert onset == sim.t
    fleet.advance(5.0)
    assert clock(busy[0]) <= 0.45 * 1980  # held at 40 % of its clock (severity 1)
    fleet.advance(30.0)  # past its end: the clock comes back
    assert clock(busy[0]) > 1500

    fleet.freeze(nodes[1])
    frozen, moving = fleet.agents[1].snapshot.read_bytes(), fleet.agents[0].snapshot.read_bytes()
    fleet.advance(5.0)
    assert fleet.agents[1].snapshot.read_bytes() == frozen  # its agent serves the readings it had
    assert fleet.agents[0].snapshot.read_bytes() != moving
    fleet.freeze(nodes[1], False)
    fleet.advance(5.0)
    assert fleet.agents[1].snapshot.read_bytes() != frozen
    with pytest.raises(ValueError, match="unknown fault kind"):
        fleet.inject("no_such_fault", nodes[0])
