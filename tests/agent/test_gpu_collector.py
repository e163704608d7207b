"""The GPU collector against the fake NVML: every family's values against the source's, converted."""

from __future__ import annotations

import copy
import itertools
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pynvml
import pytest
from prometheus_client import CollectorRegistry
from support import Series, scrape

from gpufleet.agent.collectors.gpu import GpuCollector
from gpufleet.agent.collectors.xid import XidCollector
from gpufleet.agent.nvml.backend import NvmlBackend
from gpufleet.agent.nvml.model import (
    DriverInfo,
    GpmCounters,
    GpuInventory,
    GpuSample,
    NvLinkSample,
    XidEvent,
)
from gpufleet.sim.fake.library import FakeNvml
from gpufleet.vocab import catalog
from gpufleet.vocab.nvml import CLOCK_EVENT_BITS


class FakeHost:
    """A DeviceSource whose state tests edit directly: GPU 0 and 2 are SXM H100s (NVLink, GPM, no fans),
    GPU 1 is a PCIe card with fans, retired pages and no NVLink/GPM."""

    def __init__(self, n: int = 3) -> None:
        self.t = 1_700_000_000.0
        self.inv: list[GpuInventory] = []
        self.samples: list[GpuSample] = []
        self.xids: list[XidEvent] = []
        for i in range(n):
            pcie_card = i % 3 == 1
            self.inv.append(GpuInventory(
                index=i, uuid=f"GPU-{i:08d}-aaaa-bbbb-cccc-dddddddddddd", serial=f"165432100{i}",
                pci_bus_id=f"00000000:{0x18 + 0x10 * i:02X}:00.0", vbios_version=f"96.00.89.00.0{i}",
                minor_number=i, nvlink_count=0 if pcie_card else 4, fan_count=2 if pcie_card else 0,
                gpm_supported=not pcie_card, retired_pages_supported=pcie_card, row_remap_supported=not pcie_card,
                name="NVIDIA A100-PCIE-40GB" if pcie_card else "NVIDIA H100 80GB HBM3",
                architecture=7 if pcie_card else 9,
            ))
            self.samples.append(GpuSample(
                timestamp=self.t, utilization_gpu_pct=40 + i, utilization_memory_pct=20 + i,
                clock_sm_mhz=1755 + i, clock_memory_mhz=2619, clock_graphics_mhz=1755 + i,
                power_mw=512_345 + 1000 * i, power_limit_mw=700_000, energy_mj=9_876_543_210 + i,
                temperature_gpu_c=61 + i, temperature_memory_c=70 + i,
                fan_speed_pct=[33, 35] if pcie_card else None,
                memory_used_bytes=40 * 2**30 + i, memory_reserved_bytes=571_277_312, pstate=0,
                clocks_event_reasons=CLOCK_EVENT_BITS["sw_power_cap"] | CLOCK_EVENT_BITS["sw_thermal_slowdown"],
                clocks_event_ns=({} if pcie_card else
                                 {"sw_power_cap": 12_000_000_000 + i, "sync_boost": 0, "sw_thermal_slowdown": 5_000,
                                  "hw_thermal_slowdown": 7, "hw_power_brake_slowdown": 0}),
                ecc={"volatile_corrected": 3 + i, "volatile_uncorrected": 0, "aggregate_corrected": 11 + i,
                     "aggregate_uncorrected": 1},
                remapped_rows_correctable=None if pcie_card else 2,
                remapped_rows_uncorrectable=None if pcie_card else 0,
                row_remap_pending=None if pcie_card else True, row_remap_failure=None if pcie_card else False,
                retired_pages_single_bit=4 if pcie_card else None, retired_pages_double_bit=1 if pcie_card else None,
                retired_pages_pending=False if pcie_card else None,
                pcie_gen=4 if pcie_card else 5, pcie_width=16, pcie_replay_counter=5 + i,
                pcie_tx_kbps=1200 + i, pcie_rx_kbps=3400 + i,
                nvlink=[] if pcie_card else [
                    NvLinkSample(up=link != 3, tx_kib=10_000 * (link + 1) + i, rx_kib=20_000 * (link + 1),
                                 crc_flit=link, crc_data=2 * link, replay=3, recovery=0) for link in range(4)],
                gpm=None if pcie_card else GpmCounters(sm_active_s=100.0, sm_occupancy_s=50.0, tensor_active_s=30.0,
                                                       dram_active_s=20.0, nvlink_tx_bytes=10**12,
                                                       nvlink_rx_bytes=2 * 10**12, pcie_tx_bytes=10**9,
                                                       pcie_rx_bytes=3 * 10**9),
            ))

    # DeviceSource
    def driver(self) -> DriverInfo:
        return DriverInfo()

    def inventory(self) -> list[GpuInventory]:
        return self.inv

    def sample(self, index: int) -> GpuSample:
        return self.samples[index]

    def poll_xid(self) -> list[XidEvent]:
        out, self.xids = self.xids, []
        return out

    def advance(self, dt: float, *, sm: float = 0.5, tensor: float = 0.25, nvlink_bps: int = 2**30,
                pcie_bps: int = 2**20) -> None:
        """Move time on by ``dt`` seconds with the given GPM activity."""
        self.t += dt
        for s in self.samples:
            s.timestamp = self.t
            if s.gpm is not None:
                s.gpm.sm_active_s += sm * dt
                s.gpm.sm_occupancy_s += sm / 2 * dt
                s.gpm.tensor_active_s += tensor * dt
                s.gpm.dram_active_s += 0.1 * dt
                s.gpm.nvlink_tx_bytes += int(nvlink_bps * dt)
                s.gpm.nvlink_rx_bytes += int(2 * nvlink_bps * dt)
                s.gpm.pcie_tx_bytes += int(pcie_bps * dt)
                s.gpm.pcie_rx_bytes += int(3 * pcie_bps * dt)


