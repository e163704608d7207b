"""The parsers of a scenario's tables beyond the fleet: ``[[workloads]]``, ``[[mig]]`` and ``[[mig_faults]]``,
``[jobs]`` and ``[[faults]]`` (:func:`gpufleet.sim.scenario.parse_scenario` calls them)."""

from __future__ import annotations

from typing import Any

from gpufleet.sim.faults import FAULTS
from gpufleet.sim.mig import MIG_FAULTS, MigFaultSpec, MigSpec, instance_ids, layout_of
from gpufleet.sim.scenario_spec import (
    FaultSpec,
    JobSpec,
    Scenario,
    ScenarioError,
    check_keys,
    get_field,
    parse_duration,
    parse_severity,
    positive,
)
from gpufleet.sim.workload_spec import KEYS, PATTERNS, WorkloadSpec


def parse_workloads(items: object, sc: Scenario, where: str) -> list[WorkloadSpec]:
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
        spec = WorkloadSpec(job=get_field(w, "job", str, ww, ""), pattern=get_field(w, "pattern", str, ww, ""))
        if spec.job not in jobs or jobs[spec.job].kind != "training":
            raise ScenarioError(f"{ww}.job: {spec.job!r} is not a training job of [[jobs.fixed]]")
        if spec.pattern not in PATTERNS:
            raise ScenarioError(f"{ww}.pattern: must be one of {', '.join(PATTERNS)}")
        spec.owner = get_field(w, "owner", str, ww, "")
        spec.extra = get_field(w, "extra", float, ww, spec.extra)
        if not 0.0 < spec.extra <= 3.0:
            raise ScenarioError(f"{ww}.extra: must be in (0, 3]")
        spec.sigma = get_field(w, "sigma", float, ww, spec.sigma)
        if not 0.0 < spec.sigma <= 0.5:
            raise ScenarioError(f"{ww}.sigma: must be in (0, 0.5]")
        js = jobs[spec.job]
        members = (list(range(len(names))) if js.nodes == "all" else list(range(js.nodes))
                   if isinstance(js.nodes, int) else sorted(names.index(n) for n in js.nodes))
        spec.stages = get_field(w, "stages", int, ww, spec.stages)
        if not 2 <= spec.stages <= len(members) * gpn:
            raise ScenarioError(f"{ww}.stages: must be between 2 and the job's GPUs ({len(members) * gpn})")
        spec.stage = get_field(w, "stage", int, ww, spec.stage)
        if not -spec.stages <= spec.stage < spec.stages:
            raise ScenarioError(f"{ww}.stage: must be a stage of the {spec.stages}")
        spec.node = get_field(w, "node", str, ww)
        if spec.node is not None and spec.node not in [names[n] for n in members]:
            raise ScenarioError(f"{ww}.node: {spec.node!r} is not a node of job {spec.job!r}")
        spec.gpu = get_field(w, "gpu", int, ww)
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
        spec.hot = get_field(w, "hot", int, ww, spec.hot)
        if not 1 <= spec.hot <= gpn:
            raise ScenarioError(f"{ww}.hot: must be between 1 and {gpn}")
        spec.move_every = parse_duration(w.get("move_every", spec.move_every), f"{ww}.move_every")
        if spec.move_every <= 0:
            raise ScenarioError(f"{ww}.move_every: must be greater than 0")
        if spec.pattern == "hot_experts" and len(members) < 2:
            raise ScenarioError(f"{ww}: hot experts move between nodes: the job needs at least 2 nodes")
        out.append(spec)
    return out


def parse_mig(sc: Scenario, data: dict[str, Any], source: str) -> None:
    """``[[mig]]`` nodes and ``[[mig_faults]]``; a MIG node may not be in a whole-GPU job."""
    names = sc.node_names
    layouts: dict[str, list[str]] = {}
    for i, m in enumerate(get_field(data, "mig", list, source, [])):
        mw = f"{source}: mig[{i}]"
        if not isinstance(m, dict):
            raise ScenarioError(f"{mw}: expected a table")
        check_keys(m, {"node", "layout", "job", "activity"}, mw)
        spec = MigSpec(node=get_field(m, "node", str, mw, ""), layout=get_field(m, "layout", str, mw, ""),
                       job=get_field(m, "job", str, mw, ""), activity=get_field(m, "activity", float, mw, 0.75))
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
    for i, fd in enumerate(get_field(data, "mig_faults", list, source, [])):
        fw = f"{source}: mig_faults[{i}]"
        if not isinstance(fd, dict):
            raise ScenarioError(f"{fw}: expected a table")
        check_keys(fd, {"kind", "node", "gpu", "gpu_instance", "onset", "end", "severity"}, fw)
        kind = get_field(fd, "kind", str, fw, "mig_slice_slow")
        if kind not in MIG_FAULTS:
            raise ScenarioError(f"{fw}.kind: unknown MIG fault {kind!r}; known: {', '.join(MIG_FAULTS)}")
        node = get_field(fd, "node", str, fw, "")
        if node not in layouts:
            raise ScenarioError(f"{fw}.node: {node!r} is not a [[mig]] node")
        gpu = get_field(fd, "gpu", int, fw, 0)
        if not 0 <= gpu < gpn:
            raise ScenarioError(f"{fw}.gpu: must be between 0 and {gpn - 1}")
        gi = get_field(fd, "gpu_instance", int, fw)
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


