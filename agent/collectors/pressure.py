"""Pressure collector: pressure stall information (PSI) of the host and of the attributed jobs' cgroups.

The kernel's ``Documentation/accounting/psi.rst``: ``/proc/pressure/cpu``, ``memory`` and ``io``
hold the lines ``some avg10=.. avg60=.. avg300=.. total=<µs>`` and ``full ...`` (cpu's ``full``
is all zero, or absent on kernels before 5.13). ``total`` is the cumulative stall time in
microseconds; it is exported as seconds counters,
``gpufleet_host_pressure_stalled_seconds_total{resource,kind}`` (the averages are left to
``rate()``). A missing file (a kernel without PSI, ``psi=0``) yields no series; a file that
exists but cannot be read or parsed is counted in ``gpufleet_pressure_read_errors_total``.

Jobs: a cgroup v2 directory has ``cpu.pressure``, ``memory.pressure`` and ``io.pressure`` in the
same format. For each job id the jobs collector attributes (``gpufleet_gpu_job_info``), the
collector looks for a directory named ``job_<id>`` under ``--path.cgroupfs`` (Slurm's cgroup v2
layout, ``system.slice/slurmstepd.scope/job_<id>``), at most :data:`MAX_DEPTH` levels deep and
listing at most :data:`MAX_DIRS` directories per search, without descending into ``job_*``
directories. Found paths are cached until the directory goes away; ids not found are searched
again at most every :data:`RETRY_SECONDS`. Only attributed jobs get series, so cardinality
follows the job mapping. (A finer per-job cgroup attribution, e.g. Kubernetes pods, is out of
scope here.)
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import cast

from prometheus_client.core import CounterMetricFamily, Metric

from gpufleet.agent.collectors.series import SeriesCache
from gpufleet.agent.collectors.sysfsfiles import SysfsFiles, default_max_fds
from gpufleet.vocab import catalog

log = logging.getLogger(__name__)

_HOST = catalog.spec("gpufleet_host_pressure_stalled_seconds_total")
_JOB = catalog.spec("gpufleet_job_pressure_stalled_seconds_total")
_ERRORS = catalog.spec("gpufleet_pressure_read_errors_total")
RESOURCES = ("cpu", "memory", "io")
KINDS = ("some", "full")
#: Bounds of one search for job cgroups.
MAX_DEPTH = 4
MAX_DIRS = 5000
#: Seconds before job ids that were not found are searched for again.
RETRY_SECONDS = 60.0
_MAX_FILE_BYTES = 4096
#: The files of a cgroup directory, in the order of RESOURCES.
_CGROUP_FILES = tuple(f"{r}.pressure" for r in RESOURCES)
#: What answers "no data" rather than an error: no such file, or PSI off for it.
_ABSENT = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EOPNOTSUPP})


class Unreadable(Exception):
    """A pressure file that exists but cannot be read or parsed."""


def read_pressure(path: str) -> dict[str, float] | None:
    """``{"some": seconds, "full": seconds}`` from a PSI file (``full`` only where present);
    None when the file does not exist or PSI is off for it (EOPNOTSUPP). Raises :class:`Unreadable`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise Unreadable(e.strerror or str(e)) from e
    try:
        data = os.read(fd, _MAX_FILE_BYTES)
    except OSError as e:
        if e.errno == errno.EOPNOTSUPP:  # cgroup.pressure 0, or PSI disabled
            return None
        raise Unreadable(e.strerror or str(e)) from e
    finally:
        os.close(fd)
    return parse_pressure(data)


def parse_pressure(data: bytes) -> dict[str, float]:
    """Parse a PSI file's text; raises :class:`Unreadable` on anything that is not one."""
    out: dict[str, float] = {}
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise Unreadable("not ASCII text") from None
    for line in text.splitlines():
        if not line.strip():
            continue
        kind, _, rest = line.partition(" ")
        if kind not in KINDS or kind in out:
            raise Unreadable(f"unexpected line {line[:60]!r}")
        total = next((f[6:] for f in rest.split() if f.startswith("total=")), None)
        if total is None or not total.isdigit():
            raise Unreadable(f"no total= in {line[:60]!r}")
        out[kind] = int(total) / 1e6
    if "some" not in out:
        raise Unreadable("no 'some' line")
    return out


def find_job_cgroups(root: str, jobs: set[str]) -> dict[str, str]:
    """``job id -> directory`` of the ``job_<id>`` cgroups under ``root`` (bounded breadth-first search)."""
    found: dict[str, str] = {}
    level = [root]
    listed = 0
    for _ in range(MAX_DEPTH):
        nxt: list[str] = []
        for d in level:
            if listed >= MAX_DIRS:
                return found
            listed += 1
            try:
                with os.scandir(d) as it:
                    entries = [e for e in it if e.is_dir(follow_symlinks=False)]
            except OSError:
                continue
            for e in entries:
                if e.name.startswith("job_"):
                    job = e.name[4:]
                    if job in jobs and job not in found:
                        found[job] = e.path
                else:
                    nxt.append(e.path)
        if len(found) == len(jobs):
            break
        level = nxt
    return found


