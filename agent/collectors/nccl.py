"""NCCL collector: per-rank collective time and bus bandwidth from NCCL's profiler plugin dumps.

Reads the files NCCL's example profiler plugin writes into ``--collector.nccl.directory``
(format: :mod:`gpufleet.agent.collectors.nccl_trace`), named
``[<job id>.]gpu<index>-<hostname>-<tid>.txt``: the launcher sets
``NCCL_PROFILE_DUMP_FILE=<dir>/<job id>.gpu<local GPU index>`` for each rank (docs/install-gpu-hosts.md, "Collective
timing"). The GPU comes from the name; the job from the name, else from the jobs collector's
mapping for that GPU at the time the file is read (the plugin writes when the communicator
ends, when the mapping may be gone, hence the name). Files with other names are ignored.

A file is parsed again only when its size or modification time changed, so a finished trace
costs a ``stat`` per scrape. At most :data:`MAX_FILES` files (the newest) and
:data:`MAX_FILE_BYTES` per file are read. The series sum the files present: labels are
``gpu``, ``job_id`` and ``collective`` (a fixed set, others ``other``), so cardinality follows
GPUs x jobs whose traces are kept; deleting old traces (retention) drops their series, which
Prometheus sees as a counter reset.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpufleet.agent.collectors.nccl_trace import FILE_NAME, TraceSummary, bus_factor, parse_trace
from gpufleet.agent.collectors.series import SeriesCache
from gpufleet.vocab import catalog

log = logging.getLogger(__name__)

_COUNT = catalog.spec("gpufleet_nccl_collectives_total")
_SECONDS = catalog.spec("gpufleet_nccl_collective_seconds_total")
_BUS = catalog.spec("gpufleet_nccl_collective_bus_bytes_total")
_BW = catalog.spec("gpufleet_nccl_collective_bus_bandwidth_bytes_per_second")
_ERRORS = catalog.spec("gpufleet_nccl_read_errors_total")
MAX_FILES = 512
MAX_FILE_BYTES = 64 << 20


@dataclass
class _File:
    key: tuple[int, int]  # (size, mtime_ns)
    gpu: str
    job: str
    summary: TraceSummary


class NcclCollector:
    """``gpufleet_nccl_*`` (see the module docstring)."""

    name = "nccl"

    def __init__(self, directory: str, gpu_jobs: Callable[[], dict[str, list[str]]] | None = None) -> None:
        self.directory = directory
        self._gpu_jobs = gpu_jobs
        self._files: dict[str, _File] = {}
        self._errors: dict[str, int] = {}
        self._too_large: dict[str, tuple[int, int]] = {}
        self._put = SeriesCache((_COUNT, _SECONDS, _BUS, _BW, _ERRORS)).put

    def describe(self) -> Iterable[Metric]:
        return [s.family() for s in (_COUNT, _SECONDS, _BUS, _BW, _ERRORS)]

    def _error(self, reason: str, n: int = 1) -> None:
        self._errors[reason] = self._errors.get(reason, 0) + n

    def _job_for(self, gpu: str, named: str | None) -> str:
        if named:
            return named
        if self._gpu_jobs is None:
            return ""
        try:
            jobs = self._gpu_jobs().get(gpu, [])
        except OSError:
            return ""
        return jobs[0] if len(jobs) == 1 else ""

    def _scan(self) -> None:
        try:
            entries = [e for e in os.scandir(self.directory) if FILE_NAME.match(e.name)]
        except FileNotFoundError:
            self._files.clear()
            return
        except OSError as err:
            self._error("directory")
            level = logging.WARNING if self._errors["directory"] == 1 else logging.DEBUG
            log.log(level, "NCCL trace directory %s: %s", self.directory, err.strerror or err)
            return
        stats: list[tuple[int, str, os.stat_result]] = []
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                stats.append((st.st_mtime_ns, entry.name, st))
        stats.sort(reverse=True)
        keep = stats[:MAX_FILES]
        present = {name for _, name, _ in keep}
        for name in list(self._files):
            if name not in present:
                del self._files[name]
        for _, name, st in keep:
            key = (st.st_size, st.st_mtime_ns)
            old = self._files.get(name)
            if old is not None and old.key == key:
                continue
            if st.st_size > MAX_FILE_BYTES:
                if self._too_large.get(name) != key:
                    self._too_large[name] = key
                    self._error("too_large")
                self._files.pop(name, None)
                continue
            m = FILE_NAME.match(name)
            assert m is not None
            try:
                with open(os.path.join(self.directory, name), "rb") as f:
                    text = f.read(MAX_FILE_BYTES).decode("utf-8", errors="replace")
            except OSError as e:
                self._error("unreadable")
                log.warning("NCCL trace %s: %s", name, e.strerror or e)
                continue
            summary = parse_trace(text)
            if summary.malformed_lines and (old is None or old.summary.malformed_lines < summary.malformed_lines):
                self._error("malformed_line", summary.malformed_lines - (old.summary.malformed_lines if old else 0))
            gpu = m["gpu"]
            self._files[name] = _File(key, gpu, old.job if old is not None else self._job_for(gpu, m["job"]), summary)

    def collect(self) -> Iterable[Metric]:
        if not self.directory:
            return []
        self._scan()
        top: dict[int, int] = {}  # communicator -> highest rank seen in any file
        for f in self._files.values():
            for comm, rank in f.summary.top_rank.items():
                top[comm] = max(top.get(comm, 0), rank)
        totals: dict[tuple[str, str, str], list[float]] = {}  # -> [count, seconds, bus bytes]
        for f in self._files.values():
            for (kind, comm), st in f.summary.collectives.items():
                t = totals.setdefault((f.gpu, f.job, kind), [0.0, 0.0, 0.0])
                t[0] += st.count
                t[1] += st.seconds
                t[2] += st.payload * bus_factor(kind, top.get(comm, 0) + 1)
        put = self._put
        count, seconds = cast(CounterMetricFamily, _COUNT.family()), cast(CounterMetricFamily, _SECONDS.family())
        bus, bw = cast(CounterMetricFamily, _BUS.family()), cast(GaugeMetricFamily, _BW.family())
        for labels, (n, secs, bus_bytes) in sorted(totals.items()):
            put(count, labels, n)
            put(seconds, labels, secs)
            put(bus, labels, bus_bytes)
            if secs > 0:
                put(bw, labels, bus_bytes / secs)
        out: list[Metric] = [f for f in (count, seconds, bus, bw) if f.samples]
        if self._errors:
            errors = cast(CounterMetricFamily, _ERRORS.family())
            for reason in sorted(self._errors):
                put(errors, [reason], float(self._errors[reason]))
            out.append(errors)
        return out
