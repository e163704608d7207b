"""Jobs collector: GPU -> job attribution from a dcgm-exporter style mapping directory.

The directory holds one file per GPU, named by the GPU's index ("0", "1", ...),
containing the id(s) of the job(s) running on it, one per line. A scheduler
prolog/epilog (Slurm, a Kubernetes device plugin hook, ...) writes and clears
these files. Each (gpu, job) pair becomes ``gpufleet_gpu_job_info{gpu, job_id} 1``
that queries join onto per-GPU series, instead of a job label on every series.

A missing directory yields nothing. Files whose names are not GPU indices,
files that are not regular files, unreadable files and files larger than
:data:`MAX_FILE_BYTES` are skipped (the last two logged).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable
from typing import cast

from gpufleet.agent import catalog
from prometheus_client.core import GaugeMetricFamily, Metric

log = logging.getLogger(__name__)

_SPEC = catalog.spec("gpufleet_gpu_job_info")
#: Largest mapping file read; a bigger file is not a job list and is skipped.
MAX_FILE_BYTES = 64 * 1024


def is_gpu_index(name: str) -> bool:
    """``"0"``, ``"7"``, ``"12"``; not ``"07"``, ``"-1"``, ``"0.tmp"`` or ``"٣"``."""
    return name.isascii() and name.isdigit() and (name == "0" or not name.startswith("0"))


class Skipped(Exception):
    """A mapping file that cannot be used (the message says why)."""


def read_jobs(path: str) -> list[str]:
    """The job ids in a mapping file (blank lines ignored, each id once, in file order).

    Raises :class:`Skipped` for a file that is not a regular file, unreadable or too large.
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
    jobs: dict[str, None] = {}
    for line in data.decode("utf-8", "replace").splitlines():
        job = line.strip()
        if job:
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
        return [_SPEC.family()]

    def mapping(self) -> dict[str, list[str]]:
        """GPU index -> job ids, for the GPUs that have a readable, non-empty mapping file."""
        try:
            names = os.listdir(self.mapping_dir)
        except FileNotFoundError:
            return {}
        except OSError as e:
            self._skip(self.mapping_dir, e.strerror or str(e))
            return {}
        out: dict[str, list[str]] = {}
        for name in sorted((n for n in names if is_gpu_index(n)), key=int):
            path = os.path.join(self.mapping_dir, name)
            try:
                jobs = read_jobs(path)
            except Skipped as e:
                self._skip(path, str(e))
                continue
            if jobs:
                out[name] = jobs
        return out

    def collect(self) -> Iterable[Metric]:
        mapping = self.mapping()
        if not mapping:
            return []
        fam = cast(GaugeMetricFamily, _SPEC.family())
        for gpu, jobs in mapping.items():
            for job in jobs:
                fam.add_metric([gpu, job], 1.0)
        return [fam]
