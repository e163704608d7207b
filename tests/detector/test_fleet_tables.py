"""The per-GPU tables made again after every change of the fleet, made in array passes, are the tables their
rules describe (each checked against the plain reading, a Python pass per GPU, on fleets hypothesis draws)."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import replace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.detector import engine
from gpufleet.detector.frame import nic_map
from gpufleet.detector.frame.frames import GpuFrame, NicFrame
from gpufleet.detector.rules import causes, network, phases, straggler
from gpufleet.detector.rules.network import NetworkParams

JOBS = st.sampled_from(["j1", "j2", "j3", "", None])
FLEET = st.lists(st.tuples(st.sampled_from(["n0", "n1", "n2", "n3"]), JOBS,
                           st.sampled_from(["H200", "B200", "H200 MIG 1g.18gb"]), st.sampled_from(["ns", "", None])),
                 min_size=0, max_size=50)


def _node_numbers(nodes: list[str]) -> np.ndarray:
    """Each node's number as a frame of one table's entities has them (any integers, one per node)."""
    return np.array([int(n[1:]) * 3 + 1 for n in nodes], dtype=np.int64)


def _frame(gpus: list[tuple[str, str | None, str, str | None]]) -> GpuFrame:
    n = len(gpus)
    return GpuFrame([g[0] for g in gpus], [str(i) for i in range(n)], [""] * n, [g[1] for g in gpus],
                    [g[2] for g in gpus], {}, np.ones(n, dtype=bool), np.zeros(n, dtype=bool))


@settings(max_examples=200, deadline=None)
@given(FLEET, st.booleans())
def test_job_model_codes(gpus: list[tuple[str, str | None, str, str | None]], jobless: bool) -> None:
    jobs, models, spaces = [g[1] for g in gpus], [g[2] for g in gpus], [g[3] for g in gpus]
    index: dict[tuple[str, str, str], int] = {}
    want_code, want_peerless = [], []
    for job, space, model in zip(jobs, spaces, models, strict=True):
        want_peerless.append(" MIG " in model or (not job and not jobless))
        want_code.append(index.setdefault((job or "", (space or "") if job else "", model), len(index)))
    code, peerless = straggler._count_job_model_codes(jobs, spaces, models, jobless)
    assert code.tolist() == want_code and peerless.tolist() == want_peerless
    # no namespaces at all (not Kubernetes): as if every GPU's were None
    index.clear()
    want_code = [index.setdefault((job or "", "", model), len(index)) for job, model in zip(jobs, models, strict=True)]
    assert straggler._count_job_model_codes(jobs, [], models, jobless)[0].tolist() == want_code


@settings(max_examples=200, deadline=None)
@given(FLEET, st.lists(st.sampled_from(["n0", "n1", "n2", "n3", "n9"]), max_size=6))
def test_node_groups(gpus: list[tuple[str, str | None, str, str | None]], names: list[str]) -> None:
    frame = _frame(gpus)
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for nd, job in zip(frame.nodes, frame.jobs, strict=True):
        if job:
            counts[nd][job] += 1
    index: dict[str, int] = {}
    want = []
    for nd in names:
        jobs = counts.get(nd)
        want.append(index.setdefault(max(jobs, key=lambda j: jobs[j]), len(index)) if jobs else -1)
    assert causes._count_node_groups(names, frame).tolist() == want
    numbered = replace(frame, node_ids=_node_numbers(frame.nodes))  # a frame of one table's entities
    assert causes._count_node_groups(names, numbered).tolist() == want


@settings(max_examples=200, deadline=None)
@given(FLEET, st.data())
def test_job_members(gpus: list[tuple[str, str | None, str, str | None]], data: st.DataObject) -> None:
    jobs = [g[1] for g in gpus]
    ok = np.array(data.draw(st.lists(st.booleans(), min_size=len(jobs), max_size=len(jobs))), dtype=bool)
    by_job: dict[str, list[int]] = {}
    for i in np.flatnonzero(ok).tolist():
        if jobs[i]:
            by_job.setdefault(jobs[i] or "", []).append(i)
    want = {j: ix for j, ix in by_job.items() if len(ix) >= 2}
    got = engine._job_members(jobs, ok)
    assert list(got) == list(want)  # the same order: the phase check's keys follow it
    assert {j: v.tolist() for j, v in got.items()} == want


@settings(max_examples=200, deadline=None)
@given(FLEET, st.data())
def test_per_node_job_counts(gpus: list[tuple[str, str | None, str, str | None]], data: st.DataObject) -> None:
    nodes, jobs = [g[0] for g in gpus], [g[1] for g in gpus]
    scored = np.array(data.draw(st.lists(st.booleans(), min_size=len(jobs), max_size=len(jobs))), dtype=bool)
    want: dict[tuple[str, str | None], int] = defaultdict(int)
    for i in np.flatnonzero(scored).tolist():
        want[(nodes[i], jobs[i])] += 1
    assert straggler._per_node_job(nodes, jobs, scored) == dict(want)
    assert straggler._per_node_job(nodes, jobs, scored, _node_numbers(nodes)) == dict(want)


@settings(max_examples=200, deadline=None)
@given(FLEET)
def test_phase_members(gpus: list[tuple[str, str | None, str, str | None]]) -> None:
    jobs = [g[1] for g in gpus]
    want: dict[str, list[int]] = {}
    for i, job in enumerate(jobs):
        if job:
            want.setdefault(job, []).append(i)
    got = phases._members(jobs)
    assert list(got) == list(want) and got == want


NICS = st.lists(st.tuples(st.sampled_from(["n0", "n1", "n2"]), st.sampled_from(["mlx5_0", "mlx5_1", "bond0", "eth0"]),
                          st.sampled_from([(), ("0",), ("0", "1")]), st.sampled_from(["Ethernet", "InfiniBand", ""])),
                max_size=30)


@settings(max_examples=200, deadline=None)
@given(NICS, st.booleans(), st.sampled_from(["", "bond.*|eth0"]))
def test_fabric_ports(nics: list[tuple[str, str, tuple[str, ...], str]], with_layers: bool, storage: str) -> None:
    nodes, devices = [x[0] for x in nics], [x[1] for x in nics]
    gpus, layers = [x[2] for x in nics], [x[3] for x in nics]
    frame = NicFrame(nodes, devices, ["1"] * len(nics), [""] * len(nics), {}, gpus, layers if with_layers else [])
    serves = [bool(g) for g in gpus]
    mapped = {nd for nd, g in zip(nodes, serves, strict=True) if g}
    lay = layers if with_layers else [""] * len(nics)
    want = [g or not (layer == "Ethernet" or nd in mapped) for g, layer, nd in zip(serves, lay, nodes, strict=True)]
    if storage:
        want = [w and re.fullmatch(storage, d) is None for w, d in zip(want, devices, strict=True)]
    got = network._fabric_ports(frame, NetworkParams(storage_devices=storage))
    assert got.dtype == bool and got.tolist() == want
    numbered = replace(frame, node_ids=_node_numbers(nodes))
    assert network._fabric_ports(numbered, NetworkParams(storage_devices=storage)).tolist() == want


@settings(max_examples=200, deadline=None)
@given(NICS, st.data())
def test_layer_codes(nics: list[tuple[str, str, tuple[str, ...], str]], data: st.DataObject) -> None:
    layers = [x[3] for x in nics]
    busy = np.array(sorted(data.draw(st.sets(st.integers(0, max(len(nics) - 1, 0)), max_size=len(nics)))),
                    dtype=np.int64)
    index: dict[str, int] = {}  # the plain reading: each busy port's layer numbered by first appearance
    want = [index.setdefault(layers[j], len(index)) for j in busy.tolist()]
    got = network._layer_codes(layers, busy)
    assert got.dtype == np.int64 and got.tolist() == want


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 60), unique=True, max_size=40), st.data())
def test_moved_series(was: list[int], data: st.DataObject) -> None:
    """The series that came or went between two answers (a node's series dropped, added anywhere, the order kept)."""
    kept = [i for i in was if data.draw(st.booleans())]
    added = data.draw(st.lists(st.integers(61, 90), unique=True, max_size=8))
    now = list(kept)
    for a in added:
        now.insert(data.draw(st.integers(0, len(now))), a)
    got = nic_map._moved(np.array(was, dtype=np.int64), np.array(now, dtype=np.int64))
    assert got.tolist() == sorted(set(was) ^ set(now))
