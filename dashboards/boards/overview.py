"""Fleet overview: GPUs by health, utilization and SM activity distributions, power and energy,
throttled GPUs, XID and ECC events, active detector findings."""

from __future__ import annotations

from gpufleet.dashboards import panels as p
from gpufleet.dashboards.panels import GPU_SEL, NODE, SITE, Q

F = GPU_SEL  # site, node and gpu matchers
THROTTLE = 'reason!~"gpu_idle|applications_clocks_setting|display_clock_setting"'


def _quantiles(name: str) -> list[Q]:
    return [Q(f"quantile({q}, {name}{{{F}}})", f"p{int(q * 100)}") for q in (0.1, 0.5, 0.9)] + [
        Q(f"min({name}{{{F}}})", "min")
    ]


dashboard = p.build(
    "overview", "gpufleet / Fleet overview",
    "Fleet health at a glance: GPUs up or lost, utilization and SM activity distributions, power, energy, "
    "throttling, XID and ECC events and the detector's active findings.",
    p.standard_vars(),
    [
        ("Health", [
            (p.stat("gpufleet_gpu_up", "GPUs up", f"sum(gpufleet_gpu_up{{{F}}})", op="count"), 4, 4),
            (p.stat("gpufleet_gpu_up", "GPUs lost", f"sum(1 - gpufleet_gpu_up{{{F}}})", op="count",
                    thresholds=(("green", None), ("red", 1))), 4, 4),
            (p.stat("gpufleet_gpus", "GPUs reported by NVML", f"sum(gpufleet_gpus{{{SITE},{NODE}}})",
                    op="count"), 4, 4),
            (p.stat("gpufleet_detector_finding", "Active findings",
                    f'count(gpufleet_detector_finding{{{SITE},{p.DET_NODE}}}) or vector(0) * '
                    f'count(gpufleet_detector_last_success_timestamp_seconds)', op="count",
                    note="Zero only when the detector is reporting.",
                    thresholds=(("green", None), ("orange", 1))), 4, 4),
            (p.stat("gpufleet_nvml_up", "Nodes with NVML down", f"sum(1 - gpufleet_nvml_up{{{SITE},{NODE}}})",
                    op="count", thresholds=(("green", None), ("red", 1))), 4, 4),
            (p.stat("gpufleet_gpu_energy_joules_total", "GPU energy in range",
                    f"sum(increase(gpufleet_gpu_energy_joules_total{{{F}}}[$__range]))", op="increase"), 4, 4),
            (p.timeseries("gpufleet_gpu_up", "GPUs by health",
                          [Q(f"sum by (site) (gpufleet_gpu_up{{{F}}})", "{{site}} up"),
                           Q(f"sum by (site) (1 - gpufleet_gpu_up{{{F}}})", "{{site}} lost")], op="count"), 24, 7),
        ]),
        ("Utilization", [
            (p.timeseries("gpufleet_gpu_utilization_ratio", "Utilization distribution",
                          _quantiles("gpufleet_gpu_utilization_ratio")), 12, 8),
            (p.timeseries("gpufleet_gpu_sm_active_ratio", "SM activity distribution",
                          _quantiles("gpufleet_gpu_sm_active_ratio"),
                          note="Utilization stays near 100% on every GPU of a job with a straggler; SM activity "
                               "and tensor activity show the difference."), 12, 8),
            (p.gpu_heatmap("gpufleet_gpu_sm_active_ratio", "SM activity per GPU",
                           f"gpufleet_gpu_sm_active_ratio{{{F}}}"), 24, 10),
        ]),
        ("Power and energy", [
            (p.timeseries("gpufleet_gpu_power_watts", "GPU power by site",
                          Q(f"sum by (site) (gpufleet_gpu_power_watts{{{F}}})", "{{site}}"), stack=True, fill=20),
             12, 8),
            (p.timeseries("gpufleet_gpu_energy_joules_total", "Average GPU power from energy counters",
                          Q(f"sum by (site) (rate(gpufleet_gpu_energy_joules_total{{{F}}}[$__rate_interval]))",
                            "{{site}}"), op="rate"), 12, 8),
        ]),
        ("Throttling and errors", [
            (p.timeseries("gpufleet_gpu_clock_event_active", "GPUs throttled, by reason",
                          Q(f"sum by (reason) (gpufleet_gpu_clock_event_active{{{F},{THROTTLE}}})", "{{reason}}"),
                          op="count", stack=True, fill=30), 12, 8),
            (p.timeseries("gpufleet_gpu_xid_errors_total", "XID events",
                          Q(f"sum by (instance, gpu, xid) (increase(gpufleet_gpu_xid_errors_total{{{F}}}"
                            "[$__rate_interval]))", "{{instance}} gpu {{gpu}} xid {{xid}}"), op="increase"), 12, 8),
            (p.timeseries("gpufleet_gpu_ecc_errors_total", "ECC errors",
                          Q(f"sum by (instance, gpu, error) (increase(gpufleet_gpu_ecc_errors_total"
                            f'{{{F},counter="volatile"}}[$__rate_interval]))', "{{instance}} gpu {{gpu}} {{error}}"),
                          op="increase"), 12, 8),
            (p.timeseries("gpufleet_gpu_row_remap_pending", "Row remap pending or failed",
                          [Q(f"sum(gpufleet_gpu_row_remap_pending{{{F}}})", "pending"),
                           Q(f"sum(gpufleet_gpu_row_remap_failure{{{F}}})", "failed")], op="count"), 12, 8),
        ]),
        ("Detector findings", [
            (p.table("gpufleet_detector_finding", "Active findings",
                     f"gpufleet_detector_finding{{{SITE},{p.DET_NODE}}}", links=[p.node_link()]), 24, 8),
        ]),
    ],
)
