"""Issue 31: normal is what the job and the site intend. Each mechanism with a control that fails without it.

- ports are judged against the ports of their own job: a traffic pattern every port of a job shares (all-to-all
  incast) is the job's, a subset of the job's ports doing worse is congestion;
- a power cap set alike on a whole job is policy (no throttled straggler), a GPU capped below its job is a
  fault with its direct cause; applications clocks likewise;
- a direct cause beats an inferred one over a finding's life; a GPU drawing more power than its peers is not
  power-limited; a link straggler's summary names its own evidence;
- lower utilization is a lag only where the GPU does less work too;
- the window holds four scrapes of the fleet's own interval; two nodes swinging in one window are a job edge,
  held a scrape interval past the last swing;
- an NVLink domain's finding absorbs its rack's NVLink stragglers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pytest

from gpufleet.detector.config import DetectorConfig
from gpufleet.detector.core.candidate import DIRECT, Candidate, Evidence
from gpufleet.detector.frame import cadence
from gpufleet.detector.frame.frames import GpuFrame, NicFrame
from gpufleet.detector.incidents.summary import summarize
from gpufleet.detector.incidents.tracker import Tracker
from gpufleet.detector.rules import cause_rules, fabric, network, phases, policy, straggler, throttling
from gpufleet.detector.rules.network import NetworkParams
from gpufleet.detector.rules.straggler import StragglerParams
from gpufleet.detector.rules.throttling import ThrottleParams
from gpufleet.detector.sources.profiles import Query, queries
from gpufleet.detector.sources.source import Result


def _gpus(nodes: int, per_node: int, jobs: Sequence[str | None], model: str = "NVIDIA B200") -> GpuFrame:
    n = nodes * per_node
    names = [f"n{i // per_node}" for i in range(n)]
    ids = [str(i % per_node) for i in range(n)]
    return GpuFrame(names, ids, [""] * n, list(jobs), [model] * n, {}, np.ones(n, dtype=bool),
                    np.zeros(n, dtype=bool))


# ---------------------------------------------------------------- ports: peers by job


def _fabric_ports(jobs: list[str | None], wait: list[float]) -> tuple[NicFrame, GpuFrame]:
    """One NIC per GPU (8 per node), each sending 10 GB/s, transmit-wait ticks per second as given."""
    n = len(jobs)
    g = _gpus(n // 8, 8, jobs)
    nic = NicFrame(list(g.nodes), [f"mlx5_{i}" for i in g.gpus], ["1"] * n, [""] * n,
                   {"nic_tx": np.full(n, 1e10), "nic_xmit_wait": np.asarray(wait, dtype=float),
                    "nic_rate": np.full(n, 5e10)}, [(x,) for x in g.gpus], ["InfiniBand"] * n)
    return nic, g


def test_an_all_to_all_jobs_ports_waiting_alike_are_its_pattern_not_congestion() -> None:
    # 6 nodes all-reduce (little wait), 2 nodes all-to-all: every one of its ports waits ~200x more, alike
    # (1000 ticks per MB sent, above the floor)
    jobs: list[str | None] = [*(["allreduce"] * 48), *(["moe"] * 16)]
    rng = np.random.default_rng(1)
    wait = np.r_[rng.uniform(5e4, 6e4, 48), rng.uniform(1.0e7, 1.1e7, 16)]
    nic, g = _fabric_ports(jobs, list(wait))
    assert network.find(nic, g, NetworkParams()) == []
    # the control: the same ports judged against alike ports fleet-wide (no job known) are all "congested"
    jobless = replace(g, jobs=[None] * 64)
    flagged = network.find(nic, jobless, NetworkParams())
    assert {c.node for c in flagged} == {"n6", "n7"}


def test_a_subset_of_a_jobs_ports_waiting_more_than_the_rest_is_congestion() -> None:
    jobs: list[str | None] = ["moe"] * 64
    rng = np.random.default_rng(2)
    wait = rng.uniform(1.0e7, 1.1e7, 64)
    wait[[12, 13, 14, 15]] *= 30  # four rails of one node behind an oversubscribed spine
    nic, g = _fabric_ports(jobs, list(wait))
    got = network.find(nic, g, NetworkParams())
    assert sorted((c.node, c.nic) for c in got) == [("n1", f"mlx5_{i}/1") for i in (4, 5, 6, 7)]
    assert all("xmit_wait" in c.evidence.flags for c in got)


def test_ports_of_a_job_too_small_to_judge_alone_fall_back_to_the_fleet() -> None:
    jobs: list[str | None] = ["big"] * 56 + [None] * 5 + ["tiny"] * 3
    wait = [5e4] * 64
    wait[62] = 1e7  # a port of the three-port job: judged against the fleet's jobless and small-job ports
    nic, g = _fabric_ports(jobs, wait)
    got = network.find(nic, g, NetworkParams())
    assert [(c.node, c.gpu) for c in got] == [("n7", "6")]


def test_the_job_aware_peer_groups_equal_a_per_port_key() -> None:
    rng = np.random.default_rng(4)
    for _ in range(200):
        n = int(rng.integers(0, 40))
        nic = NicFrame(["a"] * n, ["mlx5_0"] * n, ["1"] * n, [""] * n, {}, [("0",)] * n,
                       [str(x) for x in rng.choice(["InfiniBand", "Ethernet"], size=n)])
        cap = rng.choice([1e11, 2.5e10], size=n)
        job = rng.integers(-1, 4, size=n)
        busy = np.flatnonzero(rng.random(n) < 0.8)
        counts = {j: int((job[busy] == j).sum()) for j in set(job[busy].tolist()) if j >= 0}
        expected: dict[str, list[int]] = {}
        for i in busy.tolist():
            own = job[i] >= 0 and counts[int(job[i])] >= 4
            key = f"{job[i] if own else 'fleet'}|{nic.link_layers[i]}|{float(cap[i]):.2g}"
            expected.setdefault(key, []).append(i)
        got = network._peer_groups(nic, busy, cap, job, 4)
        assert sorted(x.tolist() for x in got) == sorted(expected.values())


# ---------------------------------------------------------------- policy: a site's cap on a whole job


def _capped_job(limit: list[float], clock: list[float], reason: list[float]) -> GpuFrame:
    """Two nodes of job "eco" (16 B200) plus one node of job "std" at the 1000 W default."""
    g = _gpus(3, 8, ["eco"] * 16 + ["std"] * 8)
    g.values.update({"power_limit": np.r_[limit, [1000.0] * 8], "sm_clock": np.r_[clock, [1.9e9] * 8],
                     "thr_power": np.r_[reason, [0.0] * 8], "util": np.full(24, 0.98)})
    return g


def test_a_cap_set_alike_on_a_whole_job_is_policy_and_throttles_no_one() -> None:
    clock = [1.75e9] * 14 + [1.62e9, 1.60e9]  # the leakier parts touch the same cap and clock lower
    g = _capped_job([800.0] * 16, clock, [0.0] * 14 + [1.0, 1.0])
    g.policy_cap = policy.capped_by_policy(g)
    assert g.policy_cap.tolist() == [True] * 16 + [False] * 8
    assert throttling.find(g, ThrottleParams()) == []
    # the control: without the policy the leaky parts are a power-throttled node (two of its GPUs)
    g.policy_cap = None
    assert [(c.node, c.gpu, c.cause, c.evidence.members) for c in throttling.find(g, ThrottleParams())] == [
        ("n1", None, "power", 2)]


def test_a_gpu_capped_below_its_job_is_a_fault_with_cause_power() -> None:
    limit = [800.0] * 15 + [600.0]
    clock = [1.75e9] * 15 + [1.40e9]
    g = _capped_job(limit, clock, [0.0] * 15 + [1.0])
    g.policy_cap = policy.capped_by_policy(g)
    assert not g.policy_cap[15] and g.policy_cap[:15].all()
    got = throttling.find(g, ThrottleParams())
    assert [(c.node, c.gpu, c.cause) for c in got] == [("n1", "7", "power")]


def test_a_job_whose_every_gpu_caps_alike_has_no_reference_to_be_held_below() -> None:
    # dcgm: no power limit exported; every GPU of the job caps, the fleet's other B200 do not
    g = _capped_job([np.nan] * 16, [1.6e9] * 16, [1.0] * 16)
    assert not policy.capped_by_policy(g).any()
    assert throttling.find(g, ThrottleParams()) == []


def test_applications_clocks_set_on_one_gpu_below_its_peers_are_cause_clock() -> None:
    g = _gpus(2, 8, ["j"] * 16, "NVIDIA H200")
    thr_app = np.zeros(16)
    thr_app[5] = 1.0
    clock = np.full(16, 1.98e9)
    clock[5] = 1.2e9
    g.values.update({"thr_app": thr_app, "sm_clock": clock, "util": np.full(16, 0.97)})
    got = throttling.find(g, ThrottleParams())
    assert [(c.gpu, c.cause) for c in got] == [("5", "clock")]
    view = cause_rules.GpuView(g, 5, {"sm_clock": -39.0}, cause_rules.Thresholds())
    causes, _, rules = cause_rules.evaluate(view)
    assert "thr_app" in rules and causes["clock"] > DIRECT
    # set alike on the whole job: no GPU is held below its peers
    g.values["thr_app"] = np.ones(16)
    g.values["sm_clock"] = np.full(16, 1.2e9)
    assert throttling.find(g, ThrottleParams()) == []


def test_a_gpu_drawing_more_power_than_its_peers_is_not_power_limited() -> None:
    g = _gpus(2, 8, ["j"] * 16)
    g.values.update({"thr_power": np.ones(16), "sm_clock": np.full(16, 1.7e9)})
    busier = cause_rules.GpuView(g, 3, {"power": 15.0, "sm_clock": -4.0, "tensor": 6.0}, cause_rules.Thresholds())
    causes, _, _ = cause_rules.evaluate(busier)
    assert "power" not in causes
    slower = cause_rules.GpuView(g, 3, {"power": -2.0, "sm_clock": -4.0}, cause_rules.Thresholds())
    assert cause_rules.evaluate(slower)[0]["power"] > DIRECT


# ---------------------------------------------------------------- evidence of its own, one answer


def _cand(cause: str, strength: float, score: float) -> Candidate:
    return Candidate("n1", "2", "j", "", cause, score, Evidence(causes={cause: strength}))


def test_a_direct_cause_beats_an_inferred_one_over_the_findings_life() -> None:
    tr = Tracker(open_after=2)
    tr.update(0.0, [("straggler", _cand("host", 8.0, 9.0))], lambda k: True)  # inferred: starved
    tr.update(15.0, [("straggler", _cand("host", 8.0, 9.0))], lambda k: True)
    for t in (30.0, 45.0):  # then the link retrains: direct evidence, a lower score
        tr.update(t, [("straggler", _cand("pcie", DIRECT + 5.0, 5.0))], lambda k: True)
    (f,) = tr.active.values()
    assert f.cause == "pcie" and f.other_causes() == ["host"]


def test_a_link_stragglers_summary_names_its_own_link() -> None:
    ev = Evidence(causes={"network": DIRECT + 5.0}, rules=("nic_flagged",), flags=("NIC mlx5_3/1: xmit_wait",))
    c = Candidate("n1", "3", "j", "", "network", 9.0, ev)
    assert "(its links: NIC mlx5_3/1: xmit_wait)" in summarize("straggler", c)
    bare = Candidate("n1", "3", "j", "", "pcie", 5.0, Evidence(causes={"pcie": 15.0}, rules=("pcie_replays",)))
    assert "(its links: pcie_replays)" in summarize("straggler", bare)


def _busy(n: int, jobs: list[str | None]) -> GpuFrame:
    g = _gpus(n // 8, 8, jobs, "NVIDIA H200")
    rng = np.random.default_rng(7)
    g.values.update({"util": rng.normal(0.9, 0.005, n), "util_last": np.full(n, 0.9),
                     "tensor": rng.normal(0.5, 0.005, n), "sm_active": rng.normal(0.7, 0.005, n),
                     "power": rng.normal(600.0, 3.0, n), "sm_clock": np.full(n, 1.98e9)})
    return g


def test_lower_utilization_at_the_same_work_per_second_lags_nobody() -> None:
    g = _busy(32, ["j"] * 32)
    g.values["util"][8:11] = 0.72  # an exporter sampling behind the scrape across an evaluation pass
    assert straggler.score(g, StragglerParams()).candidates == []
    g.values["tensor"][8:11] = 0.42  # starved: it does less work too
    g.values["sm_active"][8:11] = 0.6
    got = straggler.score(g, StragglerParams()).candidates
    assert got and got[0].node == "n1" and got[0].cause == "host"


def test_a_limit_set_below_its_job_peers_makes_a_straggler_at_once() -> None:
    g = _busy(32, ["j"] * 32)
    g.values["power_limit"] = np.full(32, 700.0)
    g.values["power_limit"][20] = 500.0
    g.values["thr_power"] = np.zeros(32)
    g.values["thr_power"][20] = 1.0  # it caps now; its window average clock has not fallen yet
    got = straggler.score(g, StragglerParams()).candidates
    assert [(c.gpu, c.node, c.cause) for c in got] == [("4", "n2", "power")]
    assert "power_limit" in got[0].evidence.deviations  # a deviation of its own, named in the summary


def test_a_replay_burst_is_pcie_evidence_with_or_without_link_state() -> None:
    # issue 31: a link that replays in bursts (before it retrains to x8) is cause pcie from the first burst,
    # whether or not the exporter also reports the link's width; a few replays are no evidence.
    g = _busy(32, ["j"] * 32)
    g.values.update({"pcie_gen": np.full(32, 5.0), "pcie_gen_max": np.full(32, 5.0),
                     "pcie_width": np.full(32, 16.0), "pcie_width_max": np.full(32, 16.0),
                     "pcie_replay": np.zeros(32)})
    g.values["pcie_replay"][13] = 3.0  # a blip
    assert straggler.score(g, StragglerParams()).candidates == []
    g.values["pcie_replay"][13] = 40.0  # a burst, the link still at x16
    got = straggler.score(g, StragglerParams()).candidates
    assert [(c.node, c.gpu, c.cause, c.evidence.rules) for c in got] == [("n1", "5", "pcie", ("pcie_replays",))]
    assert cause_rules.names_directly(got[0].evidence.rules, "pcie")
    g.values["pcie_width"][13] = 8.0  # retrained: the width below the maximum is the stronger evidence
    (c,) = straggler.score(g, StragglerParams()).candidates
    assert c.cause == "pcie" and c.evidence.rules == ("pcie_link_below_max",)


def test_host_pressure_and_a_latest_reading_below_the_peers_is_starvation_from_the_first_scrape() -> None:
    # issue 31: a stray process starves node n1's data loaders: its GPUs' latest utilization is below their peers'
    # at once, while the window's average has barely moved; the node's CPU pressure names the cause.
    g = _busy(32, ["j"] * 32)
    g.values["util_last"] = np.full(32, 0.9)
    g.values["util_last"][8:16] = 0.72
    g.values["util"][8:16] -= 0.01  # one scrape of eight in the window
    pressure = {"n1": ("host", {"cpu_pressure": 0.4})}
    got = straggler.score(g, StragglerParams(), node_causes=pressure).candidates
    assert [(c.node, c.gpu, c.cause, c.evidence.rules) for c in got] == [("n1", None, "host", ("host_starved",))]
    # the control: without the pressure a low reading is no evidence (a scrape's reading is noisy); with the
    # pressure but the GPUs' latest readings like their peers', nobody is starved
    assert straggler.score(g, StragglerParams()).candidates == []
    g.values["util_last"][8:16] = 0.9
    assert straggler.score(g, StragglerParams(), node_causes=pressure).candidates == []


def test_at_a_job_wide_edge_the_gpus_busy_now_are_judged() -> None:
    # the whole job checkpointed until a scrape ago: every window average is below busy_util, the latest readings
    # are busy again; a starved node shows among them (before, nobody was judged until the idle phase left the
    # window)
    g = _busy(32, ["j"] * 32)
    g.values["util"] = np.full(32, 0.45)
    g.values["util"][8:16] = 0.44
    g.values["util_last"] = np.full(32, 0.9)
    g.values["util_last"][8:16] = 0.7
    pressure = {"n1": ("host", {"cpu_pressure": 0.4})}
    edge = np.ones(32, dtype=bool)
    got = straggler.score(g, StragglerParams(), node_causes=pressure, edge=edge).candidates
    assert [(c.node, c.cause) for c in got] == [("n1", "host")]
    assert straggler.score(g, StragglerParams(), node_causes=pressure).candidates == []  # no edge: idle, unjudged


# ---------------------------------------------------------------- time: the fleet's own interval


class _Counts:
    """A source answering every query with each of 16 GPUs' sample count."""

    query_errors = 0

    def __init__(self, samples: int) -> None:
        self.samples = samples

    def query(self, query: Query, t: float, window: float) -> Result:
        n = 16
        return Result.from_pairs([({"instance": f"n{i}", "gpu": "0"}, float(self.samples)) for i in range(n)])


