"""The fake libnvidia-ml answers the real pynvml wrappers from a DeviceSource."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, TypeVar

import pynvml
import pytest

from gpufleet.agent.nvml.model import (
    DriverInfo,
    GpmCounters,
    GpuInventory,
    GpuSample,
    NvLinkSample,
    XidEvent,
)
from gpufleet.sim.fake.library import FakeNvml


class StaticSource:
    """A test double: tests edit ``inv``/``samples`` and queue ``xid`` directly."""

    def __init__(self, n: int = 3) -> None:
        self.drv = DriverInfo(driver_version="570.86.15", nvml_version="12.570.86.15", cuda_driver_version=12080)
        self.inv = [
            GpuInventory(
                index=i,
                uuid=f"GPU-{i:08x}-1111-2222-3333-444444444444",
                serial=f"165000000{i}",
                pci_bus_id=f"00000000:{0x18 + 0x11 * i:02X}:00.0",
                vbios_version="96.00.99.00.01",
                minor_number=i,
                nvlink_count=4,
                fan_count=2 if i == 2 else 0,
                retired_pages_supported=(i == 2),
                memory_total_bytes=80 * 2**30,
            )
            for i in range(n)
        ]
        self.samples = [
            GpuSample(
                timestamp=1000.0,
                utilization_gpu_pct=90 + i,
                utilization_memory_pct=40 + i,
                clock_sm_mhz=1900 - 15 * i,
                clock_memory_mhz=2619,
                clock_graphics_mhz=1905 - 15 * i,
                power_mw=650_000 + 1000 * i,
                power_limit_mw=700_000 - i,
                energy_mj=5_000_000_000 + i,
                temperature_gpu_c=60 + i,
                temperature_memory_c=70 + i,
                fan_speed_pct=[33, 44] if i == 2 else None,
                memory_used_bytes=70 * 2**30 + i,
                memory_reserved_bytes=500 * 2**20,
                pstate=i,
                clocks_event_reasons=0x4 if i == 1 else 0,
                clocks_event_ns={
                    "sw_power_cap": 11 + i,
                    "sync_boost": 22 + i,
                    "sw_thermal_slowdown": 33 + i,
                    "hw_thermal_slowdown": 44 + i,
                    "hw_power_brake_slowdown": 55 + i,
                },
                ecc={
                    "volatile_corrected": 1 + i,
                    "volatile_uncorrected": 2 + i,
                    "aggregate_corrected": 3 + i,
                    "aggregate_uncorrected": 4 + i,
                },
                remapped_rows_correctable=5 + i,
                remapped_rows_uncorrectable=6 + i,
                row_remap_pending=bool(i % 2),
                row_remap_failure=False,
                retired_pages_single_bit=3 if i == 2 else None,
                retired_pages_double_bit=1 if i == 2 else None,
                retired_pages_pending=True if i == 2 else None,
                pcie_gen=4 + (i == 0),
                pcie_width=16 >> i,
                pcie_replay_counter=100 + i,
                pcie_tx_kbps=1000 + i,
                pcie_rx_kbps=2000 + i,
                nvlink=[
                    NvLinkSample(
                        up=(link != 3), tx_kib=10_000 * (link + 1) + i, rx_kib=20_000 * (link + 1) + i,
                        crc_flit=link, crc_data=2 * link, replay=3 * link, recovery=4 * link,
                    )
                    for link in range(4)
                ],
                gpm=GpmCounters(),
            )
            for i in range(n)
        ]
        self.xid: list[XidEvent] = []
        self.polls = 0

    def driver(self) -> DriverInfo:
        return self.drv

    def inventory(self) -> list[GpuInventory]:
        return self.inv

    def sample(self, index: int) -> GpuSample:
        return self.samples[index]

    def poll_xid(self) -> list[XidEvent]:
        self.polls += 1
        out, self.xid = self.xid, []
        return out


@pytest.fixture
def src() -> StaticSource:
    return StaticSource()


@pytest.fixture
def fake(src: StaticSource) -> Iterator[FakeNvml]:
    with FakeNvml(src) as f:
        pynvml.nvmlInit()
        yield f
        while f._refcount > 0:
            pynvml.nvmlShutdown()


def h(i: int) -> Any:
    return pynvml.nvmlDeviceGetHandleByIndex(i)


T = TypeVar("T")


def known(value: T | None) -> T:
    """A model field the test source fills in (the expectation is meaningless if it is None)."""
    assert value is not None
    return value


# ------------------------------------------------------------------ values through the real wrappers

Case = tuple[str, Callable[[Any], Any], Callable[[GpuInventory, GpuSample], Any]]
DEVICE_CASES: list[Case] = [
    ("uuid", pynvml.nvmlDeviceGetUUID, lambda g, s: g.uuid),
    ("name", pynvml.nvmlDeviceGetName, lambda g, s: g.name),
    ("serial", pynvml.nvmlDeviceGetSerial, lambda g, s: g.serial),
    ("pci", lambda d: pynvml.nvmlDeviceGetPciInfo(d).busId, lambda g, s: g.pci_bus_id),
    ("vbios", pynvml.nvmlDeviceGetVbiosVersion, lambda g, s: g.vbios_version),
    ("arch", pynvml.nvmlDeviceGetArchitecture, lambda g, s: g.architecture),
    ("minor", pynvml.nvmlDeviceGetMinorNumber, lambda g, s: g.minor_number),
    ("cc", pynvml.nvmlDeviceGetCudaComputeCapability, lambda g, s: g.cuda_compute_capability),
    ("util", lambda d: (lambda u: (u.gpu, u.memory))(pynvml.nvmlDeviceGetUtilizationRates(d)),
     lambda g, s: (s.utilization_gpu_pct, s.utilization_memory_pct)),
    ("clk_sm", lambda d: pynvml.nvmlDeviceGetClockInfo(d, pynvml.NVML_CLOCK_SM), lambda g, s: s.clock_sm_mhz),
    ("clk_mem", lambda d: pynvml.nvmlDeviceGetClockInfo(d, pynvml.NVML_CLOCK_MEM), lambda g, s: s.clock_memory_mhz),
    ("clk_gr", lambda d: pynvml.nvmlDeviceGetClockInfo(d, pynvml.NVML_CLOCK_GRAPHICS),
     lambda g, s: s.clock_graphics_mhz),
    ("max_sm", lambda d: pynvml.nvmlDeviceGetMaxClockInfo(d, pynvml.NVML_CLOCK_SM), lambda g, s: g.max_clock_sm_mhz),
    ("max_mem", lambda d: pynvml.nvmlDeviceGetMaxClockInfo(d, pynvml.NVML_CLOCK_MEM),
     lambda g, s: g.max_clock_memory_mhz),
    ("max_gr", lambda d: pynvml.nvmlDeviceGetMaxClockInfo(d, pynvml.NVML_CLOCK_GRAPHICS),
     lambda g, s: g.max_clock_graphics_mhz),
    ("power", pynvml.nvmlDeviceGetPowerUsage, lambda g, s: s.power_mw),
    ("limit", pynvml.nvmlDeviceGetEnforcedPowerLimit, lambda g, s: s.power_limit_mw),
    ("energy", pynvml.nvmlDeviceGetTotalEnergyConsumption, lambda g, s: s.energy_mj),
    ("temp", lambda d: pynvml.nvmlDeviceGetTemperature(d, pynvml.NVML_TEMPERATURE_GPU),
     lambda g, s: s.temperature_gpu_c),
    ("th_slow", lambda d: pynvml.nvmlDeviceGetTemperatureThreshold(d, pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
     lambda g, s: g.temp_slowdown_c),
    ("th_shut", lambda d: pynvml.nvmlDeviceGetTemperatureThreshold(d, pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),
     lambda g, s: g.temp_shutdown_c),
    ("th_gpu", lambda d: pynvml.nvmlDeviceGetTemperatureThreshold(d, pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX),
     lambda g, s: g.temp_gpu_max_c),
    ("th_mem", lambda d: pynvml.nvmlDeviceGetTemperatureThreshold(d, pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX),
     lambda g, s: g.temp_memory_max_c),
    ("fans", pynvml.nvmlDeviceGetNumFans, lambda g, s: g.fan_count),
    ("mem", lambda d: (lambda m: (m.total, m.reserved, m.used, m.free))(
        pynvml.nvmlDeviceGetMemoryInfo(d, version=pynvml.nvmlMemory_v2)),
     lambda g, s: (g.memory_total_bytes, s.memory_reserved_bytes, s.memory_used_bytes,
                   g.memory_total_bytes - known(s.memory_reserved_bytes) - known(s.memory_used_bytes))),
    ("pstate", pynvml.nvmlDeviceGetPerformanceState, lambda g, s: s.pstate),
    ("reasons", pynvml.nvmlDeviceGetCurrentClocksEventReasons, lambda g, s: s.clocks_event_reasons),
    ("ecc_vc", lambda d: pynvml.nvmlDeviceGetTotalEccErrors(
        d, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC), lambda g, s: known(s.ecc)["volatile_corrected"]),
    ("ecc_au", lambda d: pynvml.nvmlDeviceGetTotalEccErrors(
        d, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_AGGREGATE_ECC),
     lambda g, s: known(s.ecc)["aggregate_uncorrected"]),
    ("remap", pynvml.nvmlDeviceGetRemappedRows,
     lambda g, s: (s.remapped_rows_correctable, s.remapped_rows_uncorrectable, int(known(s.row_remap_pending)),
                   int(known(s.row_remap_failure)))),
    ("pcie_gen", pynvml.nvmlDeviceGetCurrPcieLinkGeneration, lambda g, s: s.pcie_gen),
    ("pcie_w", pynvml.nvmlDeviceGetCurrPcieLinkWidth, lambda g, s: s.pcie_width),
    ("pcie_maxgen", pynvml.nvmlDeviceGetMaxPcieLinkGeneration, lambda g, s: g.pcie_max_gen),
    ("pcie_maxw", pynvml.nvmlDeviceGetMaxPcieLinkWidth, lambda g, s: g.pcie_max_width),
    ("replay", pynvml.nvmlDeviceGetPcieReplayCounter, lambda g, s: s.pcie_replay_counter),
    ("pcie_tx", lambda d: pynvml.nvmlDeviceGetPcieThroughput(d, pynvml.NVML_PCIE_UTIL_TX_BYTES),
     lambda g, s: s.pcie_tx_kbps),
    ("pcie_rx", lambda d: pynvml.nvmlDeviceGetPcieThroughput(d, pynvml.NVML_PCIE_UTIL_RX_BYTES),
     lambda g, s: s.pcie_rx_kbps),
    ("nvl_state", lambda d: [pynvml.nvmlDeviceGetNvLinkState(d, k) for k in range(4)],
     lambda g, s: [int(ln.up) for ln in known(s.nvlink)]),
    ("nvl_err", lambda d: [
        pynvml.nvmlDeviceGetNvLinkErrorCounter(d, k, c) for k in range(4) for c in (
            pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT, pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA,
            pynvml.NVML_NVLINK_ERROR_DL_REPLAY, pynvml.NVML_NVLINK_ERROR_DL_RECOVERY)],
     lambda g, s: [v for ln in known(s.nvlink) for v in (ln.crc_flit, ln.crc_data, ln.replay, ln.recovery)]),
    ("events", pynvml.nvmlDeviceGetSupportedEventTypes,
     lambda g, s: pynvml.nvmlEventTypeXidCriticalError),
]


@pytest.mark.parametrize("gpu", [0, 1])
@pytest.mark.parametrize(("name", "call", "expect"), DEVICE_CASES, ids=[c[0] for c in DEVICE_CASES])
def test_device_calls_return_the_model(fake: FakeNvml, src: StaticSource, gpu: int, name: str,
                                       call: Callable[[Any], Any], expect: Callable[..., Any]) -> None:
    assert call(h(gpu)) == expect(src.inv[gpu], src.samples[gpu])


def test_system_and_identity(fake: FakeNvml, src: StaticSource) -> None:
    assert pynvml.nvmlSystemGetDriverVersion() == "570.86.15"
    assert pynvml.nvmlSystemGetNVMLVersion() == "12.570.86.15"
    assert pynvml.nvmlSystemGetCudaDriverVersion() == 12080
    assert pynvml.nvmlSystemGetCudaDriverVersion_v2() == 12080
    assert pynvml.nvmlDeviceGetCount() == 3
    handles = [h(i) for i in range(3)]
    assert [pynvml.nvmlDeviceGetIndex(x) for x in handles] == [0, 1, 2]
    pci = pynvml.nvmlDeviceGetPciInfo(handles[1])
    assert (pci.domain, pci.bus, pci.device) == (0, 0x29, 0)
    assert pci.busIdLegacy == "0000:29:00.0"
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        h(3)
    assert pynvml.nvmlErrorString(pynvml.NVML_ERROR_GPU_IS_LOST) == "GPU is lost"


def test_fans_field_values_and_retired_pages(fake: FakeNvml, src: StaticSource) -> None:
    d2 = h(2)
    assert [pynvml.nvmlDeviceGetFanSpeed_v2(d2, f) for f in range(2)] == [33, 44]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetFanSpeed_v2(h(0), 0)  # SXM board: no fans
    assert len(pynvml.nvmlDeviceGetRetiredPages(
        d2, pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)) == 3
    assert len(pynvml.nvmlDeviceGetRetiredPages(d2, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)) == 1
    assert pynvml.nvmlDeviceGetRetiredPagesPendingStatus(d2) == 1
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetRetiredPages(h(0), pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)

    s = src.samples[1]
    ids: list[int | tuple[int, int]] = [
        pynvml.NVML_FI_DEV_MEMORY_TEMP,
        pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP,
        pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST,
        pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN,
        pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN,
        pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN,
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 2),
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, 3),
    ]
    vals = pynvml.nvmlDeviceGetFieldValues(h(1), ids)
    assert [v.nvmlReturn for v in vals] == [pynvml.NVML_SUCCESS] * len(ids)
    assert vals[0].value.uiVal == s.temperature_memory_c
    ns = known(s.clocks_event_ns)
    nvlink = known(s.nvlink)
    assert [vals[i].value.ullVal for i in range(1, 6)] == [
        ns["sw_power_cap"], ns["sync_boost"], ns["sw_thermal_slowdown"], ns["hw_thermal_slowdown"],
        ns["hw_power_brake_slowdown"]]
    assert vals[6].value.ullVal == nvlink[2].tx_kib
    assert vals[7].value.ullVal == nvlink[3].rx_kib
    assert vals[6].timestamp == int(s.timestamp * 1e6)


# ------------------------------------------------------------------ lifecycle and errors


def test_uninitialized_refcount_and_driver(src: StaticSource) -> None:
    with FakeNvml(src) as f:
        with pytest.raises(pynvml.NVMLError_Uninitialized):
            pynvml.nvmlDeviceGetCount()
        pynvml.nvmlInit()
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        assert pynvml.nvmlDeviceGetCount() == 3  # still one reference
        pynvml.nvmlShutdown()
        with pytest.raises(pynvml.NVMLError_Uninitialized):
            pynvml.nvmlDeviceGetPowerUsage(pynvml.c_nvmlDevice_t())
        with pytest.raises(pynvml.NVMLError_Uninitialized):
            pynvml.nvmlShutdown()
        f.driver_loaded = False
        with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
            pynvml.nvmlInit()
        with pytest.raises(pynvml.NVMLError_Uninitialized):
            pynvml.nvmlSystemGetDriverVersion()


def test_install_uninstall_restores_pynvml(src: StaticSource) -> None:
    before = pynvml.nvmlLib
    fake = FakeNvml(src).install()
    try:
        assert pynvml.nvmlLib is not before
        pynvml.nvmlInit()
        pynvml.nvmlDeviceGetCount()
        assert "nvmlDeviceGetCount_v2" in pynvml._nvmlGetFunctionPointer_cache
        with pytest.raises(RuntimeError):
            fake.install()
    finally:
        fake.uninstall()
    assert pynvml.nvmlLib is before
    assert "nvmlDeviceGetCount_v2" not in pynvml._nvmlGetFunctionPointer_cache
    # a second fake installs cleanly afterwards and starts uninitialized
    with FakeNvml(src), pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
    assert pynvml.nvmlLib is before


def test_missing_entry_point_is_function_not_found(fake: FakeNvml) -> None:
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlDeviceGetBAR1MemoryInfo(h(0))
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlDeviceGetEncoderUtilization(h(0))


def test_versioned_struct_mismatch(fake: FakeNvml) -> None:
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        pynvml.nvmlDeviceGetMemoryInfo(h(0), version=0x01000028)


def test_none_means_not_supported(fake: FakeNvml, src: StaticSource) -> None:
    src.samples[0] = replace(src.samples[0], power_mw=None, energy_mj=None, temperature_memory_c=None,
                             clocks_event_ns={"sw_power_cap": 1}, ecc=None)
    src.inv[0] = replace(src.inv[0], temp_memory_max_c=None, serial=None)
    d = h(0)
    calls: tuple[Callable[[], object], ...] = (
        lambda: pynvml.nvmlDeviceGetPowerUsage(d),
        lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(d),
        lambda: pynvml.nvmlDeviceGetSerial(d),
        lambda: pynvml.nvmlDeviceGetTemperatureThreshold(d, pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX),
        lambda: pynvml.nvmlDeviceGetTotalEccErrors(d, 0, 0),
    )
    for call in calls:
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call()
    vals = pynvml.nvmlDeviceGetFieldValues(d, [82, 74, 76])
    assert [v.nvmlReturn for v in vals] == [pynvml.NVML_ERROR_NOT_SUPPORTED, 0, pynvml.NVML_ERROR_NOT_SUPPORTED]
    assert pynvml.nvmlDeviceGetPowerUsage(h(1)) == src.samples[1].power_mw


ERRORS = {
    "NOT_SUPPORTED": (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVMLError_NotSupported),
    "GPU_IS_LOST": (pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVMLError_GpuIsLost),
    "UNKNOWN": (pynvml.NVML_ERROR_UNKNOWN, pynvml.NVMLError_Unknown),
    "TIMEOUT": (pynvml.NVML_ERROR_TIMEOUT, pynvml.NVMLError_Timeout),
    "DRIVER_NOT_LOADED": (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, pynvml.NVMLError_DriverNotLoaded),
    "NO_PERMISSION": (pynvml.NVML_ERROR_NO_PERMISSION, pynvml.NVMLError_NoPermission),
    "RESET_REQUIRED": (pynvml.NVML_ERROR_RESET_REQUIRED, pynvml.NVMLError_ResetRequired),
}


@pytest.mark.parametrize("kind", list(ERRORS))
@pytest.mark.parametrize("name", ["nvmlDeviceGetPciInfo", "nvmlDeviceGetPciInfo_v3"])
def test_inject_per_function_and_gpu(fake: FakeNvml, src: StaticSource, kind: str, name: str) -> None:
    code, exc = ERRORS[kind]
    fake.inject_error(code, function=name, gpu=1)
    with pytest.raises(exc):
        pynvml.nvmlDeviceGetPciInfo(h(1))
    assert pynvml.nvmlDeviceGetPciInfo(h(0)).busId == src.inv[0].pci_bus_id
    assert pynvml.nvmlDeviceGetUUID(h(1)) == src.inv[1].uuid  # other functions unaffected
    fake.clear_errors()
    assert pynvml.nvmlDeviceGetPciInfo(h(1)).busId == src.inv[1].pci_bus_id


@pytest.mark.parametrize("kind", list(ERRORS))
def test_inject_per_field(fake: FakeNvml, src: StaticSource, kind: str) -> None:
    code, _ = ERRORS[kind]
    fake.inject_error(code, field=pynvml.NVML_FI_DEV_MEMORY_TEMP, gpu=0)
    vals = pynvml.nvmlDeviceGetFieldValues(h(0), [pynvml.NVML_FI_DEV_MEMORY_TEMP, 74])
    assert [v.nvmlReturn for v in vals] == [code, pynvml.NVML_SUCCESS]
    assert vals[1].value.ullVal == known(src.samples[0].clocks_event_ns)["sw_power_cap"]
    other = pynvml.nvmlDeviceGetFieldValues(h(1), [pynvml.NVML_FI_DEV_MEMORY_TEMP])
    assert other[0].nvmlReturn == pynvml.NVML_SUCCESS


def test_inject_every_device_call_and_system_calls(fake: FakeNvml, src: StaticSource) -> None:
    fake.inject_error(pynvml.NVML_ERROR_UNKNOWN, gpu=2)
    d = h(2)  # handles still come back: the error is in the readings
    for call in (pynvml.nvmlDeviceGetPowerUsage, pynvml.nvmlDeviceGetUUID, pynvml.nvmlDeviceGetTotalEnergyConsumption,
                 lambda x: pynvml.nvmlDeviceGetFieldValues(x, [82])):
        with pytest.raises(pynvml.NVMLError_Unknown):
            call(d)
    assert pynvml.nvmlDeviceGetPowerUsage(h(0)) == src.samples[0].power_mw
    fake.inject_error(pynvml.NVML_ERROR_NO_PERMISSION, function="nvmlSystemGetDriverVersion")
    with pytest.raises(pynvml.NVMLError_NoPermission):
        pynvml.nvmlSystemGetDriverVersion()
    fake.inject_error(pynvml.NVML_ERROR_GPU_IS_LOST, function="nvmlDeviceGetHandleByIndex", gpu=1)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        h(1)
    fake.inject_error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED, function="nvmlInit")
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()
    with pytest.raises(ValueError, match="unknown NVML function"):
        fake.inject_error(3, function="nvmlDeviceGetPowerUsageTypo")
    with pytest.raises(ValueError):
        fake.inject_error(3, function="nvmlDeviceGetPowerUsage", field=82)


def test_lost_gpu_fails_every_call_while_others_work(fake: FakeNvml, src: StaticSource) -> None:
    d1 = h(1)
    src.samples[1] = replace(src.samples[1], lost=True)
    for call in (pynvml.nvmlDeviceGetPowerUsage, pynvml.nvmlDeviceGetName, pynvml.nvmlDeviceGetPciInfo,
                 lambda x: pynvml.nvmlDeviceGetFieldValues(x, [82]), pynvml.nvmlGpmQueryDeviceSupport):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            call(d1)
    assert pynvml.nvmlDeviceGetPowerUsage(h(0)) == src.samples[0].power_mw
    assert pynvml.nvmlDeviceGetPowerUsage(h(2)) == src.samples[2].power_mw


def test_broken_source_gives_unknown_not_a_crash(fake: FakeNvml, src: StaticSource) -> None:
    def boom(index: int) -> GpuSample:
        raise OSError("snapshot vanished")

    d = h(0)
    src.sample = boom  # type: ignore[method-assign]
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlDeviceGetPowerUsage(d)
    assert isinstance(fake.last_exception, OSError)


# ------------------------------------------------------------------ GPM


def _metrics(s1: Any, s2: Any, ids: list[int]) -> Any:
    mg = pynvml.c_nvmlGpmMetricsGet_t()
    mg.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    mg.numMetrics = len(ids)
    mg.sample1, mg.sample2 = s1, s2
    for i, m in enumerate(ids):
        mg.metrics[i].metricId = m
    return mg


def test_gpm_metrics_are_ratios_of_the_counters(fake: FakeNvml, src: StaticSource) -> None:
    d = h(0)
    assert pynvml.nvmlGpmQueryDeviceSupport(d).isSupportedDevice == 1
    a, b = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
    src.samples[0] = replace(src.samples[0], timestamp=100.0, gpm=GpmCounters(
        sm_active_s=10.0, sm_occupancy_s=3.0, tensor_active_s=5.0, dram_active_s=1.0,
        nvlink_tx_bytes=2**30, nvlink_rx_bytes=2**30, pcie_tx_bytes=0, pcie_rx_bytes=2**20))
    pynvml.nvmlGpmSampleGet(d, a)
    src.samples[0] = replace(src.samples[0], timestamp=104.0, gpm=GpmCounters(
        sm_active_s=13.0, sm_occupancy_s=4.6, tensor_active_s=7.2, dram_active_s=3.0,
        nvlink_tx_bytes=2**30 + 4 * 300 * 2**20, nvlink_rx_bytes=2**30 + 4 * 250 * 2**20,
        pcie_tx_bytes=4 * 10 * 2**20, pcie_rx_bytes=2**20 + 4 * 20 * 2**20))
    pynvml.nvmlGpmSampleGet(d, b)
    ids = [pynvml.NVML_GPM_METRIC_SM_UTIL, pynvml.NVML_GPM_METRIC_SM_OCCUPANCY, pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
           pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL, pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC,
           pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC, pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC,
           pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC, pynvml.NVML_GPM_METRIC_FP64_UTIL]
    out = pynvml.nvmlGpmMetricsGet(_metrics(a, b, ids))
    got = [out.metrics[i].value for i in range(8)]
    assert got == pytest.approx([75.0, 40.0, 55.0, 50.0, 300.0, 250.0, 10.0, 20.0])
    assert [out.metrics[i].nvmlReturn for i in range(8)] == [0] * 8
    assert out.metrics[8].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED  # not modelled: no made-up value
    # the same sample twice: no interval, no rate
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlGpmMetricsGet(_metrics(b, b, ids[:1]))
    pynvml.nvmlGpmSampleFree(a)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlGpmMetricsGet(_metrics(a, b, ids[:1]))
    pynvml.nvmlGpmSampleFree(b)


def test_gpm_unsupported_device(fake: FakeNvml, src: StaticSource) -> None:
    src.inv[1] = replace(src.inv[1], gpm_supported=False)
    d = h(1)
    assert pynvml.nvmlGpmQueryDeviceSupport(d).isSupportedDevice == 0
    s = pynvml.nvmlGpmSampleAlloc()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlGpmSampleGet(d, s)
    pynvml.nvmlGpmSampleFree(s)


# ------------------------------------------------------------------ XID events


def test_xid_delivery_and_timeout(fake: FakeNvml, src: StaticSource) -> None:
    es = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(h(1), pynvml.nvmlEventTypeXidCriticalError, es)
    t0 = time.monotonic()
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(es, 150)
    assert 0.14 <= time.monotonic() - t0 < 2.0

    # an event that happens while the waiter blocks, plus one for an unregistered GPU
    def later() -> None:
        time.sleep(0.1)
        src.xid.extend([XidEvent(gpu=0, xid=13, timestamp=1.0), XidEvent(gpu=1, xid=79, timestamp=2.0)])

    threading.Thread(target=later).start()
    t0 = time.monotonic()
    data = pynvml.nvmlEventSetWait_v2(es, 5000)
    assert time.monotonic() - t0 < 2.0
    assert (data.eventType, data.eventData) == (pynvml.nvmlEventTypeXidCriticalError, 79)
    assert pynvml.nvmlDeviceGetIndex(data.device) == 1
    with pytest.raises(pynvml.NVMLError_Timeout):  # GPU 0's event was not registered for
        pynvml.nvmlEventSetWait_v2(es, 50)
    pynvml.nvmlEventSetFree(es)


def test_event_wait_does_not_block_other_calls(fake: FakeNvml, src: StaticSource) -> None:
    es = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(h(0), pynvml.nvmlEventTypeXidCriticalError, es)
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            pynvml.nvmlEventSetWait_v2(es, 800)
        except pynvml.NVMLError_Timeout:
            pass
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    for _ in range(50):
        pynvml.nvmlDeviceGetPowerUsage(h(0))
    assert time.monotonic() - t0 < 0.5
    t.join()
    assert not errors
    pynvml.nvmlEventSetFree(es)


# ------------------------------------------------------------------ XID waits are signalled, not polled


class _CountingSim:
    """Wraps a SimSource and counts poll_xid calls."""

    def __init__(self) -> None:
        from gpufleet.sim.fake.sim_source import SimSource

        self.sim = SimSource(2)
        self.polls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sim, name)

    def poll_xid(self) -> list[XidEvent]:
        self.polls += 1
        return self.sim.poll_xid()


def test_xid_wait_is_woken_by_the_source_without_polling() -> None:
    src = _CountingSim()
    with FakeNvml(src) as fake:
        pynvml.nvmlInit()
        try:
            es = pynvml.nvmlEventSetCreate()
            pynvml.nvmlDeviceRegisterEvents(pynvml.nvmlDeviceGetHandleByIndex(1),
                                            pynvml.nvmlEventTypeXidCriticalError, es)
            t0 = time.monotonic()
            with pytest.raises(pynvml.NVMLError_Timeout):
                pynvml.nvmlEventSetWait_v2(es, 400)
            assert time.monotonic() - t0 >= 0.39
            assert src.polls <= 1  # one look at the source, then asleep (polling every 20 ms would be ~20)

            timer = threading.Timer(0.2, src.sim.inject_xid, (1, 79))
            timer.start()
            t0 = time.monotonic()
            data = pynvml.nvmlEventSetWait_v2(es, 5000)
            waited = time.monotonic() - t0
            timer.join()
            assert 0.15 <= waited < 1.0
            assert (data.eventData, pynvml.nvmlDeviceGetIndex(data.device)) == (79, 1)
            assert src.polls <= 3

            # nvmlShutdown wakes a blocked waiter at once (the XID thread stops promptly)
            result: list[BaseException] = []

            def waiter() -> None:
                try:
                    pynvml.nvmlEventSetWait_v2(es, 10_000)
                except BaseException as e:
                    result.append(e)

            t = threading.Thread(target=waiter)
            t.start()
            time.sleep(0.1)
        finally:
            pynvml.nvmlShutdown()
        t.join(timeout=2.0)
        assert not t.is_alive()
        assert isinstance(result[0], pynvml.NVMLError_Uninitialized)
        assert fake.last_exception is None


def test_cpu_accounting_counts_time_inside_the_fake(fake: FakeNvml, src: StaticSource) -> None:
    assert fake.cpu_seconds == 0.0
    pynvml.nvmlDeviceGetPowerUsage(h(0))
    assert fake.cpu_seconds == 0.0  # off unless a benchmark turns it on
    fake.cpu_accounting = True
    for _ in range(200):
        pynvml.nvmlDeviceGetFieldValues(h(0), [82, 74, 76])
    assert fake.cpu_seconds > 0.0