def pick(series: Series, name: str, **labels: str) -> dict[frozenset[tuple[str, str]], float]:
    """Series of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return {lbl: v for (n, lbl), v in series.items() if n == name and want <= lbl}


def value(series: Series, name: str, **labels: str) -> float:
    return series[(name, frozenset(labels.items()))]


@pytest.fixture
def host() -> Iterator[tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector]]:
    src = FakeHost()
    fake = FakeNvml(src).install()
    backend = NvmlBackend()
    assert backend.start(), backend.init_error
    try:
        yield src, fake, backend, GpuCollector(backend)
    finally:
        backend.close()
        fake.uninstall()


def expected_series(src: FakeHost | Any, dt: float | None = None) -> Series:
    """What the collector must export for ``src``, computed from the model (units converted).

    ``dt``: seconds between the two last scrapes when GPM rates are expected (FakeHost.advance defaults).
    ``src`` needs ``inv``, ``samples`` and ``driver()``.
    """
    exp: Series = {}

    def put(metric: str, v: float | None, /, **labels: str) -> None:
        if v is not None:  # None = not supported: no series
            exp[(metric, frozenset(labels.items()))] = v

    drv = src.driver()
    put("gpufleet_nvml_up", 1)
    put("gpufleet_gpus", len(src.inv))
    put("gpufleet_driver_info", 1, driver_version=drv.driver_version, nvml_version=drv.nvml_version,
        cuda_version=f"{drv.cuda_driver_version // 1000}.{drv.cuda_driver_version % 1000 // 10}")
    total_w = total_j = 0.0
    arch = {7: "ampere", 9: "hopper"}
    for inv, s in zip(src.inv, src.samples, strict=True):
        g = str(inv.index)
        put("gpufleet_gpu_info", 1, gpu=g, uuid=inv.uuid, name=inv.name, serial=inv.serial or "",
            pci_bus_id=inv.pci_bus_id, vbios_version=inv.vbios_version or "", architecture=arch[inv.architecture])
        put("gpufleet_gpu_up", 0 if s.lost else 1, gpu=g)
        if s.lost:
            continue
        put("gpufleet_gpu_utilization_ratio", s.utilization_gpu_pct / 100, gpu=g)
        put("gpufleet_gpu_memory_utilization_ratio", s.utilization_memory_pct / 100, gpu=g)
        for clock, cur, mx in (("sm", s.clock_sm_mhz, inv.max_clock_sm_mhz),
                               ("memory", s.clock_memory_mhz, inv.max_clock_memory_mhz),
                               ("graphics", s.clock_graphics_mhz, inv.max_clock_graphics_mhz)):
            put("gpufleet_gpu_clock_hertz", cur * 1e6, gpu=g, clock=clock)
            put("gpufleet_gpu_clock_max_hertz", mx * 1e6, gpu=g, clock=clock)
        put("gpufleet_gpu_power_watts", s.power_mw / 1000, gpu=g)
        put("gpufleet_gpu_power_limit_watts", s.power_limit_mw / 1000, gpu=g)
        put("gpufleet_gpu_energy_joules_total", s.energy_mj / 1000, gpu=g)
        total_w += s.power_mw / 1000
        total_j += s.energy_mj / 1000
        put("gpufleet_gpu_temperature_celsius", s.temperature_gpu_c, gpu=g, sensor="gpu")
        put("gpufleet_gpu_temperature_celsius", s.temperature_memory_c, gpu=g, sensor="memory")
        for thr, v in (("slowdown", inv.temp_slowdown_c), ("shutdown", inv.temp_shutdown_c),
                       ("gpu_max", inv.temp_gpu_max_c), ("memory_max", inv.temp_memory_max_c)):
            put("gpufleet_gpu_temperature_threshold_celsius", v, gpu=g, threshold=thr)
        for fan, pct in enumerate(s.fan_speed_pct or []):
            put("gpufleet_gpu_fan_speed_ratio", pct / 100, gpu=g, fan=str(fan))
        put("gpufleet_gpu_memory_used_bytes", s.memory_used_bytes, gpu=g)
        put("gpufleet_gpu_memory_total_bytes", inv.memory_total_bytes, gpu=g)
        put("gpufleet_gpu_memory_reserved_bytes", s.memory_reserved_bytes, gpu=g)
        put("gpufleet_gpu_performance_state", s.pstate, gpu=g)
        for reason in catalog.CLOCK_EVENT_REASONS:
            put("gpufleet_gpu_clock_event_active", 1 if s.clocks_event_reasons & CLOCK_EVENT_BITS[reason] else 0,
                gpu=g, reason=reason)
        for reason, ns in (s.clocks_event_ns or {}).items():
            put("gpufleet_gpu_clock_event_seconds_total", ns / 1e9, gpu=g, reason=reason)
        for key, n in (s.ecc or {}).items():
            counter, error = key.split("_")
            put("gpufleet_gpu_ecc_errors_total", n, gpu=g, error=error, counter=counter)
        if s.remapped_rows_correctable is not None:
            put("gpufleet_gpu_remapped_rows", s.remapped_rows_correctable, gpu=g, cause="correctable")
            put("gpufleet_gpu_remapped_rows", s.remapped_rows_uncorrectable, gpu=g, cause="uncorrectable")
            put("gpufleet_gpu_row_remap_pending", int(s.row_remap_pending), gpu=g)
            put("gpufleet_gpu_row_remap_failure", int(s.row_remap_failure), gpu=g)
        if s.retired_pages_single_bit is not None:
            put("gpufleet_gpu_retired_pages", s.retired_pages_single_bit, gpu=g, cause="single_bit")
            put("gpufleet_gpu_retired_pages", s.retired_pages_double_bit, gpu=g, cause="double_bit")
            put("gpufleet_gpu_retired_pages_pending", int(s.retired_pages_pending), gpu=g)
        put("gpufleet_gpu_pcie_link_generation", s.pcie_gen, gpu=g)
        put("gpufleet_gpu_pcie_link_generation_max", inv.pcie_max_gen, gpu=g)
        put("gpufleet_gpu_pcie_link_width", s.pcie_width, gpu=g)
        put("gpufleet_gpu_pcie_link_width_max", inv.pcie_max_width, gpu=g)
        put("gpufleet_gpu_pcie_replay_total", s.pcie_replay_counter, gpu=g)
        if not inv.gpm_supported:
            put("gpufleet_gpu_pcie_throughput_bytes_per_second", s.pcie_tx_kbps * 1024, gpu=g, direction="tx")
            put("gpufleet_gpu_pcie_throughput_bytes_per_second", s.pcie_rx_kbps * 1024, gpu=g, direction="rx")
        for link, ls in enumerate(s.nvlink or []):
            lk = str(link)
            put("gpufleet_gpu_nvlink_up", int(ls.up), gpu=g, link=lk)
            put("gpufleet_gpu_nvlink_bytes_total", ls.tx_kib * 1024, gpu=g, link=lk, direction="tx")
            put("gpufleet_gpu_nvlink_bytes_total", ls.rx_kib * 1024, gpu=g, link=lk, direction="rx")
            for err in catalog.NVLINK_ERRORS:
                put("gpufleet_gpu_nvlink_errors_total", getattr(ls, err), gpu=g, link=lk, error=err)
        if inv.gpm_supported and dt is not None:
            put("gpufleet_gpu_sm_active_ratio", 0.5, gpu=g)
            put("gpufleet_gpu_sm_occupancy_ratio", 0.25, gpu=g)
            put("gpufleet_gpu_tensor_active_ratio", 0.25, gpu=g)
            put("gpufleet_gpu_dram_active_ratio", 0.1, gpu=g)
            put("gpufleet_gpu_nvlink_throughput_bytes_per_second", 2**30, gpu=g, direction="tx")
            put("gpufleet_gpu_nvlink_throughput_bytes_per_second", 2 * 2**30, gpu=g, direction="rx")
            put("gpufleet_gpu_pcie_throughput_bytes_per_second", 2**20, gpu=g, direction="tx")
            put("gpufleet_gpu_pcie_throughput_bytes_per_second", 3 * 2**20, gpu=g, direction="rx")
    put("gpufleet_node_gpu_power_watts", total_w)
    put("gpufleet_node_gpu_energy_joules_total", total_j)
    return exp


def assert_series_equal(got: Series, exp: Series) -> None:
    got = {k: v for k, v in got.items() if k[0] != "gpufleet_nvml_errors_total"}
    missing = sorted(set(exp) - set(got), key=str)
    extra = sorted(set(got) - set(exp), key=str)
    assert not missing, f"missing series: {missing[:10]}"
    assert not extra, f"unexpected series: {extra[:10]}"
    wrong = {k: (got[k], v) for k, v in exp.items() if got[k] != pytest.approx(v, rel=1e-9, abs=1e-12)}
    assert not wrong, f"wrong values (got, expected): {dict(list(wrong.items())[:10])}"


def test_every_family_matches_the_source(host: tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector]) -> None:
    src, _, backend, collector = host
    first = scrape(collector)
    assert_series_equal(first, expected_series(src))  # first scrape: no GPM rates yet
    src.advance(10.0)
    second = scrape(collector)
    assert_series_equal(second, expected_series(src, dt=10.0))
    assert backend.errors() == {}


def test_every_gpu_catalog_metric_is_exported(host: tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector]) -> None:
    src, _, _, collector = host
    scrape(collector)
    src.advance(5.0)
    names = {n for n, _ in scrape(collector)}
    wanted = {s.name for s in catalog.by_group("gpu")} | {"gpufleet_nvml_up"}
    # counters are exposed with the _total suffix already in the catalog name
    assert wanted <= names, sorted(wanted - names)
    assert all(n in catalog.BY_NAME for n in names), sorted(n for n in names if n not in catalog.BY_NAME)


def test_unsupported_fields_yield_no_series(host: tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector]) -> None:
    src, _, backend, collector = host
    s = src.samples[0]
    s.power_mw = None
    s.temperature_memory_c = None
    s.clocks_event_ns = None
    s.ecc = None
    s.pstate = None
    s.nvlink[1].crc_flit = None  # type: ignore[index]
    s.nvlink[2].tx_kib = None  # type: ignore[index]
    got = scrape(collector)
    assert_series_equal(got, expected_series_without(src, got_power_gpus=("1", "2")))
    assert not pick(got, "gpufleet_gpu_power_watts", gpu="0")
    assert not pick(got, "gpufleet_gpu_temperature_celsius", gpu="0", sensor="memory")
    assert not pick(got, "gpufleet_gpu_ecc_errors_total", gpu="0")
    assert not pick(got, "gpufleet_gpu_nvlink_errors_total", gpu="0", link="1", error="crc_flit")
    assert pick(got, "gpufleet_gpu_nvlink_errors_total", gpu="0", link="1", error="crc_data")
    assert backend.errors() == {}, "NOT_SUPPORTED is not an error"


def expected_series_without(src: FakeHost, got_power_gpus: tuple[str, ...]) -> Series:
    """expected_series() for a source with None fields: drop what None removes, fix the node totals."""
    work = copy.deepcopy(src)
    s = work.samples[0]
    # the expectation builder needs concrete values: fill the None ones and remove their series afterwards
    s.power_mw = 0
    s.temperature_memory_c = 0
    s.pstate = 0
    s.nvlink[1].crc_flit = 0  # type: ignore[index]
    s.nvlink[2].tx_kib = 0  # type: ignore[index]
    exp = expected_series(work)
    drop = [("gpufleet_gpu_power_watts", {"gpu": "0"}),
            ("gpufleet_gpu_temperature_celsius", {"gpu": "0", "sensor": "memory"}),
            ("gpufleet_gpu_performance_state", {"gpu": "0"}),
            ("gpufleet_gpu_nvlink_errors_total", {"gpu": "0", "link": "1", "error": "crc_flit"}),
            ("gpufleet_gpu_nvlink_bytes_total", {"gpu": "0", "link": "2", "direction": "tx"})]
    for name, labels in drop:
        del exp[(name, frozenset(labels.items()))]
    total = 0.0
    for g in got_power_gpus:
        mw = work.samples[int(g)].power_mw
        assert mw is not None
        total += mw / 1000
    exp[("gpufleet_node_gpu_power_watts", frozenset())] = total
    return exp


def test_implausible_readings_are_dropped_and_counted(
    host: tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector],
) -> None:
    """Garbage from the driver (0xFFFFFFFF, a wrapped negative, 4 MW) is no data, counted as IMPLAUSIBLE_VALUE."""
    src, _, _, collector = host
    s = src.samples[0]
    s.power_mw = 0xFFFFFFFF  # 4.29 MW
    s.clock_sm_mhz = 0xFFFFFFFF  # a negative clock read as unsigned: 4.29e15 Hz
    s.temperature_gpu_c = 250
    s.utilization_gpu_pct = 101
    src.samples[1].fan_speed_pct = [33, 0xFFFF]
    got = scrape(collector)
    assert not pick(got, "gpufleet_gpu_power_watts", gpu="0")
    assert not pick(got, "gpufleet_gpu_clock_hertz", gpu="0", clock="sm")
    assert pick(got, "gpufleet_gpu_clock_hertz", gpu="0", clock="memory")  # only the bad reading goes
    assert not pick(got, "gpufleet_gpu_temperature_celsius", gpu="0", sensor="gpu")
    assert not pick(got, "gpufleet_gpu_utilization_ratio", gpu="0")
    assert not pick(got, "gpufleet_gpu_fan_speed_ratio", gpu="1")
    assert value(got, "gpufleet_gpu_up", gpu="0") == 1
    # the node total holds the plausible GPUs only
    assert value(got, "gpufleet_node_gpu_power_watts") == pytest.approx(
        sum(x.power_mw for x in src.samples[1:]) / 1000)  # type: ignore[misc]
    assert max(v for (n, _), v in got.items() if n == "gpufleet_gpu_clock_hertz") <= 10e9
    errors = pick(got, "gpufleet_nvml_errors_total", error="IMPLAUSIBLE_VALUE")
    by_function = {dict(k)["function"]: v for k, v in errors.items()}
    assert by_function == {"nvmlDeviceGetPowerUsage": 1, "nvmlDeviceGetClockInfo": 1,
                           "nvmlDeviceGetTemperature": 1, "nvmlDeviceGetUtilizationRates": 1,
                           "nvmlDeviceGetFanSpeed_v2": 1}
    s.power_mw = 650_000  # the driver recovers: the reading is back
    assert value(scrape(collector), "gpufleet_gpu_power_watts", gpu="0") == 650.0


def test_gpm_is_computed_between_samples(host: tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector]) -> None:
    src, _, _, collector = host
    assert not pick(scrape(collector), "gpufleet_gpu_sm_active_ratio"), "first scrape has no GPM interval"
    src.advance(4.0, sm=0.8, tensor=0.6, nvlink_bps=3 * 2**20)
    got = scrape(collector)
    assert value(got, "gpufleet_gpu_sm_active_ratio", gpu="0") == pytest.approx(0.8)
    assert value(got, "gpufleet_gpu_tensor_active_ratio", gpu="2") == pytest.approx(0.6)
    assert value(got, "gpufleet_gpu_nvlink_throughput_bytes_per_second", gpu="0", direction="tx") == \
        pytest.approx(3 * 2**20)
    assert not pick(got, "gpufleet_gpu_sm_active_ratio", gpu="1"), "GPU 1 has no GPM"
    src.advance(2.0, sm=0.2, tensor=0.0)
    got = scrape(collector)  # only the last interval counts, not the average since the start
    assert value(got, "gpufleet_gpu_sm_active_ratio", gpu="0") == pytest.approx(0.2)
    assert value(got, "gpufleet_gpu_tensor_active_ratio", gpu="0") == pytest.approx(0.0)


def test_gpm_survives_a_scrape_without_a_new_sample(
    host: tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector],
) -> None:
    """A source that did not move on between two scrapes (live snapshot not yet rewritten): same GPM values
    again, no error; the next interval starts at the last sample that moved."""
    src, _, backend, collector = host
    scrape(collector)
    src.advance(4.0, sm=0.8)
    assert value(scrape(collector), "gpufleet_gpu_sm_active_ratio", gpu="0") == pytest.approx(0.8)
    again = scrape(collector)  # no advance
    assert value(again, "gpufleet_gpu_sm_active_ratio", gpu="0") == pytest.approx(0.8)
    assert value(again, "gpufleet_gpu_pcie_throughput_bytes_per_second", gpu="0", direction="tx") == \
        pytest.approx(2**20), "still GPM's PCIe figure, not the fallback"
    src.advance(2.0, sm=0.3)
    assert value(scrape(collector), "gpufleet_gpu_sm_active_ratio", gpu="0") == pytest.approx(0.3)
    assert backend.errors() == {}


def test_pcie_throughput_falls_back_without_gpm(host: tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector]) -> None:
    src, _, _, collector = host
    got = scrape(collector)
    assert value(got, "gpufleet_gpu_pcie_throughput_bytes_per_second", gpu="1", direction="rx") == 3401 * 1024
    assert not pick(got, "gpufleet_gpu_pcie_throughput_bytes_per_second", gpu="0")
    src.advance(1.0, pcie_bps=5 * 2**20)
    got = scrape(collector)
    assert value(got, "gpufleet_gpu_pcie_throughput_bytes_per_second", gpu="0", direction="tx") == \
        pytest.approx(5 * 2**20)


def test_lost_gpu_is_down_keeps_identity_and_spares_the_others(
    host: tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector],
) -> None:
    src, _, backend, collector = host
    before = scrape(collector)
    src.samples[2].lost = True
    src.advance(10.0)
    got = scrape(collector)
    exp = expected_series(src, dt=10.0)
    # The node's energy counter keeps the lost GPU's last known energy (it must never decrease).
    exp[("gpufleet_node_gpu_energy_joules_total", frozenset())] += value(
        before, "gpufleet_gpu_energy_joules_total", gpu="2")
    assert_series_equal(got, exp)
    assert value(got, "gpufleet_gpu_up", gpu="2") == 0
    info = pick(got, "gpufleet_gpu_info", gpu="2")
    assert [dict(k)["uuid"] for k in info] == [src.inv[2].uuid]
    assert not pick(got, "gpufleet_gpu_power_watts", gpu="2")
    assert value(got, "gpufleet_node_gpu_power_watts") == pytest.approx(
        (src.samples[0].power_mw + src.samples[1].power_mw) / 1000)  # type: ignore[operator]
    assert any(err == "GPU_IS_LOST" for _, err in backend.errors())
    src.samples[2].lost = False  # back on the bus (after a reset)
    got = scrape(collector)
    assert value(got, "gpufleet_gpu_up", gpu="2") == 1
    assert pick(got, "gpufleet_gpu_power_watts", gpu="2")


def test_nvml_down_reports_only_nvml_up_then_recovers() -> None:
    src = FakeHost()
    with FakeNvml(src) as fake:
        fake.driver_loaded = False
        backend = NvmlBackend()
        assert backend.start() is False
        assert "DRIVER_NOT_LOADED" in backend.init_error
        collector = GpuCollector(backend)
        got = scrape(collector)
        assert value(got, "gpufleet_nvml_up") == 0
        names = {n for n, _ in got}
        assert names <= {"gpufleet_nvml_up", "gpufleet_nvml_errors_total"}
        assert value(got, "gpufleet_nvml_errors_total", function="nvmlInit", error="DRIVER_NOT_LOADED") >= 1
        fake.driver_loaded = True  # the driver got loaded: the next scrape initializes NVML
        got = scrape(collector)
        assert value(got, "gpufleet_nvml_up") == 1
        assert value(got, "gpufleet_gpus") == 3
        assert backend.pci_bus_ids() == {str(i.index): i.pci_bus_id for i in src.inv}
        backend.close()


def test_driver_unloaded_while_running() -> None:
    src = FakeHost()
    with FakeNvml(src) as fake:
        backend = NvmlBackend()
        assert backend.start()
        collector = GpuCollector(backend)
        assert value(scrape(collector), "gpufleet_nvml_up") == 1
        fake.inject_error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED, function="nvmlDeviceGetCount")
        got = scrape(collector)
        assert value(got, "gpufleet_nvml_up") == 0
        assert not pick(got, "gpufleet_gpu_up")
        fake.clear_errors()
        got = scrape(collector)
        assert value(got, "gpufleet_nvml_up") == 1
        assert len(pick(got, "gpufleet_gpu_up")) == 3
        backend.close()


class _Untouchable:
    """Stands in for libnvidia-ml: any attribute access (any NVML call) fails the test."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"describe() touched NVML ({name})")


