"""Every collector survives every NVML error kind, per function and per field.

Errors are injected into the fake NVML for one GPU before the backend starts (so
static facts read once are hit too). The checks: the collector does not raise,
NVML stays up, the other GPUs are reported exactly as without the fault, the
faulty GPU loses only the series the failing call feeds (GPU_IS_LOST: gpu_up 0,
identity kept), and every error except NOT_SUPPORTED is counted in
gpufleet_nvml_errors_total{function,error}.
"""

from __future__ import annotations

import time

import pynvml
import pytest
from support import Series, scrape
from test_gpu_collector import FakeHost, expected_series, pick, value

from gpufleet.agent.collectors.gpu import GpuCollector
from gpufleet.agent.collectors.xid import XidCollector
from gpufleet.agent.nvml.backend import NvmlBackend
from gpufleet.agent.nvml.model import XidEvent
from gpufleet.sim.fake.library import FakeNvml

KINDS = {
    "NOT_SUPPORTED": pynvml.NVML_ERROR_NOT_SUPPORTED,
    "GPU_IS_LOST": pynvml.NVML_ERROR_GPU_IS_LOST,
    "UNKNOWN": pynvml.NVML_ERROR_UNKNOWN,
    "TIMEOUT": pynvml.NVML_ERROR_TIMEOUT,
    "DRIVER_NOT_LOADED": pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
    "NO_PERMISSION": pynvml.NVML_ERROR_NO_PERMISSION,
}
SXM, PCIE = 2, 1  # FakeHost: GPU 2 has NVLink + GPM, GPU 1 has fans + retired pages
NVLINK = ("gpufleet_gpu_nvlink_up", "gpufleet_gpu_nvlink_bytes_total", "gpufleet_gpu_nvlink_errors_total")
GPM = ("gpufleet_gpu_sm_active_ratio", "gpufleet_gpu_sm_occupancy_ratio", "gpufleet_gpu_tensor_active_ratio",
       "gpufleet_gpu_dram_active_ratio", "gpufleet_gpu_nvlink_throughput_bytes_per_second")

