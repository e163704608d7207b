"""A scenario's types (:class:`Scenario`, its sites, jobs and faults, :class:`ScenarioError`) and the value
parsers every table uses (durations, times, severities, typed keys). :mod:`gpufleet.sim.scenario` is the public face."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from gpufleet.sim.faults import SEVERITY_WORDS
from gpufleet.sim.mig import MigFaultSpec, MigSpec
from gpufleet.sim.scraping import (
    DEFAULT_MISS_RATE,
    ScrapeSpec,
)
from gpufleet.sim.workload_spec import WorkloadSpec

DEFAULT_START = "2026-07-01T00:00:00Z"


class ScenarioError(ValueError):
    """A scenario that cannot be run, with a message naming the file and the field."""


@dataclass
class SiteSpec:
    name: str
    nodes: int
    gpus_per_node: int = 8
    gpu_model: str = "H100-SXM"
    nic_gbps: float = 400.0
    outdoor_mean_c: float = 18.0
    outdoor_amplitude_c: float = 6.0
    pue: float = 1.25
    utc_offset_h: float = 0.0


@dataclass
class JobSpec:
    id: str
    nodes: str | int | list[str] = "all"
    start: float = 0.0
    end: float | None = None
    parallel: str = "data"
    compute_s: float = 1.0
    intensity: float = 0.8
    grad_gb: float = 16.0
    noise: float = 0.01
    kind: str = "training"  # or "inference": a service, every GPU on its own, no job label
    checkpoint_every: float = 0.0  # seconds between checkpoints (0: none); the first after one period
    checkpoint_seconds: float = 60.0
    evals: list[tuple[float, float]] = field(default_factory=list)  # evaluation phases (start, end)


@dataclass
class FaultSpec:
    kind: str
    onset: float
    end: float | None = None
    severity: float = 1.0
    site: str | None = None
    node: str | None = None
    gpu: int | None = None
    nic: int | None = None
    precursor: float = 0.0  # seconds of early warning before the onset (pcie_downgrade: AER reports)


@dataclass
class Scenario:
    name: str
    description: str = ""
    seed: int = 0
    duration: float = 3600.0
    step: float = 15.0
    start: str | None = None
    #: Failed scrapes per target and scrape; None: the scrape model's default (miss_rate).
    scrape_miss_rate: float | None = None
    scrape: ScrapeSpec = field(default_factory=ScrapeSpec)
    sites: list[SiteSpec] = field(default_factory=list)
    auto_jobs: bool = False
    fill: float = 0.85
    mean_hours: float = 6.0
    max_nodes: int = 16
    noisy_fraction: float = 0.1
    jobs: list[JobSpec] = field(default_factory=list)
    faults: list[FaultSpec] = field(default_factory=list)
    heatwaves: list[dict[str, Any]] = field(default_factory=list)
    reboots: list[dict[str, Any]] = field(default_factory=list)
    #: Isolated counter blips (not faults): {"counter": "pcie_replay" | "symbol_error", "node", "gpu" | "nic",
    #: "at", "count"}.
    blips: list[dict[str, Any]] = field(default_factory=list)
    #: Exporter restarts: {"node", "at", "seconds", "component"}: that exporter's scrapes of the node are missing
    #: for "seconds" from "at" and the counters it keeps itself start again from 0 (hardware counters go on).
    exporter_restarts: list[dict[str, Any]] = field(default_factory=list)
    #: Nodes in MIG mode and faults of single MIG slices (gpufleet.sim.mig).
    mig: list[MigSpec] = field(default_factory=list)
    mig_faults: list[MigFaultSpec] = field(default_factory=list)
    #: Uneven work inside training jobs (gpufleet.sim.workload): busier stages, ranks, hot experts, noise.
    workloads: list[WorkloadSpec] = field(default_factory=list)

    @property
    def node_names(self) -> list[str]:
        total = sum(s.nodes for s in self.sites)
        width = max(3, len(str(total - 1)))
        return [f"node-{i:0{width}d}" for i in range(total)]

    @property
    def miss_rate(self) -> float:
        """Failed scrapes per target and scrape: the scenario's rate, else the scrape model's default."""
        if self.scrape_miss_rate is not None:
            return self.scrape_miss_rate
        return DEFAULT_MISS_RATE if self.scrape.realistic else 0.0

    def start_unix(self) -> float:
        return parse_time(self.start or DEFAULT_START)


_DURATION = re.compile(r"^(?:[0-9]*\.?[0-9]+[smhd])+$|^[0-9]*\.?[0-9]+$")
_PART = re.compile(r"([0-9]*\.?[0-9]+)([smhd]?)")
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: object, where: str) -> float:
    if isinstance(value, bool):
        raise ScenarioError(f"{where}: expected a duration, got {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ScenarioError(f"{where}: duration must not be negative")
        return float(value)
    if isinstance(value, str):
        text = value.replace(" ", "")
        if _DURATION.match(text):
            return sum(float(n) * _UNITS[u] for n, u in _PART.findall(text))
    raise ScenarioError(f"{where}: expected a duration like 90, \"15m\", \"2h\" or \"1d12h\", got {value!r}")


def parse_time(value: str) -> float:
    try:
        dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as e:
        raise ScenarioError(f"start: expected an ISO 8601 time like {DEFAULT_START!r}, got {value!r}") from e
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def parse_severity(value: object, where: str) -> float:
    if isinstance(value, str):
        if value in SEVERITY_WORDS:
            return SEVERITY_WORDS[value]
        raise ScenarioError(f"{where}: severity must be one of {', '.join(SEVERITY_WORDS)} or a number in [0, 1]")
    if isinstance(value, int | float) and not isinstance(value, bool) and 0.0 <= value <= 1.0:
        return float(value)
    raise ScenarioError(f"{where}: severity must be a number in [0, 1], got {value!r}")


def check_keys(table: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ScenarioError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")


def get_field(table: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str, default: Any = None) -> Any:
    if key not in table:
        return default
    value = table[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise ScenarioError(f"{where}.{key}: expected {'/'.join(k.__name__ for k in kinds)}, got {value!r}")
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kinds):
        raise ScenarioError(f"{where}.{key}: expected {'/'.join(k.__name__ for k in kinds)}, got {value!r}")
    return value


def positive(value: float, where: str) -> float:
    if value <= 0:
        raise ScenarioError(f"{where}: must be greater than 0, got {value}")
    return value
