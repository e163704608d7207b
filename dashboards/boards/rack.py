"""GB200/GB300 NVL72 racks (issue 21): trays x GPUs of each rack's NVLink domain.

Every per-GPU panel joins ``gpufleet_gpu_platform_info`` (chassis serial, tray) so rows read ``tray N / GPU g``
within a rack (``$rack``: chassis serials): NVLink fabric health, thermal margin, power, C2C, and the detector's
NVLink-domain and tray findings.
"""

from __future__ import annotations

from gpufleet.dashboards import panels as p
from gpufleet.dashboards.panels import NODE, SITE, Q

N = f"{SITE},{NODE}"
#: Join a per-GPU series with its rack placement (chassis serial and tray), restricted to the chosen racks.
PLACE = ('* on (instance, gpu) group_left (chassis_serial, tray) '
         'gpufleet_gpu_platform_info{chassis_serial=~"$rack"}')
ROW = "tray {{tray}} / GPU {{gpu}}"

dashboard = p.build(
    "rack", "gpufleet / NVL72 racks",
    "One rack's NVLink domain: each tray's GPUs side by side (fabric health, thermal margin, power, C2C) and "
    "the detector's NVLink domain and tray findings.",
    [*p.standard_vars(job=False, gpu=False),
     p._query_var("rack", "Rack (chassis serial)", "label_values(gpufleet_gpu_platform_info, chassis_serial)")],
    [
        ("Findings", [
            (p.table("gpufleet_detector_finding", "NVLink domain and tray findings",
                     'gpufleet_detector_finding{kind=~"nvlink_domain|tray_health"}'), 24, 6),
        ]),
        ("Trays x GPUs", [
            (p.gpu_heatmap("gpufleet_gpu_fabric_health", "NVLink fabric health (any condition)",
                           Q(f"max without (condition) (gpufleet_gpu_fabric_health{{{N}}}) {PLACE}", ROW)), 12, 14),
            (p.gpu_heatmap("gpufleet_gpu_thermal_margin_celsius", "Thermal margin",
                           Q(f"gpufleet_gpu_thermal_margin_celsius{{{N}}} {PLACE}", ROW)), 12, 14),
            (p.gpu_heatmap("gpufleet_gpu_power_watts", "Power", Q(f"gpufleet_gpu_power_watts{{{N}}} {PLACE}", ROW)),
             12, 14),
            (p.gpu_heatmap("gpufleet_gpu_c2c_enabled", "C2C link enabled",
                           Q(f"gpufleet_gpu_c2c_enabled{{{N}}} {PLACE}", ROW)), 12, 14),
        ]),
        ("Domain", [
            (p.timeseries("gpufleet_gpu_fabric_overall_health", "GPUs not healthy per NVLink domain",
                          Q(f"sum by (cluster_uuid, clique_id) ((gpufleet_gpu_fabric_overall_health{{{N}}} != bool 1) "
                            "* on (instance, gpu) group_left (cluster_uuid, clique_id) gpufleet_gpu_fabric_info)",
                            "{{cluster_uuid}} clique {{clique_id}}")), 12, 8),
            (p.table("gpufleet_gpu_platform_info", "Placement", f'gpufleet_gpu_platform_info{{{N},chassis_serial=~"$rack"}}'),
             12, 8),
        ]),
    ],
)