@pytest.mark.parametrize(("samples", "window"), [(8, 120.0), (4, 120.0), (2, 240.0), (1, 120.0)])
def test_the_window_holds_four_scrapes_of_the_fleets_own_interval(samples: int, window: float) -> None:
    cfg = DetectorConfig()
    assert cadence.fit_window(cfg, _Counts(samples), 1e9).window_seconds == window
    assert any(q.feature == "samples" for q in queries(cfg.profile))


def _swinging(nodes: int, swung: set[int]) -> GpuFrame:
    g = _gpus(nodes, 8, ["j"] * nodes * 8, "NVIDIA H200")
    umin = np.full(nodes * 8, 0.9)
    for n in swung:
        umin[n * 8:(n + 1) * 8] = 0.1
    g.values.update({"util_min": umin, "util_max": np.full(nodes * 8, 0.95)})
    return g


def test_two_nodes_swinging_in_one_window_are_a_job_edge_held_a_scrape_past_the_last() -> None:
    edges = phases.JobEdges()
    assert edges.update(_swinging(5, {1, 3}), 0.0, 60.0).all()  # a checkpoint two of five nodes' samples caught
    assert not phases.JobEdges().update(_swinging(5, {1}), 0.0, 60.0).any()  # one node's own trouble is no edge
    assert edges.update(_swinging(5, set()), 45.0, 60.0).all()  # the peers' windows may still hold it
    assert not edges.update(_swinging(5, set()), 60.0, 60.0).any()


