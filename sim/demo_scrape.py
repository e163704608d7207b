"""The demo's scraping: fetch each agent's exposition over HTTP and read it into a per-GPU view.

The exposition is parsed with prometheus-client's text parser; every sample is kept (the detector
reads them) and the series the demo shows (SM clock, utilization, SM and tensor activity, power,
temperature, energy, active throttle reasons, the job) fill one :class:`GpuView` per GPU. Metric
names come from the catalog; a failed scrape is a view with ``error`` set, never an exception.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from gpufleet.vocab.catalog import spec
from gpufleet.vocab.nvml import CLOCK_EVENT_BITS

# Metric names, checked against the catalog at import (KeyError if one is renamed).
M_CLOCK = spec("gpufleet_gpu_clock_hertz").name
M_UTIL = spec("gpufleet_gpu_utilization_ratio").name
M_SM_ACTIVE = spec("gpufleet_gpu_sm_active_ratio").name
M_TENSOR = spec("gpufleet_gpu_tensor_active_ratio").name
M_POWER = spec("gpufleet_gpu_power_watts").name
M_TEMP = spec("gpufleet_gpu_temperature_celsius").name
M_THROTTLE = spec("gpufleet_gpu_clock_event_active").name
M_ENERGY = spec("gpufleet_gpu_energy_joules_total").name
M_GPU_UP = spec("gpufleet_gpu_up").name
M_JOB = spec("gpufleet_gpu_job_info").name



def _reason(name: str) -> str:
    """A clock-event reason's label value, checked against NVML's reasons at import (KeyError if renamed)."""
    if name not in CLOCK_EVENT_BITS:
        raise KeyError(f"unknown clock-event reason {name!r}")
    return name


#: Clock-event reasons that mean "held down" (gpu_idle and application settings are not trouble).
THROTTLE_REASONS = {
    _reason("sw_power_cap"): "power cap",
    _reason("hw_slowdown"): "HW slowdown",
    _reason("sw_thermal_slowdown"): "SW thermal",
    _reason("hw_thermal_slowdown"): "HW thermal",
    _reason("hw_power_brake_slowdown"): "power brake",
}


@dataclass
class GpuView:
    """One GPU as its agent reports it (None = the agent exported no such series)."""

    gpu: str
    up: bool = True
    sm_clock_mhz: float | None = None
    util_pct: float | None = None
    sm_active_pct: float | None = None
    tensor_pct: float | None = None
    power_w: float | None = None
    temp_c: float | None = None
    energy_j: float | None = None
    throttle: list[str] = field(default_factory=list)
    job: str | None = None


@dataclass
class NodeView:
    node: str
    url: str
    error: str | None = None
    gpus: dict[str, GpuView] = field(default_factory=dict)
    #: every sample of the scrape: (name, labels, value)
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)

    @property
    def power_w(self) -> float | None:
        vals = [g.power_w for g in self.gpus.values() if g.power_w is not None]
        return sum(vals) if vals else None


def _gpu_order(key: str) -> tuple[int, str]:
    return (int(key), key) if key.isdigit() else (1 << 30, key)


def parse_node(node: str, url: str, text: str) -> NodeView:
    """The per-GPU view of one agent's exposition."""
    view = NodeView(node, url)

    def gpu(labels: dict[str, str]) -> GpuView | None:
        key = labels.get("gpu")
        if key is None:
            return None
        return view.gpus.setdefault(key, GpuView(key))

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            v = float(s.value)
            view.samples.append((s.name, s.labels, v))
            # only per-GPU families name a GPU (PCIe and pod info series carry GPU lists or "")
            g = gpu(s.labels) if s.name.startswith("gpufleet_gpu_") and s.labels.get("gpu") else None
            if g is None:
                continue
            if s.name == M_CLOCK and s.labels.get("clock") == "sm":
                g.sm_clock_mhz = v / 1e6
            elif s.name == M_UTIL:
                g.util_pct = 100 * v
            elif s.name == M_SM_ACTIVE:
                g.sm_active_pct = 100 * v
            elif s.name == M_TENSOR:
                g.tensor_pct = 100 * v
            elif s.name == M_POWER:
                g.power_w = v
            elif s.name == M_TEMP and s.labels.get("sensor") == "gpu":
                g.temp_c = v
            elif s.name == M_ENERGY:
                g.energy_j = v
            elif s.name == M_GPU_UP:
                g.up = v == 1
            elif s.name == M_THROTTLE and v == 1 and s.labels.get("reason") in THROTTLE_REASONS:
                g.throttle.append(s.labels["reason"])
            elif s.name == M_JOB and v == 1:
                g.job = s.labels.get("job_id")
    view.gpus = dict(sorted(view.gpus.items(), key=lambda kv: _gpu_order(kv[0])))
    return view


def scrape(node: str, url: str, timeout: float = 3.0) -> NodeView:
    """Scrape one agent over HTTP; a failed scrape is a view with ``error`` set, never an exception."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            text = r.read().decode("utf-8")
        return parse_node(node, url, text)
    except (urllib.error.URLError, OSError, ValueError) as e:
        return NodeView(node, url, error=f"scrape failed: {e}")


def scrape_all(targets: Sequence[tuple[str, str]], pool: ThreadPoolExecutor) -> list[NodeView]:
    return list(pool.map(lambda t: scrape(*t), targets))


