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

from gpufleet.agent.collectors.series import SeriesCache
from gpufleet.agent.collectors.usage import GpuUsage
from gpufleet.agent.vocab import catalog

_MODE = catalog.spec("gpufleet_gpu_mig_mode_enabled")
_INFO = catalog.spec("gpufleet_mig_device_info")
_USED = catalog.spec("gpufleet_mig_memory_used_bytes")
_TOTAL = catalog.spec("gpufleet_mig_memory_total_bytes")
_GPM = (("gpufleet_mig_sm_active_ratio", "sm_active_pct"), ("gpufleet_mig_sm_occupancy_ratio", "sm_occupancy_pct"),
        ("gpufleet_mig_tensor_active_ratio", "tensor_active_pct"), ("gpufleet_mig_dram_active_ratio", "dram_active_pct"))
_SPECS = (_MODE, _INFO, _USED, _TOTAL, *(catalog.spec(n) for n, _ in _GPM))
_PER_PCT = 100
#: Label sets built once, unchanged samples reused (the encoder then reuses their rendered lines).
_put = SeriesCache(_SPECS).put


class MigCollector:
    name = "mig"

    def __init__(self, usage: GpuUsage) -> None:
        self.usage = usage

    def describe(self) -> Iterable[Metric]:
        return [s.family() for s in _SPECS]

    def collect(self) -> Iterable[Metric]:
        f = {s.name: s.family() for s in _SPECS}
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
                gi = str(d.gpu_instance)
                _put(f[_INFO.name], [g, gi, str(d.compute_instance), d.profile, d.uuid], 1)
                if d.gpu_instance in seen:
                    continue  # memory and activity are the GPU instance's: once per instance
                seen.add(d.gpu_instance)
                if u.memory_used_bytes is not None:
                    _put(f[_USED.name], [g, gi], u.memory_used_bytes)
                if u.memory_total_bytes is not None:
                    _put(f[_TOTAL.name], [g, gi], u.memory_total_bytes)
                if u.gpm is not None:
                    for name, attr in _GPM:
                        v = getattr(u.gpm, attr)
                        if v is not None:
                            _put(f[name], [g, gi], v / _PER_PCT)
        return [fam for fam in f.values() if fam.samples]
