"""detector/rules/fabric.py (issue 21) on hand-made inputs: the domain threshold, nodes outside a multi-node NVLink
domain, the dcgm profile's health mask, and the place (rack, tray) in summaries."""

from __future__ import annotations

from gpufleet.detector.core.candidate import Candidate
from gpufleet.detector.frame.features import NodeNaming
from gpufleet.detector.rules import fabric
from gpufleet.detector.sources.source import Result
from gpufleet.vocab import fabric as fb

NAMING = NodeNaming()
CLUSTER = "00000001-0000-0000-0000-000000000001"


def rack(trays: int = 18, sick: int = 0, cluster: str = CLUSTER) -> dict[str, Result]:
    """gpufleet-profile meta of one rack of ``trays`` x 4 GPUs, the first ``sick`` GPUs bandwidth-degraded."""
    info, plat, health, c2c, margin = [], [], [], [], []
    k = 0
    for t in range(trays):
        for g in range(4):
            base = {"instance": f"tray-{t:02d}:9445", "gpu": str(g), "site": "s1"}
            info.append(({**base, "cluster_uuid": cluster, "clique_id": "7"}, 1.0))
            plat.append(({**base, "chassis_serial": "RACK-A", "tray": str(t)}, 1.0))
            health.append(({**base, "condition": "bandwidth_degraded"}, 1.0 if k < sick else 0.0))
            health.append(({**base, "condition": "route_unhealthy"}, 0.0))
            c2c.append((base, 1.0))
            margin.append((base, 25.0))
            k += 1
    return {"@fab_info": Result.from_pairs(info), "@platform": Result.from_pairs(plat),
            "fab_health": Result.from_pairs(health), "c2c": Result.from_pairs(c2c), "margin": Result.from_pairs(margin)}


def kinds(res: fabric.FabricResult) -> list[tuple[str, str, str, str | None]]:
    return [(k, c.cause, c.node, c.gpu) for k, c in res.candidates]


def test_a_healthy_rack_has_no_candidate_and_is_observed() -> None:
    places: fabric.Places = {}
    res = fabric.find(rack(), NAMING, places)
    assert res.candidates == [] and res.observed("tray-03", "2") and res.observed("rack RACK-A", "")
    assert places["tray-03"] == ("RACK-A", 3)


def test_few_sick_gpus_are_gpu_findings_many_are_one_domain_finding() -> None:
    assert kinds(fabric.find(rack(sick=3), NAMING, {})) == [
        ("tray_health", "nvlink", "tray-00", str(g)) for g in range(3)]
    places: fabric.Places = {}
    res = fabric.find(rack(sick=18), NAMING, places)  # a quarter of 72
    assert kinds(res) == [("nvlink_domain", "nvlink", "rack RACK-A", None)]
    [(_, c)] = res.candidates
    assert c.evidence.members == 18 and c.evidence.values["trays"] == 5
    text = fabric.summarize("nvlink_domain", c, places)
    assert text.startswith("NVLink domain of rack RACK-A: 18 of 72 GPUs on 5 trays degraded")


def test_gpus_without_a_multi_node_domain_are_their_nodes_domain() -> None:
    """HGX hosts report cluster UUID 0: their NVLink domain is the node, never pooled with other nodes."""
    meta = rack(trays=6, sick=4, cluster="00000000-0000-0000-0000-000000000000")
    places: fabric.Places = {}
    res = fabric.find(meta, NAMING, places)
    assert kinds(res) == [("nvlink_domain", "nvlink", "tray-00", None)]
    assert fabric.summarize("nvlink_domain", res.candidates[0][1], places).startswith(
        "NVLink domain of node tray-00: 4 of 4 GPUs on 1 trays degraded")
    del meta["@platform"]
    assert kinds(fabric.find(meta, NAMING, {})) == [("nvlink_domain", "nvlink", "tray-00", None)]


def test_the_dcgm_profile_decodes_the_health_mask_and_names_the_clique() -> None:
    sick = fb.encode({"bandwidth_degraded": True, "route_recovery_in_progress": True})
    base = [{"instance": "tray-01:9400", "gpu": str(g), "Hostname": "tray-01"} for g in range(4)]
    meta = {"@fab_info": Result.from_pairs([(b, 3.0) for b in base]),
            "@platform": Result.from_pairs([(b, 1.0) for b in base]),
            "fab_mask": Result.from_pairs([(b, float(sick if b["gpu"] == "2" else fb.HEALTHY_MASK)) for b in base])}
    places: fabric.Places = {}
    res = fabric.find(meta, NAMING, places)
    assert kinds(res) == [("tray_health", "nvlink", "tray-01", "2")]
    text = fabric.summarize("tray_health", res.candidates[0][1], places)
    assert text == ("GPU 2 on tray-01 (tray 1 of rack clique 3): NVLink fabric health degraded "
                    "(bandwidth_degraded, route_recovery_in_progress)")


def test_c2c_and_margin_are_tray_findings_and_other_summaries_gain_the_place() -> None:
    meta = rack(trays=4)
    pairs = [(dict(lb), v) for lb, v in meta["margin"]]
    meta["margin"] = Result.from_pairs([(lb, 2.0 if lb["instance"] == "tray-01:9445" else v) for lb, v in pairs])
    pairs = [(dict(lb), v) for lb, v in meta["c2c"]]
    meta["c2c"] = Result.from_pairs([(lb, 0.0 if lb["instance"] == "tray-02:9445" else v) for lb, v in pairs])
    places: fabric.Places = {}
    assert kinds(fabric.find(meta, NAMING, places)) == [("tray_health", "thermal", "tray-01", None),
                                                        ("tray_health", "c2c", "tray-02", None)]
    summary = fabric.placed(lambda kind, c: f"{kind} on {c.node}", places)
    assert summary("straggler", Candidate("tray-01", "0", None, "s1", "thermal", 9.0)) == \
        "straggler on tray-01 [tray 1 of rack RACK-A]"
    assert summary("straggler", Candidate("h100-7", "0", None, "s1", "thermal", 9.0)) == "straggler on h100-7"
