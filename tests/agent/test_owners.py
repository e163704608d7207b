"""Per-process use and owners: fake NVML processes on GPUs, a fake /proc with cgroup files (Slurm, Kubernetes,
systemd), the processes collector's series one by one, and the jobs collector attributing from cgroups."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest
from support import Series, exposition, parse, scrape
from test_gpu_collector import FakeHost

from gpufleet.agent.cgroups import (
    K8S_POD,
    NO_OWNER,
    SLURM_JOB,
    SYSTEMD_UNIT,
    Owner,
    parse_cgroup,
    slurm_job_exists,
)
from gpufleet.agent.cli import main as cli_main
from gpufleet.agent.collectors.jobs import JobsCollector
from gpufleet.agent.collectors.processes import ProcessesCollector
from gpufleet.agent.collectors.usage import GpuUsage
from gpufleet.agent.nvml.backend import NvmlBackend
from gpufleet.agent.nvml.model import MigDeviceInventory, MigSample, ProcessSample
from gpufleet.sim.fake.library import FakeNvml
from gpufleet.sim.live_agents import agent_command

POD_UID = "0e1f2a3b-4c5d-6e7f-8091-a2b3c4d5e6f7"
#: Real-format /proc/PID/cgroup contents.
CGROUPS = {
    # Slurm, cgroup v2 (slurmstepd.scope), two steps of job 1234
    101: "0::/system.slice/slurmstepd.scope/job_1234/step_0/user/task_0\n",
    102: "0::/system.slice/slurmstepd.scope/job_1234/step_1/user/task_0\n",
    # Slurm, cgroup v1 (hybrid host: the v2 line is at the root, the job is in the controllers' hierarchy)
    103: ("12:freezer:/slurm/uid_1000/job_77/step_batch/task_0\n11:memory:/slurm/uid_1000/job_77/step_batch\n"
          "1:name=systemd:/system.slice/slurmd.service\n0::/\n"),
    # Kubernetes, systemd cgroup driver (pod UID with _) and cgroupfs driver
    104: (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_UID.replace('-', '_')}.slice/"
          "cri-containerd-5f1c0d2e9a.scope\n"),
    105: f"0::/kubepods/besteffort/pod{POD_UID}/5f1c0d2e9a\n",
    # systemd service, and a login session's scope
    106: "0::/system.slice/vllm-inference.service\n",
    107: "0::/user.slice/user-1000.slice/session-4.scope\n",
    # the root cgroup: no owner
    108: "0::/\n",
}


def test_parse_cgroup_owners() -> None:
    got = {pid: parse_cgroup(text) for pid, text in CGROUPS.items()}
    assert got == {
        101: Owner(SLURM_JOB, "1234", "0"),
        102: Owner(SLURM_JOB, "1234", "1"),
        103: Owner(SLURM_JOB, "77", "batch"),
        104: Owner(K8S_POD, POD_UID),
        105: Owner(K8S_POD, POD_UID),
        106: Owner(SYSTEMD_UNIT, "vllm-inference.service"),
        107: Owner(SYSTEMD_UNIT, "session-4.scope"),
        108: NO_OWNER,
    }
    for bad in ("garbage", "0:/x", "x::/y", ""):
        with pytest.raises(ValueError):
            parse_cgroup(bad)


def write_proc(root: Path, cgroups: dict[int, str]) -> None:
    for pid, text in cgroups.items():
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "cgroup").write_text(text)


def proc_host(tmp_path: Path) -> tuple[FakeHost, Path]:
    """GPU 0: job 1234 (2 procs) + the pod (2) + a hidden process (pid 999: no /proc entry);
    GPU 1: job 77, the service, the session, the root-cgroup process; GPU 2: in MIG mode, one process per slice."""
    src = FakeHost()
    s = src.samples
    s[0].processes = [ProcessSample(101, 10 * 2**30, sm_util_pct=30, mem_util_pct=10),
                      ProcessSample(102, 2 * 2**30, sm_util_pct=20, mem_util_pct=5),
                      ProcessSample(104, 3 * 2**30, sm_util_pct=15, mem_util_pct=1),
                      ProcessSample(105, 1 * 2**30, sm_util_pct=None),  # no sample this interval
                      ProcessSample(999, 2**20, sm_util_pct=5, mem_util_pct=0)]
    s[1].processes = [ProcessSample(103, 4 * 2**30, sm_util_pct=50, mem_util_pct=20),
                      ProcessSample(106, None, sm_util_pct=10, mem_util_pct=2),  # memory not available
                      ProcessSample(107, 2**20, sm_util_pct=1, mem_util_pct=1),
                      ProcessSample(108, 2**21, sm_util_pct=2, mem_util_pct=1)]
    src.inv[2].mig_mode_current = src.inv[2].mig_mode_pending = 1
    src.inv[2].mig_devices = [MigDeviceInventory(gpu_instance_id=gi, uuid=f"MIG-{gi}") for gi in (7, 8)]
    s[2].mig = [MigSample(memory_used_bytes=2**30), MigSample(memory_used_bytes=2**30)]
    s[2].processes = [ProcessSample(101, 2**30, gpu_instance_id=7, compute_instance_id=0),
                      ProcessSample(106, 2**29, gpu_instance_id=8, compute_instance_id=0)]
    proc = tmp_path / "proc"
    write_proc(proc, CGROUPS)
    return src, proc


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[tuple[FakeHost, FakeNvml, NvmlBackend, GpuUsage]]:
    src, proc = proc_host(tmp_path)
    fake = FakeNvml(src).install()
    backend = NvmlBackend()
    assert backend.start(), backend.init_error
    try:
        yield src, fake, backend, GpuUsage(backend, str(proc), max_age=0.0)
    finally:
        backend.close()
        fake.uninstall()


def owner_series(series: Series) -> Series:
    return {k: v for k, v in series.items() if k[0].startswith(("gpufleet_gpu_owner", "gpufleet_gpu_process_"))}


def test_owner_series_one_by_one(procs: tuple[FakeHost, FakeNvml, NvmlBackend, GpuUsage]) -> None:
    src, _, _, usage = procs
    got = scrape(ProcessesCollector(usage))
    exp: Series = {}

    def own(g: str, gi: str, kind: str, owner: str, n: int, mem: float | None, sm: float | None,
            memutil: float | None) -> None:
        labels = frozenset({("gpu", g), ("gpu_instance", gi), ("owner_kind", kind), ("owner", owner)})
        exp[("gpufleet_gpu_owner_processes", labels)] = n
        for name, v in (("memory_used_bytes", mem), ("sm_utilization_ratio", sm),
                        ("memory_utilization_ratio", memutil)):
            if v is not None:
                exp[(f"gpufleet_gpu_owner_{name}", labels)] = v

    own("0", "", SLURM_JOB, "1234", 2, 12 * 2**30, 0.5, 0.15)  # two steps of one job: one owner
    own("0", "", K8S_POD, POD_UID, 2, 4 * 2**30, 0.15, 0.01)  # pid 105 had no sample: only 104's
    own("0", "", "unknown", "", 1, 2**20, 0.05, 0.0)  # pid 999: no /proc entry (exited or hidden)
    own("1", "", SLURM_JOB, "77", 1, 4 * 2**30, 0.5, 0.2)
    own("1", "", SYSTEMD_UNIT, "vllm-inference.service", 1, None, 0.1, 0.02)  # memory N/A: no series
    own("1", "", SYSTEMD_UNIT, "session-4.scope", 1, 2**20, 0.01, 0.01)
    own("1", "", "unknown", "", 1, 2**21, 0.02, 0.01)
    own("2", "7", SLURM_JOB, "1234", 1, 2**30, None, None)  # MIG: per slice, no per-process utilization
    own("2", "8", SYSTEMD_UNIT, "vllm-inference.service", 1, 2**29, None, None)
    exp[("gpufleet_gpu_process_owner_errors_total", frozenset({("error", "not_found")}))] = 1
    assert owner_series(got).keys() == exp.keys()
    for key, v in exp.items():
        assert got[key] == pytest.approx(v), key
    for g, n in (("0", 5), ("1", 4), ("2", 2)):
        assert got[("gpufleet_gpu_processes", frozenset({("gpu", g)}))] == n
    # The next scrape has no new utilization samples (same source time): no utilization series, not zeros.
    again = scrape(ProcessesCollector(usage))
    assert not any("utilization" in k[0] for k in again)
    src.advance(1.0)
    assert any("utilization" in k[0] for k in scrape(ProcessesCollector(usage)))


def test_per_pid_series_only_with_the_flag(procs: tuple[FakeHost, FakeNvml, NvmlBackend, GpuUsage]) -> None:
    _, _, _, usage = procs
    assert not any(k[0].startswith("gpufleet_gpu_process_") and "errors" not in k[0]
                   for k in scrape(ProcessesCollector(usage)))
    got = scrape(ProcessesCollector(usage, per_pid=True))
    pids = {(dict(k[1])["gpu"], dict(k[1])["pid"]) for k in got if k[0] == "gpufleet_gpu_process_memory_used_bytes"}
    assert pids == {("0", "101"), ("0", "102"), ("0", "104"), ("0", "105"), ("0", "999"), ("1", "103"),
                    ("1", "107"), ("1", "108"), ("2", "101"), ("2", "106")}  # 106 on GPU 1: memory N/A ...
    assert ("gpufleet_gpu_process_memory_used_bytes",
            frozenset({("gpu", "2"), ("gpu_instance", "8"), ("pid", "106"), ("owner_kind", SYSTEMD_UNIT),
                       ("owner", "vllm-inference.service")})) in got  # ... but known on its MIG slice


def test_hidden_proc_degrades_to_unknown_owners_and_errors(
    procs: tuple[FakeHost, FakeNvml, NvmlBackend, GpuUsage], tmp_path: Path,
) -> None:
    """ProtectProc=invisible / hidepid: other users' /proc/PID are absent. No per-owner series, the
    processes still counted under unknown, every failed read counted."""
    _, _, backend, _ = procs
    empty = tmp_path / "hidden-proc"
    empty.mkdir()
    hidden = ProcessesCollector(GpuUsage(backend, str(empty), max_age=0.0))
    got = scrape(hidden)
    kinds = {dict(k[1])["owner_kind"] for k in got if k[0] == "gpufleet_gpu_owner_processes"}
    assert kinds == {"unknown"}
    errors = ("gpufleet_gpu_process_owner_errors_total", frozenset({("error", "not_found")}))
    assert got[errors] == 9  # one failed read per pid (101 and 106 run on two GPUs each)
    assert scrape(hidden)[errors] == 9  # not read again on every scrape


# ---------------------------------------------------------------------- unreadable cgroup files, unprivileged
# An unprivileged agent cannot read a /proc/PID/cgroup it has no permission for (a file of mode 0, or
# another user's 0600 file); root reads any file whatever its mode. So the check runs as uid/gid
# NOBODY with no supplementary groups: as root (CI) in a forked child that drops to them, as any
# other user (a developer) right here. The files it reads live in a directory every user may enter
# (pytest's tmp_path is 0700 root's).

NOBODY = 65534
PERMISSION_DENIED = ("gpufleet_gpu_process_owner_errors_total", frozenset({("error", "permission_denied")}))


@pytest.fixture
def open_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="gpufleet-test-owners-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def unprivileged(fn: Callable[[], str], warm_up: Callable[[], object] | None = None) -> str:
    """``fn()`` run without privilege: in a forked child as NOBODY when we are root, else here.

    Everything ``fn`` imports must be imported already (NOBODY may not read the interpreter's files):
    ``warm_up`` runs first, in the child, still as root."""
    if os.geteuid() != 0:
        return fn()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child; it never returns into pytest
        code = 1
        try:
            os.close(r)
            if warm_up is not None:
                warm_up()
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            data = fn().encode()
            with os.fdopen(w, "wb") as f:
                f.write(data)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the unprivileged child failed (its traceback is above)"
    return data.decode()


def test_unreadable_cgroup_file_is_permission_denied(
    procs: tuple[FakeHost, FakeNvml, NvmlBackend, GpuUsage], open_dir: Path,
) -> None:
    """A hardened agent (its own uid, other users' /proc/PID/cgroup unreadable): pid 101's process counts
    under owner unknown, the failed read under permission_denied, every other owner is still right."""
    _, _, backend, _ = procs
    proc = open_dir / "proc"
    write_proc(proc, CGROUPS)
    for d in proc.iterdir():
        d.chmod(0o755)
    (proc / "101" / "cgroup").chmod(0)
    readable = parse(exposition(ProcessesCollector(GpuUsage(backend, str(proc), max_age=0.0))))
    usage = GpuUsage(backend, str(proc), max_age=0.0)  # a fresh owner cache for the unprivileged scrape
    got = parse(unprivileged(lambda: exposition(ProcessesCollector(usage), JobsCollector(
        str(open_dir / "no-mapping"), usage, str(open_dir / "cgroup")))))

    def owners(series: Series, gpu: str) -> dict[tuple[str, str, str], float]:
        return {(d["gpu_instance"], d["owner_kind"], d["owner"]): v for n, lbl in series
                if n == "gpufleet_gpu_owner_processes" and (d := dict(lbl))["gpu"] == gpu for v in [series[(n, lbl)]]}

    if os.geteuid() == 0:  # the same files read as root: 101 is job 1234's (so the child above really was not root)
        assert PERMISSION_DENIED not in readable
        assert owners(readable, "0")[("", SLURM_JOB, "1234")] == 2
    assert got[PERMISSION_DENIED] == 1  # 101 runs on GPUs 0 and 2: read once, then cached
    assert owners(got, "0") == {("", SLURM_JOB, "1234"): 1, ("", K8S_POD, POD_UID): 2, ("", "unknown", ""): 2}
    assert owners(got, "1") == owners(readable, "1")  # job 77, the service, the session, the root cgroup
    assert len(owners(got, "1")) == 4
    assert owners(got, "2") == {("7", "unknown", ""): 1, ("8", SYSTEMD_UNIT, "vllm-inference.service"): 1}
    assert {(d["gpu"], d["job_id"]) for n, lbl in got if n == "gpufleet_gpu_job_info" for d in [dict(lbl)]} == \
        {("0", "1234"), ("1", "77")}  # GPU 2's only Slurm process is 101's: its job is not known there
    for g, n in (("0", 5), ("1", 4), ("2", 2)):  # every process still counted
        assert got[("gpufleet_gpu_processes", frozenset({("gpu", g)}))] == n


def unprivileged_agent(args: list[str], tmpdir: Path) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``gpufleet-agent ARGS`` run as NOBODY (as root) or as ourselves.

    The console script in a process of its own where NOBODY may run our interpreter; else (an
    interpreter under root's 0700 home) the same ``main`` in a forked child, which first runs it once
    as root so every module is imported before it drops privilege."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    env["TMPDIR"] = str(tmpdir)  # one NOBODY may write to (procs:N:P makes its own fake /proc there)
    drop: dict[str, Any] = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}
    try:  # may NOBODY run our interpreter and read the package?
        probe = subprocess.run([sys.executable, "-c", "import gpufleet.agent.cli"], capture_output=True,
                               timeout=60, env=env, cwd="/", **drop).returncode == 0
    except PermissionError:
        probe = False
    if probe:
        r = subprocess.run([*agent_command(), *args], capture_output=True, text=True, timeout=60, env=env,
                           cwd="/", **drop)
        return r.returncode, r.stdout, r.stderr

    def run_main() -> tuple[int, str, str]:
        out, err = io.TextIOWrapper(io.BytesIO()), io.TextIOWrapper(io.BytesIO())
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli_main(args)
        out.flush()
        err.flush()
        return rc, out.buffer.getvalue().decode(), err.buffer.getvalue().decode()

    got = json.loads(unprivileged(lambda: json.dumps(run_main()), warm_up=run_main))
    return int(got[0]), str(got[1]), str(got[2])


def test_unprivileged_agent_counts_an_unreadable_cgroup_and_exits_0(open_dir: Path) -> None:
    """``gpufleet-agent once`` as an unprivileged user, one GPU process' cgroup file unreadable."""
    proc = open_dir / "proc"
    # procs:2:4: pids 10000, 10014 on GPU 0 and 10007, 10021 on GPU 1 (sim/fake/shared_source.py)
    write_proc(proc, {10000: "0::/system.slice/slurmstepd.scope/job_4200/step_0/user/task_0\n",
                      10007: "0::/system.slice/slurmstepd.scope/job_4200/step_0/user/task_1\n",
                      10014: "0::/system.slice/slurmstepd.scope/job_77/step_0/user/task_0\n",
                      10021: "0::/system.slice/vllm-inference.service\n"})
    for d in proc.iterdir():
        d.chmod(0o755)
    (proc / "10014" / "cgroup").chmod(0)
    tmp = open_dir / "tmp"
    tmp.mkdir(mode=0o1777)
    tmp.chmod(0o1777)
    rc, out, err = unprivileged_agent(["once", "--nvml.fake=procs:2:4", f"--path.procfs={proc}",
                                       f"--path.cgroupfs={open_dir / 'cgroup'}",
                                       f"--collector.jobs.mapping-dir={open_dir / 'no-mapping'}",
                                       "--no-collector.pods"], tmp)
    assert rc == 0, err
    got = parse(out)
    assert got[PERMISSION_DENIED] == 1, err
    owners = {(d["gpu"], d["owner_kind"], d["owner"]): v for (n, lbl), v in got.items()
              if n == "gpufleet_gpu_owner_processes" for d in [dict(lbl)]}
    assert owners == {("0", SLURM_JOB, "4200"): 1, ("0", "unknown", ""): 1,
                      ("1", SLURM_JOB, "4200"): 1, ("1", SYSTEMD_UNIT, "vllm-inference.service"): 1}
    jobs = {(d["gpu"], d["job_id"]) for (n, lbl) in got if n == "gpufleet_gpu_job_info" for d in [dict(lbl)]}
    assert jobs == {("0", "4200"), ("1", "4200")}  # job 77 is unknown: no job made up for GPU 0
    assert got[("gpufleet_scrape_collector_success", frozenset({("collector", "processes")}))] == 1
    assert got[("gpufleet_scrape_collector_success", frozenset({("collector", "jobs")}))] == 1
    assert any(n == "gpufleet_gpu_power_watts" for n, _ in got)  # nothing else lost


def test_running_processes_need_privilege_in_mig_mode(procs: tuple[FakeHost, FakeNvml, NvmlBackend, GpuUsage]) -> None:
    """Unprivileged, the whole-GPU list of a MIG GPU is NO_PERMISSION: the reader asks each MIG device."""
    _, fake, backend, usage = procs
    fake.privileged = False
    with pytest.raises(pynvml.NVMLError_NoPermission):
        pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(2))
    got = scrape(ProcessesCollector(usage))
    assert got[("gpufleet_gpu_processes", frozenset({("gpu", "2")}))] == 2
    assert got[("gpufleet_gpu_owner_processes", frozenset({("gpu", "2"), ("gpu_instance", "8"),
               ("owner_kind", SYSTEMD_UNIT), ("owner", "vllm-inference.service")}))] == 1
    assert ("nvmlDeviceGetComputeRunningProcesses", "NO_PERMISSION") not in backend.errors()


def test_nvml_without_process_support_gives_no_series(tmp_path: Path) -> None:
    src = FakeHost()  # processes None: NOT_SUPPORTED
    with FakeNvml(src):
        backend = NvmlBackend()
        assert backend.start()
        try:
            got = scrape(ProcessesCollector(GpuUsage(backend, str(tmp_path), max_age=0.0)))
        finally:
            backend.close()
    assert got == {}


# ---------------------------------------------------------------------- jobs: cgroups first, mapping a hint


def jobs_of(series: Series) -> set[tuple[str, str]]:
    return {(dict(k[1])["gpu"], dict(k[1])["job_id"]) for k in series if k[0] == "gpufleet_gpu_job_info"}


def test_jobs_from_cgroups_without_mapping_files(procs: tuple[FakeHost, FakeNvml, NvmlBackend, GpuUsage],
                                                 tmp_path: Path) -> None:
    _, _, _, usage = procs
    got = scrape(JobsCollector(str(tmp_path / "no-mapping"), usage, str(tmp_path / "cgroup")))
    assert jobs_of(got) == {("0", "1234"), ("1", "77"), ("2", "1234")}
    assert not any("mapping" in k[0] for k in got)  # no directory: no file counts


def test_stale_mapping_files_are_ignored_and_counted(procs: tuple[FakeHost, FakeNvml, NvmlBackend, GpuUsage],
                                                     tmp_path: Path) -> None:
    _, _, _, usage = procs
    cg = tmp_path / "cgroup"
    (cg / "system.slice" / "slurmstepd.scope" / "job_555").mkdir(parents=True)  # allocated, no CUDA context yet
    mapping = tmp_path / "mapping"
    mapping.mkdir()
    (mapping / "0").write_text("1234\n")  # running on the GPU: agrees with the cgroups
    (mapping / "3").write_text("555\n")  # no process yet but its cgroup exists: kept (the hint's purpose)
    (mapping / "4").write_text("9001\n")  # crashed node / no epilog: no process, no cgroup: stale
    (mapping / "5").write_text("9002\n77\n")  # one stale id: the file counts once, its live job stays
    got = scrape(JobsCollector(str(mapping), usage, str(cg)))
    assert jobs_of(got) == {("0", "1234"), ("1", "77"), ("2", "1234"), ("3", "555"), ("5", "77")}
    assert got[("gpufleet_gpu_job_mapping_stale_files", frozenset())] == 2
    assert slurm_job_exists(str(cg), "555") is True and slurm_job_exists(str(cg), "9001") is False


def test_mapping_trusted_without_a_slurm_cgroup_tree(procs: tuple[FakeHost, FakeNvml, NvmlBackend, GpuUsage],
                                                    tmp_path: Path) -> None:
    _, _, _, usage = procs
    mapping = tmp_path / "mapping"
    mapping.mkdir()
    (mapping / "4").write_text("other-scheduler-job\n")
    got = scrape(JobsCollector(str(mapping), usage, str(tmp_path / "no-slurm-here")))
    assert ("4", "other-scheduler-job") in jobs_of(got)
    assert got[("gpufleet_gpu_job_mapping_stale_files", frozenset())] == 0
    assert slurm_job_exists(str(tmp_path / "no-slurm-here"), "1") is None


def test_cgroup_v1_slurm_tree(tmp_path: Path) -> None:
    (tmp_path / "freezer" / "slurm" / "uid_1000" / "job_77").mkdir(parents=True)
    assert slurm_job_exists(str(tmp_path), "77") is True
    assert slurm_job_exists(str(tmp_path), "78") is False


def test_the_real_pynvml_wrappers_read_the_fake(procs: tuple[FakeHost, FakeNvml, NvmlBackend, GpuUsage]) -> None:
    """The fake implements the C entry points and struct layouts pynvml's own wrappers use."""
    src, _, _, _ = procs
    h0, h2 = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlDeviceGetHandleByIndex(2)
    got = [(p.pid, p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h0)]
    assert got == [(p.pid, p.used_memory_bytes) for p in src.samples[0].processes or []]
    assert [(p.pid, p.gpuInstanceId) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h2)] == [(101, 7), (106, 8)]
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h2, 1)
    assert [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(mig)] == [106]
    new = {(s.pid, s.smUtil, s.memUtil) for s in pynvml.nvmlDeviceGetProcessesUtilizationInfo(h0, 0)}
    old = {(s.pid, s.smUtil, s.memUtil) for s in pynvml.nvmlDeviceGetProcessUtilization(h0, 0)}
    assert new == old == {(101, 30, 10), (102, 20, 5), (104, 15, 1), (999, 5, 0)}
    with pytest.raises(pynvml.NVMLError_NotFound):  # nothing newer than the last seen timestamp
        pynvml.nvmlDeviceGetProcessesUtilizationInfo(h0, int(src.t * 1e6))
    with pytest.raises(pynvml.NVMLError_NotSupported):  # no per-process utilization in MIG mode
        pynvml.nvmlDeviceGetProcessUtilization(h2, 0)


