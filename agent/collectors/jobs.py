"""Jobs collector: GPU -> job attribution from a dcgm-exporter style mapping directory.

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
from typing import cast

from prometheus_client.core import GaugeMetricFamily, Metric

from gpufleet.agent.vocab import catalog

log = logging.getLogger(__name__)

_SPEC = catalog.spec("gpufleet_gpu_job_info")
_SKIPPED = catalog.spec("gpufleet_gpu_job_mapping_skipped_files")
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

    def __init__(self, mapping_dir: str) -> None:
        self.mapping_dir = mapping_dir
        self._warned: set[tuple[str, str]] = set()  # (file, problem) already logged at warning level

    def _skip(self, path: str, problem: str) -> None:
        level = logging.DEBUG if (path, problem) in self._warned else logging.WARNING
        self._warned.add((path, problem))
        log.log(level, "job mapping %s skipped: %s", path, problem)

    def describe(self) -> Iterable[Metric]:
        return [_SPEC.family(), _SKIPPED.family()]

    def mapping(self) -> dict[str, list[str]]:
        """GPU index -> job ids, for the GPUs that have a readable, non-empty mapping file."""
        return self._read()[0]

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
        mapping, skipped = self._read()
        out: list[Metric] = []
        if mapping:
            fam = cast(GaugeMetricFamily, _SPEC.family())
            for gpu, jobs in mapping.items():
                for job in jobs:
                    fam.add_metric([gpu, job], 1.0)
            out.append(fam)
        if skipped is not None:
            skip = cast(GaugeMetricFamily, _SKIPPED.family())
            skip.add_metric([], skipped)
            out.append(skip)
        return out
