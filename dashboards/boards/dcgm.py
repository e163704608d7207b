"""Straggler view for fleets on dcgm-exporter + node_exporter (the detector's `dcgm` profile).

Same story as the job view, from DCGM_FI_* series; jobs come from dcgm-exporter's hpc_job label. Every
series name and label comes from :mod:`gpufleet.vocab.exporters`.
"""

from __future__ import annotations

from grafanalib import core as g

from gpufleet.dashboards import panels as p
from gpufleet.dashboards.panels import DET_NODE, NAMESPACE, SITE, Q
from gpufleet.vocab import exporters


def _sample(name: str) -> str:
    """The sample name of an external series (KeyError for a name the vocabulary does not list)."""
    return exporters.external(name).sample


SM_CLOCK = _sample("DCGM_FI_DEV_SM_CLOCK")
ENGINE_ACTIVE = _sample("DCGM_FI_PROF_GR_ENGINE_ACTIVE")
TENSOR_ACTIVE = _sample("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE")
POWER = _sample("DCGM_FI_DEV_POWER_USAGE")
GPU_TEMP = _sample("DCGM_FI_DEV_GPU_TEMP")
THROTTLE_REASONS = _sample("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS")
IB_XMIT_WAIT = _sample("node_infiniband_port_transmit_wait")
JOB = exporters.DCGM_JOB_LABEL

D = f'{SITE},{NAMESPACE},instance=~"$node(:[0-9]+)?",{JOB}=~"$job_id"'
PER_GPU = p.legend([JOB, "pod", "instance", "gpu"])


def _views(name: str, title: str) -> list[tuple[g.Panel, int, int]]:
    series = f"{name}{{{D}}}"
    return [
        (p.gpu_heatmap(name, f"{title} per GPU", Q(series, PER_GPU)), 12, 10),
        (p.timeseries(name, f"{title} against peers",
                      [Q(series, PER_GPU)] + [Q(f"quantile by ({JOB}) ({q}, {series})",
                                                f"{{{{{JOB}}}}} p{int(q * 100)}") for q in (0.1, 0.5, 0.9)],
                      note="Series p10/p50/p90 are the job's peer band."), 12, 10),
    ]


_TEMPLATES = [
    p.datasource_var(),
    p.site_var(SM_CLOCK),
    p.namespace_var(SM_CLOCK),
    p._query_var("job_id", f"Job ({JOB})", f"label_values({SM_CLOCK}{{{SITE}}}, {JOB})"),
    p.node_var(SM_CLOCK),
]

dashboard = p.build(
    "dcgm", "gpufleet / Stragglers (dcgm-exporter)",
    "For fleets running NVIDIA dcgm-exporter and node_exporter with gpufleet-detector's dcgm profile: each "
    "job's GPUs side by side and the detector's straggler findings.",
    _TEMPLATES,
    [
        ("Detector", [
            (p.timeseries("gpufleet_detector_straggler_score", "Straggler score",
                          f'gpufleet_detector_straggler_score{{{SITE},{DET_NODE},job_id=~"$job_id"}}',
                          links=[p.node_link("dcgm")]), 12, 9),
            (p.table("gpufleet_detector_finding", "Findings",
                     f'gpufleet_detector_finding{{{SITE},{DET_NODE},{NAMESPACE},job_id=~"$job_id"}}'), 12, 9),
        ]),
        ("SM clock", _views(SM_CLOCK, "SM clock")),
        ("Graphics engine activity", _views(ENGINE_ACTIVE, "Engine activity")),
        ("Tensor activity", _views(TENSOR_ACTIVE, "Tensor activity")),
        ("Power", _views(POWER, "Power")),
        ("Temperature", _views(GPU_TEMP, "GPU temperature")),
        ("Throttling and network", [
            (p.timeseries(THROTTLE_REASONS, "Throttle reasons bitmask (non-zero)",
                          Q(f"{THROTTLE_REASONS}{{{D}}} > 0", PER_GPU)), 12, 8),
            (p.timeseries(IB_XMIT_WAIT, "InfiniBand xmit_wait",
                          Q(f'rate({IB_XMIT_WAIT}{{{SITE},instance=~"$node(:[0-9]+)?"}}'
                            "[$__rate_interval])", "{{instance}} {{device}}/{{port}}"), op="rate"), 12, 8),
        ]),
    ],
)
