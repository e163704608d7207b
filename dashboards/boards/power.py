"""Power and PUE: per-site PUE against expected, facility against IT power, energy."""

from __future__ import annotations

from gpufleet.dashboards import panels as p
from gpufleet.dashboards.panels import NODE, SITE, Q

dashboard = p.build(
    "power", "gpufleet / Power and PUE",
    "PUE per site (facility / IT power) against the detector's expected PUE for the IT load and weather; "
    "facility, IT and GPU power; energy.",
    [p.datasource_var(), p.site_var("gpufleet_site_it_power_watts"), p.node_var()],
    [
        ("PUE", [
            (p.timeseries("gpufleet_detector_site_pue", "PUE against expected",
                          [Q(f"gpufleet_detector_site_pue{{{SITE}}}", "{{site}} observed"),
                           Q(f"gpufleet_detector_site_pue_expected{{{SITE}}}", "{{site}} expected")]), 16, 9),
            (p.table("gpufleet_detector_finding", "PUE drift findings",
                     f'gpufleet_detector_finding{{{SITE},kind="pue_drift"}}'), 8, 9),
            (p.timeseries("gpufleet_site_outdoor_temperature_celsius", "Outdoor temperature",
                          Q(f"gpufleet_site_outdoor_temperature_celsius{{{SITE}}}", "{{site}}")), 12, 8),
        ]),
        ("Power", [
            (p.timeseries("gpufleet_site_facility_power_watts", "Facility against IT power",
                          [Q(f"gpufleet_site_facility_power_watts{{{SITE}}}", "{{site}} facility"),
                           Q(f"gpufleet_site_it_power_watts{{{SITE}}}", "{{site}} IT")]), 12, 8),
            (p.timeseries("gpufleet_node_gpu_power_watts", "GPU power per node",
                          Q(f"gpufleet_node_gpu_power_watts{{{SITE},{NODE}}}", "{{instance}}"), stack=True,
                          fill=20), 12, 8),
        ]),
        ("Energy", [
            (p.stat("gpufleet_node_gpu_energy_joules_total", "GPU energy in range",
                    f"sum(increase(gpufleet_node_gpu_energy_joules_total{{{SITE},{NODE}}}[$__range]))",
                    op="increase"), 8, 6),
            (p.timeseries("gpufleet_node_gpu_energy_joules_total", "GPU energy per hour by site",
                          Q(f"sum by (site) (increase(gpufleet_node_gpu_energy_joules_total{{{SITE},{NODE}}}[1h]))",
                            "{{site}}"), op="increase"), 16, 6),
        ]),
    ],
)
