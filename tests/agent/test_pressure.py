"""Pressure collector (PSI of the host and of job cgroups) and the host collector's CPU steal and iowait."""

from __future__ import annotations

import errno
import os
from collections import namedtuple
from pathlib import Path

import psutil
import pytest
from support import Series, key, scrape

from gpufleet.agent import settings
from gpufleet.agent.collectors import pressure
from gpufleet.agent.collectors.host import HostCollector
from gpufleet.agent.collectors.pressure import PressureCollector, Unreadable, find_job_cgroups, parse_pressure

#: The kernel's formats (Documentation/accounting/psi.rst); totals in microseconds.
CPU = ("some avg10=2.04 avg60=0.75 avg300=0.40 total=157656722\n"
       "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
CPU_OLD = "some avg10=0.00 avg60=0.00 avg300=0.00 total=1500000\n"  # kernels before 5.13: no cpu full line
MEMORY = ("some avg10=0.00 avg60=0.00 avg300=0.00 total=4200000\n"
          "full avg10=0.00 avg60=0.00 avg300=0.00 total=2100000\n")
IO = ("some avg10=12.50 avg60=8.10 avg300=3.00 total=98000000\n"
      "full avg10=10.00 avg60=6.00 avg300=2.00 total=76000000\n")


def named(series: Series, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: v for (n, labels), v in series.items() if n == name}


def procfs(tmp_path: Path, **files: str) -> Path:
    d = tmp_path / "proc" / "pressure"
    d.mkdir(parents=True)
    for name, text in files.items():
        (d / name).write_text(text)
    return tmp_path / "proc"


def job_cgroup(cgroupfs: Path, job: str, rel: str = "system.slice/slurmstepd.scope", text: str = IO) -> Path:
    d = cgroupfs / rel / f"job_{job}"
    d.mkdir(parents=True)
    for r in ("cpu", "memory", "io"):
        (d / f"{r}.pressure").write_text(text)
    return d


HOST = "gpufleet_host_pressure_stalled_seconds_total"
JOB = "gpufleet_job_pressure_stalled_seconds_total"
ERR = "gpufleet_pressure_read_errors_total"


def test_host_psi_totals_in_seconds(tmp_path: Path) -> None:
    proc = procfs(tmp_path, cpu=CPU, memory=MEMORY, io=IO)
    series = scrape(PressureCollector(str(proc), str(tmp_path / "cg"), lambda: []))
    assert named(series, HOST) == {
        frozenset({"resource": "cpu", "kind": "some"}.items()): 157.656722,
        frozenset({"resource": "cpu", "kind": "full"}.items()): 0.0,
        frozenset({"resource": "memory", "kind": "some"}.items()): 4.2,
        frozenset({"resource": "memory", "kind": "full"}.items()): 2.1,
        frozenset({"resource": "io", "kind": "some"}.items()): 98.0,
        frozenset({"resource": "io", "kind": "full"}.items()): 76.0,
    }
    assert set(named(series, ERR).values()) == {0.0}
    assert not named(series, JOB)


def test_old_kernel_without_cpu_full_and_kernel_without_psi(tmp_path: Path) -> None:
    proc = procfs(tmp_path / "a", cpu=CPU_OLD)  # no memory, no io file either
    series = scrape(PressureCollector(str(proc), str(tmp_path / "cg"), lambda: []))
    assert named(series, HOST) == {frozenset({"resource": "cpu", "kind": "some"}.items()): 1.5}
    # no /proc/pressure at all (CONFIG_PSI off, psi=0): no series of any kind, no error
    assert scrape(PressureCollector(str(tmp_path / "none"), str(tmp_path / "cg"), lambda: [])) == {}


def test_garbage_and_unreadable_files_are_counted(tmp_path: Path) -> None:
    proc = procfs(tmp_path, cpu="some avg10=0.00 total=abc\n", io=IO)
    (proc / "pressure" / "memory").mkdir()  # exists, cannot be read
    c = PressureCollector(str(proc), str(tmp_path / "cg"), lambda: [])
    series = scrape(c)
    assert series[key(ERR, scope="host", resource="cpu")] == 1
    assert series[key(ERR, scope="host", resource="memory")] == 1
    assert series[key(ERR, scope="host", resource="io")] == 0
    assert series[key(HOST, resource="io", kind="full")] == 76.0  # the good file still counts
    assert key(HOST, resource="cpu", kind="some") not in series
    assert scrape(c)[key(ERR, scope="host", resource="cpu")] == 2


def test_psi_disabled_for_a_cgroup_reads_as_absent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a pressure file with PSI off (cgroup.pressure 0) fails with EOPNOTSUPP: no data, no error."""
    proc = procfs(tmp_path, cpu=CPU)

    def no_psi(fd: int, n: int, offset: int = 0) -> bytes:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "read", no_psi)
    monkeypatch.setattr(os, "pread", no_psi)  # the collector re-reads kept descriptors at offset 0
    series = scrape(PressureCollector(str(proc), str(tmp_path / "cg"), lambda: []))
    assert series == {}


@pytest.mark.parametrize("text", [
    "", "full avg10=0.00 total=5\n", "some avg10=0.00\n", "some total=1\nsome total=2\n", "weird total=1\n",
    "some total=-5\n",
])
def test_parse_rejects_what_is_not_psi(text: str) -> None:
    with pytest.raises(Unreadable):
        parse_pressure(text.encode())


def test_parse_accepts_the_kernel_format() -> None:
    assert parse_pressure(CPU.encode()) == {"some": 157.656722, "full": 0.0}
    assert parse_pressure(b"some avg10=0.00 avg60=0.00 avg300=0.00 total=0") == {"some": 0.0}


def test_job_cgroup_pressure_for_attributed_jobs_only(tmp_path: Path) -> None:
    proc = procfs(tmp_path, cpu=CPU)
    cg = tmp_path / "cg"
    job_cgroup(cg, "4242")
    job_cgroup(cg, "7")  # a job on this host that the agent does not attribute to a GPU
    (cg / "system.slice" / "slurmstepd.scope" / "job_4242" / "step_0").mkdir()
    c = PressureCollector(str(proc), str(cg), lambda: ["4242", "9999"])
    jobs = named(scrape(c), JOB)
    assert {dict(lab)["job_id"] for lab in jobs} == {"4242"}
    assert jobs[frozenset({"job_id": "4242", "resource": "io", "kind": "some"}.items())] == 98.0
    assert len(jobs) == 6


def test_job_lookup_is_cached_and_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proc = procfs(tmp_path, cpu=CPU)
    cg = tmp_path / "cg"
    job_cgroup(cg, "1")
    calls: list[set[str]] = []
    real = pressure.find_job_cgroups

    def counting(root: str, jobs: set[str]) -> dict[str, str]:
        calls.append(set(jobs))
        return real(root, jobs)

    monkeypatch.setattr(pressure, "find_job_cgroups", counting)
    now = [0.0]
    ids = ["1", "2"]
    c = PressureCollector(str(proc), str(cg), lambda: ids, clock=lambda: now[0])
    scrape(c)
    assert calls == [{"1", "2"}]
    now[0] = 10.0
    job_cgroup(cg, "2")
    assert {dict(lab)["job_id"] for lab in named(scrape(c), JOB)} == {"1"}  # "2" not searched again yet
    assert len(calls) == 1
    now[0] = pressure.RETRY_SECONDS + 1
    assert {dict(lab)["job_id"] for lab in named(scrape(c), JOB)} == {"1", "2"}
    assert calls[-1] == {"2"}  # the found one is cached
    # the job ends: its cgroup goes away, its series with it
    for f in (cg / "system.slice" / "slurmstepd.scope" / "job_1").iterdir():
        f.unlink()
    (cg / "system.slice" / "slurmstepd.scope" / "job_1").rmdir()
    ids.remove("1")
    assert {dict(lab)["job_id"] for lab in named(scrape(c), JOB)} == {"2"}


def test_search_depth_is_bounded(tmp_path: Path) -> None:
    cg = tmp_path / "cg"
    job_cgroup(cg, "5", rel="a/b/c")  # depth 4: found
    job_cgroup(cg, "6", rel="a/b/c/d/e")  # deeper than MAX_DEPTH: not searched
    assert set(find_job_cgroups(str(cg), {"5", "6"})) == {"5"}
    assert find_job_cgroups(str(tmp_path / "missing"), {"5"}) == {}


def test_unreadable_job_pressure_is_counted(tmp_path: Path) -> None:
    proc = procfs(tmp_path, cpu=CPU)
    cg = tmp_path / "cg"
    d = job_cgroup(cg, "3")
    (d / "memory.pressure").write_text("garbage\n")
    series = scrape(PressureCollector(str(proc), str(cg), lambda: ["3"]))
    assert series[key(ERR, scope="job", resource="memory")] == 1
    assert key(JOB, job_id="3", resource="cpu", kind="some") in series


scputimes = namedtuple("scputimes", "user nice system idle iowait irq softirq steal guest guest_nice")


def test_host_cpu_steal_and_iowait_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    t0 = scputimes(100, 0, 50, 800, 50, 0, 0, 3.5, 0, 0)
    t1 = scputimes(160, 0, 70, 900, 70.25, 0, 0, 4.0, 0, 0)
    seq = iter([t0, t1])
    monkeypatch.setattr(psutil, "cpu_times", lambda percpu=False: next(seq))
    now = [0.0]
    c = HostCollector(clock=lambda: now[0])
    now[0] = 0.01  # too soon for a new sample: the priming sample's counters are served
    series = scrape(c)
    assert series[key("gpufleet_host_cpu_steal_seconds_total")] == 3.5
    assert series[key("gpufleet_host_cpu_iowait_seconds_total")] == 50
    now[0] = 15.0
    series = scrape(c)
    assert series[key("gpufleet_host_cpu_steal_seconds_total")] == 4.0
    assert series[key("gpufleet_host_cpu_iowait_seconds_total")] == 70.25


def test_platform_without_steal_has_no_series(monkeypatch: pytest.MonkeyPatch) -> None:
    times = namedtuple("times", "user nice system idle")
    monkeypatch.setattr(psutil, "cpu_times", lambda percpu=False: times(1, 0, 1, 10))
    series = scrape(HostCollector())
    assert key("gpufleet_host_cpu_steal_seconds_total") not in series
    assert key("gpufleet_host_cpu_iowait_seconds_total") not in series


def test_settings_paths_and_pcie_interval(tmp_path: Path) -> None:
    s = settings.resolve(["--path.procfs=/host/proc", "--path.cgroupfs=/host/cgroup", "--collector.pcie.interval=0"],
                         {})
    assert (s.config.procfs_path, s.config.cgroupfs_path, s.config.pcie_interval) == ("/host/proc", "/host/cgroup", 0)
    cfg = tmp_path / "agent.toml"
    cfg.write_text('[path]\nprocfs = "/p"\ncgroupfs = "/c"\n[collector.pcie]\ninterval = 120\n'
                   '[collectors]\npcie = false\npressure = false\n')
    s = settings.resolve([f"--config.file={cfg}"], {"GPUFLEET_PATH_PROCFS": "/env/proc"})
    assert (s.config.procfs_path, s.config.cgroupfs_path, s.config.pcie_interval) == ("/env/proc", "/c", 120)
    assert not s.config.enabled("pcie") and not s.config.enabled("pressure")
    with pytest.raises(settings.UsageError):
        settings.resolve(["--collector.pcie.interval=-1"], {})


def test_real_host_reads_without_error() -> None:
    """On this machine: whatever /proc/pressure holds parses (or is absent), never an error."""
    series = scrape(PressureCollector("/proc", "/nonexistent-cgroupfs", lambda: []))
    assert all(v == 0 for v in named(series, ERR).values())
    if os.path.exists("/proc/pressure/cpu"):
        assert key(HOST, resource="cpu", kind="some") in series


def test_kept_psi_files_follow_new_text_replaced_files_and_ended_jobs(tmp_path: Path) -> None:
    """The PSI files stay open between scrapes (re-read at offset 0): a new total, a file replaced by a rename and
    a job whose cgroup went are all seen, and close() leaves no descriptor behind."""
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    proc = procfs(tmp_path, cpu=CPU, memory=MEMORY, io=IO)
    cg = tmp_path / "cg"
    job = job_cgroup(cg, "42")
    for d in (proc / "pressure", job):  # as old as a host's: the descriptors are kept
        os.utime(d, (1e9, 1e9))
    before = fds()
    c = PressureCollector(str(proc), str(cg), lambda: ["42"])
    assert scrape(c)[key(JOB, job_id="42", resource="io", kind="some")] == 98.0
    assert fds() == before + 6  # three host files, three of the job's
    cpu = proc / "pressure" / "cpu"
    fd = os.open(cpu, os.O_WRONLY)  # a new total in place (the kernel's file regenerates its text)
    os.pwrite(fd, CPU.replace("total=157656722", "total=157656723").encode(), 0)
    os.close(fd)
    assert scrape(c)[key(HOST, resource="cpu", kind="some")] == 157.656723
    tmp = cpu.with_name(".cpu")
    tmp.write_text(CPU_OLD)
    os.replace(tmp, cpu)  # a rename: the directory changed, its files are opened again
    series = scrape(c)
    assert series[key(HOST, resource="cpu", kind="some")] == 1.5
    assert key(HOST, resource="cpu", kind="full") not in series
    for f in job.iterdir():
        f.unlink()
    job.rmdir()  # the job ended
    series = scrape(c)
    assert not named(series, JOB)
    assert fds() <= before + 3
    c.close()
    assert fds() == before
