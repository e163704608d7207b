"""MIG in the detector: a GPU's MIG layout joins its model and a GPU in MIG mode is never a whole-GPU straggler
peer; a fleet without MIG does not report the MIG input missing."""

from __future__ import annotations

import numpy as np
from test_detector_features import Q_JOB, Q_SAMPLES, Q_UTIL, Fixed, lab

from gpufleet.detector.frame.features import collect
from gpufleet.detector.rules.straggler import StragglerParams, _groups
from gpufleet.detector.sources.profiles import GPUFLEET, Query

Q_MODEL = next(q for q in GPUFLEET if q.feature == "@model")
Q_MIG = next(q for q in GPUFLEET if q.feature == "@mig")


def test_mig_layout_joins_the_model_and_mig_gpus_are_no_whole_gpu_peers() -> None:
    h100 = "NVIDIA H100 80GB HBM3"
    gpus = [("a", "0"), ("a", "1"), ("b", "0"), ("b", "1")]
    answers: dict[Query, list[tuple[dict[str, str], float]]] = {
        Q_SAMPLES: [(lab(n, g), 20.0) for n, g in gpus],
        Q_UTIL: [(lab(n, g), 0.9) for n, g in gpus],
        Q_JOB: [(lab(n, g, job_id="42"), 20.0) for n, g in gpus],
        Q_MODEL: [(lab(n, g, name=h100), 1.0) for n, g in gpus],
        # a/0 and b/0: 7 x 1g.10gb; a/1: 3g.40gb + 4 x 1g.10gb; b/1 not in MIG mode
        Q_MIG: [(lab(n, "0", gpu_instance=str(gi), profile="1g.10gb"), 1.0) for n in ("a", "b") for gi in range(7, 14)]
               + [(lab("a", "1", gpu_instance="2", profile="3g.40gb"), 1.0)]
               + [(lab("a", "1", gpu_instance=str(gi), profile="1g.10gb"), 1.0) for gi in range(9, 13)],
    }
    frame = collect(Fixed(answers), [Q_SAMPLES, Q_UTIL, Q_JOB, Q_MODEL, Q_MIG], t=1000.0, window=300.0)
    models = dict(zip(zip(frame.gpu.nodes, frame.gpu.gpus, strict=True), frame.gpu.models, strict=True))
    assert models == {("a", "0"): f"{h100} MIG 1g.10gb*7", ("b", "0"): f"{h100} MIG 1g.10gb*7",
                      ("a", "1"): f"{h100} MIG 1g.10gb*4+3g.40gb", ("b", "1"): h100}
    groups = _groups(frame.gpu, np.ones(4, dtype=bool), StragglerParams(min_peers=1))
    by = dict(zip(zip(frame.gpu.nodes, frame.gpu.gpus, strict=True), groups.tolist(), strict=True))
    # GPUs in MIG mode are never whole-GPU peers (their slices are, in detector.rules.mig); the whole GPU is
    assert by == {("a", "0"): -1, ("b", "0"): -1, ("a", "1"): -1, ("b", "1"): 0}
    assert "gpufleet_mig_device_info" not in frame.missing


def test_no_mig_fleet_reports_nothing_missing_for_mig() -> None:
    answers = {Q_SAMPLES: [(lab("a", "0"), 20.0)], Q_UTIL: [(lab("a", "0"), 0.5)]}
    frame = collect(Fixed(answers), [Q_SAMPLES, Q_UTIL, Q_MIG], t=1000.0, window=300.0)
    assert frame.missing == set()
    assert frame.gpu.models == [""]


def test_the_kubelet_pod_is_the_job_without_a_job_id() -> None:
    q_job, q_pod = (q for q in GPUFLEET if q.feature == "@job")
    assert (q_job.metric, q_pod.metric) == ("gpufleet_gpu_job_info", "gpufleet_gpu_pod_info")
    answers: dict[Query, list[tuple[dict[str, str], float]]] = {
        Q_SAMPLES: [(lab("a", g), 20.0) for g in "0123"],
        q_job: [(lab("a", "0", job_id="1234"), 20.0)],  # Slurm job from cgroups (or a mapping file)
        q_pod: [(lab("a", g, namespace="ml", pod="trainer-0", container="c"), 20.0) for g in "123"],
    }
    frame = collect(Fixed(answers), [Q_SAMPLES, q_job, q_pod, Q_MIG], t=1000.0, window=300.0, profile="gpufleet")
    assert frame.gpu.jobs == ["1234", "trainer-0", "trainer-0", "trainer-0"]
    assert frame.missing == set()
    empty = collect(Fixed({Q_SAMPLES: answers[Q_SAMPLES]}), [Q_SAMPLES, q_job, q_pod], t=1000.0, window=300.0)
    assert empty.missing == {"gpufleet_gpu_job_info"}  # no job attribution at all is still reported