def test_describe_does_not_touch_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pynvml, "nvmlLib", _Untouchable())
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    backend = NvmlBackend()
    names = {f.name for f in GpuCollector(backend).describe()}
    names |= {f.name for f in XidCollector(backend).describe()}
    reg = CollectorRegistry()
    reg.register(GpuCollector(backend))  # registration calls describe()
    wanted = {s.name.removesuffix("_total") for s in catalog.by_group("gpu") + catalog.by_group("xid")}
    wanted |= {"gpufleet_nvml_up", "gpufleet_nvml_errors", "gpufleet_nvml_call_stalled_seconds"}
    assert names == wanted


def test_node_totals_sum_the_gpus(host: tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector]) -> None:
    src, _, _, collector = host
    got = scrape(collector)
    assert value(got, "gpufleet_node_gpu_power_watts") == pytest.approx(
        sum(s.power_mw for s in src.samples) / 1000)  # type: ignore[misc]
    assert value(got, "gpufleet_node_gpu_energy_joules_total") == pytest.approx(
        sum(s.energy_mj for s in src.samples) / 1000)  # type: ignore[misc]


# ---------------------------------------------------------------------- tiered reads (slow interval)


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def slow_clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    from gpufleet.agent.nvml import reader

    clock = _Clock()
    monkeypatch.setattr(reader, "slow_clock", clock)
    return clock


