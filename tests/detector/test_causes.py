"""Fabric and host evidence of a straggler's cause (detector/rules/causes.py) and how the straggler scoring uses it."""

from __future__ import annotations

import numpy as np
import pytest

from gpufleet.detector.frame.features import GpuFrame
from gpufleet.detector.rules import straggler
from gpufleet.detector.rules.causes import CauseParams, collective_z, node_causes
from gpufleet.detector.rules.straggler import StragglerParams

NODES = [f"n{i}" for i in range(4)]


def frame(n_nodes: int = 4, *, slow_node: int | None = None, coll: dict[int, float] | None = None) -> GpuFrame:
    """One job of 8 GPUs per node; ``slow_node``'s GPUs idle 20 % more (a starved host)."""
    n = 8 * n_nodes
    rng = np.random.default_rng(3)
    vals = {"util": 0.97 + rng.normal(0, 0.004, n), "samples": np.full(n, 8.0),
            "sm_clock": 1.98e9 + rng.normal(0, 2e6, n), "tensor": 0.45 + rng.normal(0, 0.005, n),
            "power": 520 + rng.normal(0, 5, n), "temp": 60 + rng.normal(0, 1, n)}
    if slow_node is not None:
        sl = slice(8 * slow_node, 8 * slow_node + 8)
        vals["util"][sl] -= 0.2
        vals["tensor"][sl] -= 0.1
    if coll is not None:
        vals["coll_frac"] = np.full(n, 0.30) + rng.normal(0, 0.005, n)
        for i, v in coll.items():
            vals["coll_frac"][i] = v
    return GpuFrame([f"n{i // 8}" for i in range(n)], [str(i % 8) for i in range(n)], ["dc1"] * n, ["j"] * n,
                    ["H100"] * n, vals, np.ones(n, dtype=bool), np.zeros(n, dtype=bool))


def nodes(**per_feature: list[float]) -> dict[str, dict[str, float]]:
    return {nd: {f: v[i] for f, v in per_feature.items()} for i, nd in enumerate(NODES)}


def test_cpu_pressure_on_the_node_and_not_its_peers_is_host() -> None:
    got = node_causes(nodes(host_cpu_pressure=[0.01, 0.02, 0.45, 0.015]), frame(), CauseParams())
    assert got == {"n2": ("host", {"cpu_pressure": 0.45})}
    # the whole fleet under pressure singles out nobody; a little pressure is no cause
    assert node_causes(nodes(host_cpu_pressure=[0.4, 0.5, 0.45, 0.42]), frame(), CauseParams()) == {}
    assert node_causes(nodes(host_cpu_pressure=[0.001, 0.002, 0.06, 0.001]), frame(), CauseParams()) == {}


def test_pressure_that_began_inside_the_window_counts_from_its_latest_interval() -> None:
    # 40 % stalled since the latest scrape: a 120 s window's rate is 0.05 (below the minimum), its irate 0.4
    window, now = [0.01, 0.02, 0.05, 0.015], [0.01, 0.02, 0.4, 0.015]
    assert node_causes(nodes(host_cpu_pressure=window), frame(), CauseParams()) == {}
    got = node_causes(nodes(host_cpu_pressure=window, host_cpu_pressure_now=now), frame(), CauseParams())
    assert got == {"n2": ("host", {"cpu_pressure_now": 0.4})}
    # a latest interval alike on every node of the job (a job-wide burst) singles out no host
    alike = [0.38, 0.41, 0.4, 0.39]
    assert node_causes(nodes(host_cpu_pressure=window, host_cpu_pressure_now=alike), frame(), CauseParams()) == {}
    # the window's own reading, where it stands out, is the evidence named
    got = node_causes(nodes(host_cpu_pressure=[0.01, 0.02, 0.3, 0.015], host_cpu_pressure_now=now), frame(),
                      CauseParams())
    assert got == {"n2": ("host", {"cpu_pressure": 0.3})}


def test_steal_is_per_cpu() -> None:
    got = node_causes(nodes(host_steal=[0.2, 0.3, 19.2, 0.1], host_cpus=[192.0] * 4), frame(), CauseParams())
    assert list(got) == ["n2"] and got["n2"][0] == "host"
    assert got["n2"][1]["cpu_steal"] == pytest.approx(0.1)
    # without the CPU count steal cannot be judged
    assert node_causes(nodes(host_steal=[0.2, 0.3, 19.2, 0.1]), frame(), CauseParams()) == {}


