"""After the fleet changes (a node replaced, drained, back; a job restarted) the caches kept between evaluations,
edited rather than rebuilt (detector.frame.positions, detector.rules.nic_jobs, the baselines' slots by entity
code), give what a detector built fresh on the new fleet gives, and what the passes over every entity give."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from bench_churn import ChangingFleet

from gpufleet.detector.config import parse
from gpufleet.detector.core import memo
from gpufleet.detector.engine import Detector, Evaluation
from gpufleet.detector.rules import nic_jobs as nic_jobs_module

CFG = parse({"findings": {"open_after": 1}})


def _partition(codes: np.ndarray) -> list[tuple[int, ...]]:
    groups: dict[int, list[int]] = {}
    for i, c in enumerate(codes.tolist()):
        if c >= 0:
            groups.setdefault(c, []).append(i)
    return sorted(tuple(g) for g in groups.values())


def _changes(fleet: ChangingFleet) -> Iterator[str]:
    nodes = sorted({str(x) for x in fleet.inst[next(iter(fleet.inst))].tolist()})
    fleet.replace(nodes[3], "renamed-a:9445")
    yield "node replaced"
    fleet.drain(nodes[5])
    yield "node drained"
    fleet.restart_job("job-1", "job-1-restart")
    yield "job restarted"
    fleet.back(nodes[5])
    yield "node back"
    fleet.replace(nodes[9], "renamed-b:9445")
    fleet.drain(nodes[12])
    fleet.restart_job("job-2", "job-2-restart")
    yield "several at once"
    fleet.back(nodes[12])
    yield "node back (2)"


def _check_caches(det: Detector, ev: Evaluation) -> None:
    """The edited caches against the passes over every entity, on this evaluation's frames."""
    g, nic = ev.features.gpu, ev.features.nic
    assert g.codes is not None and nic.codes is not None  # the frames carry entity codes: the edit paths ran
    pos, by_node = det._gpu_index.pos, det._gpu_index.by_node
    expect = {k: i for i, k in enumerate(zip(g.nodes, g.gpus, strict=True))}
    assert len(pos) == len(expect) and all(pos[k] == i for k, i in expect.items())
    assert ("no-such-node", "0") not in pos
    groups: dict[str, list[int]] = {}
    for i, n in enumerate(g.nodes):
        groups.setdefault(n, []).append(i)
    assert sorted(by_node) == sorted(groups) and all(by_node[n].tolist() == ix for n, ix in groups.items())
    assert det._gpu_index.node_names == list(groups)
    assert [det._gpu_index.node_names[c] for c in det._gpu_index.node_code.tolist()] == g.nodes
    nics = det._nic_index.pos
    ids = [f"{d}/{p}" for d, p in zip(nic.devices, nic.ports, strict=True)]
    assert all((n, x) in nics for n, x in zip(nic.nodes, ids, strict=True)) and len(nics) == len(ids)
    assert (nic.nodes[0], "mlx5_99/1") not in nics
    with memo.scope({}):  # a pass over every NIC (no kept state)
        fresh = nic_jobs_module._codes(nic, g, range(len(nic.devices)), range(len(g.gpus)), {})
    with memo.scope(det._memos):
        kept = nic_jobs_module.nic_jobs(nic, g)
    assert _partition(kept) == _partition(fresh)
    refs = det.baseline.power_limit
    assert refs.update(list(zip(g.nodes, g.gpus, strict=True)), g.get("power_limit"), ev.t).tolist() == \
        det.baseline.gpu_power_limit(g.nodes, g.gpus, g.get("power_limit"), ev.t, g.codes, g.space).tolist()


@pytest.mark.parametrize("n", [1024])
def test_an_evaluation_after_each_change_finds_what_a_fresh_detector_finds(n: int) -> None:
    fleet = ChangingFleet(n)
    # a congested port on a node that is later replaced, and one on a node of a job that restarts: judged
    # against the ports of its own job (the NICs' jobs, edited)
    for q, r in fleet.results.items():
        if q.feature == "power_limit":  # GPUs of a node with limits of their own (each GPU's reference its own)
            r.values[:] = 600.0 + 50.0 * (np.arange(len(r.values)) % 3)
        if q.feature == "nic_xmit_wait":
            inst = fleet.inst[q]
            for node in ("node-00003:9445", "node-00040:9445"):
                r.values[np.flatnonzero(inst == node)[:1]] = 5e7
    det = Detector(CFG, fleet.src)
    t = 1_700_000_000.0
    for _ in range(2):
        det.evaluate(t)
        t += 60.0
    for step in _changes(fleet):
        ev = det.evaluate(t)
        fresh = Detector(CFG, fleet.src).evaluate(t)
        assert ev.candidates == fresh.candidates, step
        assert any(k == "network" for k, _ in ev.candidates), step  # the congested ports are found
        assert ev.features.gpu.nodes == fresh.features.gpu.nodes
        _check_caches(det, ev)
        again = det.evaluate(t + 60.0)  # then steady: the same
        assert again.candidates == ev.candidates, step
        t += 120.0
