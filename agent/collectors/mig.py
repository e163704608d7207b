"""MIG collector: the MIG mode of every GPU and, in MIG mode, its MIG devices and their use.

Reads come from the shared :class:`~gpufleet.agent.collectors.usage.GpuUsage` (see
:mod:`gpufleet.agent.nvml.mig`). ``gpufleet_gpu_mig_mode_enabled{gpu, state}`` for every GPU
that has MIG; per MIG device ``gpufleet_mig_device_info{gpu, gpu_instance, compute_instance,
profile, uuid}``; per GPU instance its memory and, on GPM devices, its activity
(``gpufleet_mig_*{gpu, gpu_instance}``). The parent GPU's device-level series (power,
temperature, clocks, ECC) stay with the GPU collector. What the driver does not give has no
series; a GPU without MIG has none of these.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import Metric

from gpufleet.agent.collectors.series import FrozenLabels, SeriesCache
from gpufleet.agent.collectors.usage import GpuUsage
from gpufleet.agent.nvml.mig import MigDevice
from gpufleet.vocab import catalog

_MODE = catalog.spec("gpufleet_gpu_mig_mode_enabled")
_INFO = catalog.spec("gpufleet_mig_device_info")
_USED = catalog.spec("gpufleet_mig_memory_used_bytes")
_TOTAL = catalog.spec("gpufleet_mig_memory_total_bytes")
_GPM = (("gpufleet_mig_sm_active_ratio", "sm_active_pct"), ("gpufleet_mig_sm_occupancy_ratio", "sm_occupancy_pct"),
        ("gpufleet_mig_tensor_active_ratio", "tensor_active_pct"), ("gpufleet_mig_dram_active_ratio", "dram_active_pct"))
_SPECS = (_MODE, _INFO, _USED, _TOTAL, *(catalog.spec(n) for n, _ in _GPM))
_PER_PCT = 100
#: Label sets built once, unchanged samples reused (the encoder then reuses their rendered lines).
_CACHE = SeriesCache(_SPECS)
_put, _labels_of, _emit = _CACHE.put, _CACHE.labels_of, _CACHE.emit
#: The per-GPU-instance families, in the order of a _Row's ``instance`` label sets.
_PER_INSTANCE = (_USED.name, _TOTAL.name, *(n for n, _ in _GPM))


class _Row:
    """One MIG device's label sets, kept while the reader keeps the device (its identity is read once per layout)."""

    __slots__ = ("device", "info", "instance")

    def __init__(self, g: str, d: MigDevice) -> None:
        self.device = d
        gi = str(d.gpu_instance)
        self.info = _labels_of(_INFO.name, (g, gi, str(d.compute_instance), d.profile, d.uuid))
        self.instance: tuple[FrozenLabels, ...] = tuple(_labels_of(n, (g, gi)) for n in _PER_INSTANCE)


class MigCollector:
    name = "mig"

    def __init__(self, usage: GpuUsage) -> None:
        self.usage = usage
        #: id(MigDevice) -> its row, for the devices of the last scrape
        self._rows: dict[int, _Row] = {}

    def describe(self) -> Iterable[Metric]:
        return [s.family() for s in _SPECS]

    def collect(self) -> Iterable[Metric]:
        f = {s.name: s.family() for s in _SPECS}
        info = f[_INFO.name].samples
        used, total, *activity = (f[n].samples for n in _PER_INSTANCE)
        gpm = tuple(zip(activity, (attr for _, attr in _GPM), range(2, 2 + len(_GPM)), strict=True))
        rows = self._rows
        kept: dict[int, _Row] = {}
        for use in self.usage.snapshot().gpus:
            r = use.mig
            if r is None:
                continue
            g = r.gpu
            if r.mode_current is not None:
                _put(f[_MODE.name], [g, "current"], 1 if r.mode_current else 0)
            if r.mode_pending is not None:
                _put(f[_MODE.name], [g, "pending"], 1 if r.mode_pending else 0)
            seen: set[int] = set()
            for u in r.devices:
                d = u.device
                row = rows.get(id(d))
                if row is None or row.device is not d:
                    row = _Row(g, d)
                kept[id(d)] = row
                _emit(info, row.info, 1)
                if d.gpu_instance in seen:
                    continue  # memory and activity are the GPU instance's: once per instance
                seen.add(d.gpu_instance)
                labels = row.instance
                if u.memory_used_bytes is not None:
                    _emit(used, labels[0], u.memory_used_bytes)
                if u.memory_total_bytes is not None:
                    _emit(total, labels[1], u.memory_total_bytes)
                if u.gpm is not None:
                    for samples, attr, i in gpm:
                        v = getattr(u.gpm, attr)
                        if v is not None:
                            _emit(samples, labels[i], v / _PER_PCT)
        self._rows = kept
        return [fam for fam in f.values() if fam.samples]
