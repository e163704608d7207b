"""The catalog's detector families (DETECTOR in :data:`gpufleet.vocab.catalog.SPECS`): gpufleet-detector's own
families: findings, incidents, health, the remote-write receiver and the remediation service."""

from __future__ import annotations

from gpufleet.vocab.catalog_base import (
    _C,
    _G,
    FINDING_CAUSES,
    FINDING_KINDS,
    FINDING_ROUTES,
    REMOTE_WRITE_RESULTS,
    REMOTE_WRITE_SAMPLE_RESULTS,
    WORKLOAD_PATTERNS,
    MetricSpec,
)

DETECTOR: tuple[MetricSpec, ...] = (
    # ---------------------------------------------------------------- detector
    MetricSpec("gpufleet_detector_straggler_score", _G, "",
               "Combined straggler score of a GPU against its peers (0 = typical; >= threshold = straggler).",
               ("node", "gpu", "job_id"), "detector"),
    MetricSpec("gpufleet_detector_feature_deviation", _G, "",
               "Robust z-score of a feature of a GPU against its peer group (median/MAD).",
               ("node", "gpu", "job_id", "feature"), "detector"),
    MetricSpec("gpufleet_detector_finding", _G, "",
               "An active finding; value is its score. Series vanish when the finding closes. gpu_instance: the "
               "MIG slice of the GPU a finding is about (empty when not a slice). route: who it goes to (hardware: "
               "the hardware on-call; workload: the job's owner, the job made some ranks busier).",
               ("kind", "cause", "node", "gpu", "job_id", "site", "namespace", "pod", "gpu_instance", "route"),
               "detector", label_values={"kind": FINDING_KINDS, "cause": FINDING_CAUSES, "route": FINDING_ROUTES}),
    MetricSpec("gpufleet_detector_finding_start_timestamp_seconds", _G, "timestamp",
               "Unix time an active finding started.",
               ("kind", "cause", "node", "gpu", "job_id", "site", "namespace", "pod", "gpu_instance", "route"),
               "detector"),
    # ---------------------------------------------------------------- detector: incidents (issue 10)
    MetricSpec("gpufleet_detector_finding_detected_timestamp_seconds", _G, "timestamp",
               "Unix time an active finding was detected (the evaluation at which it opened).",
               ("kind", "cause", "node", "gpu", "job_id", "site", "namespace", "pod", "gpu_instance", "route"),
               "detector"),
    MetricSpec("gpufleet_detector_incident", _G, "",
               "An open incident (one physical problem: its findings of every kind); value is the highest score of "
               "its findings. Labels are those of its first finding (Kubernetes: its namespace and pod) and stay "
               "while it is open, through gaps. route: workload while every finding of it is a workload one, "
               "hardware from its first hardware finding on (it does not go back); owner: who gets a workload "
               "incident's ticket (namespace, team or Slurm account; empty when not known).",
               ("incident", "node", "gpu", "site", "job_id", "namespace", "pod", "route", "owner"), "detector",
               label_values={"route": FINDING_ROUTES}),
    MetricSpec("gpufleet_detector_incident_finding", _G, "",
               "A finding of an open incident; value is 1. pattern: a workload finding's pattern (empty when none).",
               ("incident", "kind", "cause", "gpu", "nic", "pattern"), "detector",
               label_values={"kind": FINDING_KINDS, "cause": FINDING_CAUSES, "pattern": ("", *WORKLOAD_PATTERNS)}),
    MetricSpec("gpufleet_detector_incident_slowdown_ratio", _G, "ratio",
               "Estimated slowdown of an open incident's job (its step time over the step time without the suspect, "
               "minus one; detector.impact): the highest of its findings'. Absent where activity does not say it "
               "(a network straggler, a serving job).", ("incident", "job_id"), "detector"),
    MetricSpec("gpufleet_detector_incident_gpu_hours_lost", _G, "",
               "GPU-hours an open incident's job has lost since its onset (the job's GPUs x the share of each "
               "step they wait for the suspect x time; detector.impact): the highest of its findings'.",
               ("incident", "job_id"), "detector"),
    MetricSpec("gpufleet_detector_incident_evidence_info", _G, "",
               "The findings page of an open incident (value 1): url is [detector] external_url + "
               "/findings/<incident>; alerts carry it as their evidence_url annotation. Absent without "
               "external_url.", ("incident", "url"), "detector"),
    MetricSpec("gpufleet_detector_site_pue", _G, "", "Observed PUE of a site (facility / IT power).", ("site",),
               "detector"),
    MetricSpec("gpufleet_detector_site_pue_expected", _G, "",
               "PUE expected from IT load and outdoor temperature.", ("site",), "detector"),
    MetricSpec("gpufleet_detector_last_success_timestamp_seconds", _G, "timestamp",
               "Unix time of the last successful evaluation.", (), "detector"),
    MetricSpec("gpufleet_detector_evaluation_duration_seconds", _G, "seconds",
               "Time the last evaluation took.", (), "detector"),
    MetricSpec("gpufleet_detector_evaluations_total", _C, "", "Evaluations run, by result.", ("result",), "detector"),
    MetricSpec("gpufleet_detector_query_errors_total", _C, "", "Queries to the metrics source that failed.", (),
               "detector"),
    MetricSpec("gpufleet_detector_missing_inputs", _G, "",
               "1 for each input metric the detector looked for and did not find.", ("metric",), "detector"),
    # ---------------------------------------------------------------- detector: remote write receiver (issue 33)
    MetricSpec("gpufleet_detector_remote_write_requests_total", _C, "",
               "Remote write requests received, by result (ok; unauthorized, not_found, method, content_type, "
               "encoding, length, too_large, snappy, protobuf, out_of_order; error: the receiver failed).",
               ("result",), "detector", label_values={"result": REMOTE_WRITE_RESULTS}),
    MetricSpec("gpufleet_detector_remote_write_samples_total", _C, "",
               "Remote write samples received, by result (accepted, a late one put in its place; out_of_order: "
               "older than the window kept, or another value at a time already held; not_kept: a metric the "
               "profile does not read; stale: a staleness marker).",
               ("result",), "detector", label_values={"result": REMOTE_WRITE_SAMPLE_RESULTS}),
    MetricSpec("gpufleet_detector_remote_write_series", _G, "",
               "Series held in the remote write window.", (), "detector"),
    MetricSpec("gpufleet_detector_remote_write_newest_timestamp_seconds", _G, "timestamp",
               "Time of the newest sample received by remote write.", (), "detector"),
    MetricSpec("gpufleet_detector_degraded", _G, "",
               "Why the detector's last evaluation could not judge everything (backend faults, issue 34): 1 for a "
               "fleet-wide reason (query_error, partial_response, gap: the evaluation was held), the number of nodes "
               "held for a per-node one (frozen_target, stale_target), 1 for evaluation_failed, warm_start, "
               "missing_inputs; 0 otherwise.", ("reason",), "detector"),
    MetricSpec("gpufleet_detector_held_node", _G, "",
               "1 for each node whose findings the last evaluation held (its samples froze or went stale).",
               ("node", "reason"), "detector"),
    MetricSpec("gpufleet_detector_incident_direct", _G, "",
               "1 for each open incident with direct hardware evidence (a clock-event reason, a power limit, memory "
               "errors, a flagged link: a throttling or network finding, or a straggler whose cause was read, not "
               "inferred), 0 for one whose cause is only inferred from deviations.", ("incident",), "detector"),
    MetricSpec("gpufleet_detector_incident_detected_timestamp_seconds", _G, "timestamp",
               "Unix time the open incident's first finding opened (what the remediation service's minimum open "
               "time counts from).", ("incident",), "detector"),
    MetricSpec("gpufleet_detector_remediation_decisions_total", _C, "",
               "Remediation decisions by action (fence, resume), outcome (done, dry_run, refused, failed) and "
               "reason (the guard rail that refused, or ok).", ("action", "outcome", "reason"), "detector"),
    MetricSpec("gpufleet_detector_remediation_fenced_nodes", _G, "",
               "1 for each node the remediation service fenced and has not yet resumed.", ("node", "incident"),
               "detector"),
    MetricSpec("gpufleet_detector_remediation_leader", _G, "",
               "1 while this remediation replica holds the lock and may act; 0 on its HA partner.", (), "detector"),
)
