"""Job-wide phase edges read through staggered scrapes (detector/rules/phases.py, issue 25).

A dcgm-exporter + node_exporter fleet, each target scraped at its own offset inside the 30 s interval: one
training job on 6 nodes checkpoints (every rank idles together for 75 s while the storage bond bursts), then
runs an evaluation pass (every rank's power and tensor activity drop by a quarter). Nothing is wrong: no
finding. The same fleet with a GPU whose clock halves under a hardware-slowdown reason, starting right at the
checkpoint: found, with its cause. The controls show that the edges, not luck, keep the healthy fleet clean.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from gpufleet.detector.config import parse
from gpufleet.detector.engine import Detector
from gpufleet.detector.frame.frames import GpuFrame
from gpufleet.detector.incidents.tracker import Finding
from gpufleet.detector.rules import phases
from gpufleet.detector.sources.memory import MemorySource

T0 = 1_800_000_000.0
SCRAPE = 30.0
NODES = 6
CKPT = (T0 + 900.0, T0 + 975.0)  # the whole job checkpoints
EVAL = (T0 + 1500.0, T0 + 2100.0)  # an evaluation pass: lighter on every rank
HW_SLOWDOWN = 0x8


def _offset(node: int) -> float:
    """Each target's own offset inside the interval (as Prometheus spreads targets), in seconds."""
    return (node * 11.3) % SCRAPE