def _tiered(interval: float) -> Iterator[tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector]]:
    src = FakeHost()
    fake = FakeNvml(src).install()
    backend = NvmlBackend()
    assert backend.start(), backend.init_error
    try:
        yield src, fake, backend, GpuCollector(backend, slow_interval=interval)
    finally:
        backend.close()
        fake.uninstall()


@pytest.fixture
def tiered() -> Iterator[tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector]]:
    yield from _tiered(10.0)


@pytest.fixture
def untiered() -> Iterator[tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector]]:
    yield from _tiered(0.0)


def _bump_slow(src: FakeHost) -> None:
    """Change one counter of every slow group on GPU 0 (and GPU 1's retired pages)."""
    s0 = src.samples[0]
    assert s0.ecc is not None and s0.nvlink
    s0.ecc["volatile_corrected"] += 5
    s0.nvlink[2].crc_flit = (s0.nvlink[2].crc_flit or 0) + 7
    s0.nvlink[1].up = False
    s0.remapped_rows_correctable = 9
    src.samples[1].retired_pages_single_bit = 6


def test_slow_groups_change_after_the_interval_not_before(
    tiered: tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector], slow_clock: _Clock,
) -> None:
    src, _, _, collector = tiered
    first = scrape(collector)
    _bump_slow(src)
    src.samples[0].power_mw = 600_000  # a fast reading changes too
    slow_clock.t += 9.0
    src.advance(9.0)
    cached = scrape(collector)
    # Fast groups are read on every scrape ...
    assert value(cached, "gpufleet_gpu_power_watts", gpu="0") == 600.0
    # ... the slow ones are served from the cache until the interval is over.
    for key in (("gpufleet_gpu_ecc_errors_total", {"gpu": "0", "error": "corrected", "counter": "volatile"}),
                ("gpufleet_gpu_nvlink_errors_total", {"gpu": "0", "link": "2", "error": "crc_flit"}),
                ("gpufleet_gpu_nvlink_up", {"gpu": "0", "link": "1"}),
                ("gpufleet_gpu_remapped_rows", {"gpu": "0", "cause": "correctable"}),
                ("gpufleet_gpu_retired_pages", {"gpu": "1", "cause": "single_bit"})):
        name, labels = key
        assert value(cached, name, **labels) == value(first, name, **labels), key
    slow_clock.t += 1.0
    src.advance(1.0)
    fresh = scrape(collector)
    assert value(fresh, "gpufleet_gpu_ecc_errors_total", gpu="0", error="corrected", counter="volatile") == 3 + 5
    assert value(fresh, "gpufleet_gpu_nvlink_errors_total", gpu="0", link="2", error="crc_flit") == 2 + 7
    assert value(fresh, "gpufleet_gpu_nvlink_up", gpu="0", link="1") == 0
    assert value(fresh, "gpufleet_gpu_remapped_rows", gpu="0", cause="correctable") == 9
    assert value(fresh, "gpufleet_gpu_retired_pages", gpu="1", cause="single_bit") == 6
    # Everything else matches the source exactly, as without tiering.
    assert_series_equal(fresh, expected_series(src, dt=1.0))


