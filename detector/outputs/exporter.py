"""The detector's /metrics: a prometheus-client collector over the last evaluation, and the HTTP server.

Series (names, labels and help from :mod:`gpufleet.vocab.catalog`, group
``detector``): per-GPU straggler score and per-feature robust z-score, one
``gpufleet_detector_finding`` per active finding (value = score; labels kind,
cause, node, gpu, job_id, site, namespace, pod, gpu_instance, route; "" when not applicable) with its start and
detection times, one ``gpufleet_detector_incident`` per open incident (value =
its highest score; labels incident, node, gpu, site, job_id, fixed while it is open,
so an alert on it fires once per incident; route and owner, see :class:`IncidentRoutes`) with its findings in
``gpufleet_detector_incident_finding`` (incident, kind, cause, gpu, nic, pattern),
each site's PUE and expected PUE, and the detector's health (last successful
evaluation, evaluation duration, evaluations by result, query errors, missing
inputs). The HTTP(S) server is the agent's (TLS and basic auth from an
exporter-toolkit web config).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Protocol
from urllib.parse import quote

import numpy as np
from prometheus_client.core import CollectorRegistry, Metric
from prometheus_client.exposition import choose_encoder

from gpufleet.detector.engine import Detector
from gpufleet.detector.frame.backend_guard import NODE_REASONS, REASONS
from gpufleet.detector.incidents.tracker import Finding
from gpufleet.detector.remediate import direct_evidence
from gpufleet.vocab.catalog import spec


class Health:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.last_success: float | None = None
        self.duration: float | None = None
        self.results = {"success": 0, "failure": 0}
        self.last_error = ""
        #: Why the service is not ready ("" once it is): its state is being rebuilt from Prometheus (issue 24).
        self.not_ready = ""
        #: Why the last evaluation could not judge everything: reason -> one line (issue 34; the reasons are
        #: :data:`gpufleet.detector.frame.backend_guard.REASONS`), and the nodes it held (node -> reason).
        self.degraded: dict[str, str] = {}
        self.held_nodes: dict[str, str] = {}


class IncidentRoutes:
    """Route and owner of each open incident, as its alert labels (issue 19).

    An incident's route is "workload" while every finding it had is a workload one (its ticket goes to the job's
    owner) and "hardware" from its first hardware finding on: it does not go back, so a workload incident that
    turns out to hide a fault pages once and a hardware incident never turns into a ticket. Its owner is the
    first one its findings name, kept while it is open. Closed incidents are forgotten.
    """

    def __init__(self) -> None:
        self._seen: dict[str, tuple[str, str]] = {}
        self._lock = threading.Lock()  # scrapes may collect concurrently

    def update(self, by: dict[str, list[Finding]]) -> dict[str, tuple[str, str]]:
        """incident -> (route, owner) for the open incidents ``by`` (incident -> its open findings)."""
        out: dict[str, tuple[str, str]] = {}
        with self._lock:
            for inc, fds in by.items():
                route, owner = self._seen.get(inc, ("workload", ""))
                ordered = sorted(fds, key=lambda f: f.opened)
                if any(f.route != "workload" for f in ordered):
                    route = "hardware"
                owner = owner or next((f.owner for f in ordered if f.owner), "")
                out[inc] = (route, owner)
            self._seen = out
        return dict(out)


class DetectorCollector:
    def __init__(self, detector: Detector, health: Health) -> None:
        self.detector = detector
        self.health = health
        self.routes = IncidentRoutes()

    def collect(self) -> Iterator[Metric]:
        det, h = self.detector, self.health
        ev = det.last
        score = spec("gpufleet_detector_straggler_score").family()
        dev = spec("gpufleet_detector_feature_deviation").family()
        if ev is not None:
            g, st = ev.features.gpu, ev.straggler
            for i in np.flatnonzero(st.scored):
                labels = [g.nodes[i], g.gpus[i], g.jobs[i] or ""]
                score.add_metric(labels, float(st.score[i]))
                for f, z in st.z.items():
                    if np.isfinite(z[i]):
                        dev.add_metric([*labels, f], float(z[i]))
        yield score
        yield dev
        finding = spec("gpufleet_detector_finding").family()
        start = spec("gpufleet_detector_finding_start_timestamp_seconds").family()
        detected = spec("gpufleet_detector_finding_detected_timestamp_seconds").family()
        active = list(det.tracker.active.values())
        for fd in active:
            labels = [fd.kind, fd.cause or "", fd.node or "", fd.gpu or "", fd.job or "", fd.site or "", fd.namespace,
                      fd.pod, fd.gpu_instance, fd.route]
            finding.add_metric(labels, fd.score)
            start.add_metric(labels, fd.start)
            detected.add_metric(labels, fd.detected)
        yield finding
        yield start
        yield detected
        incident = spec("gpufleet_detector_incident").family()
        member = spec("gpufleet_detector_incident_finding").family()
        by: dict[str, list[Finding]] = {}
        for fd in active:
            by.setdefault(fd.incident, []).append(fd)
        meta = dict(det.tracker.incident_meta)
        routes = self.routes.update(by)
        for inc, fds in sorted(by.items()):
            first = min(fds, key=lambda f: f.opened)
            node, gpu, site, job, ns, pod = meta.get(inc, (first.node or "", first.gpu or "", first.site or "",
                                                           first.job or "", first.namespace, first.pod))
            route, owner = routes[inc]
            incident.add_metric([inc, node, gpu, site, job, ns, pod, route, owner], max(f.score for f in fds))
            for fd in fds:
                member.add_metric([inc, fd.kind, fd.cause or "", fd.gpu or "", fd.nic, fd.pattern], 1.0)
        yield incident
        yield member
        yield from impact_families(by, meta, det.cfg.external_url)
        direct = spec("gpufleet_detector_incident_direct").family()
        opened = spec("gpufleet_detector_incident_detected_timestamp_seconds").family()
        for inc, fds in sorted(by.items()):
            direct.add_metric([inc], 1.0 if any(direct_evidence.direct(f) for f in fds) else 0.0)
            opened.add_metric([inc], min(f.detected for f in fds))
        yield direct
        yield opened
        pue = spec("gpufleet_detector_site_pue").family()
        exp = spec("gpufleet_detector_site_pue_expected").family()
        if ev is not None:
            for site, s in sorted(ev.pue.items()):
                pue.add_metric([site], s.pue)
                if s.expected is not None:
                    exp.add_metric([site], s.expected)
        yield pue
        yield exp
        with h.lock:
            last = spec("gpufleet_detector_last_success_timestamp_seconds").family()
            if h.last_success is not None:
                last.add_metric([], h.last_success)
            yield last
            dur = spec("gpufleet_detector_evaluation_duration_seconds").family()
            if h.duration is not None:
                dur.add_metric([], h.duration)
            yield dur
            evals = spec("gpufleet_detector_evaluations_total").family()
            for result, n in sorted(h.results.items()):
                evals.add_metric([result], n)
            yield evals
            degraded = spec("gpufleet_detector_degraded").family()
            for reason in REASONS:
                nodes = sum(1 for r in h.held_nodes.values() if r == reason)
                degraded.add_metric([reason], float(nodes if reason in NODE_REASONS else reason in h.degraded))
            yield degraded
            held = spec("gpufleet_detector_held_node").family()
            for node, reason in sorted(h.held_nodes.items()):
                held.add_metric([node, reason], 1.0)
            yield held
        errs = spec("gpufleet_detector_query_errors_total").family()
        errs.add_metric([], det.source.query_errors)
        yield errs
        missing = spec("gpufleet_detector_missing_inputs").family()
        if ev is not None:
            for m in sorted(ev.features.missing):
                missing.add_metric([m], 1.0)
        yield missing


def impact_families(by: dict[str, list[Finding]], meta: Mapping[str, tuple[str, ...]],
                    external_url: str) -> Iterator[Metric]:
    """Each open incident's cost (detector.incidents.impact: the highest of its findings') and its findings page."""
    slow = spec("gpufleet_detector_incident_slowdown_ratio").family()
    lost = spec("gpufleet_detector_incident_gpu_hours_lost").family()
    page = spec("gpufleet_detector_incident_evidence_info").family()
    for inc, fds in sorted(by.items()):
        first = min(fds, key=lambda f: f.opened)
        job = meta[inc][3] if inc in meta else (first.job or "")
        imps = [f.impact for f in fds if f.impact is not None]
        slows = [s for s in (i.slowdown for i in imps) if s is not None]
        if slows:
            slow.add_metric([inc, job], max(slows))
        if imps:
            lost.add_metric([inc, job], max(i.gpu_hours_lost for i in imps))
        if external_url:
            page.add_metric([inc, evidence_url(external_url, inc)], 1.0)
    yield slow
    yield lost
    yield page


def evidence_url(external_url: str, incident: str) -> str:
    """The findings page of ``incident`` under ``external_url`` (the incident id quoted for a path)."""
    return f"{external_url.rstrip('/')}/findings/{quote(incident, safe='')}"


class PageSource(Protocol):
    def page(self, target: str) -> tuple[int, bytes, str] | None: ...


class Exposer:
    """What the agent's MetricsServer serves."""

    def __init__(self, registry: CollectorRegistry, health: Health, pages: PageSource | None = None) -> None:
        self.registry = registry
        self.h = health
        self.pages = pages

    def page(self, target: str) -> tuple[int, bytes, str] | None:
        """The findings pages (detector.outputs.pages), where the service serves them."""
        return self.pages.page(target) if self.pages is not None else None

    def exposition(self, accept: str | None = None) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type

    def health(self) -> str:
        with self.h.lock:
            if self.h.last_success is None and self.h.results["failure"]:
                return f"evaluations failing: {self.h.last_error}"
            if self.h.degraded:  # /health: 200 "DEGRADED" and why, one reason a line
                return "degraded: " + "\n".join(f"{r}: {d}" for r, d in sorted(self.h.degraded.items()))
            return "OK"

    def ready(self) -> str:
        """"" once the state is rebuilt; else why not (``/ready`` answers 503 with it)."""
        with self.h.lock:
            return self.h.not_ready


def registry_for(detector: Detector, health: Health) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(DetectorCollector(detector, health))
    return reg
