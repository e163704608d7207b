"""Processes collector: the compute processes on every GPU, aggregated to the owners that run them.

From the shared :class:`~gpufleet.agent.collectors.usage.GpuUsage`: per GPU the number of compute
processes (``gpufleet_gpu_processes``), and per (GPU, MIG GPU instance, owner) the processes, their
used memory and their summed SM and memory utilization since the last scrape
(``gpufleet_gpu_owner_*{gpu, gpu_instance, owner_kind, owner}``). The owner is the Slurm job, the
Kubernetes pod UID or the systemd unit of the process' cgroup (:mod:`gpufleet.agent.cgroups`); a
process whose cgroup cannot be read, or names none of them, counts under ``owner_kind="unknown"``.
Exported per owner, not per PID, so the number of series follows the workloads, not their
processes; ``per_pid`` (``--collector.processes.per-pid``) adds the per-process series.

Privilege: ``/proc/PID/cgroup`` is world-readable; with ``hidepid=`` on /proc or the unit's
``ProtectProc=invisible`` other users' processes are invisible: their owner is unknown, and each
failed read is counted in ``gpufleet_gpu_process_owner_errors_total{error="not_found"}``.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import Metric

from gpufleet.agent.cgroups import Owner
from gpufleet.agent.collectors.series import FrozenLabels, SeriesCache
from gpufleet.agent.collectors.usage import GpuUsage
from gpufleet.agent.nvml.processes import GpuProcess
from gpufleet.vocab import catalog

_COUNT = catalog.spec("gpufleet_gpu_processes")
_OWNER = catalog.spec("gpufleet_gpu_owner_processes")
_MEM = catalog.spec("gpufleet_gpu_owner_memory_used_bytes")
_SM = catalog.spec("gpufleet_gpu_owner_sm_utilization_ratio")
_MEMUTIL = catalog.spec("gpufleet_gpu_owner_memory_utilization_ratio")
_ERRORS = catalog.spec("gpufleet_gpu_process_owner_errors_total")
_PID_MEM = catalog.spec("gpufleet_gpu_process_memory_used_bytes")
_PID_SM = catalog.spec("gpufleet_gpu_process_sm_utilization_ratio")
_SPECS = (_COUNT, _OWNER, _MEM, _SM, _MEMUTIL, _ERRORS)
_PER_PCT = 100
#: Label sets built once, unchanged samples reused (the encoder then reuses their rendered lines).
_CACHE = SeriesCache((*_SPECS, _PID_MEM, _PID_SM))
_put, _labels_of, _emit = _CACHE.put, _CACHE.labels_of, _CACHE.emit
#: The families of one owner row (gpu, gpu_instance, owner_kind, owner), in this order.
_ROW = (_OWNER.name, _MEM.name, _SM.name, _MEMUTIL.name)


class _Agg:
    __slots__ = ("mem", "memutil", "n", "sm")

    def __init__(self) -> None:
        self.n = 0
        self.mem: int | None = None
        self.sm: float | None = None
        self.memutil: float | None = None

    def add(self, p: GpuProcess) -> None:
        self.n += 1
        if p.used_memory_bytes is not None:
            self.mem = (self.mem or 0) + p.used_memory_bytes
        if p.sm_util_pct is not None:
            self.sm = (self.sm or 0.0) + p.sm_util_pct
        if p.mem_util_pct is not None:
            self.memutil = (self.memutil or 0.0) + p.mem_util_pct


def aggregate(processes: list[tuple[GpuProcess, Owner]]) -> dict[tuple[str, str, str], _Agg]:
    """(gpu_instance, owner_kind, owner) -> the aggregate of the processes."""
    out: dict[tuple[str, str, str], _Agg] = {}
    for p, o in processes:
        gi = "" if p.gpu_instance is None else str(p.gpu_instance)
        key = (gi, o.kind, o.id)
        agg = out.get(key)
        if agg is None:
            agg = out[key] = _Agg()
        agg.add(p)
    return out


class ProcessesCollector:
    name = "processes"

    def __init__(self, usage: GpuUsage, *, per_pid: bool = False) -> None:
        self.usage = usage
        self.per_pid = per_pid
        #: (gpu, gpu_instance, owner_kind, owner) -> its label set in each _ROW family, for the owners of the
        #: last scrape (an owner stays on a GPU for many scrapes).
        self._rows: dict[tuple[str, str, str, str], tuple[FrozenLabels, ...]] = {}

    def describe(self) -> Iterable[Metric]:
        specs = (*_SPECS, _PID_MEM, _PID_SM) if self.per_pid else _SPECS
        return [s.family() for s in specs]

    def collect(self) -> Iterable[Metric]:
        snap = self.usage.snapshot()
        f = {s.name: s.family() for s in (*_SPECS, _PID_MEM, _PID_SM)}
        owners, mems, sms, memutils = (f[name].samples for name in _ROW)
        rows = self._rows
        seen: dict[tuple[str, str, str, str], tuple[FrozenLabels, ...]] = {}
        for use in snap.gpus:
            if use.processes is None:
                continue
            g = use.gpu
            _put(f[_COUNT.name], [g], len(use.processes))
            for (gi, kind, owner), a in sorted(aggregate(use.processes).items()):
                key = (g, gi, kind, owner)
                row = rows.get(key)
                if row is None:
                    row = tuple(_labels_of(name, key) for name in _ROW)
                seen[key] = row
                _emit(owners, row[0], a.n)
                if a.mem is not None:
                    _emit(mems, row[1], a.mem)
                if a.sm is not None:
                    _emit(sms, row[2], a.sm / _PER_PCT)
                if a.memutil is not None:
                    _emit(memutils, row[3], a.memutil / _PER_PCT)
            if self.per_pid:
                for p, o in use.processes:
                    gi = "" if p.gpu_instance is None else str(p.gpu_instance)
                    if p.used_memory_bytes is not None:
                        _put(f[_PID_MEM.name], [g, gi, str(p.pid), o.kind, o.id], p.used_memory_bytes)
                    if p.sm_util_pct is not None:
                        _put(f[_PID_SM.name], [g, gi, str(p.pid)], p.sm_util_pct / _PER_PCT)
        self._rows = seen
        if snap.up:
            err = f[_ERRORS.name]
            for reason, n in sorted(snap.owner_errors.items()):
                _put(err, [reason], n)
        return [fam for fam in f.values() if fam.samples]