#: pynvml function -> (GPU to break, families (name or (name, labels)) the call feeds for that GPU)
FUNCTIONS: dict[str, tuple[int, tuple[object, ...]]] = {
    "nvmlDeviceGetUtilizationRates": (SXM, ("gpufleet_gpu_utilization_ratio",
                                            "gpufleet_gpu_memory_utilization_ratio")),
    "nvmlDeviceGetClockInfo": (SXM, ("gpufleet_gpu_clock_hertz",)),
    "nvmlDeviceGetMaxClockInfo": (SXM, ("gpufleet_gpu_clock_max_hertz",)),
    "nvmlDeviceGetPowerUsage": (SXM, ("gpufleet_gpu_power_watts",)),
    "nvmlDeviceGetEnforcedPowerLimit": (SXM, ("gpufleet_gpu_power_limit_watts",)),
    "nvmlDeviceGetTotalEnergyConsumption": (SXM, ("gpufleet_gpu_energy_joules_total",)),
    "nvmlDeviceGetTemperature": (SXM, (("gpufleet_gpu_temperature_celsius", {"sensor": "gpu"}),)),
    "nvmlDeviceGetTemperatureThreshold": (SXM, ("gpufleet_gpu_temperature_threshold_celsius",)),
    "nvmlDeviceGetNumFans": (PCIE, ("gpufleet_gpu_fan_speed_ratio",)),
    "nvmlDeviceGetFanSpeed_v2": (PCIE, ("gpufleet_gpu_fan_speed_ratio",)),
    "nvmlDeviceGetMemoryInfo": (SXM, ("gpufleet_gpu_memory_used_bytes", "gpufleet_gpu_memory_total_bytes",
                                      "gpufleet_gpu_memory_reserved_bytes")),
    "nvmlDeviceGetPerformanceState": (SXM, ("gpufleet_gpu_performance_state",)),
    "nvmlDeviceGetCurrentClocksEventReasons": (SXM, ("gpufleet_gpu_clock_event_active",)),
    "nvmlDeviceGetFieldValues": (SXM, (("gpufleet_gpu_temperature_celsius", {"sensor": "memory"}),
                                       "gpufleet_gpu_clock_event_seconds_total", "gpufleet_gpu_nvlink_bytes_total")),
    "nvmlDeviceGetTotalEccErrors": (SXM, ("gpufleet_gpu_ecc_errors_total",)),
    "nvmlDeviceGetRemappedRows": (SXM, ("gpufleet_gpu_remapped_rows", "gpufleet_gpu_row_remap_pending",
                                        "gpufleet_gpu_row_remap_failure")),
    "nvmlDeviceGetRetiredPages": (PCIE, ("gpufleet_gpu_retired_pages", "gpufleet_gpu_retired_pages_pending")),
    "nvmlDeviceGetRetiredPagesPendingStatus": (PCIE, ("gpufleet_gpu_retired_pages_pending",)),
    "nvmlDeviceGetCurrPcieLinkGeneration": (SXM, ("gpufleet_gpu_pcie_link_generation",)),
    "nvmlDeviceGetCurrPcieLinkWidth": (SXM, ("gpufleet_gpu_pcie_link_width",)),
    "nvmlDeviceGetMaxPcieLinkGeneration": (SXM, ("gpufleet_gpu_pcie_link_generation_max",)),
    "nvmlDeviceGetMaxPcieLinkWidth": (SXM, ("gpufleet_gpu_pcie_link_width_max",)),
    "nvmlDeviceGetPcieReplayCounter": (SXM, ("gpufleet_gpu_pcie_replay_total",)),
    "nvmlDeviceGetPcieThroughput": (PCIE, ("gpufleet_gpu_pcie_throughput_bytes_per_second",)),
    "nvmlDeviceGetNvLinkState": (SXM, NVLINK),
    # only data CRC: state, replay, recovery and flit CRC come from link-scoped field values (test_nvlink_fields)
    "nvmlDeviceGetNvLinkErrorCounter": (SXM, (("gpufleet_gpu_nvlink_errors_total", {"error": "crc_data"}),)),
    "nvmlGpmQueryDeviceSupport": (SXM, GPM),
    "nvmlGpmSampleGet": (SXM, GPM),
    # identity: the GPU keeps a gpufleet_gpu_info series (with what could be read)
    "nvmlDeviceGetUUID": (SXM, ()),
    "nvmlDeviceGetName": (SXM, ()),
    "nvmlDeviceGetSerial": (SXM, ()),
    "nvmlDeviceGetPciInfo": (SXM, ()),
    "nvmlDeviceGetVbiosVersion": (SXM, ()),
    "nvmlDeviceGetArchitecture": (SXM, ()),
    "nvmlDeviceGetMinorNumber": (SXM, ()),
    "nvmlDeviceGetCudaComputeCapability": (SXM, ()),
}


def _only_gpus(series: Series, gpus: set[str]) -> Series:
    return {k: v for k, v in series.items() if dict(k[1]).get("gpu") in gpus}


def _run(fake: FakeNvml, src: FakeHost) -> tuple[NvmlBackend, Series]:
    backend = NvmlBackend()
    backend.start()
    collector = GpuCollector(backend)
    scrape(collector)
    src.advance(10.0)
    return backend, scrape(collector)