def _scrapes(duration: float, *, slow: tuple[int, int, float] | None, rng: np.random.Generator
             ) -> Iterator[tuple[float, list[tuple[str, dict[str, str], float]], dict[str, str]]]:
    """(time, samples, target labels) of every scrape of every node, in time order. ``slow``: (node, GPU,
    from): that GPU runs at half clock under HW slowdown from then on, and its job waits for it."""
    events = []
    for node in range(NODES):
        t = T0 + _offset(node)
        while t < T0 + duration:
            events.append((t + rng.normal(0, 0.05), node))
            t += SCRAPE
    tx = dict.fromkeys(range(NODES), 0.0)
    wait = dict.fromkeys(range(NODES), 0.0)
    last: dict[int, float] = {}
    for t, node in sorted(events):
        host = f"h-{node:02d}"
        ckpt = CKPT[0] <= t < CKPT[1]
        lighter = EVAL[0] <= t < EVAL[1]
        slowed = slow is not None and t >= slow[2]
        samples: list[tuple[str, dict[str, str], float]] = []
        for g in range(8):
            lb = {"gpu": str(g), "UUID": f"GPU-{node}-{g}", "modelName": "NVIDIA H100 80GB HBM3", "Hostname": host,
                  "namespace": "ml", "pod": f"llama-worker-{node}", "container": "main"}
            this_slow = slowed and slow is not None and (node, g) == slow[:2]
            if ckpt:
                util, power, tensor, clock = 3.0, 110.0, 0.0, 1980.0
            else:
                util = 97.0 + rng.normal(0, 1.0)
                power = (470.0 if lighter else 620.0) * (0.85 if slowed and not this_slow else 1.0)
                power += rng.normal(0, 8.0)
                tensor = (0.45 if lighter else 0.6) * (0.6 if slowed and not this_slow else 1.0)
                tensor += rng.normal(0, 0.005)
                clock = 990.0 if this_slow else 1980.0 + rng.normal(0, 3.0)
            reasons = HW_SLOWDOWN if this_slow and not ckpt else 0.0
            samples += [("DCGM_FI_DEV_GPU_UTIL", lb, util), ("DCGM_FI_DEV_POWER_USAGE", lb, power),
                        ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", lb, tensor), ("DCGM_FI_DEV_SM_CLOCK", lb, clock),
                        ("DCGM_FI_DEV_MEM_CLOCK", lb, 2619.0), ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", lb, 0.8),
                        ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", lb, float(reasons))]
        dt = t - last.get(node, t - SCRAPE)
        last[node] = t
        bond_rate = 2.0e10 if ckpt else 1.0e6  # the checkpoint goes to storage through the bond
        tx[node] += bond_rate * dt
        wait[node] += (4.0e7 * (8.0 if node == 4 else 1.0 + 0.1 * node) if ckpt else 10.0) * dt  # bursts wait, unevenly
        port = {"device": "mlx5_bond_0", "port": "1"}
        samples += [("node_infiniband_port_data_transmitted_bytes_total", port, tx[node]),
                    ("node_infiniband_port_transmit_wait_total", port, wait[node]),
                    ("node_infiniband_rate_bytes_per_second", port, 2.5e10)]
        yield t, samples, {"instance": f"10.0.0.{node + 1}:9400", "job": "dcgm"}


def _run(slow: tuple[int, int, float] | None = None, duration: float = 2400.0) -> list[Finding]:
    cfg = parse({"detector": {"profile": "dcgm", "interval_seconds": 15.0, "window_seconds": 120.0}})
    src = MemorySource()
    det = Detector(cfg, src)
    next_eval = T0 + 150.0
    for t, samples, target in _scrapes(duration, slow=slow, rng=np.random.default_rng(7)):
        while next_eval <= t:
            det.evaluate(next_eval)
            next_eval += cfg.interval_seconds
        src.add(t, samples, target)
    return det.tracker.all_findings()


def test_a_checkpoint_and_an_evaluation_pass_read_through_staggered_scrapes_raise_nothing() -> None:
    assert [(f.kind, f.node, f.gpu, f.cause) for f in _run()] == []


def test_without_the_edges_the_staggered_checkpoint_looks_like_stragglers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the same fleet with the job-edge state switched off raises straggler findings at the
    checkpoint's edges (healthy nodes many sigma apart only because they were scraped at other moments)."""
    monkeypatch.setattr(phases.JobEdges, "update", lambda self, frame, t=None, interval=0.0: np.zeros(len(frame), dtype=bool))
    found = _run(duration=1300.0)
    assert any(f.kind == "straggler" and CKPT[0] - 60 <= f.start <= CKPT[1] + 180 for f in found)


def test_a_storage_bond_bursting_at_a_checkpoint_is_no_congestion(monkeypatch: pytest.MonkeyPatch) -> None:
    """No topology (dcgm profile) says the bond serves no GPU: it is its timing (bursts while the job's GPUs
    idle at a checkpoint) that keeps it out of congestion. The control: judged regardless, one bond whose
    burst waited longer than its peers' is flagged for transmit-wait."""
    from gpufleet.detector import engine

    assert not [f for f in _run(duration=1300.0) if f.kind == "network"]
    monkeypatch.setattr(engine, "_quiet_nodes", lambda g, busy_util, index=None: set())
    assert [(f.kind, f.node, f.nic) for f in _run(duration=1300.0) if f.kind == "network"] == [
        ("network", "10.0.0.5", "mlx5_bond_0/1")]


def test_a_hardware_slowdown_that_starts_at_the_checkpoint_is_found_with_its_cause() -> None:
    found = _run(slow=(2, 5, CKPT[0] + 30.0), duration=1500.0)
    assert {(f.kind, f.node, f.gpu, f.cause) for f in found} <= {
        ("straggler", "10.0.0.3", "5", "clock"), ("throttling", "10.0.0.3", "5", "clock"),
        ("straggler", "10.0.0.3", None, "clock")}
    assert any(f.kind == "throttling" for f in found) and any(f.kind == "straggler" for f in found)
    first = min(f.opened for f in found)
    assert first <= CKPT[1] + 4 * SCRAPE  # within a few scrapes of the job computing again


def test_most_nodes_swinging_is_an_edge_until_none_swings() -> None:
    def frame(swinging: list[bool]) -> GpuFrame:
        n = len(swinging)
        umin = np.array([0.05 if s else 0.97 for s in swinging])
        values = {"util_min": umin, "util_max": np.full(n, 0.99), "power_min": np.full(n, 600.0),
                  "power_max": np.full(n, 620.0)}
        return GpuFrame([f"n{i}" for i in range(n)], ["0"] * n, [""] * n, ["job"] * n, ["H100"] * n, values,
                        np.ones(n), np.zeros(n))

    edges = phases.JobEdges()
    assert not edges.update(frame([True, False, False, False])).any()  # one node's own trouble: no edge
    assert edges.update(frame([True, True, True, False])).all()  # most nodes: the job is at an edge
    assert edges.update(frame([False, False, True, False])).all()  # it stays while any node still swings
    assert not edges.update(frame([False, False, False, False])).any()  # and ends when none does
