"""The XID listener thread: events become counters, unsupported GPUs are skipped, it stops promptly."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pynvml
import pytest
from support import scrape
from test_gpu_collector import FakeHost, pick, value

from gpufleet.agent.collectors.xid import XidCollector
from gpufleet.agent.nvml.backend import NvmlBackend
from gpufleet.agent.nvml.model import XidEvent
from gpufleet.sim.fake.library import FakeNvml


def wait_for(cond: Callable[[], object], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


@pytest.fixture
def env() -> Iterator[tuple[FakeHost, FakeNvml, NvmlBackend]]:
    src = FakeHost()
    fake = FakeNvml(src).install()
    backend = NvmlBackend()
    assert backend.start()
    try:
        yield src, fake, backend
    finally:
        backend.close()
        fake.uninstall()


def test_events_are_counted_per_gpu_and_code(env: tuple[FakeHost, FakeNvml, NvmlBackend]) -> None:
    src, _, backend = env
    seen: list[XidEvent] = []
    xid = XidCollector(backend, wait_ms=100, on_event=seen.append)
    assert scrape(xid) == {}, "no XID yet: no series (not zeros)"
    xid.start()
    try:
        wait_for(lambda: xid.registered == (0, 1, 2))
        before = time.time()
        src.xids += [XidEvent(gpu=0, xid=79, timestamp=src.t), XidEvent(gpu=2, xid=48, timestamp=src.t)]
        wait_for(lambda: len(seen) == 2)
        src.xids += [XidEvent(gpu=0, xid=79, timestamp=src.t)]
        wait_for(lambda: len(seen) == 3)
        got = scrape(xid)
        assert value(got, "gpufleet_gpu_xid_errors_total", gpu="0", xid="79") == 2
        assert value(got, "gpufleet_gpu_xid_errors_total", gpu="2", xid="48") == 1
        assert len(pick(got, "gpufleet_gpu_xid_errors_total")) == 2
        last = value(got, "gpufleet_gpu_xid_last_seen_timestamp_seconds", gpu="0", xid="79")
        assert before <= last <= time.time()
        assert [(e.gpu, e.xid) for e in seen] == [(0, 79), (2, 48), (0, 79)]
    finally:
        t0 = time.monotonic()
        xid.close()
        assert time.monotonic() - t0 < 1.0, "close() must stop the thread within a second"
    assert not xid.running


def test_gpu_without_event_support_is_skipped(env: tuple[FakeHost, FakeNvml, NvmlBackend]) -> None:
    src, fake, backend = env
    fake.inject_error(pynvml.NVML_ERROR_NOT_SUPPORTED, function="nvmlDeviceRegisterEvents", gpu=1)
    xid = XidCollector(backend, wait_ms=100)
    xid.start()
    try:
        wait_for(lambda: xid.registered == (0, 2))
        src.xids.append(XidEvent(gpu=2, xid=94, timestamp=src.t))
        wait_for(lambda: pick(scrape(xid), "gpufleet_gpu_xid_errors_total"))
        assert value(scrape(xid), "gpufleet_gpu_xid_errors_total", gpu="2", xid="94") == 1
        assert backend.errors() == {}, "a GPU without event support is not an error"
    finally:
        xid.close()


def test_registration_error_on_one_gpu_keeps_the_others_and_is_retried(
    env: tuple[FakeHost, FakeNvml, NvmlBackend],
) -> None:
    src, fake, backend = env
    fake.inject_error(pynvml.NVML_ERROR_UNKNOWN, function="nvmlDeviceRegisterEvents", gpu=0)
    xid = XidCollector(backend, wait_ms=50, retry_s=0.2)
    xid.start()
    try:
        wait_for(lambda: xid.registered == (1, 2))
        assert backend.errors()[("nvmlDeviceRegisterEvents", "UNKNOWN")] >= 1
        src.xids.append(XidEvent(gpu=1, xid=13, timestamp=src.t))
        wait_for(lambda: pick(scrape(xid), "gpufleet_gpu_xid_errors_total", gpu="1"))
        fake.clear_errors()
        wait_for(lambda: xid.registered == (0, 1, 2))  # retried after retry_s
        src.xids.append(XidEvent(gpu=0, xid=31, timestamp=src.t))
        wait_for(lambda: pick(scrape(xid), "gpufleet_gpu_xid_errors_total", gpu="0"))
    finally:
        xid.close()


def test_listener_rebuilds_after_nvml_reinit(env: tuple[FakeHost, FakeNvml, NvmlBackend]) -> None:
    src, fake, backend = env
    xid = XidCollector(backend, wait_ms=50, backoff=(0.02, 0.1))
    xid.start()
    try:
        wait_for(lambda: xid.registered == (0, 1, 2))
        generation = backend.generation
        fake.inject_error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED, function="nvmlDeviceGetCount")
        assert backend.refresh() is False  # the scrape notices the driver went away
        fake.clear_errors()
        assert backend.refresh() is True  # ... and re-initializes NVML on the next one
        assert backend.generation == generation + 1
        src.xids.append(XidEvent(gpu=2, xid=79, timestamp=src.t))
        wait_for(lambda: pick(scrape(xid), "gpufleet_gpu_xid_errors_total", gpu="2"))
        assert xid.running
    finally:
        xid.close()


def test_close_without_start_and_twice(env: tuple[FakeHost, FakeNvml, NvmlBackend]) -> None:
    _, _, backend = env
    xid = XidCollector(backend)
    xid.close()
    xid.start()
    xid.start()  # idempotent
    xid.close()
    xid.close()
    assert not xid.running
