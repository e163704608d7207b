"""``gpufleet-detector remediate --config FILE``: fence the node of a confirmed hardware fault, safely (issue 34).

Off unless ``[remediation] enabled = true``, and dry-run (decides, logs, counts and notifies, changes nothing)
until ``dry_run = false``. Each ``interval_seconds`` it:

1. takes the pages: the firing alerts named in ``alertnames`` that Alertmanager posted to ``POST /webhook``
   (its webhook receiver, payload version 4) or that it lists (``GET /api/v2/alerts``, so a restarted service
   has them at once);
2. asks every detector (``detectors``: a list of shards, each a list of the URLs of its replicas) for
   ``/ready`` and ``/metrics``: its open incidents (route, kinds, direct evidence, detection time), whether
   it is degraded and why, the nodes it holds;
3. decides each page with the guard rails (:mod:`~gpufleet.detector.remediate.policy`) and carries out what
   they allow through the backend (:mod:`~gpufleet.detector.remediate.backends`: Slurm or Kubernetes);
4. resumes the nodes gpufleet fenced whose incident closed, once the health check passed.

Only the replica holding ``lock_file`` (an exclusive ``flock``; an HA pair shares the file) acts. Every fence is
written to ``journal`` (JSON lines: its intent before the action, the hourly limit counting attempts; done after)
and the node's own state says what was done, so a restart or a failover repeats nothing; a fence begun before a
restart and found done on the node is reported then (its log line, count and notification are not lost). Every action and refusal is logged (once per
change), counted in ``gpufleet_detector_remediation_decisions_total`` and posted to Alertmanager as an alert
``GpufleetRemediation`` (labels action, outcome, reason, node, incident). ``GET /metrics`` and ``/health``
are served on ``listen`` (TLS and basic auth from ``web_config_file``, exporter-toolkit format).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shlex
import subprocess
import threading
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import requests
from prometheus_client.core import CollectorRegistry, Metric
from prometheus_client.exposition import generate_latest

from gpufleet.detector.remediate.backends import Backend, BackendError, Kubernetes, Slurm
from gpufleet.detector.remediate.feed import page_alerts, poll
from gpufleet.detector.remediate.policy import Decision, NodeState, Rails, View, fence, resume
from gpufleet.vocab.catalog import spec

log = logging.getLogger("gpufleet.remediate")


class RemediationConfigError(ValueError):
    pass


@dataclass
class RemediationConfig:
    rails: Rails = field(default_factory=Rails)
    backend: str = "slurm"
    listen: str = "127.0.0.1:9447"
    web_config_file: str = ""
    detectors: list[list[str]] = field(default_factory=list)
    alertmanager: str = ""
    lock_file: str = "/var/lib/gpufleet/remediate.lock"
    journal: str = "/var/lib/gpufleet/remediate.jsonl"
    interval_seconds: float = 15.0
    timeout_seconds: float = 10.0
    scontrol: str = "scontrol"
    kubernetes_api: str = "https://kubernetes.default.svc"
    kubernetes_token_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    kubernetes_ca_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"


_RAILS: dict[str, type | tuple[type, ...]] = {"enabled": bool, "dry_run": bool, "alertnames": list, "min_open_seconds": (int, float),
          "max_per_hour": int, "max_per_job": int, "max_job_share": (int, float), "health_check": list,
          "health_check_timeout": (int, float)}
_OWN: dict[str, type | tuple[type, ...]] = {"backend": str, "listen": str, "web_config_file": str, "detectors": list, "alertmanager": str,
        "lock_file": str, "journal": str, "interval_seconds": (int, float), "timeout_seconds": (int, float),
        "scontrol": str, "kubernetes_api": str, "kubernetes_token_file": str, "kubernetes_ca_file": str}


def parse_config(text: str) -> RemediationConfig:
    """The ``[remediation]`` table of a TOML config; RemediationConfigError (one line) on anything wrong."""
    try:
        raw = tomllib.loads(text).get("remediation", {})
    except tomllib.TOMLDecodeError as e:
        raise RemediationConfigError(f"not TOML: {e}") from e
    cfg = RemediationConfig()
    for key, value in raw.items():
        want = _RAILS.get(key) or _OWN.get(key)
        if want is None:
            raise RemediationConfigError(f"[remediation] unknown key {key!r}")
        if not isinstance(value, want) or (isinstance(value, bool) and want is not bool):
            raise RemediationConfigError(f"[remediation] {key}: wrong type {type(value).__name__}")
        if key in _RAILS:
            setattr(cfg.rails, key, tuple(str(v) for v in value) if isinstance(value, list) else value)
        elif key == "detectors" and isinstance(value, list):
            cfg.detectors = [[str(u) for u in (v if isinstance(v, list) else [v])] for v in value]
        else:
            setattr(cfg, key, value)
    if cfg.backend not in ("slurm", "kubernetes"):
        raise RemediationConfigError(f"[remediation] backend must be slurm or kubernetes, not {cfg.backend!r}")
    if cfg.rails.enabled and not cfg.detectors:
        raise RemediationConfigError("[remediation] detectors: at least one detector URL is needed")
    if cfg.rails.max_per_hour < 0 or cfg.rails.max_per_job < 1 or not 0 <= cfg.rails.max_job_share <= 1:
        raise RemediationConfigError("[remediation] max_per_hour >= 0, max_per_job >= 1, 0 <= max_job_share <= 1")
    return cfg


def backend_for(cfg: RemediationConfig) -> Backend:
    if cfg.backend == "kubernetes":
        return Kubernetes(cfg.kubernetes_api, cfg.kubernetes_token_file,
                          cfg.kubernetes_ca_file if Path(cfg.kubernetes_ca_file).exists() else None,
                          cfg.timeout_seconds)
    return Slurm(cfg.scontrol, cfg.timeout_seconds)


class Leader:
    """The HA pair's lock: an exclusive ``flock`` on ``path``, taken when free, held while the process lives."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._f: IO[str] | None = None

    def held(self) -> bool:
        if self._f is not None:
            return True
        try:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            f = open(self.path, "a+")  # noqa: SIM115 - kept open while leader
        except OSError as e:
            log.warning("lock file %s: %s", self.path, e)
            return False
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            return False
        self._f = f
        return True

    def release(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class Journal:
    """Fences, one JSON line each, written and synced before the action (what the hourly limit counts)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def records(self) -> list[dict[str, Any]]:
        try:
            lines = self.path.read_text().splitlines()
        except OSError:
            return []
        out = []
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a torn last line after a crash
            if isinstance(rec, dict):
                out.append(rec)
        return out

    def fences_since(self, t: float) -> list[float]:
        """The times of the fences attempted since ``t`` (an attempt counts: the limit errs on the safe side)."""
        out = []
        for rec in self.records():
            try:
                if rec.get("action") == "fence" and rec.get("phase", "intent") == "intent" and float(rec["t"]) >= t:
                    out.append(float(rec["t"]))
            except (KeyError, TypeError, ValueError):
                continue
        return out

    def unfinished(self) -> dict[tuple[str, str], float]:
        """(node, incident) -> the intent's time, of the fences begun and not recorded done: the service stopped
        mid-action."""
        begun: dict[tuple[str, str], float] = {}
        for rec in self.records():
            key = (str(rec.get("node", "")), str(rec.get("incident", "")))
            if rec.get("action") == "fence":
                if rec.get("phase", "intent") == "intent":
                    try:
                        begun[key] = float(rec.get("t", 0.0))
                    except (TypeError, ValueError):
                        begun[key] = 0.0
                else:
                    begun.pop(key, None)
        return begun

    def write(self, rec: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(rec, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())


class Remediator:
    """One service: its pages, its decisions and their counts."""

    def __init__(self, cfg: RemediationConfig, backend: Backend, session: requests.Session | None = None) -> None:
        self.cfg = cfg
        self.backend = backend
        self.session = session or requests.Session()
        self.leader = Leader(cfg.lock_file)
        self.journal = Journal(cfg.journal)
        self.lock = threading.Lock()
        self.webhook_pages: dict[str, dict[str, str]] = {}  # incident -> labels (firing, from the webhook)
        self.counts: dict[tuple[str, str, str], int] = {}
        self.fenced_now: list[NodeState] = []
        self.is_leader = False
        self.last_error = ""
        self._said: dict[tuple[str, str, str], str] = {}  # (action, node, incident) -> last outcome/reason

    # ------------------------------------------------------------------ inputs

    def webhook(self, payload: Any) -> int:
        """Fold an Alertmanager webhook payload (version 4) in; the number of alerts taken."""
        alerts = payload.get("alerts") if isinstance(payload, dict) else None
        if not isinstance(alerts, list):
            raise ValueError("not an Alertmanager webhook payload (no alerts list)")
        n = 0
        with self.lock:
            for a in alerts:
                labels = a.get("labels") if isinstance(a, dict) else None
                if not isinstance(labels, dict) or labels.get("alertname") not in self.cfg.rails.alertnames:
                    continue
                inc = str(labels.get("incident", ""))
                if not inc:
                    continue
                if a.get("status") == "resolved":
                    self.webhook_pages.pop(inc, None)
                else:
                    self.webhook_pages[inc] = {str(k): str(v) for k, v in labels.items()}
                n += 1
        return n

    def pages(self) -> dict[str, dict[str, str]]:
        with self.lock:
            out = dict(self.webhook_pages)
        if self.cfg.alertmanager:
            out.update(page_alerts(self.session, self.cfg.alertmanager, self.cfg.rails.alertnames,
                                   self.cfg.timeout_seconds))
        return out

    # ------------------------------------------------------------------ one round

    def tick(self, now: float | None = None) -> list[Decision]:
        """Poll, decide and act once; the decisions made."""
        now = time.time() if now is None else now
        view = poll(self.session, self.cfg.detectors, self.cfg.timeout_seconds)
        leader = self.is_leader = self.leader.held()
        try:
            fenced = self.backend.fenced()
        except BackendError as e:
            self.last_error = str(e)
            view = View(unreachable=f"{self.backend.name}: {e}")
            fenced = []
        self.fenced_now = fenced
        decisions: list[Decision] = []
        unfinished = self.journal.unfinished() if leader else {}
        for state in fenced:  # begun before a restart and found done on the node: reported now, not repeated
            if (state.node, state.incident) in unfinished:
                self.journal.write({"t": now, "action": "fence", "phase": "done", "node": state.node,
                                    "incident": state.incident, "job": state.job})
                decisions.append(self._report(Decision("fence", state.node, state.incident, True, "ok", state.job,
                                                       "found done on the node after a restart"), "done"))
        for inc, labels in sorted(self.pages().items()):
            node = labels.get("node", "")
            try:
                state = self.backend.state(node) if node else NodeState(node)
            except BackendError as e:
                decisions.append(self._report(Decision("fence", node, inc, False, "backend_error", "", str(e))))
                continue
            begun = unfinished.get((node, inc))
            if begun is not None and not state.fenced and now - begun < self.cfg.timeout_seconds:
                # A fence begun by a process that stopped mid-action (its scontrol or API call may outlive it):
                # not repeated until that call has had the time it was given (then it failed, and is begun again).
                decisions.append(self._report(Decision("fence", node, inc, False, "in_flight", labels.get("job", ""),
                                                       f"begun {now - begun:.0f} s ago before a restart")))
                continue
            d = fence(labels, view, state, fenced, self.journal.fences_since(now - 3600.0), now, self.cfg.rails,
                      leader)
            decisions.append(self._carry_out(d, labels, now))
        for state in fenced:
            r = resume(state, view, leader)
            if r is not None:
                decisions.append(self._carry_out(r, {}, now))
        return decisions

    def _carry_out(self, d: Decision, labels: dict[str, str], now: float) -> Decision:
        if not d.allowed:
            return self._report(d)
        if d.action == "resume":
            failed = self._health_check(d.node)
            if failed:
                return self._report(Decision("resume", d.node, d.incident, False, "health_check_failed", d.job,
                                             failed))
        if self.cfg.rails.dry_run:
            return self._report(d, "dry_run")
        try:
            if d.action == "fence":
                self.journal.write({"t": now, "action": "fence", "phase": "intent", "node": d.node,
                                    "incident": d.incident, "job": d.job})
                kind = labels.get("kind") or "straggler"
                summary = labels.get("summary") or f"{labels.get('alertname', 'gpufleet')} on {d.node}"
                self.backend.fence(d.node, d.incident, d.job, kind, summary)
                self.journal.write({"t": now, "action": "fence", "phase": "done", "node": d.node,
                                    "incident": d.incident, "job": d.job})
            else:
                self.backend.resume(d.node)
        except BackendError as e:
            return self._report(Decision(d.action, d.node, d.incident, False, "backend_error", d.job, str(e)),
                                "failed")
        return self._report(d, "done")

    def _health_check(self, node: str) -> str:
        """"" when the configured check passed (or there is none); else why not."""
        argv = [a.replace("{node}", node) for a in self.cfg.rails.health_check]
        if not argv:
            return ""
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=self.cfg.rails.health_check_timeout,
                               check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{shlex.join(argv)}: {e}"
        return "" if p.returncode == 0 else f"{shlex.join(argv)} exited {p.returncode}: {p.stdout[-200:]}"

    def _report(self, d: Decision, outcome: str = "") -> Decision:
        outcome = outcome or ("refused" if not d.allowed else "done")
        key = (d.action, d.node, d.incident)
        said = f"{outcome}/{d.reason}"
        if self._said.get(key) == said:
            return d  # the same answer as last round: logged, counted and notified once
        self._said[key] = said
        with self.lock:
            ck = (d.action, outcome, d.reason)
            self.counts[ck] = self.counts.get(ck, 0) + 1
        line = f"{d.action} {d.node or '-'} for incident {d.incident or '-'}: {outcome} ({d.reason}" + \
               (f": {d.detail}" if d.detail else "") + ")"
        (log.warning if outcome in ("failed",) else log.info)("%s", line)
        self._notify(d, outcome, line)
        return d

    def _notify(self, d: Decision, outcome: str, line: str) -> None:
        if not self.cfg.alertmanager:
            return
        now = time.time()
        alert = {"labels": {"alertname": "GpufleetRemediation", "action": d.action, "outcome": outcome,
                            "reason": d.reason, "node": d.node, "incident": d.incident, "job_id": d.job,
                            "severity": "warning" if outcome == "failed" else "info"},
                 "annotations": {"summary": f"gpufleet remediation: {d.action} {outcome}", "description": line},
                 "startsAt": _rfc3339(now), "endsAt": _rfc3339(now + 3600.0)}
        try:
            r = self.session.post(self.cfg.alertmanager.rstrip("/") + "/api/v2/alerts", json=[alert],
                                  timeout=self.cfg.timeout_seconds)
            if r.status_code >= 300:
                log.warning("Alertmanager refused the notification: HTTP %s", r.status_code)
        except requests.RequestException as e:
            log.warning("cannot notify Alertmanager: %s", e)

    # ------------------------------------------------------------------ /metrics

    def collect(self) -> Iterator[Metric]:
        fam = spec("gpufleet_detector_remediation_decisions_total").family()
        with self.lock:
            for (action, outcome, reason), n in sorted(self.counts.items()):
                fam.add_metric([action, outcome, reason], n)
        yield fam
        fenced = spec("gpufleet_detector_remediation_fenced_nodes").family()
        for s in self.fenced_now:
            fenced.add_metric([s.node, s.incident], 1.0)
        yield fenced
        leader = spec("gpufleet_detector_remediation_leader").family()
        leader.add_metric([], 1.0 if self.is_leader else 0.0)
        yield leader

    def exposition(self) -> bytes:
        reg = CollectorRegistry(auto_describe=False)
        reg.register(self)
        return bytes(generate_latest(reg))


def _rfc3339(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"