def test_interval_zero_reads_the_slow_groups_every_scrape(
    untiered: tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector], slow_clock: _Clock,
) -> None:
    src, _, _, collector = untiered
    scrape(collector)
    _bump_slow(src)
    src.advance(1.0)  # the slow clock does not move at all
    got = scrape(collector)
    assert_series_equal(got, expected_series(src, dt=1.0))
    assert value(got, "gpufleet_gpu_nvlink_errors_total", gpu="0", link="2", error="crc_flit") == 9


def test_slow_tier_makes_far_fewer_nvml_calls(
    tiered: tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector], slow_clock: _Clock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, _, _, collector = tiered
    scrape(collector)
    calls: Counter[str] = Counter()
    for name in ("nvmlDeviceGetNvLinkErrorCounter", "nvmlDeviceGetNvLinkState", "nvmlDeviceGetFieldValues"):
        entry: Any = pynvml._nvmlGetFunctionPointer(name)  # the fake's entry point

        def counting(*args: Any, _real: Any = entry._impl, _name: str = name) -> Any:
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(entry, "_impl", counting)
    scrape(collector)
    # served from the cache: only the per-scrape field request (one per GPU)
    assert calls == {"nvmlDeviceGetFieldValues": 3}
    calls.clear()
    slow_clock.t += 10.0
    scrape(collector)
    # state, replay, recovery and flit CRC of every link in one more field request per NVLink GPU;
    # data CRC (no scoped field) per link: 2 NVLink GPUs x 4 links
    assert calls == {"nvmlDeviceGetFieldValues": 3 + 2, "nvmlDeviceGetNvLinkErrorCounter": 2 * 4}