def test_pfc_pause_and_drops_are_network() -> None:
    got = node_causes(nodes(node_pause=[0.0002, 0.0003, 0.3, 0.0001], host_cpu_pressure=[0.01, 0.01, 0.5, 0.01]),
                      frame(), CauseParams())
    assert got == {"n2": ("network", {"pfc_paused_fraction": 0.3})}  # the fabric explains the starved CPU
    got = node_causes(nodes(node_discards=[0.0, 0.0, 12.0, 0.0]), frame(), CauseParams())
    assert got == {"n2": ("network", {"nic_discards": 12.0})}
    assert node_causes(nodes(node_discards=[3.0, 2.0, 12.0, 4.0]), frame(), CauseParams()) == {}  # drops everywhere


def test_aer_needs_a_sustained_rate() -> None:
    # 2 reports in a 2-minute window: a blip, no cause; 1 per second: a marginal link
    blip = 2 / 120
    assert node_causes(nodes(node_aer_cor=[0.0, 0.0, blip, 0.0]), frame(), CauseParams()) == {}
    got = node_causes(nodes(node_aer_cor=[0.0, 0.0, 1.0, 0.0]), frame(), CauseParams())
    assert got == {"n2": ("pcie", {"aer_correctable_per_s": 1.0})}


def test_peers_are_the_nodes_of_the_same_job() -> None:
    """Two jobs: node n2's pressure is compared with n3 (its job), where everyone is under pressure."""
    f = frame()
    f.jobs[16:] = ["k"] * 16
    f.jobs[:16] = ["j"] * 16
    per = nodes(host_cpu_pressure=[0.01, 0.01, 0.45, 0.5])
    per["n4"] = {"host_cpu_pressure": 0.4}
    f.nodes.extend(["n4"] * 8)
    f.gpus.extend(str(i) for i in range(8))
    f.jobs.extend(["k"] * 8)
    assert node_causes(per, f, CauseParams()) == {}


def test_straggler_cause_uses_the_node_evidence() -> None:
    f = frame(slow_node=2)
    without = straggler.score(f, StragglerParams())
    assert {(c.node, c.cause) for c in without.candidates} == {("n2", "host")}  # util alone says host
    evidence = node_causes(nodes(node_pause=[0.0, 0.0, 0.3, 0.0]), f, CauseParams())
    with_ev = straggler.score(f, StragglerParams(), None, node_causes=evidence)
    [c] = with_ev.candidates
    assert (c.node, c.gpu, c.cause) == ("n2", None, "network")  # the node's ports were paused: the fabric
    assert c.evidence.values["pfc_paused_fraction"] == 0.3


def test_pause_storm_makes_link_stragglers_without_a_gpu_deviation() -> None:
    f = frame()
    assert straggler.score(f, StragglerParams()).candidates == []
    evidence = node_causes(nodes(node_pause=[0.0, 0.0, 0.3, 0.0]), f, CauseParams())
    [c] = straggler.score(f, StragglerParams(), None, node_causes=evidence).candidates
    assert (c.node, c.gpu, c.cause) == ("n2", None, "network")
    # host or PCIe evidence alone does not make a straggler of a rank that does not deviate
    evidence = node_causes(nodes(host_cpu_pressure=[0.01, 0.01, 0.5, 0.01]), f, CauseParams())
    assert straggler.score(f, StragglerParams(), None, node_causes=evidence).candidates == []


def test_collective_timing_names_the_rank_its_peers_wait_for() -> None:
    f = frame(coll={13: 0.05})  # every rank sits 30 % of the time in collectives; rank 13 hardly at all
    groups = np.zeros(len(f), dtype=np.int64)
    z = collective_z(f, groups)
    assert int(np.nanargmax(z)) == 13 and z[13] > 4
    res = straggler.score(f, StragglerParams())
    assert [(c.node, c.gpu) for c in res.candidates] == [("n1", "5")]
    assert np.isnan(collective_z(frame(), groups)).all()  # no traces: no opinion


def test_leave_one_out_medians_match_the_definition() -> None:
    """The one-sort leave-one-out median equals the median of the others, computed one by one (NaN = no value)."""
    from gpufleet.detector.rules.causes import _loo_median

    rng = np.random.default_rng(7)
    for n in (1, 2, 3, 4, 5, 8, 33):
        for _ in range(20):
            x = rng.choice([0.0, 0.5, 1.0, 2.0, 7.0, np.nan], size=n) + rng.normal(0, 0.01, n) * (rng.random() < 0.5)
            got = _loo_median(x)
            for i in range(n):
                others = np.delete(x, i)
                others = others[np.isfinite(others)]
                want = float(np.median(others)) if len(others) else np.nan
                assert (np.isnan(want) and np.isnan(got[i])) or got[i] == pytest.approx(want), (x, i)
