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

import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from gpufleet.sim.fleet import GPU_MODELS
from gpufleet.sim.scenario_spec import (
    DEFAULT_START,
    FaultSpec,
    JobSpec,
    Scenario,
    ScenarioError,
    SiteSpec,
    check_keys,
    get_field,
    parse_duration,
    parse_severity,
    parse_time,
    positive,
)
from gpufleet.sim.scenario_tables import parse_fault, parse_jobs, parse_mig, parse_workloads
from gpufleet.sim.scraping import (
    COMPONENTS,
    ScrapeSpecError,
    parse_scrape,
)

#: The public names, wherever they are defined (callers import them from here).
__all__ = [
    "DEFAULT_START", "FaultSpec", "JobSpec", "Scenario", "ScenarioError", "SiteSpec", "builtin_names",
    "builtin_text", "describe", "load_file", "load_scenario", "parse_duration", "parse_scenario",
    "parse_severity", "parse_time",
]


def parse_scenario(data: dict[str, Any], source: str = "<scenario>") -> Scenario:
    """A validated :class:`Scenario` from a parsed TOML document (errors name ``source``)."""
    w = source
    check_keys(data, {"name", "description", "seed", "hours", "duration", "step", "start", "scrape_miss_rate",
                       "sites", "jobs", "faults", "heatwaves", "reboots", "blips", "exporter_restarts", "mig",
                       "mig_faults", "workloads", "scrape"}, w)
    sc = Scenario(name=get_field(data, "name", str, w, Path(source).stem))
    sc.description = get_field(data, "description", str, w, "")
    sc.seed = get_field(data, "seed", int, w, 0)
    if "hours" in data and "duration" in data:
        raise ScenarioError(f"{w}: give either hours or duration, not both")
    if "hours" in data:
        sc.duration = positive(get_field(data, "hours", float, w) * 3600.0, f"{w}.hours")
    elif "duration" in data:
        sc.duration = positive(parse_duration(data["duration"], f"{w}.duration"), f"{w}.duration")
    sc.step = positive(parse_duration(data.get("step", 15), f"{w}.step"), f"{w}.step")
    if sc.step > sc.duration:
        raise ScenarioError(f"{w}.step: {sc.step:g} s is longer than the duration ({sc.duration:g} s)")
    sc.start = get_field(data, "start", str, w)
    if sc.start is not None:
        parse_time(sc.start)
    sc.scrape_miss_rate = get_field(data, "scrape_miss_rate", float, w, None)
    if sc.scrape_miss_rate is not None and not 0.0 <= sc.scrape_miss_rate < 1.0:
        raise ScenarioError(f"{w}.scrape_miss_rate: must be in [0, 1)")
    try:
        sc.scrape = parse_scrape(get_field(data, "scrape", dict, w, {}), f"{w}.scrape")
    except ScrapeSpecError as e:
        raise ScenarioError(str(e)) from e
    sites = get_field(data, "sites", list, w)
    if not sites:
        raise ScenarioError(f"{w}: at least one [[sites]] table is required")
    for i, s in enumerate(sites):
        sw = f"{w}: sites[{i}]"
        if not isinstance(s, dict):
            raise ScenarioError(f"{sw}: expected a table")
        check_keys(s, {f.name for f in SiteSpec.__dataclass_fields__.values()}, sw)
        spec = SiteSpec(name=get_field(s, "name", str, sw, f"site-{i}"), nodes=int(get_field(s, "nodes", int, sw, 0)))
        if spec.nodes < 1:
            raise ScenarioError(f"{sw}.nodes: a site needs at least 1 node")
        spec.gpus_per_node = get_field(s, "gpus_per_node", int, sw, 8)
        if not 1 <= spec.gpus_per_node <= 16:
            raise ScenarioError(f"{sw}.gpus_per_node: must be between 1 and 16")
        spec.gpu_model = get_field(s, "gpu_model", str, sw, "H100-SXM")
        if spec.gpu_model not in GPU_MODELS:
            raise ScenarioError(f"{sw}.gpu_model: unknown model {spec.gpu_model!r}; known: {', '.join(GPU_MODELS)}")
        for key in ("nic_gbps", "outdoor_mean_c", "outdoor_amplitude_c", "pue", "utc_offset_h"):
            setattr(spec, key, get_field(s, key, float, sw, getattr(spec, key)))
        if spec.pue < 1.0:
            raise ScenarioError(f"{sw}.pue: a PUE is at least 1.0")
        sc.sites.append(spec)
    names = [s.name for s in sc.sites]
    if len(set(names)) != len(names):
        raise ScenarioError(f"{w}: site names must be unique")
    if len({s.gpus_per_node for s in sc.sites}) != 1:
        raise ScenarioError(f"{w}: all sites must use the same gpus_per_node")
    node_names = set(sc.node_names)
    parse_jobs(sc, get_field(data, "jobs", dict, w, {}), node_names, f"{w}: jobs")
    for i, fd in enumerate(get_field(data, "faults", list, w, [])):
        sc.faults.append(parse_fault(fd, node_names, set(names), sc, f"{w}: faults[{i}]"))
    for i, h in enumerate(get_field(data, "heatwaves", list, w, [])):
        hw = f"{w}: heatwaves[{i}]"
        if not isinstance(h, dict):
            raise ScenarioError(f"{hw}: expected a table")
        check_keys(h, {"site", "start", "end", "delta_c"}, hw)
        site = get_field(h, "site", str, hw, names[0])
        if site not in names:
            raise ScenarioError(f"{hw}.site: unknown site {site!r}")
        sc.heatwaves.append({"site": site, "start": parse_duration(h.get("start", 0), f"{hw}.start"),
                             "end": parse_duration(h.get("end", sc.duration), f"{hw}.end"),
                             "delta_c": get_field(h, "delta_c", float, hw, 8.0)})
    for i, r in enumerate(get_field(data, "reboots", list, w, [])):
        rw = f"{w}: reboots[{i}]"
        if not isinstance(r, dict):
            raise ScenarioError(f"{rw}: expected a table")
        check_keys(r, {"node", "at"}, rw)
        node = get_field(r, "node", str, rw)
        if node not in node_names:
            raise ScenarioError(f"{rw}.node: unknown node {node!r}")
        sc.reboots.append({"node": node, "at": parse_duration(r.get("at", 0), f"{rw}.at")})
    gpn = sc.sites[0].gpus_per_node
    for i, b in enumerate(get_field(data, "blips", list, w, [])):
        bw = f"{w}: blips[{i}]"
        if not isinstance(b, dict):
            raise ScenarioError(f"{bw}: expected a table")
        check_keys(b, {"counter", "node", "gpu", "nic", "at", "count"}, bw)
        counter = get_field(b, "counter", str, bw, "pcie_replay")
        if counter not in ("pcie_replay", "symbol_error"):
            raise ScenarioError(f"{bw}.counter: must be \"pcie_replay\" or \"symbol_error\"")
        node = get_field(b, "node", str, bw)
        if node not in node_names:
            raise ScenarioError(f"{bw}.node: unknown node {node!r}")
        where = "gpu" if counter == "pcie_replay" else "nic"
        idx = get_field(b, where, int, bw, 0)
        if not 0 <= idx <= gpn - (where == "gpu"):
            raise ScenarioError(f"{bw}.{where}: out of range")
        count = get_field(b, "count", int, bw, 1)
        if count < 1:
            raise ScenarioError(f"{bw}.count: must be at least 1")
        sc.blips.append({"counter": counter, "node": node, where: idx, "at": parse_duration(b.get("at", 0), f"{bw}.at"),
                         "count": count})
    for i, r in enumerate(get_field(data, "exporter_restarts", list, w, [])):
        rw = f"{w}: exporter_restarts[{i}]"
        if not isinstance(r, dict):
            raise ScenarioError(f"{rw}: expected a table")
        check_keys(r, {"node", "at", "seconds", "component"}, rw)
        node = get_field(r, "node", str, rw)
        if node not in node_names:
            raise ScenarioError(f"{rw}.node: unknown node {node!r}")
        component = get_field(r, "component", str, rw, "gpu")
        if component not in COMPONENTS:
            raise ScenarioError(f"{rw}.component: must be one of {', '.join(COMPONENTS)}, got {component!r}")
        sc.exporter_restarts.append({"node": node, "at": parse_duration(r.get("at", 0), f"{rw}.at"),
                                     "seconds": parse_duration(r.get("seconds", 60), f"{rw}.seconds"),
                                     "component": component})
    parse_mig(sc, data, w)
    sc.workloads = parse_workloads(data.get("workloads"), sc, w)
    return sc


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