def parse_jobs(sc: Scenario, jobs: dict[str, Any], node_names: set[str], w: str) -> None:
    check_keys(jobs, {"auto", "fill", "mean_hours", "max_nodes", "noisy_fraction", "fixed"}, w)
    sc.auto_jobs = get_field(jobs, "auto", bool, w, False)
    sc.fill = get_field(jobs, "fill", float, w, 0.85)
    if not 0.0 < sc.fill <= 1.0:
        raise ScenarioError(f"{w}.fill: must be in (0, 1]")
    sc.mean_hours = positive(get_field(jobs, "mean_hours", float, w, 6.0), f"{w}.mean_hours")
    sc.max_nodes = int(positive(get_field(jobs, "max_nodes", int, w, 16), f"{w}.max_nodes"))
    sc.noisy_fraction = get_field(jobs, "noisy_fraction", float, w, 0.1)
    ids = set()
    for i, j in enumerate(get_field(jobs, "fixed", list, w, [])):
        jw = f"{w}.fixed[{i}]"
        if not isinstance(j, dict):
            raise ScenarioError(f"{jw}: expected a table")
        check_keys(j, {"id", "nodes", "start", "end", "parallel", "compute_s", "intensity", "grad_gb", "noise",
                        "kind", "checkpoint_every", "checkpoint_seconds", "evals"}, jw)
        spec = JobSpec(id=get_field(j, "id", str, jw, f"job-{i + 1:04d}"))
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
        spec.parallel = get_field(j, "parallel", str, jw, "data")
        if spec.parallel not in ("data", "hybrid"):
            raise ScenarioError(f"{jw}.parallel: must be \"data\" or \"hybrid\"")
        for key in ("compute_s", "intensity", "grad_gb", "noise"):
            setattr(spec, key, get_field(j, key, float, jw, getattr(spec, key)))
        spec.kind = get_field(j, "kind", str, jw, "training")
        if spec.kind not in ("training", "inference"):
            raise ScenarioError(f"{jw}.kind: must be \"training\" or \"inference\"")
        spec.checkpoint_every = parse_duration(j.get("checkpoint_every", 0), f"{jw}.checkpoint_every")
        spec.checkpoint_seconds = parse_duration(j.get("checkpoint_seconds", 60), f"{jw}.checkpoint_seconds")
        for k, ev in enumerate(get_field(j, "evals", list, jw, [])):
            if not isinstance(ev, list) or len(ev) != 2:
                raise ScenarioError(f"{jw}.evals[{k}]: expected [start, end]")
            a, b = (parse_duration(x, f"{jw}.evals[{k}]") for x in ev)
            if b <= a:
                raise ScenarioError(f"{jw}.evals[{k}]: end must be after start")
            spec.evals.append((a, b))
        if spec.compute_s <= 0 or not 0.0 < spec.intensity <= 1.0:
            raise ScenarioError(f"{jw}: compute_s must be > 0 and intensity in (0, 1]")
        sc.jobs.append(spec)


def parse_fault(fd: object, node_names: set[str], site_names: set[str], sc: Scenario, w: str) -> FaultSpec:
    if not isinstance(fd, dict):
        raise ScenarioError(f"{w}: expected a table")
    check_keys(fd, {"kind", "onset", "end", "severity", "site", "node", "gpu", "nic", "precursor"}, w)
    kind = get_field(fd, "kind", str, w)
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
        spec.site = get_field(fd, "site", str, w, sc.sites[0].name)
        if spec.site not in site_names:
            raise ScenarioError(f"{w}.site: unknown site {spec.site!r}")
        return spec
    spec.node = get_field(fd, "node", str, w)
    if spec.node is None:
        raise ScenarioError(f"{w}.node: fault {kind!r} needs a node")
    if spec.node not in node_names:
        raise ScenarioError(f"{w}.node: unknown node {spec.node!r}")
    gpn = sc.sites[0].gpus_per_node
    spec.gpu = get_field(fd, "gpu", int, w)
    if spec.gpu is not None and not 0 <= spec.gpu < gpn:
        raise ScenarioError(f"{w}.gpu: must be between 0 and {gpn - 1}")
    if target == "gpu" and spec.gpu is None and kind not in ("hbm_ecc",):
        spec.gpu = 0 if kind in ("xid79", "pcie_downgrade", "nvlink_down", "clock_stuck_low") else None
    spec.nic = get_field(fd, "nic", int, w)
    if spec.nic is not None and not 0 <= spec.nic <= gpn:
        raise ScenarioError(f"{w}.nic: must be between 0 and {gpn}")
    if target == "nic" and spec.nic is None:
        spec.nic = spec.gpu if spec.gpu is not None else 0
    return spec
