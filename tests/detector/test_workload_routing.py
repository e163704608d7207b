"""Slowness the workload causes goes to the job's owner, once per job and pattern (detector/rules/workload.py, issue 19).

A dcgm-exporter fleet scraped at staggered offsets: one synchronous job on 6 nodes x 8 GPUs. Its busier ranks do
more work per step at full clocks (higher tensor activity and power, no reason, no error) while the others wait.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from gpufleet.detector.config import parse
from gpufleet.detector.engine import Detector
from gpufleet.detector.incidents.tracker import Finding
from gpufleet.detector.sources.memory import MemorySource

T0 = 1_800_000_000.0
SCRAPE = 30.0
NODES = 6
HW_SLOWDOWN = 0x8
#: (t, node, gpu) -> the rank's extra work (0: even), or None to make its clock stuck at half under HW slowdown
Busier = Callable[[float, int, int], float | None]


def _scrapes(duration: float, busier: Busier, rng: np.random.Generator
             ) -> Iterator[tuple[float, list[tuple[str, dict[str, str], float]], dict[str, str]]]:
    events = sorted((T0 + (node * 11.3) % SCRAPE + k * SCRAPE + rng.normal(0, 0.05), node)
                    for node in range(NODES) for k in range(int(duration // SCRAPE)))
    for t, node in events:
        extras = {g: busier(t, node, g) for g in range(8)}
        samples: list[tuple[str, dict[str, str], float]] = []
        for g in range(8):
            lb = {"gpu": str(g), "UUID": f"GPU-{node}-{g}", "modelName": "NVIDIA H100 80GB HBM3",
                  "Hostname": f"h-{node}", "namespace": "team-llm", "pod": f"llama-worker-{node}", "container": "c"}
            extra = extras[g]
            stuck = extra is None
            work = 1.0 + (extra or 0.0)
            clock = 990.0 if stuck else 1980.0 + rng.normal(0, 3.0)
            tensor = (0.75 if stuck else 0.55 * work) + rng.normal(0, 0.005)
            power = (450.0 if stuck else 560.0 * work) + rng.normal(0, 6.0)
            samples += [("DCGM_FI_DEV_GPU_UTIL", lb, 97.0 + rng.normal(0, 0.5)),
                        ("DCGM_FI_DEV_POWER_USAGE", lb, power), ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", lb, tensor),
                        ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", lb, min(0.99, 0.75 * work) + rng.normal(0, 0.004)),
                        ("DCGM_FI_DEV_SM_CLOCK", lb, clock), ("DCGM_FI_DEV_MEM_CLOCK", lb, 2619.0),
                        ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", lb, float(HW_SLOWDOWN if stuck else 0))]
        yield t, samples, {"instance": f"10.0.0.{node + 1}:9400", "job": "dcgm"}


def _run(busier: Busier, duration: float) -> list[Finding]:
    cfg = parse({"detector": {"profile": "dcgm", "interval_seconds": 15.0, "window_seconds": 120.0}})
    src = MemorySource()
    det = Detector(cfg, src)
    next_eval = T0 + 150.0
    for t, samples, target in _scrapes(duration, busier, np.random.default_rng(3)):
        while next_eval <= t:
            det.evaluate(next_eval)
            next_eval += cfg.interval_seconds
        src.add(t, samples, target)
    return det.tracker.all_findings()


def _routes(found: list[Finding]) -> list[tuple[str, str | None, str, str, str]]:
    return [(f.kind, f.cause, f.route, f.pattern, f.owner) for f in found]


def test_a_busier_pipeline_stage_is_one_ticket_for_the_owner() -> None:
    found = _run(lambda t, node, g: 0.3 if g >= 6 else 0.0, 1500.0)  # the last stage: GPUs 6, 7 of every node
    assert _routes(found) == [("straggler", "workload", "workload", "stage_imbalance", "team-llm")]
    assert found[0].job == "llama-worker-0" or found[0].job  # the job (here each pod, without kube-state-metrics)


def test_a_data_skew_episode_and_moving_hot_experts_are_told_apart() -> None:
    def skew(t: float, node: int, g: int) -> float:
        return 0.35 if node == 2 and T0 + 600 <= t < T0 + 1800 else 0.0

    def experts(t: float, node: int, g: int) -> float:
        hot = int((t - T0 - 600) // 360) % NODES if t >= T0 + 600 else -1
        return 0.4 if node == hot and g in (1, 2) else 0.0

    skewed = _run(skew, 2100.0)
    assert {(f.route, f.pattern) for f in skewed} == {("workload", "data_skew")}
    moving = _run(experts, 2400.0)
    assert {(f.route, f.pattern) for f in moving} == {("workload", "hot_experts")}
    assert not [f for f in skewed + moving if f.route == "hardware"]


def test_a_clock_stuck_gpu_in_the_busier_stage_is_still_paged_with_its_cause() -> None:
    def stage_and_fault(t: float, node: int, g: int) -> float | None:
        if node == 4 and g == 7 and t >= T0 + 900:
            return None  # stuck at half clock under HW slowdown
        return 0.3 if g >= 6 else 0.0

    found = _run(stage_and_fault, 1500.0)
    hardware = {(f.kind, f.node, f.gpu, f.cause) for f in found if f.route == "hardware"}
    assert hardware and all(node == "10.0.0.5" and cause == "clock" for _, node, _, cause in hardware)
    assert ("throttling", "10.0.0.5", "7", "clock") in hardware
    assert {(f.route, f.pattern) for f in found if f.route == "workload"} == {("workload", "stage_imbalance")}


def _router_patterns(spans: dict[str, tuple[float, float]], until: float) -> set[str]:
    """WorkloadRouter alone: node -> (from, to) seconds of the job's start in which the node holds a busier spot."""
    from gpufleet.detector.core.candidate import Candidate
    from gpufleet.detector.rules.workload import WorkloadRouter

    router, patterns = WorkloadRouter(120.0), set()
    for k in range(int(until // 15)):
        t = T0 + 15 * k
        cands = [("straggler", Candidate(n, None, "job-pp", "s", "workload", 5.0)) for n, (a, b) in spans.items()
                 if a <= t - T0 < b]
        patterns |= {c.pattern for _, c in router.route(cands, t)}
    return patterns


def test_a_stage_whose_nodes_show_one_after_another_while_it_settles_is_no_hot_expert() -> None:
    # gpufleet-sim's `workload` scenario, full series: the busier stage's second node stands out 75 s after the
    # first, which then drops below the threshold for a while: no spot moved to a new node, the stage settled.
    assert _router_patterns({"node-006": (0, 300), "node-007": (75, 1800)}, 1800) == {"stage_imbalance"}
    # the same hand-over once the job has settled is hot experts moving
    assert _router_patterns({"node-006": (0, 600), "node-007": (630, 1800)}, 1800) == {"hot_experts"}
