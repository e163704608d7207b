"""Job and straggler view: each job's GPUs side by side (per-GPU heatmaps and peer bands),
the detector's straggler scores, feature deviations and findings."""

from __future__ import annotations

from grafanalib import core as g

from gpufleet.dashboards import panels as p
from gpufleet.dashboards.panels import DET_NODE, JOB, NAMESPACE, NODE, SITE, Q

#: The selected jobs' GPUs; a GPU shared by several jobs appears once per job.
JOB_INFO = f"gpufleet_gpu_job_info{{{SITE},{JOB}}}"
DET = f"{SITE},{DET_NODE},{JOB}"
PER_GPU = "{{job_id}} {{instance}} gpu {{gpu}}"


def _of_job(name: str, extra: str = "") -> str:
    sel = ",".join(x for x in (SITE, NODE, extra) if x)
    return f"{JOB_INFO} * on (instance, gpu) group_left () {name}{{{sel}}}"


def _bands(name: str, extra: str = "") -> list[Q]:
    """Each GPU of the selected jobs against its job's median and 10th/90th percentiles."""
    series = _of_job(name, extra)
    return [Q(series, PER_GPU)] + [
        Q(f"quantile by (job_id) ({q}, {series})", f"{{{{job_id}}}} p{int(q * 100)}") for q in (0.1, 0.5, 0.9)
    ]


def _views(name: str, title: str, extra: str = "") -> list[tuple[g.Panel, int, int]]:
    return [
        (p.gpu_heatmap(name, f"{title} per GPU", Q(_of_job(name, extra), PER_GPU)), 12, 10),
        (p.timeseries(name, f"{title} against peers", _bands(name, extra),
                      note="Series p10/p50/p90 are the job's peer band."), 12, 10),
    ]


dashboard = p.build(
    "job", "gpufleet / Jobs and stragglers",
    "Each job's GPUs side by side. In a synchronous job every GPU waits for the slowest: utilization stays "
    "high everywhere, healthy peers drop power and tensor activity, and the straggler looks busier.",
    [*p.standard_vars(gpu=False)[:2], p.namespace_var(), *p.standard_vars(gpu=False)[2:]],
    [
        ("Detector", [
            (p.timeseries("gpufleet_detector_straggler_score", "Straggler score",
                          f"gpufleet_detector_straggler_score{{{DET}}}", links=[p.node_link()]), 12, 9),
            (p.timeseries("gpufleet_detector_feature_deviation", "Feature deviation (robust z)",
                          f"gpufleet_detector_feature_deviation{{{DET}}}"), 12, 9),
            (p.table("gpufleet_detector_finding", "Straggler and throttling findings",
                     f'gpufleet_detector_finding{{{DET},{NAMESPACE},kind=~"straggler|throttling"}}',
                     links=[p.node_link()]), 24, 7),
            (p.table("gpufleet_gpu_pod_info", "Kubernetes pods holding GPUs",
                     f"gpufleet_gpu_pod_info{{{SITE},{NODE},{NAMESPACE}}}", links=[p.node_link()]), 24, 7),
        ]),
        ("SM clock", _views("gpufleet_gpu_clock_hertz", "SM clock", 'clock="sm"')),
        ("SM activity", _views("gpufleet_gpu_sm_active_ratio", "SM activity")),
        ("Tensor activity", _views("gpufleet_gpu_tensor_active_ratio", "Tensor activity")),
        ("Power", _views("gpufleet_gpu_power_watts", "Power")),
        ("Temperature", _views("gpufleet_gpu_temperature_celsius", "GPU temperature", 'sensor="gpu"')),
        ("Utilization", _views("gpufleet_gpu_utilization_ratio", "Utilization")),
    ],
)
