"""What one read of a GPU gives (:class:`Reading`, :class:`GpmRates`) and what the reader keeps per device
between reads (:class:`ReaderState`: GPM sample buffers, prepared field-value requests, the slow tier's cache)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, fields
from typing import Any

import pynvml

from gpufleet.agent.nvml.model import GpuSample

_BLANK: dict[str, Any] = {f.name: None for f in fields(GpuSample)}
#: Every reading field of a GpuSample (not its time, lost flag or GPM counters).
#: (MIG devices and processes are read by :mod:`.mig` and :mod:`.processes`, not per reading.)
READINGS = tuple(k for k in _BLANK if k not in ("timestamp", "lost", "gpm", "mig", "processes"))


@dataclass
class GpmRates:
    """GPM metrics between the previous and the current sample (percent and MiB/s, as NVML gives them)."""

    interval_s: float
    sm_active_pct: float | None = None
    sm_occupancy_pct: float | None = None
    tensor_active_pct: float | None = None
    dram_active_pct: float | None = None
    nvlink_tx_mibps: float | None = None
    nvlink_rx_mibps: float | None = None
    pcie_tx_mibps: float | None = None
    pcie_rx_mibps: float | None = None


@dataclass
class Reading:
    """One GPU at one moment. ``sample`` is None for a lost GPU."""

    index: int
    lost: bool = False
    sample: GpuSample | None = None
    memory_total_bytes: int | None = None
    #: NVLink link ids, aligned with ``sample.nvlink``; ``nvlink_up`` is None where the state was unreadable.
    nvlink_links: tuple[int, ...] = ()
    nvlink_up: list[bool | None] = field(default_factory=list)
    gpm: GpmRates | None = None
    #: Identifies the slow-tier values of this reading: the same object as the previous reading's when they
    #: were served from cache or re-read unchanged (consumers may reuse what they derived from them).
    slow_token: object = None


class ReaderState:
    """Per-device state kept between readings: GPM sample buffers and the field-value request."""

    def __init__(self) -> None:
        self.buffers: list[Any] = []
        self.current = 0
        self.prev_valid = False
        self.prev_t = 0.0
        self.metrics_get: Any = None
        self.gpm_broken = False
        self.gpm_pcie_ok: bool | None = None
        self.last_rates: GpmRates | None = None
        self.field_request: Any = None
        self.field_links: tuple[int, ...] | None = None
        self.field_words: Any = None
        self.nvlink_words: Any = None
        #: The slow tier's NVLink request (FI_NVLINK_SCOPED for every link) and the links it was built for.
        self.nvlink_request: Any = None
        self.nvlink_links: tuple[int, ...] | None = None
        #: Does the GPU count NVLink data CRC errors? None: not known yet; False: every link answered
        #: NOT_SUPPORTED on the first read, so it is not asked again (until NVML is re-initialized).
        self.crc_data: bool | None = None
        #: slow_clock() when nvmlDeviceGetUtilizationRates last answered NOT_SUPPORTED (a GPU in MIG mode):
        #: not asked again until UTILIZATION_RETRY_SECONDS later (MIG mode changes with a GPU reset).
        self.utilization_unsupported_at: float | None = None
        #: The driver lacks a newer entry point: use the older one (fewer fields).
        self.legacy_memory = False
        self.legacy_reasons = False
        #: Slow tier cache: time.monotonic() of the last complete slow read (None: read on the next reading),
        #: its SLOW_FIELDS values, the links it covered and per link (state, *NVLink error counters).
        self.slow_at: float | None = None
        self.slow: dict[str, Any] = {}
        self.slow_links_key: tuple[int, ...] = ()
        self.slow_links: list[tuple[bool | None, int | None, int | None, int | None, int | None]] = []
        self.slow_token: object = None

    def invalidate_slow(self) -> None:
        """Forget the slow tier cache: the next reading re-reads every slow group."""
        self.slow_at = None
        self.slow = {}
        self.slow_links = []
        self.slow_token = None

    def close(self) -> None:
        for buf in self.buffers:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlGpmSampleFree(buf)
        self.buffers = []
        self.prev_valid = False
        self.invalidate_slow()


def blank_sample(timestamp: float) -> GpuSample:
    """A GpuSample with every reading None (unknown) and ``timestamp`` set."""
    s = GpuSample.__new__(GpuSample)
    s.__dict__.update(_BLANK)
    s.timestamp = timestamp
    s.lost = False
    s.mig = []
    return s