def _check(src: FakeHost, backend: NvmlBackend, got: Series, kind: str, function: str, gpu: int,
           affected: tuple[object, ...]) -> None:
    g = str(gpu)
    others = {str(i) for i in range(len(src.inv))} - {g}
    assert value(got, "gpufleet_nvml_up") == 1
    exp = expected_series(src, dt=10.0)
    got_others, exp_others = _only_gpus(got, others), _only_gpus(exp, others)
    assert got_others == pytest.approx(exp_others), "a fault on one GPU changed the others"
    assert len(pick(got, "gpufleet_gpu_info", gpu=g)) == 1, "the faulty GPU keeps its identity series"
    errors = backend.errors()
    if kind == "NOT_SUPPORTED":
        assert errors == {}, "NOT_SUPPORTED is not an error"
    else:
        assert errors.get((function, kind), 0) >= 1, errors
    if kind == "GPU_IS_LOST":
        assert value(got, "gpufleet_gpu_up", gpu=g) == 0
        assert not pick(got, "gpufleet_gpu_power_watts", gpu=g), "a lost GPU reports no readings"
        return
    assert value(got, "gpufleet_gpu_up", gpu=g) == 1
    for item in affected:
        name, labels = item if isinstance(item, tuple) else (item, {})
        assert not pick(got, name, gpu=g, **labels), f"{name} still reported for GPU {g} after {function} failed"
    # what the failing call does not feed is still there
    if function != "nvmlDeviceGetPowerUsage":
        assert value(got, "gpufleet_gpu_power_watts", gpu=g) == src.samples[gpu].power_mw / 1000  # type: ignore[operator]
    else:
        assert value(got, "gpufleet_gpu_utilization_ratio", gpu=g) == src.samples[gpu].utilization_gpu_pct / 100  # type: ignore[operator]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("function", FUNCTIONS)
def test_function_fault(function: str, kind: str) -> None:
    gpu, affected = FUNCTIONS[function]
    src = FakeHost()
    with FakeNvml(src) as fake:
        fake.inject_error(KINDS[kind], function=function, gpu=gpu)
        backend, got = _run(fake, src)
        try:
            _check(src, backend, got, kind, function, gpu, affected)
            if kind == "NOT_SUPPORTED":
                return  # a capability, not a fault: static facts found unsupported are not asked again
            # the fault clears: the GPU is fully back (static facts that failed are read again)
            fake.clear_errors()
            collector = GpuCollector(backend)
            src.advance(10.0)
            scrape(collector)
            src.advance(10.0)
            assert _only_gpus(scrape(collector), {str(gpu)}) == pytest.approx(
                _only_gpus(expected_series(src, dt=10.0), {str(gpu)}))
        finally:
            backend.close()


FIELDS = {
    82: ("gpufleet_gpu_temperature_celsius", {"sensor": "memory"}),
    74: ("gpufleet_gpu_clock_event_seconds_total", {"reason": "sw_power_cap"}),
    76: ("gpufleet_gpu_clock_event_seconds_total", {"reason": "sync_boost"}),
    269: ("gpufleet_gpu_clock_event_seconds_total", {"reason": "sw_thermal_slowdown"}),
    270: ("gpufleet_gpu_clock_event_seconds_total", {"reason": "hw_thermal_slowdown"}),
    271: ("gpufleet_gpu_clock_event_seconds_total", {"reason": "hw_power_brake_slowdown"}),
    138: ("gpufleet_gpu_nvlink_bytes_total", {"direction": "tx"}),
    139: ("gpufleet_gpu_nvlink_bytes_total", {"direction": "rx"}),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("field", FIELDS)
def test_field_fault(field: int, kind: str) -> None:
    src = FakeHost()
    with FakeNvml(src) as fake:
        fake.inject_error(KINDS[kind], field=field, gpu=SXM)
        backend, got = _run(fake, src)
        try:
            _check(src, backend, got, kind, "nvmlDeviceGetFieldValues", SXM, (FIELDS[field],))
            if kind != "GPU_IS_LOST":  # the other fields of the same call still arrive
                other = next(f for f in FIELDS if FIELDS[f][0] != FIELDS[field][0])
                name, labels = FIELDS[other]
                assert pick(got, name, gpu=str(SXM), **labels)
        finally:
            backend.close()


@pytest.mark.parametrize("kind", KINDS)
def test_every_call_of_one_gpu_fails(kind: str) -> None:
    src = FakeHost()
    with FakeNvml(src) as fake:
        fake.inject_error(KINDS[kind], gpu=SXM)
        backend, got = _run(fake, src)
        try:
            assert value(got, "gpufleet_nvml_up") == 1
            assert value(got, "gpufleet_gpu_up", gpu=str(SXM)) == 0, "a GPU that answers nothing is not up"
            others = {"0", "1"}
            assert _only_gpus(got, others) == pytest.approx(_only_gpus(expected_series(src, dt=10.0), others))
        finally:
            backend.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("function", ["nvmlDeviceGetCount", "nvmlInit"])
def test_system_fault_reports_nvml_down(function: str, kind: str) -> None:
    src = FakeHost()
    with FakeNvml(src) as fake:
        fake.inject_error(KINDS[kind], function=function)
        backend = NvmlBackend()
        assert backend.start() is False
        assert kind in backend.init_error
        got = scrape(GpuCollector(backend))
        assert value(got, "gpufleet_nvml_up") == 0
        assert {n for n, _ in got} <= {"gpufleet_nvml_up", "gpufleet_nvml_errors_total"}
        fake.clear_errors()
        got = scrape(GpuCollector(backend))
        assert value(got, "gpufleet_nvml_up") == 1
        backend.close()


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "NOT_SUPPORTED"])
@pytest.mark.parametrize("function", ["nvmlEventSetCreate", "nvmlDeviceGetSupportedEventTypes",
                                      "nvmlDeviceRegisterEvents", "nvmlEventSetWait_v2"])