# ---------------------------------------------------------------- one physical problem, one finding


def test_an_nvlink_domain_finding_absorbs_its_racks_nvlink_stragglers() -> None:
    places: fabric.Places = {"tray1": ("R1", 1), "tray2": ("R1", 2), "other": ("R2", 1), "rack R1": ("R1", None)}
    domain = Candidate("rack R1", None, None, "", "nvlink", 20.0, Evidence())
    res = fabric.FabricResult([("nvlink_domain", domain)], set(), {"rack R1"})
    strag = [("straggler", Candidate(n, None, "j", "", cause, 9.0, Evidence()))
             for n, cause in (("tray1", "nvlink"), ("tray2", "nvlink"), ("tray2", "thermal"), ("other", "nvlink"))]
    kept = fabric.absorb(strag, res, places)
    assert [(c.node, c.cause) for _, c in kept] == [("tray2", "thermal"), ("other", "nvlink")]


# ---------------------------------------------------------------- lock-step or independent replicas


def test_a_job_of_independent_replicas_is_read_from_its_swings_not_assumed() -> None:
    rng = np.random.default_rng(5)
    edges = phases.JobEdges()
    for k in range(phases.LOCKSTEP_HORIZON):  # bursty evaluation replicas on 6 trays: one swings at a time
        edges.update(_swinging(6, {int(rng.integers(6))} if k % 4 else set()), 15.0 * k, 15.0)
    assert edges.independent(_swinging(6, set())).all()
    steady = phases.JobEdges()
    for k in range(phases.LOCKSTEP_HORIZON):  # ranks in lock-step, one node's own trouble swinging it alone
        steady.update(_swinging(6, {2}), 15.0 * k, 15.0)
    assert not steady.independent(_swinging(6, set())).any()


