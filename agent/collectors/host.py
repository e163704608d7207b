"""Host collector: CPU utilization, CPU count, memory and load averages via psutil.

CPU utilization is the busy fraction of all CPU time since the previous scrape
(the semantics of ``psutil.cpu_percent(interval=None)``), computed from
``psutil.cpu_times()`` with the collector's own previous sample so that other
users of psutil in the process do not disturb it. The first sample is taken
when the collector is created. A scrape less than :data:`MIN_INTERVAL_SECONDS`
after the previous measurement (CPU times tick at 100 Hz, so the ratio would be
noise), or with no CPU time elapsed, leaves the series out rather than
reporting a made-up value, and keeps the older baseline for the next scrape.

CPU steal and iowait (``/proc/stat``'s ``cpu`` line, which psutil gives in seconds) are
exported as counters from the newest of those samples, so they cost no extra read; a
platform whose ``cpu_times()`` has no such field gets no series.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any, cast

import psutil
from prometheus_client.core import GaugeMetricFamily, Metric

from gpufleet.vocab import catalog

log = logging.getLogger(__name__)

_CPU = "gpufleet_host_cpu_utilization_ratio"
_COUNT = "gpufleet_host_cpus"
_MEM_TOTAL = "gpufleet_host_memory_total_bytes"
_MEM_AVAIL = "gpufleet_host_memory_available_bytes"
_LOAD = "gpufleet_host_load_average"
_STEAL = "gpufleet_host_cpu_steal_seconds_total"
_IOWAIT = "gpufleet_host_cpu_iowait_seconds_total"
_NAMES = (_CPU, _COUNT, _MEM_TOTAL, _MEM_AVAIL, _LOAD, _STEAL, _IOWAIT)
_WINDOWS = ("1m", "5m", "15m")
#: Shortest interval over which CPU utilization is reported.
MIN_INTERVAL_SECONDS = 0.1


def cpu_busy_total(times: Any) -> tuple[float, float]:
    """(busy, total) CPU seconds from a ``psutil.cpu_times()`` result.

    Idle time is ``idle`` plus ``iowait``; on Linux ``guest``/``guest_nice`` are
    already counted in ``user``/``nice`` and are removed from the total.
    """
    total = float(sum(times))
    total -= getattr(times, "guest", 0.0) + getattr(times, "guest_nice", 0.0)
    idle = float(times.idle) + getattr(times, "iowait", 0.0)
    return total - idle, total


class HostCollector:
    """psutil host context: ``gpufleet_host_*``."""

    name = "host"

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._specs = {n: catalog.spec(n) for n in _NAMES}
        self._last: tuple[float, float, float] | None = None  # (clock, busy, total)
        self._times: Any = None  # the newest psutil.cpu_times() sample (steal, iowait)
        try:
            self._times = psutil.cpu_times()
            self._last = (clock(), *cpu_busy_total(self._times))
        except (OSError, RuntimeError) as e:  # pragma: no cover - psutil always works on Linux
            log.warning("psutil.cpu_times failed: %s", e)

    def describe(self) -> Iterable[Metric]:
        return [catalog.spec(n).family() for n in _NAMES]

    def cpu_utilization(self) -> float | None:
        """Busy fraction of CPU time since the previous measurement (None when not measurable)."""
        t = self._clock()
        if self._last is not None and t - self._last[0] < MIN_INTERVAL_SECONDS:
            return None
        self._times = psutil.cpu_times()
        now = (t, *cpu_busy_total(self._times))
        last, self._last = self._last, now
        if last is None:
            return None
        d_busy, d_total = now[1] - last[1], now[2] - last[2]
        if d_total <= 0:
            return None
        return min(max(d_busy / d_total, 0.0), 1.0)

    def collect(self) -> Iterable[Metric]:
        fams: list[Metric] = []

        def gauge(name: str, value: float | None) -> None:
            if value is not None:
                fam = cast(GaugeMetricFamily, self._specs[name].family())
                fam.add_metric([], float(value))
                fams.append(fam)

        gauge(_CPU, self.cpu_utilization())
        for name, field in ((_STEAL, "steal"), (_IOWAIT, "iowait")):
            value = getattr(self._times, field, None)
            if value is not None:
                fam = self._specs[name].family()
                fam.add_metric([], float(value))
                fams.append(fam)
        gauge(_COUNT, psutil.cpu_count(logical=True))
        mem = psutil.virtual_memory()
        gauge(_MEM_TOTAL, mem.total)
        gauge(_MEM_AVAIL, mem.available)
        try:
            loads = os.getloadavg()
        except OSError:  # pragma: no cover - not on Linux
            loads = None
        if loads is not None:
            fam = cast(GaugeMetricFamily, self._specs[_LOAD].family())
            for window, value in zip(_WINDOWS, loads, strict=True):
                fam.add_metric([window], value)
            fams.append(fam)
        return fams