def test_older_drivers_use_the_older_utilization_call(procs: tuple[FakeHost, FakeNvml, NvmlBackend, GpuUsage]) -> None:
    _, fake, backend, usage = procs
    fake.inject_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, function="nvmlDeviceGetProcessesUtilizationInfo")
    got = scrape(ProcessesCollector(usage))
    key = frozenset({("gpu", "1"), ("gpu_instance", ""), ("owner_kind", SLURM_JOB), ("owner", "77")})
    assert got[("gpufleet_gpu_owner_sm_utilization_ratio", key)] == pytest.approx(0.5)
    assert not backend.errors()


def test_nvml_and_proc_errors_are_counted_never_a_crash(
    procs: tuple[FakeHost, FakeNvml, NvmlBackend, GpuUsage], tmp_path: Path,
) -> None:
    _, fake, backend, usage = procs
    (tmp_path / "proc" / "103" / "cgroup").write_bytes(b"\xff\xfe not a cgroup file \x00")
    fake.inject_error(pynvml.NVML_ERROR_UNKNOWN, function="nvmlDeviceGetComputeRunningProcesses", gpu=0)
    fake.inject_error(pynvml.NVML_ERROR_UNKNOWN, function="nvmlDeviceGetMigMode", gpu=2)
    got = scrape(ProcessesCollector(usage))
    assert ("gpufleet_gpu_processes", frozenset({("gpu", "0")})) not in got  # no list: no series, not 0
    assert got[("gpufleet_gpu_owner_processes", frozenset({("gpu", "1"), ("gpu_instance", ""),
                                                          ("owner_kind", "unknown"), ("owner", "")}))] == 2
    assert got[("gpufleet_gpu_process_owner_errors_total", frozenset({("error", "unparsable")}))] == 1
    errors = backend.errors()
    assert errors[("nvmlDeviceGetComputeRunningProcesses", "UNKNOWN")] == 1
    assert errors[("nvmlDeviceGetMigMode", "UNKNOWN")] == 1
    fake.inject_error(pynvml.NVML_ERROR_GPU_IS_LOST, gpu=1)
    got = scrape(ProcessesCollector(usage))
    assert ("gpufleet_gpu_processes", frozenset({("gpu", "1")})) not in got