def test_xid_listener_survives(function: str, kind: str) -> None:
    src = FakeHost()
    with FakeNvml(src) as fake:
        backend = NvmlBackend()
        assert backend.start()
        fake.inject_error(KINDS[kind], function=function)
        xid = XidCollector(backend, wait_ms=50, backoff=(0.02, 0.05), retry_s=0.1)
        xid.start()
        try:
            time.sleep(0.15)
            assert xid.running
            scrape(xid)  # collecting while broken does not raise
            if function == "nvmlEventSetWait_v2" and kind == "TIMEOUT":
                assert backend.errors() == {}, "TIMEOUT is how the wait says 'no event'"
            else:
                assert any(f == function and e == kind for f, e in backend.errors()), backend.errors()
            fake.clear_errors()
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and len(xid.registered) < 3:
                time.sleep(0.02)
            assert xid.registered == (0, 1, 2)
            src.xids.append(XidEvent(gpu=1, xid=79, timestamp=src.t))
            while time.monotonic() < deadline and not pick(scrape(xid), "gpufleet_gpu_xid_errors_total"):
                time.sleep(0.02)
            assert value(scrape(xid), "gpufleet_gpu_xid_errors_total", gpu="1", xid="79") == 1
        finally:
            xid.close()
            backend.close()
        assert not xid.running


def test_old_driver_without_newer_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver without nvmlDeviceGetMemoryInfo_v2 / ...ClocksEventReasons: the older calls are used."""
    original_memory = pynvml.nvmlDeviceGetMemoryInfo

    def memory_info(handle: pynvml.c_nvmlDevice_t, version: object = None) -> object:
        if version is not None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return original_memory(handle)

    def event_reasons(handle: object) -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", memory_info)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", event_reasons)
    src = FakeHost()
    with FakeNvml(src) as fake:
        backend, got = _run(fake, src)
        try:
            exp = expected_series(src, dt=10.0)
            for s in src.samples:  # v1 has no reserved memory; its "used" includes it (as NVML's v1 does)
                s.memory_used_bytes += s.memory_reserved_bytes  # type: ignore[operator]
                s.memory_reserved_bytes = None
            exp_v1 = expected_series(src, dt=10.0)
            assert not pick(got, "gpufleet_gpu_memory_reserved_bytes")
            assert {k: v for k, v in got.items() if k[0] != "gpufleet_nvml_errors_total"} == pytest.approx(exp_v1)
            assert len(exp) > len(exp_v1)
            assert backend.errors() == {}, "a missing newer entry point is not an error once the old one works"
        finally:
            backend.close()
