"""The agent against the real NVIDIA driver: skipped on a machine without libnvidia-ml or a GPU.

Run on a GPU host with ``.venv/bin/python -m pytest tests/gpu``; the fuller comparison with the fake
is ``OUT=dir bash tests/gpu/check.sh`` (tests/gpu/gpucheck.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pynvml
import pytest
from gpucheck import probe_errors
from support import Series, scrape

from gpufleet.agent.collectors import budget as budgets
from gpufleet.agent.collectors.gpu import GpuCollector
from gpufleet.agent.nvml.backend import NvmlBackend


def _gpus() -> int:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError:
        return 0
    finally:
        pynvml.nvmlShutdown()


GPUS = _gpus()
pytestmark = pytest.mark.skipif(GPUS == 0, reason="no NVIDIA driver (libnvidia-ml) or no GPU on this machine")


@pytest.fixture
def backend() -> Iterator[NvmlBackend]:
    b = NvmlBackend()
    assert b.start(), b.init_error
    yield b
    b.close()


def _scrape(c: GpuCollector, seconds: float = 10.0) -> tuple[Series, list[str]]:
    now = time.monotonic()
    budget = budgets.Budget(now, now + seconds)
    token = budgets.enter(budget)
    try:
        return scrape(c), budget.missing
    finally:
        budgets.leave(token)


def test_every_gpu_answers_within_the_budget(backend: NvmlBackend) -> None:
    c = GpuCollector(backend)
    _scrape(c)
    got, missing = _scrape(c)
    assert missing == []
    assert got[("gpufleet_nvml_up", frozenset())] == 1
    up = {dict(k)["gpu"]: v for (n, k), v in got.items() if n == "gpufleet_gpu_up"}
    assert up == {str(i): 1.0 for i in range(GPUS)}
    assert not [n for n, _ in got if n == "gpufleet_nvml_call_stalled_seconds"]
    assert backend.lanes.threads <= GPUS + 1


def test_error_paths_answer_as_documented() -> None:
    got = probe_errors("")
    assert got["nvmlDeviceGetHandleByIndex(count)"] == "INVALID_ARGUMENT"
    assert got["nvmlDeviceGetNvLinkState(link 63)"] in ("INVALID_ARGUMENT", "NOT_SUPPORTED")
    assert got["nvmlDeviceGetName(1-byte buffer)"] == "INSUFFICIENT_SIZE"
    assert got["nvmlEventSetWait_v2(empty set, 1 ms)"] in ("TIMEOUT", "NOT_SUPPORTED")
    assert got["nvmlDeviceGetCount(after shutdown)"] == "UNINITIALIZED"
    assert got["nvmlDeviceGetHandleByUUID(unknown)"] in ("NOT_FOUND", "INVALID_ARGUMENT")
