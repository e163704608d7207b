"""The fabric collector: a GPU's NVLink domain and its place in the rack (Blackwell, GB200/GB300 NVL72).

Per GPU, from :class:`~gpufleet.agent.nvml.fabric_reader.FabricReader`: identity on ``_info`` series
(``gpufleet_gpu_fabric_info``: NVLink cluster UUID and clique; ``gpufleet_gpu_platform_info``: chassis
serial, slot, tray, host id, module id), health as gauges an alert can use (fabric state and registration
status, one ``gpufleet_gpu_fabric_health{condition}`` per health-mask field the driver reports, the health
summary), the thermal margin, pending repairs, the C2C link and the NVLink bandwidth mode. A reading the
driver does not have (NOT_SUPPORTED, or an older library without the entry point) has no series: an
H100 host without an NVLink fabric exports none of the fabric health series, never a 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client.core import Metric
from prometheus_client.samples import Sample

from gpufleet.agent.collectors.series import FrozenLabels, SeriesCache
from gpufleet.agent.nvml.backend import NvmlBackend
from gpufleet.agent.nvml.fabric_reader import FabricReader, FabricReading, LinkCounters
from gpufleet.vocab import catalog
from gpufleet.vocab import fabric as fb
from gpufleet.vocab.fabric import NVLINK5_EVENTS

_SPECS = catalog.by_group("fabric")
_CACHE = SeriesCache(_SPECS)
_put, _labels_of, _emit = _CACHE.put, _CACHE.labels_of, _CACHE.emit


class FabricCollector:
    name = "fabric"

    def __init__(self, backend: NvmlBackend, *, slow_interval: float = 30.0) -> None:
        """``slow_interval``: --collector.gpu.slow-interval, how often the NVLink 5 per-link counters are re-read."""
        self.backend = backend
        self.reader = FabricReader(backend, slow_interval)
        #: Per GPU label: the link counters last rendered and their samples (reused while the reader serves the
        #: same read: 9 counters x 18 links per GPU), and per link its counters and samples of the last read (a
        #: link whose counters did not change keeps its samples).
        self._link_samples: dict[str, tuple[LinkCounters, list[Sample]]] = {}
        self._per_link: dict[str, dict[int, tuple[tuple[int | None, ...], list[Sample | None]]]] = {}
        #: (GPU label, link) -> its label sets in NVLINK5_EVENTS order (built once)
        self._link_labels: dict[tuple[str, int], list[FrozenLabels]] = {}

    def describe(self) -> Iterable[Metric]:
        return [s.family() for s in _SPECS]

    def collect(self) -> Iterable[Metric]:
        b = self.backend
        if not b.up:  # the gpu collector reports NVML down (gpufleet_nvml_up 0)
            return []
        f = {s.name: s.family() for s in _SPECS}
        devices = list(b.devices)
        for dev in devices:
            r = self.reader.read(dev)
            if r is not None:
                _series(f, dev.label, r)
                if r.links is not None:
                    f["gpufleet_gpu_nvlink_link_events_total"].samples.extend(self._links(dev.label, r.links))
        self.reader.forget({d.index for d in devices})
        return [fam for fam in f.values() if fam.samples]

    def _links(self, g: str, links: LinkCounters) -> list[Sample]:
        cached = self._link_samples.get(g)
        if cached is not None and cached[0] is links:
            return cached[1]
        last = self._per_link.get(g, {})
        now: dict[int, tuple[tuple[int | None, ...], list[Sample | None]]] = {}
        out: list[Sample] = []
        for link, values in links.links:
            prev = last.get(link)
            if prev is not None and prev[0] == values:
                slots = prev[1]
            else:  # a new sample only for the counters that moved; the others keep theirs
                labels = self._link_labels.get((g, link))
                if labels is None:
                    labels = self._link_labels[(g, link)] = [_labels_of(_LINKS_FAMILY, (g, str(link), e))
                                                             for e in NVLINK5_EVENTS]
                old = prev[0] if prev is not None else (None,) * len(values)
                slots = list(prev[1]) if prev is not None else [None] * len(values)
                for k, v in enumerate(values):
                    if v is None:
                        slots[k] = None
                    elif v != old[k] or slots[k] is None:
                        tmp: list[Sample] = []
                        _emit(tmp, labels[k], v)
                        slots[k] = tmp[0]
            now[link] = (values, slots)
            out.extend(x for x in slots if x is not None)
        self._per_link[g] = now
        self._link_samples[g] = (links, out)
        return out


_LINKS = catalog.spec("gpufleet_gpu_nvlink_link_events_total")
_LINKS_FAMILY = _LINKS.family().name  # the counter family's name (without _total), as SeriesCache keys it

def _series(f: Mapping[str, Metric], g: str, r: FabricReading) -> None:
    gl = [g]
    pl = r.platform
    if pl is not None:
        _put(f["gpufleet_gpu_platform_info"], [g, pl.chassis_serial, str(pl.slot_number), str(pl.tray_index),
                                              str(pl.host_id), str(pl.module_id)], 1)
    fab = r.fabric
    if fab is not None and fab.state != fb.FABRIC_STATE_NOT_SUPPORTED:
        _put(f["gpufleet_gpu_fabric_info"], [g, fab.cluster_uuid, str(fab.clique_id)], 1)
        _put(f["gpufleet_gpu_fabric_state"], gl, fab.state)
        _put(f["gpufleet_gpu_fabric_status"], gl, fab.status)
        health = f["gpufleet_gpu_fabric_health"]
        for field in fb.HEALTH_FIELDS:
            holds = fb.condition(fab.health_mask, field)
            if holds is not None:
                _put(health, [g, field.name], 1 if holds else 0)
        if fab.health_summary != fb.SUMMARY_NOT_SUPPORTED:
            _put(f["gpufleet_gpu_fabric_overall_health"], gl, fab.health_summary)
    if r.margin_c is not None:
        _put(f["gpufleet_gpu_thermal_margin_celsius"], gl, r.margin_c)
    if r.repair is not None:
        repair = f["gpufleet_gpu_repair_pending"]
        for kind, pending in zip(fb.REPAIR_KINDS, r.repair, strict=True):
            _put(repair, [g, kind], 1 if pending else 0)
    if r.c2c_enabled is not None:
        _put(f["gpufleet_gpu_c2c_enabled"], gl, 1 if r.c2c_enabled else 0)
    mode = fb.BW_MODE_NAMES.get(r.bw_mode) if r.bw_mode is not None else None
    if mode is not None:
        _put(f["gpufleet_gpu_nvlink_bandwidth_mode"], [g, mode], 1)