def test_a_straggler_among_independent_replicas_needs_evidence_of_its_own() -> None:
    g = _busy(32, ["replicas"] * 32)
    g.values["tensor"][9] = 0.8  # busier than the others now: a replica's own burst, not a lagging rank
    g.values["sm_active"][9] = 0.95
    assert [c.gpu for c in straggler.score(g, StragglerParams()).candidates] == ["1"]  # judged in lock-step
    g.independent = np.ones(32, dtype=bool)
    assert straggler.score(g, StragglerParams()).candidates == []
    g.values["thr_thermal"] = np.zeros(32)
    g.values["thr_thermal"][9] = 1.0  # its own direct evidence still makes it one
    g.values["sm_clock"][9] = 1.6e9
    assert [(c.gpu, c.cause) for c in straggler.score(g, StragglerParams()).candidates] == [("1", "thermal")]


def test_a_live_window_too_short_for_the_interval_is_named_once_with_its_fix(
        caplog: pytest.LogCaptureFixture) -> None:
    g = _gpus(2, 8, ["j"] * 16)
    g.values["samples"] = np.full(16, 1.0)
    assert not cadence.warn_if_short(120.0, g)  # one sample tells no interval: read again later
    g.values["samples"] = np.full(16, 2.0)
    with caplog.at_level("WARNING", logger="gpufleet.detector"):
        assert cadence.warn_if_short(120.0, g)
    assert "set window_seconds = 240" in caplog.text


def test_a_window_widened_from_a_young_series_does_not_grow_without_end() -> None:
    g = _gpus(2, 8, ["j"] * 16)
    window = 120.0
    for samples in (1.0, 1.0, 2.0, 4.0, 4.0):  # a restart: one sample, then the scrapes fill the window
        g.values["samples"] = np.full(16, samples)
        window = cadence.wanted_window(window, g)
    assert window == 240.0
    g.values["samples"] = np.full(16, 2.0)  # a fleet scraped every few minutes: at most the widest window
    assert cadence.wanted_window(cadence.wanted_window(240.0, g), g) == cadence.MAX_WINDOW
