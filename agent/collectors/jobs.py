"""Jobs collector: GPU -> job attribution from the processes on the GPUs and a mapping directory.

With the shared :class:`~gpufleet.agent.collectors.usage.GpuUsage` (the agent always gives it), the
job that holds a GPU is first the Slurm job of the processes running on it (their
``/proc/PID/cgroup``, see :mod:`gpufleet.agent.cgroups`; a MIG device's processes count for its
parent GPU: the per-slice view is ``gpufleet_gpu_owner_processes{gpu_instance}``). The mapping
directory below is then a hint, for the time before the first CUDA context exists: a mapping
file whose job no longer exists (no process of it on any GPU, and no ``job_<id>`` cgroup under
Slurm's cgroup tree in ``--path.cgroupfs``) is ignored and counted in
``gpufleet_gpu_job_mapping_stale_files``, not exported. On a host without a Slurm cgroup tree
(another scheduler writes the files) the mapping files are trusted as they are.

The directory holds one file per GPU, named by the GPU's index ("0", "1", ...),
containing the id(s) of the job(s) running on it, one per line. A scheduler
prolog/epilog (Slurm, a Kubernetes device plugin hook, ...) writes and clears
these files. Each (gpu, job) pair becomes ``gpufleet_gpu_job_info{gpu, job_id} 1``
that queries join onto per-GPU series, instead of a job label on every series.

A missing directory yields nothing (no scheduler on this host). A directory that
exists but cannot be listed (permission denied, not a directory) is a collector
failure (``gpufleet_scrape_collector_success{collector="jobs"} 0``). Files whose
names are not GPU indices are ignored. Files that are not regular files,
unreadable files, files larger than :data:`MAX_FILE_BYTES` and files that are not
a list of job ids (invalid UTF-8, a NUL or other control character, an id longer
than :data:`MAX_JOB_ID_CHARS`) are skipped whole, logged once, and counted in
``gpufleet_gpu_job_mapping_skipped_files``: a job id label is never made from
garbage.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

from prometheus_client.core import GaugeMetricFamily, Metric

from gpufleet.agent.cgroups import SLURM_JOB, slurm_job_exists
from gpufleet.agent.collectors.series import SeriesCache
from gpufleet.vocab import catalog

if TYPE_CHECKING:
    from gpufleet.agent.collectors.usage import GpuUsage

log = logging.getLogger(__name__)

_SPEC = catalog.spec("gpufleet_gpu_job_info")
_SKIPPED = catalog.spec("gpufleet_gpu_job_mapping_skipped_files")
_STALE = catalog.spec("gpufleet_gpu_job_mapping_stale_files")
#: The (gpu, job) label sets repeat scrape after scrape: built once, their samples (and rendered lines) reused.
_put = SeriesCache([_SPEC]).put
#: Largest mapping file read; a bigger file is not a job list and is skipped.
MAX_FILE_BYTES = 64 * 1024
#: Longest job id accepted (Slurm and Kubernetes ids are far shorter).
MAX_JOB_ID_CHARS = 256


def is_gpu_index(name: str) -> bool:
    """``"0"``, ``"7"``, ``"12"``; not ``"07"``, ``"-1"``, ``"0.tmp"`` or ``"٣"``."""
    return name.isascii() and name.isdigit() and (name == "0" or not name.startswith("0"))


class Skipped(Exception):
    """A mapping file that cannot be used (the message says why)."""


class MappingDirError(OSError):
    """The mapping directory exists but cannot be listed: the collector fails for this scrape."""


def read_jobs(path: str) -> list[str]:
    """The job ids in a mapping file (blank lines ignored, each id once, in file order).

    Raises :class:`Skipped` for a file that is not a regular file, unreadable, too large, or not a
    list of job ids (invalid UTF-8, control characters, an id longer than :data:`MAX_JOB_ID_CHARS`).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # NONBLOCK: a FIFO never hangs us
    except OSError as e:
        raise Skipped(f"cannot open: {e.strerror}") from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Skipped("not a regular file")
        data = os.read(fd, MAX_FILE_BYTES + 1)
    except OSError as e:
        raise Skipped(f"cannot read: {e.strerror}") from e
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise Skipped(f"larger than {MAX_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Skipped(f"not UTF-8 text (byte {e.start})") from None
    jobs: dict[str, None] = {}
    for lineno, line in enumerate(text.split("\n"), start=1):
        job = line.strip(" \t\r")
        if not job:
            continue
        if not job.isprintable():  # NUL, escape sequences, other control or invisible separators
            bad = next(c for c in job if not c.isprintable())
            raise Skipped(f"line {lineno}: control character {bad!r} in a job id")
        if len(job) > MAX_JOB_ID_CHARS:
            raise Skipped(f"line {lineno}: job id longer than {MAX_JOB_ID_CHARS} characters")
        jobs[job] = None
    return list(jobs)


class JobsCollector:
    """``gpufleet_gpu_job_info`` from a dcgm-exporter job mapping directory."""

    name = "jobs"

    def __init__(self, mapping_dir: str, usage: GpuUsage | None = None, cgroupfs: str | None = None) -> None:
        """``usage``: the processes on the GPUs (jobs from their cgroups); ``cgroupfs``: where Slurm's
        job cgroups are looked for (stale mapping files). Without them: the mapping directory alone."""
        self.mapping_dir = mapping_dir
        self.usage = usage
        self.cgroupfs = cgroupfs
        self._warned: set[tuple[str, str]] = set()  # (file, problem) already logged at warning level

    def _skip(self, path: str, problem: str) -> None:
        level = logging.DEBUG if (path, problem) in self._warned else logging.WARNING
        self._warned.add((path, problem))
        log.log(level, "job mapping %s skipped: %s", path, problem)

    def describe(self) -> Iterable[Metric]:
        fams = [_SPEC.family(), _SKIPPED.family()]
        if self.usage is not None or self.cgroupfs is not None:
            fams.append(_STALE.family())
        return fams

    def mapping(self) -> dict[str, list[str]]:
        """GPU index -> job ids, for the GPUs that have a readable, non-empty mapping file."""
        return self._read()[0]

    def process_jobs(self) -> dict[str, list[str]] | None:
        """GPU index -> the Slurm jobs of the processes on it (every GPU NVML listed processes of);
        None without process data (no usage reader, NVML down)."""
        if self.usage is None:
            return None
        snap = self.usage.snapshot()
        if not snap.up:
            return None
        out: dict[str, list[str]] = {}
        for use in snap.gpus:
            if use.processes is not None:
                out[use.gpu] = sorted({o.id for _, o in use.processes if o.kind == SLURM_JOB}, key=_job_key)
        return out

    def attribution(self) -> tuple[dict[str, list[str]], int | None, int | None]:
        """(GPU index -> job ids, mapping files skipped, mapping files stale); skipped and stale are
        None when the mapping directory does not exist. Raises :class:`MappingDirError`."""
        mapping, skipped = self._read()
        from_procs = self.process_jobs()
        running = {j for jobs in (from_procs or {}).values() for j in jobs}
        out: dict[str, dict[str, None]] = {g: dict.fromkeys(jobs) for g, jobs in (from_procs or {}).items() if jobs}
        stale = None if skipped is None else 0
        for gpu, jobs in mapping.items():
            live = [j for j in jobs if j in running or not self._gone(j)]
            if len(live) < len(jobs):
                assert stale is not None
                stale += 1
                self._skip(os.path.join(self.mapping_dir, gpu), "stale: its job has no process and no cgroup")
            for j in live:
                out.setdefault(gpu, {})[j] = None
        ordered = {g: list(out[g]) for g in sorted(out, key=_job_key)}
        return ordered, skipped, stale

    def _gone(self, job: str) -> bool:
        """True when Slurm's cgroup tree exists and has no cgroup for ``job`` (False: not known)."""
        if self.cgroupfs is None or not job.isdigit():
            return False
        return slurm_job_exists(self.cgroupfs, job) is False

    def _read(self) -> tuple[dict[str, list[str]], int | None]:
        """(GPU index -> job ids, files skipped); skipped is None when the directory does not exist.

        Raises :class:`MappingDirError` when the directory exists but cannot be listed."""
        try:
            names = os.listdir(self.mapping_dir)
        except FileNotFoundError:
            return {}, None
        except OSError as e:
            raise MappingDirError(e.errno, f"job mapping directory {self.mapping_dir}: {e.strerror or e}") from e
        out: dict[str, list[str]] = {}
        skipped = 0
        for name in sorted((n for n in names if is_gpu_index(n)), key=int):
            path = os.path.join(self.mapping_dir, name)
            try:
                jobs = read_jobs(path)
            except Skipped as e:
                self._skip(path, str(e))
                skipped += 1
                continue
            if jobs:
                out[name] = jobs
        return out, skipped

    def collect(self) -> Iterable[Metric]:
        mapping, skipped, stale = self.attribution()
        out: list[Metric] = []
        if mapping:
            fam = cast(GaugeMetricFamily, _SPEC.family())
            for gpu, jobs in mapping.items():
                for job in jobs:
                    _put(fam, (gpu, job), 1.0)
            out.append(fam)
        if skipped is not None:
            skip = cast(GaugeMetricFamily, _SKIPPED.family())
            skip.add_metric([], skipped)
            out.append(skip)
        if stale is not None and (self.usage is not None or self.cgroupfs is not None):
            st = cast(GaugeMetricFamily, _STALE.family())
            st.add_metric([], stale)
            out.append(st)
        return out


def _job_key(text: str) -> tuple[int, str]:
    return (int(text), "") if text.isdigit() and len(text) < 19 else (1 << 63, text)