def test_lost_gpu_drops_its_slow_cache(
    tiered: tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector], slow_clock: _Clock,
) -> None:
    src, _, _, collector = tiered
    scrape(collector)
    src.samples[0].lost = True
    scrape(collector)
    src.samples[0].lost = False
    _bump_slow(src)
    src.advance(1.0)
    slow_clock.t += 1.0  # well inside the interval: but the GPU came back, so it is read afresh
    got = scrape(collector)
    assert value(got, "gpufleet_gpu_ecc_errors_total", gpu="0", error="corrected", counter="volatile") == 8
    assert value(got, "gpufleet_gpu_nvlink_up", gpu="0", link="1") == 0


def test_failed_slow_read_is_retried_on_the_next_scrape(
    tiered: tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector], slow_clock: _Clock,
) -> None:
    _, fake, _, collector = tiered
    fake.inject_error(pynvml.NVML_ERROR_UNKNOWN, function="nvmlDeviceGetTotalEccErrors", gpu=0)
    got = scrape(collector)
    assert not pick(got, "gpufleet_gpu_ecc_errors_total", gpu="0")
    fake.clear_errors()
    slow_clock.t += 1.0
    got = scrape(collector)  # not cached for 10 s: the ECC counters are back at once
    assert value(got, "gpufleet_gpu_ecc_errors_total", gpu="0", error="corrected", counter="volatile") == 3


def test_node_energy_never_decreases_while_a_gpu_is_lost(
    host: tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector],
) -> None:
    src, _, _, collector = host
    seen = [value(scrape(collector), "gpufleet_node_gpu_energy_joules_total")]
    for step in range(4):
        if step == 1:
            src.samples[1].lost = True
        if step == 3:
            src.samples[1].lost = False
        for s in src.samples:
            assert s.energy_mj is not None
            s.energy_mj += 1_000  # 1 J per GPU per step
        src.advance(1.0)
        got = scrape(collector)
        seen.append(value(got, "gpufleet_node_gpu_energy_joules_total"))
    assert all(b > a for a, b in itertools.pairwise(seen)), seen
    # While lost, GPU 1 counts with its last known energy; once back, with its current one.
    assert seen[-1] == pytest.approx(sum(s.energy_mj or 0 for s in src.samples) / 1000)
