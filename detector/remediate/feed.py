"""The remediation service's inputs: the detectors' own state (``/ready``, ``/metrics``) and Alertmanager's pages.

:func:`poll` reads every replica of every shard and folds their answers into one
:class:`~gpufleet.detector.remediate.policy.View`; anything it cannot read makes the view ``unreachable`` (the
service then refuses to act: it cannot tell a healthy fleet from a blind detector). :func:`page_alerts` lists
the active alerts Alertmanager holds (``GET /api/v2/alerts``), so a restarted service has its pages at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import requests
from prometheus_client.parser import text_string_to_metric_families

from gpufleet.detector.frame.backend_guard import NODE_REASONS
from gpufleet.detector.remediate.policy import Incident, View


class _Replica:
    def __init__(self) -> None:
        self.incidents: dict[str, Incident] = {}
        self.degraded: dict[str, str] = {}
        self.held: dict[str, str] = {}


def read_metrics(text: str) -> _Replica:
    """One detector's /metrics: its open incidents, its degraded reasons, the nodes it holds."""
    rep = _Replica()
    meta: dict[str, dict[str, str]] = {}
    kinds: dict[str, set[str]] = {}
    direct: dict[str, bool] = {}
    detected: dict[str, float] = {}
    job_nodes: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            lb = s.labels
            if s.name == "gpufleet_detector_incident":
                meta[lb.get("incident", "")] = lb
            elif s.name == "gpufleet_detector_incident_finding":
                kinds.setdefault(lb.get("incident", ""), set()).add(lb.get("kind", ""))
            elif s.name == "gpufleet_detector_incident_direct":
                direct[lb.get("incident", "")] = s.value > 0
            elif s.name == "gpufleet_detector_incident_detected_timestamp_seconds":
                detected[lb.get("incident", "")] = s.value
            elif s.name == "gpufleet_detector_degraded" and s.value > 0 and lb.get("reason") not in NODE_REASONS:
                rep.degraded[lb.get("reason", "")] = "the detector says so (gpufleet_detector_degraded)"
            elif s.name == "gpufleet_detector_held_node":
                rep.held[lb.get("node", "")] = lb.get("reason", "")
            elif s.name == "gpufleet_detector_straggler_score" and lb.get("job_id"):
                job_nodes.setdefault(lb["job_id"], set()).add(lb.get("node", ""))
    for inc, lb in meta.items():
        if not inc:
            continue
        job = lb.get("job_id", "")
        rep.incidents[inc] = Incident(inc, lb.get("node", ""), job, lb.get("route", ""),
                                      frozenset(kinds.get(inc, set())), direct.get(inc, False),
                                      detected.get(inc, float("inf")), len(job_nodes.get(job, ())))
    return rep


def poll(session: requests.Session, shards: Sequence[Sequence[str]], timeout: float) -> View:
    view = View()
    disagree: set[str] = set()
    for replicas in shards:
        seen: list[set[str]] = []
        for url in replicas:
            base = url.rstrip("/")
            try:
                ready = session.get(f"{base}/ready", timeout=timeout)
                if ready.status_code == 503:
                    view.not_ready = view.not_ready or f"{base}: {ready.text.strip()[:200]}"
                    continue
                r = session.get(f"{base}/metrics", timeout=timeout)
                r.raise_for_status()
                rep = read_metrics(r.text)
            except (requests.RequestException, ValueError) as e:
                view.unreachable = view.unreachable or f"{base}: {type(e).__name__}: {str(e)[:200]}"
                continue
            for reason, detail in rep.degraded.items():
                view.degraded.setdefault(reason, f"{base}: {detail}")
            view.held_nodes.update(rep.held)
            for inc, i in rep.incidents.items():
                view.incidents.setdefault(inc, i)
            seen.append(set(rep.incidents))
        if len(seen) > 1:
            disagree |= set[str]().union(*seen) - seen[0].intersection(*seen[1:])
    view.disagree = frozenset(disagree)
    return view


def page_alerts(session: requests.Session, alertmanager: str, names: Sequence[str],
                timeout: float) -> dict[str, dict[str, str]]:
    """incident -> labels of the active (not silenced or inhibited) alerts named ``names``; {} when
    Alertmanager does not answer (the webhook's pages still count)."""
    try:
        r = session.get(alertmanager.rstrip("/") + "/api/v2/alerts",
                        params={"active": "true", "silenced": "false", "inhibited": "false"}, timeout=timeout)
        r.raise_for_status()
        alerts = r.json()
    except (requests.RequestException, ValueError):
        return {}
    out: dict[str, dict[str, str]] = {}
    for a in alerts if isinstance(alerts, list) else []:
        labels = a.get("labels") if isinstance(a, dict) else None
        if isinstance(labels, dict) and labels.get("alertname") in names and labels.get("incident"):
            out[str(labels["incident"])] = {str(k): str(v) for k, v in labels.items()}
    return out
