"""The GPU collector: every NVML reading of every GPU, in base units.

Families come from the catalog (group "gpu" plus the exporter's
``gpufleet_nvml_up`` and ``gpufleet_nvml_errors_total``). NVML's units are
converted to base units here: MHz -> Hz, mW -> W, mJ -> J, percent -> ratio,
KiB -> bytes, KB/s -> bytes/s (KB = 1024 bytes, as NVML's other KiB counters),
ns -> s, MiB/s -> bytes/s. A reading NVML does not support yields no sample.
A lost GPU is ``gpufleet_gpu_up 0`` and keeps its ``gpufleet_gpu_info`` series
(cached identity); the other GPUs are reported as usual. When NVML is down the
collector yields ``gpufleet_nvml_up 0`` (and the error counters) and nothing else.

NVML calls run on the backend's lanes (:mod:`gpufleet.agent.nvml.lanes`): the GPUs one after another
on one worker, each given a deadline within the GPU share of the scrape's budget (:mod:`.budget`); a
GPU whose call overruns keeps that worker to itself and the others go on on another. A GPU whose read did not finish in time has no reading series this scrape (not
even ``gpufleet_gpu_up``; its ``gpufleet_gpu_info`` stays), the collector reports success 0, and
``gpufleet_nvml_call_stalled_seconds{gpu,call}`` says which call has been blocked for how long; the
GPU is read again once that call returns. A node-wide call that does not return makes
``gpufleet_nvml_up`` 0.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from functools import partial

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

from gpufleet.agent.collectors import budget as budgets
from gpufleet.agent.collectors.series import FrozenLabels, SampleSink, SeriesCache
from gpufleet.agent.nvml.backend import Device, NvmlBackend
from gpufleet.agent.nvml.hardware import architecture_label
from gpufleet.agent.nvml.lanes import NODE, Lanes, staggered
from gpufleet.agent.nvml.reader import read_gpu
from gpufleet.agent.nvml.reading import Reading
from gpufleet.vocab import catalog
from gpufleet.vocab.nvml import CLOCK_EVENT_BITS

#: A metric family being filled.
Fam = GaugeMetricFamily | CounterMetricFamily

# Conversions to base units: multiply by these ...
MHZ = 1_000_000
KIB = 1024
KB = 1024
MIB = 1024 * 1024
# ... divide by these (division rounds correctly: 95 / 100 is 0.95, 95 * 0.01 is not).
PER_PCT = 100
PER_MILLI = 1000
PER_NS = 1_000_000_000

_EXPORTER = ("gpufleet_nvml_up", "gpufleet_nvml_errors_total")
_NAMES: tuple[str, ...] = tuple(s.name for s in catalog.by_group("gpu")) + _EXPORTER
_SPECS = tuple(catalog.spec(n) for n in _NAMES)
_REASONS = tuple((r, CLOCK_EVENT_BITS[r]) for r in catalog.CLOCK_EVENT_REASONS)
_THRESHOLDS = (("slowdown", "temp_slowdown"), ("shutdown", "temp_shutdown"), ("gpu_max", "temp_gpu_max"),
               ("memory_max", "temp_memory_max"))
_CLOCKS = (("sm", "clock_sm_mhz", "max_clock_sm"), ("memory", "clock_memory_mhz", "max_clock_memory"),
           ("graphics", "clock_graphics_mhz", "max_clock_graphics"))
_NVLINK_ERRORS = tuple(catalog.NVLINK_ERRORS)
#: Families fed by the reader's slow tier (see nvml.reader).
_SLOW_NAMES = ("gpufleet_gpu_ecc_errors_total", "gpufleet_gpu_remapped_rows", "gpufleet_gpu_row_remap_pending",
               "gpufleet_gpu_row_remap_failure", "gpufleet_gpu_retired_pages", "gpufleet_gpu_retired_pages_pending",
               "gpufleet_gpu_nvlink_up", "gpufleet_gpu_nvlink_errors_total")
_GPM_RATIOS = (("gpufleet_gpu_sm_active_ratio", "sm_active_pct"),
               ("gpufleet_gpu_sm_occupancy_ratio", "sm_occupancy_pct"),
               ("gpufleet_gpu_tensor_active_ratio", "tensor_active_pct"),
               ("gpufleet_gpu_dram_active_ratio", "dram_active_pct"))


#: Default of --collector.gpu.slow-interval (seconds between reads of the slow tier; see nvml.reader).
DEFAULT_SLOW_INTERVAL = 30.0


class GpuCollector:
    name = "gpu"

    def __init__(self, backend: NvmlBackend, *, slow_interval: float = DEFAULT_SLOW_INTERVAL) -> None:
        """``slow_interval``: --collector.gpu.slow-interval (0 = read every group on every scrape)."""
        self.backend = backend
        self.slow_interval = slow_interval
        #: Last known cumulative energy (J) per GPU (by UUID), so the node total never drops while a GPU is lost.
        self._energy: dict[str, float] = {}
        #: Per GPU label: (reader slow_token, slow-tier family name -> samples) of the last slow read.
        self._slow_samples: dict[str, tuple[object, dict[str, list[Sample]]]] = {}
        #: Per GPU label: NVLink (tx, rx) label dicts, one pair per link (never mutated).
        self._link_labels: dict[str, list[tuple[FrozenLabels, FrozenLabels]]] = {}

    def describe(self) -> Iterable[Metric]:
        return [*(s.family() for s in _SPECS), catalog.spec("gpufleet_nvml_call_stalled_seconds").family()]

    def collect(self) -> Iterable[Metric]:
        b = self.backend
        budget = budgets.current()
        until = budget.share(budgets.GPU_SHARE)
        lanes: Lanes = b.lanes
        answered, up_now = lanes.run(NODE, "nvmlDeviceGetCount", b.refresh, until)
        if not answered:
            budget.missing.append("nvml: node-wide call")
        if not up_now:
            up = catalog.spec("gpufleet_nvml_up").family()
            up.add_metric([], 0)
            return [up, *self._errors(), *stalled_family(lanes)]
        devices = list(b.devices)
        slow = self.slow_interval
        # One worker reads the GPUs in order; a GPU whose call overruns keeps that worker (its lane is
        # stalled) and the GPUs after it go on on another.
        outcomes = lanes.run_batch([(d.label, "read_gpu", partial(read_gpu, b, d, slow_interval=slow))
                                    for d in devices], staggered(time.monotonic(), until, len(devices)))
        readings: list[Reading | None] = []
        for d, o in zip(devices, outcomes, strict=True):
            if not o.answered:
                budget.missing.append(f"gpu {d.label}")
                readings.append(None)
            elif o.error is not None:
                raise o.error
            else:
                readings.append(o.result)
        f: dict[str, Fam] = {s.name: s.family() for s in _SPECS}
        f["gpufleet_nvml_up"].add_metric([], 1)
        self._identity(f, devices, readings)
        total_w = total_j = 0.0
        n_w = n_j = 0
        last_energy = self._energy
        present: set[str] = set()
        for dev, r in zip(devices, readings, strict=True):
            s = None if r is None else r.sample
            key = str(dev.facts.get("uuid") or dev.label)
            present.add(key)
            if s is None or s.energy_mj is None:
                # Lost (or its energy unreadable this time): its last known energy stays in the node total,
                # which is a counter and must not drop because one GPU fell off the bus.
                if key in last_energy:
                    total_j += last_energy[key]
                    n_j += 1
                if s is None:
                    continue
            assert r is not None  # s is r.sample
            g = dev.label
            gl = [g]
            _div(f["gpufleet_gpu_utilization_ratio"], gl, s.utilization_gpu_pct, PER_PCT)
            _div(f["gpufleet_gpu_memory_utilization_ratio"], gl, s.utilization_memory_pct, PER_PCT)
            clock, clock_max = f["gpufleet_gpu_clock_hertz"], f["gpufleet_gpu_clock_max_hertz"]
            for label, attr, fact in _CLOCKS:
                _add(clock, [g, label], getattr(s, attr), MHZ)
                _add(clock_max, [g, label], dev.fact(fact), MHZ)
            if s.power_mw is not None:
                watts = s.power_mw / PER_MILLI
                _put(f["gpufleet_gpu_power_watts"], gl, watts)
                total_w += watts
                n_w += 1
            _div(f["gpufleet_gpu_power_limit_watts"], gl, s.power_limit_mw, PER_MILLI)
            if s.energy_mj is not None:
                joules = s.energy_mj / PER_MILLI
                _put(f["gpufleet_gpu_energy_joules_total"], gl, joules)
                total_j += joules
                n_j += 1
                last_energy[key] = joules
            temp = f["gpufleet_gpu_temperature_celsius"]
            _add(temp, [g, "gpu"], s.temperature_gpu_c)
            _add(temp, [g, "memory"], s.temperature_memory_c)
            thr = f["gpufleet_gpu_temperature_threshold_celsius"]
            for label, fact in _THRESHOLDS:
                _add(thr, [g, label], dev.fact(fact))
            if s.fan_speed_pct:
                fan = f["gpufleet_gpu_fan_speed_ratio"]
                for i, pct in enumerate(s.fan_speed_pct):
                    _put(fan, [g, str(i)], pct / PER_PCT)
            _add(f["gpufleet_gpu_memory_used_bytes"], gl, s.memory_used_bytes)
            _add(f["gpufleet_gpu_memory_total_bytes"], gl, r.memory_total_bytes)
            _add(f["gpufleet_gpu_memory_reserved_bytes"], gl, s.memory_reserved_bytes)
            _add(f["gpufleet_gpu_performance_state"], gl, s.pstate)
            if s.clocks_event_reasons is not None:
                active = f["gpufleet_gpu_clock_event_active"]
                mask = s.clocks_event_reasons
                for reason, bit in _REASONS:
                    _put(active, [g, reason], 1 if mask & bit else 0)
            if s.clocks_event_ns:
                secs = f["gpufleet_gpu_clock_event_seconds_total"]
                for reason, ns in s.clocks_event_ns.items():
                    _put(secs, [g, reason], ns / PER_NS)
            self._slow(f, g, r)
            self._pcie(f, dev, r)
            self._nvlink_bytes(f, g, r)
            self._gpm(f, g, r)
        for gone in [k for k in last_energy if k not in present]:  # GPUs no longer enumerated
            del last_energy[gone]
        if n_w:
            f["gpufleet_node_gpu_power_watts"].add_metric([], total_w)
        if n_j:
            f["gpufleet_node_gpu_energy_joules_total"].add_metric([], total_j)
        out: list[Metric] = [f[n] for n in _NAMES[:-1] if f[n].samples]
        out.extend(self._errors())
        out.extend(stalled_family(lanes))
        return out

    # ------------------------------------------------------------------ helpers

    def _identity(self, f: dict[str, Fam], devices: list[Device], readings: list[Reading | None]) -> None:
        b = self.backend
        if b.driver is not None:
            d = b.driver
            f["gpufleet_driver_info"].add_metric([d.driver_version, d.nvml_version, d.cuda_version], 1)
        f["gpufleet_gpus"].add_metric([], len(devices))
        info, up = f["gpufleet_gpu_info"], f["gpufleet_gpu_up"]
        for dev, r in zip(devices, readings, strict=True):
            facts = dev.facts
            info.add_metric([
                dev.label, facts.get("uuid") or "", facts.get("name") or "", facts.get("serial") or "",
                facts.get("pci_bus_id") or "", facts.get("vbios_version") or "",
                architecture_label(facts.get("architecture")),  # "" (no label) when unknown
            ], 1)
            if r is not None:  # a GPU whose read is stalled is neither up nor down: no sample
                _put(up, [dev.label], 0 if r.lost or r.sample is None else 1)

    def _slow(self, f: dict[str, Fam], g: str, r: Reading) -> None:
        """The slow tier's series (ECC, row remapping, retired pages, NVLink state and errors).

        While the reader serves them from its cache (same ``slow_token``), the very same samples
        are reused (StickySample: the encoder reuses their rendered lines too)."""
        cached = self._slow_samples.get(g)
        if cached is None or cached[0] is not r.slow_token or r.slow_token is None:
            # Re-read: counters and flags that did not change keep their very sample (see _put).
            tmp: dict[str, SampleSink] = {name: _Samples(f[name].name) for name in _SLOW_NAMES}
            s = r.sample
            assert s is not None
            if s.ecc:
                ecc = tmp["gpufleet_gpu_ecc_errors_total"]
                for key, n in s.ecc.items():
                    counter, _, error = key.partition("_")
                    _put(ecc, [g, error, counter], n)
            self._memory_health(tmp, g, r)
            self._nvlink_health(tmp, g, r)
            cached = (r.slow_token, {name: fam.samples for name, fam in tmp.items() if fam.samples})
            self._slow_samples[g] = cached
        for name, samples in cached[1].items():
            f[name].samples.extend(samples)

    @staticmethod
    def _memory_health(f: Mapping[str, SampleSink], g: str, r: Reading) -> None:
        s = r.sample
        assert s is not None
        rows = f["gpufleet_gpu_remapped_rows"]
        _add(rows, [g, "correctable"], s.remapped_rows_correctable)
        _add(rows, [g, "uncorrectable"], s.remapped_rows_uncorrectable)
        _add_bool(f["gpufleet_gpu_row_remap_pending"], [g], s.row_remap_pending)
        _add_bool(f["gpufleet_gpu_row_remap_failure"], [g], s.row_remap_failure)
        pages = f["gpufleet_gpu_retired_pages"]
        _add(pages, [g, "single_bit"], s.retired_pages_single_bit)
        _add(pages, [g, "double_bit"], s.retired_pages_double_bit)
        _add_bool(f["gpufleet_gpu_retired_pages_pending"], [g], s.retired_pages_pending)

    @staticmethod
    def _pcie(f: dict[str, Fam], dev: Device, r: Reading) -> None:
        s = r.sample
        assert s is not None
        g = dev.label
        gl = [g]
        _add(f["gpufleet_gpu_pcie_link_generation"], gl, s.pcie_gen)
        _add(f["gpufleet_gpu_pcie_link_generation_max"], gl, dev.fact("pcie_max_gen"))
        _add(f["gpufleet_gpu_pcie_link_width"], gl, s.pcie_width)
        _add(f["gpufleet_gpu_pcie_link_width_max"], gl, dev.fact("pcie_max_width"))
        _add(f["gpufleet_gpu_pcie_replay_total"], gl, s.pcie_replay_counter)
        thr = f["gpufleet_gpu_pcie_throughput_bytes_per_second"]
        gpm = r.gpm
        tx = gpm.pcie_tx_mibps if gpm else None
        rx = gpm.pcie_rx_mibps if gpm else None
        if tx is not None or rx is not None:
            _add(thr, [g, "tx"], tx, MIB)
            _add(thr, [g, "rx"], rx, MIB)
        else:
            _add(thr, [g, "tx"], s.pcie_tx_kbps, KB)
            _add(thr, [g, "rx"], s.pcie_rx_kbps, KB)

    @staticmethod
    def _nvlink_health(f: Mapping[str, SampleSink], g: str, r: Reading) -> None:
        s = r.sample
        assert s is not None
        if not s.nvlink:
            return
        up_fam, errs_fam = f["gpufleet_gpu_nvlink_up"], f["gpufleet_gpu_nvlink_errors_total"]
        ups = r.nvlink_up
        for i, (link, ls) in enumerate(zip(r.nvlink_links, s.nvlink, strict=False)):
            lk = str(link)
            state = ups[i] if i < len(ups) else None
            if state is not None:
                _put(up_fam, [g, lk], 1 if state else 0)
            for name in _NVLINK_ERRORS:
                v = getattr(ls, name)
                if v is not None:
                    _put(errs_fam, [g, lk, name], v)

    def _nvlink_bytes(self, f: dict[str, Fam], g: str, r: Reading) -> None:
        """NVLink data counters: the largest per-scrape group (2 series per link, 18 links per H100).
        Samples are built directly, with label dicts kept across scrapes."""
        s = r.sample
        assert s is not None
        if not s.nvlink:
            return
        fam = f["gpufleet_gpu_nvlink_bytes_total"]
        add, name = fam.samples.append, fam.name + "_total"
        labels = self._link_labels.get(g)
        if labels is None or len(labels) != len(r.nvlink_links):
            labels = self._link_labels[g] = [
                (FrozenLabels(name, (("gpu", g), ("link", str(link)), ("direction", "tx"))),
                 FrozenLabels(name, (("gpu", g), ("link", str(link)), ("direction", "rx"))))
                for link in r.nvlink_links]
        new = _new
        for (tx_labels, rx_labels), ls in zip(labels, s.nvlink, strict=False):
            if ls.tx_kib is not None:
                add(new(Sample, (name, tx_labels, ls.tx_kib * KIB, None, None, None)))
            if ls.rx_kib is not None:
                add(new(Sample, (name, rx_labels, ls.rx_kib * KIB, None, None, None)))

    @staticmethod
    def _gpm(f: dict[str, Fam], g: str, r: Reading) -> None:
        gpm = r.gpm
        if gpm is None:
            return
        gl = [g]
        for name, attr in _GPM_RATIOS:
            _div(f[name], gl, getattr(gpm, attr), PER_PCT)
        thr = f["gpufleet_gpu_nvlink_throughput_bytes_per_second"]
        _add(thr, [g, "tx"], gpm.nvlink_tx_mibps, MIB)
        _add(thr, [g, "rx"], gpm.nvlink_rx_mibps, MIB)

    def _errors(self) -> Iterator[Metric]:
        errors = self.backend.errors()
        fam = catalog.spec("gpufleet_nvml_errors_total").family()
        for (function, error), n in sorted(errors.items()):
            fam.add_metric([function, error], n)
        if errors:
            yield fam


def stalled_family(lanes: Lanes) -> list[Metric]:
    """``gpufleet_nvml_call_stalled_seconds{gpu,call}`` for every NVML call a scrape gave up on that is
    still running (gpu "" for node-wide calls); nothing when none is."""
    stalls = lanes.stalled()
    if not stalls:
        return []
    fam = catalog.spec("gpufleet_nvml_call_stalled_seconds").family()
    for st in stalls:
        fam.add_metric([st.key, st.call], round(st.seconds, 3))
    return [fam]


class _Samples:
    """Just a family's name and a sample list: what _put fills (the slow tier's per-GPU sample lists)."""

    __slots__ = ("name", "samples")

    def __init__(self, name: str) -> None:
        self.name = name
        self.samples: list[Sample] = []


#: Label sets built once and unchanged samples reused (the GPU label sets repeat every scrape).
_put = SeriesCache(_SPECS).put
_new = tuple.__new__


def _add(fam: SampleSink, labels: list[str], value: float | None, scale: float = 1) -> None:
    if value is not None:
        _put(fam, labels, value * scale if scale != 1 else value)


def _div(fam: SampleSink, labels: list[str], value: float | None, divisor: float) -> None:
    if value is not None:
        _put(fam, labels, value / divisor)


def _add_bool(fam: SampleSink, labels: list[str], value: bool | None) -> None:
    if value is not None:
        _put(fam, labels, 1 if value else 0)
