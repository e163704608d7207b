"""The NVML fault matrix for calls that do not return: every function, hung or slow, on one GPU.

A hung call (the fake NVML blocks it until cleared) costs that GPU its readings for as long as it
hangs, and nothing else: the scrape returns within its budget, the other GPUs are reported exactly
as without the fault, the GPU keeps its identity series but has no ``gpufleet_gpu_up`` (neither up
nor lost), ``gpufleet_nvml_call_stalled_seconds`` names the GPU and the call, the collector reports
itself incomplete, and the call is never made a second time while it hangs. A call that hangs at
NVML's initialization (static facts are read there) stalls NVML node-wide: ``gpufleet_nvml_up 0``
and the stall named with ``gpu=""``. Once cleared, everything is back on the next scrape. A slow
call that still answers within the budget changes nothing.
"""

from __future__ import annotations

import re
import time

import pytest
from support import Series, scrape
from test_fault_injection import FUNCTIONS, SXM
from test_gpu_collector import FakeHost, expected_series, pick, value

from gpufleet.agent.collectors import budget as budgets
from gpufleet.agent.collectors.gpu import GpuCollector
from gpufleet.agent.nvml.backend import NvmlBackend
from gpufleet.agent.nvml.lanes import NODE
from gpufleet.sim.fake.library import FakeNvml

#: Seconds a scrape of these tests may take.
BUDGET = 0.3
#: Functions read once per GPU, when NVML is initialized (device identity and limits): their hang leaves that GPU
#: unopened (stalled in it) once the backend's open bound passes; NVML comes up with the other GPUs.
AT_INIT = frozenset({
    "nvmlDeviceGetMaxClockInfo", "nvmlDeviceGetTemperatureThreshold", "nvmlDeviceGetNumFans",
    "nvmlDeviceGetMaxPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkWidth", "nvmlDeviceGetNvLinkState",
    "nvmlGpmQueryDeviceSupport", "nvmlDeviceGetUUID", "nvmlDeviceGetName", "nvmlDeviceGetSerial",
    "nvmlDeviceGetPciInfo", "nvmlDeviceGetVbiosVersion", "nvmlDeviceGetArchitecture",
    "nvmlDeviceGetMinorNumber", "nvmlDeviceGetCudaComputeCapability",
})


def _scrape(collector: GpuCollector, seconds: float = BUDGET) -> tuple[Series, list[str], float]:
    """One scrape under a budget: its series, what the collector left out, and how long it took."""
    now = time.monotonic()
    b = budgets.Budget(now, now + seconds)
    token = budgets.enter(b)
    try:
        got = scrape(collector)
    finally:
        budgets.leave(token)
    return got, b.missing, time.monotonic() - now


def _only(series: Series, gpus: set[str]) -> Series:
    return {k: v for k, v in series.items() if dict(k[1]).get("gpu") in gpus}


def _stalls(got: Series) -> dict[tuple[str, str], float]:
    """Stalled calls by (gpu, call), the call without its version suffix (pynvml's nvmlDeviceGetPciInfo
    is blocked in its nvmlDeviceGetPciInfo_v3)."""
    return {(dict(labels)["gpu"], re.sub(r"_v\d+$", "", dict(labels)["call"])): v for (n, labels), v in got.items()
            if n == "gpufleet_nvml_call_stalled_seconds"}


def _wait_free(backend: NvmlBackend, key: str) -> None:
    end = time.monotonic() + 5
    while backend.lanes.busy(key):
        assert time.monotonic() < end, f"lane {key!r} still busy after the stall was cleared"
        time.sleep(0.01)


