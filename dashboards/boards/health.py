"""Agent and detector health: collectors, NVML, scrape cost; detector freshness, duration, errors."""

from __future__ import annotations

from gpufleet.dashboards import panels as p
from gpufleet.dashboards.panels import NODE, SITE, Q

N = f"{SITE},{NODE}"

dashboard = p.build(
    "health", "gpufleet / Agent and detector health",
    "Is the telemetry itself healthy? Agents' collectors and NVML, and the detector's evaluations.",
    p.standard_vars(job=False, gpu=False),
    [
        ("Agents", [
            (p.table("gpufleet_build_info", "Agent versions", f"gpufleet_build_info{{{N}}}"), 12, 7),
            (p.table("gpufleet_driver_info", "Driver versions", f"gpufleet_driver_info{{{N}}}"), 12, 7),
            (p.timeseries("gpufleet_nvml_up", "NVML up", Q(f"gpufleet_nvml_up{{{N}}}", "{{instance}}")), 12, 8),
            (p.timeseries("gpufleet_scrape_collector_success", "Collector success",
                          Q(f"gpufleet_scrape_collector_success{{{N}}}", "{{instance}} {{collector}}")), 12, 8),
            (p.timeseries("gpufleet_scrape_collector_duration_seconds", "Collector duration",
                          Q(f"gpufleet_scrape_collector_duration_seconds{{{N}}}", "{{instance}} {{collector}}")),
             12, 8),
            (p.timeseries("gpufleet_nvml_errors_total", "NVML errors",
                          Q(f"sum by (instance, function, error) (rate(gpufleet_nvml_errors_total{{{N}}}"
                            "[$__rate_interval]))", "{{instance}} {{function}} {{error}}"), op="rate"), 12, 8),
            (p.timeseries("gpufleet_nvml_call_stalled_seconds", "NVML calls stalled (GPU left out of scrapes)",
                          Q(f"gpufleet_nvml_call_stalled_seconds{{{N}}}", "{{instance}} gpu {{gpu}} {{call}}")),
             24, 8),
        ]),
        ("Detector", [
            (p.stat("gpufleet_detector_last_success_timestamp_seconds", "Since last successful evaluation",
                    "time() - max(gpufleet_detector_last_success_timestamp_seconds)", op="age",
                    thresholds=(("green", None), ("orange", 300), ("red", 900))), 6, 6),
            (p.timeseries("gpufleet_detector_evaluation_duration_seconds", "Evaluation duration",
                          Q("gpufleet_detector_evaluation_duration_seconds", "{{instance}}")), 9, 6),
            (p.timeseries("gpufleet_detector_evaluations_total", "Evaluations by result",
                          Q("sum by (result) (rate(gpufleet_detector_evaluations_total[$__rate_interval]))",
                            "{{result}}"), op="rate"), 9, 6),
            (p.timeseries("gpufleet_detector_query_errors_total", "Query errors",
                          Q("rate(gpufleet_detector_query_errors_total[$__rate_interval])", "{{instance}}"),
                          op="rate"), 12, 7),
            (p.table("gpufleet_detector_missing_inputs", "Inputs the detector did not find",
                     "gpufleet_detector_missing_inputs == 1"), 12, 7),
        ]),
    ],
)
