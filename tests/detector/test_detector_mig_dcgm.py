"""MIG slices from dcgm-exporter's GPU-instance series (detector.rules.mig, the dcgm profile): each GPU_I_ID is a slice
with its GPU_I_PROFILE; its job is the hpc_job on its series, else the pod holding the MIG device (the exporter's own
pod label set aside when Prometheus renamed the workload's to exported_pod); the parent GPU is a GPU entity with
its device readings and its MIG layout, and a whole GPU beside it is untouched."""

from __future__ import annotations

import math

from test_detector_features import Fixed, lab

from gpufleet.detector.frame.features import NodeNaming, collect
from gpufleet.detector.rules.mig import slice_frame
from gpufleet.detector.sources.profiles import DCGM, DCGM_MIG, Query, queries
from gpufleet.vocab import exporters

H100 = "NVIDIA H100 80GB HBM3"
GI, PROF = exporters.DCGM_MIG_INSTANCE_LABEL, exporters.DCGM_MIG_PROFILE_LABEL


def _q(feature: str, metric: str, mig: bool) -> Query:
    """The dcgm query of ``feature`` on ``metric``, of GPU-instance series (``mig``) or of whole GPUs."""
    return next(q for q in (*DCGM, *DCGM_MIG) if q.feature == feature and q.metric == metric
                and (mig == any(k == GI and v == ".+" for k, _, v in q.matchers)))


def _slice(gi: str, **extra: str) -> dict[str, str]:
    return lab("a", "0", modelName=H100, **{PROF: "1g.10gb", GI: gi}, **extra)


#: GPU 0 of node a in MIG mode: gi 7 held by pod ml/train-0, gi 8 by ml/train-1 (seen by Prometheus as
#: exported_pod beside the exporter's own pod label), gi 9 by Slurm job 5001, gi 10 by nothing; GPU 1 whole.
SLICES = [_slice("7", namespace="ml", pod="train-0", container="c"),
          _slice("8", exported_namespace="ml", exported_pod="train-1", namespace="gpu-operator",
                 pod="dcgm-exporter-x1"),
          _slice("9", hpc_job="5001"), _slice("10")]
GR = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"


def _answers() -> dict[Query, list[tuple[dict[str, str], float]]]:
    whole = lab("a", "1", modelName=H100, hpc_job="77")
    return {
        _q("samples", "DCGM_FI_DEV_GPU_UTIL", False): [(whole, 20.0)],
        _q("util", "DCGM_FI_DEV_GPU_UTIL", False): [(whole, 97.0)],
        _q("@job", "DCGM_FI_DEV_GPU_UTIL", False): [(whole, 20.0)],
        _q("@model", "DCGM_FI_DEV_GPU_UTIL", False): [(whole, 97.0)],
        _q("samples", "DCGM_FI_DEV_SM_CLOCK", True): [(s, 20.0) for s in SLICES],
        _q("@model", "DCGM_FI_DEV_SM_CLOCK", True): [(s, 1980.0) for s in SLICES],
        _q("@mig", GR, True): [(s, 0.8) for s in SLICES],
        _q("sm_clock", "DCGM_FI_DEV_SM_CLOCK", False): [(s, 1980.0) for s in SLICES] + [(whole, 1980.0)],
        _q("sm_active", GR, False): [(whole, 0.9)],
        _q("@mig_info", GR, True): [(s, 0.8) for s in SLICES],
        _q("@mig_samples", GR, True): [(s, 20.0) for s in SLICES],
        _q("mig_sm_active", GR, True): [(s, 0.8) for s in SLICES],
        _q("@mig_job", GR, True): [(s, 20.0) for s in SLICES],
    }


def test_dcgm_gpu_instance_series_are_slices_with_their_jobs_and_pods() -> None:
    snap = collect(Fixed(_answers()), queries("dcgm"), 1000.0, 300.0, profile="dcgm", naming=NodeNaming())
    at = {(n, g): i for i, (n, g) in enumerate(zip(snap.gpu.nodes, snap.gpu.gpus, strict=True))}
    assert set(at) == {("a", "0"), ("a", "1")}
    parent, whole = at[("a", "0")], at[("a", "1")]
    assert snap.gpu.models[parent] == f"{H100} MIG 1g.10gb*4" and snap.gpu.models[whole] == H100
    assert snap.gpu.valid[parent] and snap.gpu.get("sm_clock")[parent] == 1980.0  # (Fixed applies no scale)
    assert math.isnan(snap.gpu.get("sm_active")[parent]) and snap.gpu.get("sm_active")[whole] == 0.9
    assert snap.gpu.jobs[parent] is None and snap.gpu.jobs[whole] == "77"
    sf = slice_frame(snap, NodeNaming())
    assert sf.keys == [("a", "0", "10"), ("a", "0", "7"), ("a", "0", "8"), ("a", "0", "9")]
    assert sf.profiles == ["1g.10gb"] * 4
    assert sf.jobs == [None, "train-0", "train-1", "5001"]
    assert sf.frame.pods == [None, "train-0", "train-1", None]
    assert sf.frame.namespaces == [None, "ml", "ml", None]
    assert sf.frame.gpus == ["0/10", "0/7", "0/8", "0/9"]
    assert sf.frame.models == [f"{H100} slice 1g.10gb"] * 4
    assert list(sf.frame.valid) == [True] * 4 and list(sf.frame.get("util")) == [0.8] * 4
    assert list(sf.frame.get("sm_clock")) == [1980.0] * 4  # the parent's clock, each slice's cause evidence


def test_a_fleet_without_mig_reports_no_missing_mig_input() -> None:
    def of_instances(q: Query) -> bool:
        return any(k == GI and op == "=~" for k, op, _ in q.matchers)

    answers = {q: v for q, v in _answers().items() if not of_instances(q)}
    snap = collect(Fixed(answers), queries("dcgm"), 1000.0, 300.0, profile="dcgm", naming=NodeNaming())
    plain = [q for q in queries("dcgm") if not of_instances(q)]
    assert len(plain) < len(queries("dcgm"))
    base = collect(Fixed(answers), plain, 1000.0, 300.0, profile="dcgm", naming=NodeNaming())
    assert snap.missing == base.missing and GR not in snap.missing  # the whole GPU's GR_ENGINE_ACTIVE is there
    assert snap.gpu.gpus == ["1"] and snap.gpu.models == [H100] and slice_frame(snap, NodeNaming()).keys == []