@pytest.mark.parametrize("function", FUNCTIONS)
def test_hung_function(function: str) -> None:
    gpu = FUNCTIONS[function][0]
    g = str(gpu)
    src = FakeHost()
    with FakeNvml(src) as fake:
        fake.inject_stall(function=function, gpu=gpu)
        backend = NvmlBackend()
        backend.open_timeout = BUDGET / 3
        try:
            answered, _ = backend.lanes.run(NODE, "nvmlInit", backend.start, time.monotonic() + BUDGET)
            collector = GpuCollector(backend)
            got, missing, took = _scrape(collector)
            src.advance(10.0)
            got, missing, took = _scrape(collector)
            assert took < BUDGET + 0.2, "the scrape waited past its budget"
            blocked = fake.stalls.blocked
            assert fake.stalls.blocking == 1, "one call hangs, and only one"
            if function in AT_INIT:
                assert answered, "NVML comes up without the GPU that hangs in its identification"
                assert value(got, "gpufleet_nvml_up") == 1
                others = {str(i) for i in range(len(src.inv))} - {g}
                assert _only(got, others) == pytest.approx(_only(expected_series(src, dt=10.0), others))
                assert not pick(got, "gpufleet_gpu_up", gpu=g), "a stalled GPU is neither up nor lost"
                assert not pick(got, "gpufleet_gpu_power_watts", gpu=g), "no reading of a stalled GPU"
                assert set(_stalls(got)) == {(g, re.sub(r"_v\d+$", "", function))}
                assert missing == [f"gpu {g}"]
            else:
                assert answered
                assert value(got, "gpufleet_nvml_up") == 1
                others = {str(i) for i in range(len(src.inv))} - {g}
                assert _only(got, others) == pytest.approx(_only(expected_series(src, dt=10.0), others))
                assert len(pick(got, "gpufleet_gpu_info", gpu=g)) == 1, "a stalled GPU keeps its identity"
                assert not pick(got, "gpufleet_gpu_up", gpu=g), "a stalled GPU is neither up nor lost"
                assert not pick(got, "gpufleet_gpu_temperature_celsius", gpu=g), "no reading of a stalled GPU"
                assert not pick(got, "gpufleet_gpu_power_watts", gpu=g), "no reading of a stalled GPU"
                (key, call), = _stalls(got)
                assert key == g and call == re.sub(r"_v\d+$", "", function), call
                assert missing == [f"gpu {g}"]
            # more scrapes while it hangs: the call is not made again, no thread piles up
            threads = backend.lanes.threads
            for _ in range(3):
                _scrape(collector, 0.05)
            assert fake.stalls.blocked == blocked and backend.lanes.threads == threads
            # cleared: the very next scrape has everything back
            fake.clear_stalls()
            _wait_free(backend, NODE)
            _wait_free(backend, g)
            _scrape(collector, 5.0)
            src.advance(10.0)
            got, missing, _ = _scrape(collector, 5.0)
            assert missing == [] and not _stalls(got)
            assert value(got, "gpufleet_nvml_up") == 1
            assert value(got, "gpufleet_gpu_up", gpu=g) == 1
            assert _only(got, {g}) == pytest.approx(_only(expected_series(src, dt=10.0), {g}))
        finally:
            fake.clear_stalls()
            backend.close()


@pytest.mark.parametrize("function", [None, "nvmlDeviceGetPowerUsage", "nvmlDeviceGetFieldValues",
                                      "nvmlDeviceGetMemoryInfo"])
def test_slow_function_within_budget_changes_nothing(function: str | None) -> None:
    src = FakeHost()
    with FakeNvml(src) as fake:
        backend = NvmlBackend()
        backend.start()
        try:
            fake.inject_stall(function=function, gpu=SXM, delay=0.002)
            collector = GpuCollector(backend)
            _scrape(collector, 5.0)
            src.advance(10.0)
            got, missing, _ = _scrape(collector, 5.0)
            assert fake.stalls.blocked > 0
            assert missing == [] and not _stalls(got)
            assert got == pytest.approx(expected_series(src, dt=10.0))
        finally:
            backend.close()


def test_slow_past_budget_is_absent_then_back_and_never_stale() -> None:
    """A call slower than the budget: absent while it runs, its late answer dropped, read afresh after."""
    src = FakeHost()
    with FakeNvml(src) as fake:
        backend = NvmlBackend()
        backend.start()
        try:
            collector = GpuCollector(backend)
            _scrape(collector, 5.0)
            rule = fake.inject_stall(function="nvmlDeviceGetPowerUsage", gpu=SXM, delay=0.4)
            src.advance(10.0)
            got, missing, _ = _scrape(collector, 0.1)
            assert missing == [f"gpu {SXM}"] and not pick(got, "gpufleet_gpu_power_watts", gpu=str(SXM))
            assert _stalls(got) == {} or set(_stalls(got)) == {(str(SXM), "nvmlDeviceGetPowerUsage")}
            rule.released.set()  # the rule ends; the late answer comes back and is dropped
            _wait_free(backend, str(SXM))
            assert backend.lanes.late == 1
            src.advance(10.0)
            got, missing, _ = _scrape(collector, 5.0)
            assert missing == []
            assert value(got, "gpufleet_gpu_power_watts", gpu=str(SXM)) == src.samples[SXM].power_mw / 1000  # type: ignore[operator]
        finally:
            backend.close()


def test_every_call_hung_is_nvml_down_within_budget() -> None:
    src = FakeHost()
    with FakeNvml(src) as fake:
        backend = NvmlBackend()
        backend.start()
        try:
            fake.inject_stall()  # every call, every GPU
            collector = GpuCollector(backend)
            got, missing, took = _scrape(collector)
            assert took < BUDGET + 0.2
            assert value(got, "gpufleet_nvml_up") == 0
            assert set(_stalls(got)) == {("", "nvmlDeviceGetCount")}
            assert missing == ["nvml: node-wide call"]
            for _ in range(3):
                _scrape(collector, 0.05)
            assert fake.stalls.blocking == 1, "the node-wide call is not made again while it hangs"
        finally:
            fake.clear_stalls()
            backend.close()
