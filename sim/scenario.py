"""Declarative scenarios (TOML, or YAML with the same keys): fleet, jobs, faults, confounders, duration, step, seed.

Example::

    name = "one-straggler"
    description = "4 nodes, one job, a GPU whose clock is stuck low"
    seed = 7
    hours = 2            # or duration = "90m" (s, m, h, d suffixes; plain numbers are seconds)
    step = 15            # seconds between samples
    start = "2026-07-01T00:00:00Z"   # optional; recordings default to this, live runs to now
    scrape_miss_rate = 0.0005        # probability a target's scrape fails (default 0.001; 0 with model "aligned")

    [scrape]                         # how Prometheus scrapes the fleet (gpufleet.sim.scraping)
    model = "prometheus"             # per-target offsets, jitter, exporter lag, rank skew; "aligned": none

    [[sites]]
    name = "site-a"
    nodes = 4
    gpus_per_node = 8
    gpu_model = "H100-SXM"           # H100-SXM, H200-SXM, A100-SXM
    outdoor_mean_c = 18
    outdoor_amplitude_c = 6
    pue = 1.25

    [jobs]
    auto = false                     # true: jobs start and end over time, filling `fill` of the nodes
    [[jobs.fixed]]
    id = "job-0001"
    nodes = "all"                    # "all", a number of nodes (the first N), or a list of node names
    start = 0
    # end = "1h"; parallel = "data" | "hybrid"; compute_s; intensity; grad_gb; noise

    [[faults]]
    kind = "clock_stuck_low"         # see gpufleet.sim.faults
    node = "node-002"
    gpu = 5
    onset = "20m"
    severity = "obvious"             # marginal | moderate | obvious | a number in [0, 1]
    # precursor = "20m"              # pcie_downgrade: correctable AER reports start this long before the onset

    [[heatwaves]]                    # confounder, not a fault
    site = "site-a"
    start = "2h"
    end = "30h"
    delta_c = 9

    [[reboots]]                      # planned reboot: counters reset, scrapes missing for 3 minutes
    node = "node-001"
    at = "3h"

    [[mig]]                          # a node in MIG mode (it runs no whole-GPU job)
    node = "node-003"
    layout = "1g.10gb*7"             # H100 profiles, see gpufleet.sim.mig
    job = "5001"                     # optional: the Slurm job of every slice ("": none, each its own workload)
    activity = 0.75                  # optional: SM activity of the job's slices

    [[workloads]]                    # uneven work inside a training job: see gpufleet.sim.workload
    job = "job-0001"
    pattern = "stage_imbalance"      # stage_imbalance | data_skew | hot_experts | seqlen_noise
    owner = "team-llm"

    [[mig_faults]]                   # a fault of one MIG slice (gpufleet.sim.mig.MIG_FAULTS)
    kind = "mig_slice_slow"
    node = "node-003"
    gpu = 1
    gpu_instance = 9
    onset = "20m"

Nodes are named ``node-000``, ``node-001``, ... across sites in order.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import Any

from gpufleet.sim.faults import FAULTS, SEVERITY_WORDS
from gpufleet.sim.fleet import GPU_MODELS
from gpufleet.sim.mig import MIG_FAULTS, MigFaultSpec, MigSpec, instance_ids, layout_of
from gpufleet.sim.scraping import (
    COMPONENTS,
    DEFAULT_MISS_RATE,
    ScrapeSpec,
    ScrapeSpecError,
    parse_scrape,
)
from gpufleet.sim.workload_spec import KEYS, PATTERNS, WorkloadSpec

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


def _check_keys(table: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ScenarioError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")


def _get(table: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str, default: Any = None) -> Any:
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


def _positive(value: float, where: str) -> float:
    if value <= 0:
        raise ScenarioError(f"{where}: must be greater than 0, got {value}")
    return value


def parse_scenario(data: dict[str, Any], source: str = "<scenario>") -> Scenario:
    """A validated :class:`Scenario` from a parsed TOML document (errors name ``source``)."""
    w = source
    _check_keys(data, {"name", "description", "seed", "hours", "duration", "step", "start", "scrape_miss_rate",
                       "sites", "jobs", "faults", "heatwaves", "reboots", "blips", "exporter_restarts", "mig",
                       "mig_faults", "workloads", "scrape"}, w)
    sc = Scenario(name=_get(data, "name", str, w, Path(source).stem))
    sc.description = _get(data, "description", str, w, "")
    sc.seed = _get(data, "seed", int, w, 0)
    if "hours" in data and "duration" in data:
        raise ScenarioError(f"{w}: give either hours or duration, not both")
    if "hours" in data:
        sc.duration = _positive(_get(data, "hours", float, w) * 3600.0, f"{w}.hours")
    elif "duration" in data:
        sc.duration = _positive(parse_duration(data["duration"], f"{w}.duration"), f"{w}.duration")
    sc.step = _positive(parse_duration(data.get("step", 15), f"{w}.step"), f"{w}.step")
    if sc.step > sc.duration:
        raise ScenarioError(f"{w}.step: {sc.step:g} s is longer than the duration ({sc.duration:g} s)")
    sc.start = _get(data, "start", str, w)
    if sc.start is not None:
        parse_time(sc.start)
    sc.scrape_miss_rate = _get(data, "scrape_miss_rate", float, w, None)
    if sc.scrape_miss_rate is not None and not 0.0 <= sc.scrape_miss_rate < 1.0:
        raise ScenarioError(f"{w}.scrape_miss_rate: must be in [0, 1)")
    try:
        sc.scrape = parse_scrape(_get(data, "scrape", dict, w, {}), f"{w}.scrape")
    except ScrapeSpecError as e:
        raise ScenarioError(str(e)) from e
    sites = _get(data, "sites", list, w)
    if not sites:
        raise ScenarioError(f"{w}: at least one [[sites]] table is required")
    for i, s in enumerate(sites):
        sw = f"{w}: sites[{i}]"
        if not isinstance(s, dict):
            raise ScenarioError(f"{sw}: expected a table")
        _check_keys(s, {f.name for f in SiteSpec.__dataclass_fields__.values()}, sw)
        spec = SiteSpec(name=_get(s, "name", str, sw, f"site-{i}"), nodes=int(_get(s, "nodes", int, sw, 0)))
        if spec.nodes < 1:
            raise ScenarioError(f"{sw}.nodes: a site needs at least 1 node")
        spec.gpus_per_node = _get(s, "gpus_per_node", int, sw, 8)
        if not 1 <= spec.gpus_per_node <= 16:
            raise ScenarioError(f"{sw}.gpus_per_node: must be between 1 and 16")
        spec.gpu_model = _get(s, "gpu_model", str, sw, "H100-SXM")
        if spec.gpu_model not in GPU_MODELS:
            raise ScenarioError(f"{sw}.gpu_model: unknown model {spec.gpu_model!r}; known: {', '.join(GPU_MODELS)}")
        for key in ("nic_gbps", "outdoor_mean_c", "outdoor_amplitude_c", "pue", "utc_offset_h"):
            setattr(spec, key, _get(s, key, float, sw, getattr(spec, key)))
        if spec.pue < 1.0:
            raise ScenarioError(f"{sw}.pue: a PUE is at least 1.0")
        sc.sites.append(spec)
    names = [s.name for s in sc.sites]
    if len(set(names)) != len(names):
        raise ScenarioError(f"{w}: site names must be unique")
    if len({s.gpus_per_node for s in sc.sites}) != 1:
        raise ScenarioError(f"{w}: all sites must use the same gpus_per_node")
    node_names = set(sc.node_names)
    _parse_jobs(sc, _get(data, "jobs", dict, w, {}), node_names, f"{w}: jobs")
    for i, fd in enumerate(_get(data, "faults", list, w, [])):
        sc.faults.append(_parse_fault(fd, node_names, set(names), sc, f"{w}: faults[{i}]"))
    for i, h in enumerate(_get(data, "heatwaves", list, w, [])):
        hw = f"{w}: heatwaves[{i}]"
        if not isinstance(h, dict):
            raise ScenarioError(f"{hw}: expected a table")
        _check_keys(h, {"site", "start", "end", "delta_c"}, hw)
        site = _get(h, "site", str, hw, names[0])
        if site not in names:
            raise ScenarioError(f"{hw}.site: unknown site {site!r}")
        sc.heatwaves.append({"site": site, "start": parse_duration(h.get("start", 0), f"{hw}.start"),
                             "end": parse_duration(h.get("end", sc.duration), f"{hw}.end"),
                             "delta_c": _get(h, "delta_c", float, hw, 8.0)})
    for i, r in enumerate(_get(data, "reboots", list, w, [])):
        rw = f"{w}: reboots[{i}]"
        if not isinstance(r, dict):
            raise ScenarioError(f"{rw}: expected a table")
        _check_keys(r, {"node", "at"}, rw)
        node = _get(r, "node", str, rw)
        if node not in node_names:
            raise ScenarioError(f"{rw}.node: unknown node {node!r}")
        sc.reboots.append({"node": node, "at": parse_duration(r.get("at", 0), f"{rw}.at")})
    gpn = sc.sites[0].gpus_per_node
    for i, b in enumerate(_get(data, "blips", list, w, [])):
        bw = f"{w}: blips[{i}]"
        if not isinstance(b, dict):
            raise ScenarioError(f"{bw}: expected a table")
        _check_keys(b, {"counter", "node", "gpu", "nic", "at", "count"}, bw)
        counter = _get(b, "counter", str, bw, "pcie_replay")
        if counter not in ("pcie_replay", "symbol_error"):
            raise ScenarioError(f"{bw}.counter: must be \"pcie_replay\" or \"symbol_error\"")
        node = _get(b, "node", str, bw)
        if node not in node_names:
            raise ScenarioError(f"{bw}.node: unknown node {node!r}")
        where = "gpu" if counter == "pcie_replay" else "nic"
        idx = _get(b, where, int, bw, 0)
        if not 0 <= idx <= gpn - (where == "gpu"):
            raise ScenarioError(f"{bw}.{where}: out of range")
        count = _get(b, "count", int, bw, 1)
        if count < 1:
            raise ScenarioError(f"{bw}.count: must be at least 1")
        sc.blips.append({"counter": counter, "node": node, where: idx, "at": parse_duration(b.get("at", 0), f"{bw}.at"),
                         "count": count})
    for i, r in enumerate(_get(data, "exporter_restarts", list, w, [])):
        rw = f"{w}: exporter_restarts[{i}]"
        if not isinstance(r, dict):
            raise ScenarioError(f"{rw}: expected a table")
        _check_keys(r, {"node", "at", "seconds", "component"}, rw)
        node = _get(r, "node", str, rw)
        if node not in node_names:
            raise ScenarioError(f"{rw}.node: unknown node {node!r}")
        component = _get(r, "component", str, rw, "gpu")
        if component not in COMPONENTS:
            raise ScenarioError(f"{rw}.component: must be one of {', '.join(COMPONENTS)}, got {component!r}")
        sc.exporter_restarts.append({"node": node, "at": parse_duration(r.get("at", 0), f"{rw}.at"),
                                     "seconds": parse_duration(r.get("seconds", 60), f"{rw}.seconds"),
                                     "component": component})
    _parse_mig(sc, data, w)
    sc.workloads = _parse_workloads(data.get("workloads"), sc, w)
    return sc


def _parse_workloads(items: object, sc: Scenario, where: str) -> list[WorkloadSpec]:
    """The validated ``[[workloads]]`` tables of a scenario whose jobs are parsed (errors name ``where``)."""
    if items is None:
        return []
    if not isinstance(items, list):
        raise ScenarioError(f"{where}: workloads must be an array of tables ([[workloads]])")
    jobs = {j.id: j for j in sc.jobs}
    names = sc.node_names
    gpn = sc.sites[0].gpus_per_node
    out = []
    for i, w in enumerate(items):
        ww = f"{where}: workloads[{i}]"
        if not isinstance(w, dict):
            raise ScenarioError(f"{ww}: expected a table")
        unknown = sorted(set(w) - KEYS)
        if unknown:
            raise ScenarioError(f"{ww}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(KEYS))}")
        spec = WorkloadSpec(job=_get(w, "job", str, ww, ""), pattern=_get(w, "pattern", str, ww, ""))
        if spec.job not in jobs or jobs[spec.job].kind != "training":
            raise ScenarioError(f"{ww}.job: {spec.job!r} is not a training job of [[jobs.fixed]]")
        if spec.pattern not in PATTERNS:
            raise ScenarioError(f"{ww}.pattern: must be one of {', '.join(PATTERNS)}")
        spec.owner = _get(w, "owner", str, ww, "")
        spec.extra = _get(w, "extra", float, ww, spec.extra)
        if not 0.0 < spec.extra <= 3.0:
            raise ScenarioError(f"{ww}.extra: must be in (0, 3]")
        spec.sigma = _get(w, "sigma", float, ww, spec.sigma)
        if not 0.0 < spec.sigma <= 0.5:
            raise ScenarioError(f"{ww}.sigma: must be in (0, 0.5]")
        js = jobs[spec.job]
        members = (list(range(len(names))) if js.nodes == "all" else list(range(js.nodes))
                   if isinstance(js.nodes, int) else sorted(names.index(n) for n in js.nodes))
        spec.stages = _get(w, "stages", int, ww, spec.stages)
        if not 2 <= spec.stages <= len(members) * gpn:
            raise ScenarioError(f"{ww}.stages: must be between 2 and the job's GPUs ({len(members) * gpn})")
        spec.stage = _get(w, "stage", int, ww, spec.stage)
        if not -spec.stages <= spec.stage < spec.stages:
            raise ScenarioError(f"{ww}.stage: must be a stage of the {spec.stages}")
        spec.node = _get(w, "node", str, ww)
        if spec.node is not None and spec.node not in [names[n] for n in members]:
            raise ScenarioError(f"{ww}.node: {spec.node!r} is not a node of job {spec.job!r}")
        spec.gpu = _get(w, "gpu", int, ww)
        if spec.gpu is not None and (spec.node is None or not 0 <= spec.gpu < gpn):
            raise ScenarioError(f"{ww}.gpu: needs a node and must be between 0 and {gpn - 1}")
        if spec.pattern == "data_skew" and spec.node is None:
            raise ScenarioError(f"{ww}.node: a data_skew workload names the busier node (and gpu for one rank)")
        if "start" in w:
            spec.start = parse_duration(w["start"], f"{ww}.start")
        if "end" in w:
            spec.end = parse_duration(w["end"], f"{ww}.end")
            if spec.end <= (spec.start or 0.0):
                raise ScenarioError(f"{ww}.end: must be after the start")
        spec.hot = _get(w, "hot", int, ww, spec.hot)
        if not 1 <= spec.hot <= gpn:
            raise ScenarioError(f"{ww}.hot: must be between 1 and {gpn}")
        spec.move_every = parse_duration(w.get("move_every", spec.move_every), f"{ww}.move_every")
        if spec.move_every <= 0:
            raise ScenarioError(f"{ww}.move_every: must be greater than 0")
        if spec.pattern == "hot_experts" and len(members) < 2:
            raise ScenarioError(f"{ww}: hot experts move between nodes: the job needs at least 2 nodes")
        out.append(spec)
    return out


def _parse_mig(sc: Scenario, data: dict[str, Any], source: str) -> None:
    """``[[mig]]`` nodes and ``[[mig_faults]]``; a MIG node may not be in a whole-GPU job."""
    names = sc.node_names
    layouts: dict[str, list[str]] = {}
    for i, m in enumerate(_get(data, "mig", list, source, [])):
        mw = f"{source}: mig[{i}]"
        if not isinstance(m, dict):
            raise ScenarioError(f"{mw}: expected a table")
        _check_keys(m, {"node", "layout", "job", "activity"}, mw)
        spec = MigSpec(node=_get(m, "node", str, mw, ""), layout=_get(m, "layout", str, mw, ""),
                       job=_get(m, "job", str, mw, ""), activity=_get(m, "activity", float, mw, 0.75))
        if spec.node not in names:
            raise ScenarioError(f"{mw}.node: unknown node {spec.node!r}")
        if spec.node in layouts:
            raise ScenarioError(f"{mw}.node: {spec.node} is already in MIG mode")
        try:
            layouts[spec.node] = layout_of(spec.layout)
        except ValueError as e:
            raise ScenarioError(f"{mw}.layout: {e}") from None
        if not 0.0 < spec.activity <= 1.0:
            raise ScenarioError(f"{mw}.activity: must be in (0, 1]")
        if sc.auto_jobs:
            raise ScenarioError(f"{mw}: [[mig]] nodes need fixed jobs (jobs.auto = false)")
        for js in sc.jobs:
            members = names if js.nodes == "all" else names[:js.nodes] if isinstance(js.nodes, int) else js.nodes
            if spec.node in members:
                raise ScenarioError(f"{mw}.node: {spec.node} is in MIG mode but in whole-GPU job {js.id!r}")
        sc.mig.append(spec)
    gpn = sc.sites[0].gpus_per_node
    for i, fd in enumerate(_get(data, "mig_faults", list, source, [])):
        fw = f"{source}: mig_faults[{i}]"
        if not isinstance(fd, dict):
            raise ScenarioError(f"{fw}: expected a table")
        _check_keys(fd, {"kind", "node", "gpu", "gpu_instance", "onset", "end", "severity"}, fw)
        kind = _get(fd, "kind", str, fw, "mig_slice_slow")
        if kind not in MIG_FAULTS:
            raise ScenarioError(f"{fw}.kind: unknown MIG fault {kind!r}; known: {', '.join(MIG_FAULTS)}")
        node = _get(fd, "node", str, fw, "")
        if node not in layouts:
            raise ScenarioError(f"{fw}.node: {node!r} is not a [[mig]] node")
        gpu = _get(fd, "gpu", int, fw, 0)
        if not 0 <= gpu < gpn:
            raise ScenarioError(f"{fw}.gpu: must be between 0 and {gpn - 1}")
        gi = _get(fd, "gpu_instance", int, fw)
        known = [g for g, _ in instance_ids(layouts[node])]
        if gi not in known:
            raise ScenarioError(f"{fw}.gpu_instance: {gi!r} is not a GPU instance of the layout (its: {known})")
        fault = MigFaultSpec(kind, node, gpu, gi, parse_duration(fd.get("onset", 0), f"{fw}.onset"))
        if "end" in fd:
            fault.end = parse_duration(fd["end"], f"{fw}.end")
            if fault.end <= fault.onset:
                raise ScenarioError(f"{fw}.end: must be after the onset")
        fault.severity = parse_severity(fd.get("severity", "obvious"), f"{fw}.severity")
        sc.mig_faults.append(fault)


def _parse_jobs(sc: Scenario, jobs: dict[str, Any], node_names: set[str], w: str) -> None:
    _check_keys(jobs, {"auto", "fill", "mean_hours", "max_nodes", "noisy_fraction", "fixed"}, w)
    sc.auto_jobs = _get(jobs, "auto", bool, w, False)
    sc.fill = _get(jobs, "fill", float, w, 0.85)
    if not 0.0 < sc.fill <= 1.0:
        raise ScenarioError(f"{w}.fill: must be in (0, 1]")
    sc.mean_hours = _positive(_get(jobs, "mean_hours", float, w, 6.0), f"{w}.mean_hours")
    sc.max_nodes = int(_positive(_get(jobs, "max_nodes", int, w, 16), f"{w}.max_nodes"))
    sc.noisy_fraction = _get(jobs, "noisy_fraction", float, w, 0.1)
    ids = set()
    for i, j in enumerate(_get(jobs, "fixed", list, w, [])):
        jw = f"{w}.fixed[{i}]"
        if not isinstance(j, dict):
            raise ScenarioError(f"{jw}: expected a table")
        _check_keys(j, {"id", "nodes", "start", "end", "parallel", "compute_s", "intensity", "grad_gb", "noise",
                        "kind", "checkpoint_every", "checkpoint_seconds", "evals"}, jw)
        spec = JobSpec(id=_get(j, "id", str, jw, f"job-{i + 1:04d}"))
        if spec.id in ids:
            raise ScenarioError(f"{jw}.id: duplicate job id {spec.id!r}")
        ids.add(spec.id)
        nodes = j.get("nodes", "all")
        if isinstance(nodes, list):
            bad = [n for n in nodes if n not in node_names]
            if bad or not nodes:
                raise ScenarioError(f"{jw}.nodes: unknown node(s) {bad!r}" if bad else f"{jw}.nodes: empty")
        elif isinstance(nodes, int) and not isinstance(nodes, bool):
            if not 1 <= nodes <= len(node_names):
                raise ScenarioError(f"{jw}.nodes: must be between 1 and {len(node_names)}")
        elif nodes != "all":
            raise ScenarioError(f"{jw}.nodes: expected \"all\", a node count or a list of node names")
        spec.nodes = nodes
        spec.start = parse_duration(j.get("start", 0), f"{jw}.start")
        spec.end = parse_duration(j["end"], f"{jw}.end") if "end" in j else None
        spec.parallel = _get(j, "parallel", str, jw, "data")
        if spec.parallel not in ("data", "hybrid"):
            raise ScenarioError(f"{jw}.parallel: must be \"data\" or \"hybrid\"")
        for key in ("compute_s", "intensity", "grad_gb", "noise"):
            setattr(spec, key, _get(j, key, float, jw, getattr(spec, key)))
        spec.kind = _get(j, "kind", str, jw, "training")
        if spec.kind not in ("training", "inference"):
            raise ScenarioError(f"{jw}.kind: must be \"training\" or \"inference\"")
        spec.checkpoint_every = parse_duration(j.get("checkpoint_every", 0), f"{jw}.checkpoint_every")
        spec.checkpoint_seconds = parse_duration(j.get("checkpoint_seconds", 60), f"{jw}.checkpoint_seconds")
        for k, ev in enumerate(_get(j, "evals", list, jw, [])):
            if not isinstance(ev, list) or len(ev) != 2:
                raise ScenarioError(f"{jw}.evals[{k}]: expected [start, end]")
            a, b = (parse_duration(x, f"{jw}.evals[{k}]") for x in ev)
            if b <= a:
                raise ScenarioError(f"{jw}.evals[{k}]: end must be after start")
            spec.evals.append((a, b))
        if spec.compute_s <= 0 or not 0.0 < spec.intensity <= 1.0:
            raise ScenarioError(f"{jw}: compute_s must be > 0 and intensity in (0, 1]")
        sc.jobs.append(spec)


def _parse_fault(fd: object, node_names: set[str], site_names: set[str], sc: Scenario, w: str) -> FaultSpec:
    if not isinstance(fd, dict):
        raise ScenarioError(f"{w}: expected a table")
    _check_keys(fd, {"kind", "onset", "end", "severity", "site", "node", "gpu", "nic", "precursor"}, w)
    kind = _get(fd, "kind", str, w)
    if kind not in FAULTS:
        raise ScenarioError(f"{w}.kind: unknown fault {kind!r}; known: {', '.join(FAULTS)}")
    spec = FaultSpec(kind=kind, onset=parse_duration(fd.get("onset", 0), f"{w}.onset"))
    if "end" in fd:
        spec.end = parse_duration(fd["end"], f"{w}.end")
        if spec.end <= spec.onset:
            raise ScenarioError(f"{w}.end: must be after the onset")
    spec.severity = parse_severity(fd.get("severity", "obvious"), f"{w}.severity")
    if "precursor" in fd:
        if not FAULTS[kind].has_precursor:
            raise ScenarioError(f"{w}.precursor: fault {kind!r} has no early warning; only "
                                f"{', '.join(k for k, c in FAULTS.items() if c.has_precursor)} take a precursor")
        spec.precursor = parse_duration(fd["precursor"], f"{w}.precursor")
        if spec.precursor > spec.onset:
            raise ScenarioError(f"{w}.precursor: must not start before the scenario (at most the onset)")
    target = FAULTS[kind].target
    if target == "site":
        spec.site = _get(fd, "site", str, w, sc.sites[0].name)
        if spec.site not in site_names:
            raise ScenarioError(f"{w}.site: unknown site {spec.site!r}")
        return spec
    spec.node = _get(fd, "node", str, w)
    if spec.node is None:
        raise ScenarioError(f"{w}.node: fault {kind!r} needs a node")
    if spec.node not in node_names:
        raise ScenarioError(f"{w}.node: unknown node {spec.node!r}")
    gpn = sc.sites[0].gpus_per_node
    spec.gpu = _get(fd, "gpu", int, w)
    if spec.gpu is not None and not 0 <= spec.gpu < gpn:
        raise ScenarioError(f"{w}.gpu: must be between 0 and {gpn - 1}")
    if target == "gpu" and spec.gpu is None and kind not in ("hbm_ecc",):
        spec.gpu = 0 if kind in ("xid79", "pcie_downgrade", "nvlink_down", "clock_stuck_low") else None
    spec.nic = _get(fd, "nic", int, w)
    if spec.nic is not None and not 0 <= spec.nic <= gpn:
        raise ScenarioError(f"{w}.nic: must be between 0 and {gpn}")
    if target == "nic" and spec.nic is None:
        spec.nic = spec.gpu if spec.gpu is not None else 0
    return spec


def _read_document(p: Path) -> dict[str, Any]:
    """A scenario file's table: TOML, or YAML (same schema) for ``.yaml``/``.yml`` when PyYAML is installed."""
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ScenarioError(f"{p}: cannot read: {e.strerror or e}") from e
    if p.suffix in (".yaml", ".yml"):
        try:
            import yaml  # optional: PyYAML
        except ImportError:
            raise ScenarioError(f"{p}: YAML scenarios need PyYAML (pip install pyyaml); or use TOML") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ScenarioError(f"{p}: not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ScenarioError(f"{p}: a scenario is a mapping at the top level")
        return data
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{p}: not valid TOML: {e}") from e


def load_file(path: str | Path) -> Scenario:
    p = Path(path)
    return parse_scenario(_read_document(p), str(p))


def builtin_names() -> list[str]:
    root = resources.files("gpufleet.sim") / "scenarios"
    return sorted(p.name.removesuffix(".toml") for p in root.iterdir() if p.name.endswith(".toml"))


def builtin_text(name: str) -> str:
    return (resources.files("gpufleet.sim") / "scenarios" / f"{name}.toml").read_text(encoding="utf-8")


def load_scenario(name_or_path: str | Path, *, nodes: int | None = None, gpus_per_node: int | None = None,
                  hours: float | None = None, step: float | None = None, seed: int | None = None) -> Scenario:
    """A built-in scenario by name or a TOML file by path, with optional overrides."""
    text_name = str(name_or_path)
    if text_name in builtin_names():
        data = tomllib.loads(builtin_text(text_name))
        source = f"built-in scenario {text_name!r}"
    elif Path(text_name).suffix in (".toml", ".yaml", ".yml") or Path(text_name).exists():
        p = Path(text_name)
        data = _read_document(p)
        source = str(p)
    else:
        raise ScenarioError(f"unknown scenario {text_name!r}: not a built-in ({', '.join(builtin_names())}) "
                            "nor a .toml file")
    if nodes is not None:
        if len(data.get("sites", [])) != 1:
            raise ScenarioError(f"{source}: --nodes needs a single-site scenario")
        data["sites"][0]["nodes"] = nodes
    if gpus_per_node is not None:
        for s in data.get("sites", []):
            s["gpus_per_node"] = gpus_per_node
    if hours is not None:
        data.pop("duration", None)
        data["hours"] = hours
    if step is not None:
        data["step"] = step
    if seed is not None:
        data["seed"] = seed
    return parse_scenario(data, source)


def describe(name: str) -> str:
    """The one-line description of a built-in scenario."""
    try:
        return str(tomllib.loads(builtin_text(name)).get("description", ""))
    except (OSError, tomllib.TOMLDecodeError):
        return ""