class PressureCollector:
    """``gpufleet_host_pressure_*`` and ``gpufleet_job_pressure_*`` (see the module docstring)."""

    name = "pressure"

    def __init__(self, procfs_path: str, cgroupfs_path: str, job_ids: Callable[[], Iterable[str]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.procfs_path = procfs_path
        self.cgroupfs_path = cgroupfs_path
        self._job_ids = job_ids
        self._clock = clock
        self._paths: dict[str, str] = {}  # job id -> cgroup directory
        self._missing: dict[str, float] = {}  # job id -> when it was last searched for and not found
        self._errors: dict[tuple[str, str], int] = {}
        self._warned: set[tuple[str, str]] = set()
        self._put = SeriesCache((_HOST, _JOB, _ERRORS)).put  # unchanged values reuse their samples
        #: The PSI files stay open and are re-read with pread (procfs and cgroupfs regenerate them at offset 0);
        #: a few descriptors at most, the rest of the budget is the NIC collector's.
        self._files = SysfsFiles(max_fds=min(64, default_max_fds() // 8))

    def close(self) -> None:
        self._files.close()

    def _read_all(self, scope: str, directory: str, names: tuple[str, ...]) -> list[dict[str, float] | None]:
        """:func:`read_pressure` of each file ``names`` (one per resource) of ``directory``, through the kept
        descriptors; a file that exists but cannot be read or parsed is counted and gives None."""
        got = self._files.values(directory, names)
        if got is None:
            return [None] * len(names)
        out: list[dict[str, float] | None] = []
        for resource, name, raw in zip(RESOURCES, names, got, strict=True):
            try:
                if isinstance(raw, OSError):
                    if raw.errno in _ABSENT:
                        out.append(None)
                        continue
                    raise Unreadable(raw.strerror or str(raw))
                out.append(parse_pressure(raw))
            except Unreadable as e:
                self._count_error(scope, resource, os.path.join(directory, name), e)
                out.append(None)
        return out

    def _count_error(self, scope: str, resource: str, path: str, e: Unreadable) -> None:
        self._errors[(scope, resource)] = self._errors.get((scope, resource), 0) + 1
        level = logging.DEBUG if (path, str(e)) in self._warned else logging.WARNING
        self._warned.add((path, str(e)))
        log.log(level, "pressure file %s: %s", path, e)

    def describe(self) -> Iterable[Metric]:
        return [_HOST.family(), _JOB.family(), _ERRORS.family()]

    def job_cgroups(self) -> dict[str, str]:
        """Job id -> cgroup directory for the attributed jobs that have one."""
        jobs = set(self._job_ids())
        self._paths = {j: p for j, p in self._paths.items() if j in jobs}
        self._missing = {j: t for j, t in self._missing.items() if j in jobs}
        now = self._clock()
        wanted = {j for j in jobs if j not in self._paths
                  and (j not in self._missing or now - self._missing[j] >= RETRY_SECONDS)}
        if wanted:
            found = find_job_cgroups(self.cgroupfs_path, wanted)
            self._paths.update(found)
            for j in wanted - found.keys():
                self._missing[j] = now
            for j in found:
                self._missing.pop(j, None)
            log.debug("job cgroups: found %s, not found %s", found, sorted(wanted - found.keys()))
        return self._paths

    def collect(self) -> Iterable[Metric]:
        put = self._put
        host = cast(CounterMetricFamily, _HOST.family())
        for resource, values in zip(RESOURCES, self._read_all("host", os.path.join(self.procfs_path, "pressure"),
                                                              RESOURCES), strict=True):
            for kind, seconds in (values or {}).items():
                put(host, [resource, kind], seconds)
        job = cast(CounterMetricFamily, _JOB.family())
        for job_id, directory in sorted(self.job_cgroups().items()):
            if not os.path.isdir(directory):  # the job ended: search again next time
                del self._paths[job_id]
                continue
            for resource, values in zip(RESOURCES, self._read_all("job", directory, _CGROUP_FILES), strict=True):
                for kind, seconds in (values or {}).items():
                    put(job, [job_id, resource, kind], seconds)
        self._files.sweep()  # the descriptors of jobs that ended
        out: list[Metric] = [f for f in (host, job) if f.samples]
        if out or self._errors:
            errors = cast(CounterMetricFamily, _ERRORS.family())
            keys = {(scope, r) for scope in ("host", "job") for r in RESOURCES} | set(self._errors)
            for scope, resource in sorted(keys):
                put(errors, [scope, resource], float(self._errors.get((scope, resource), 0)))
            out.append(errors)
        return out
