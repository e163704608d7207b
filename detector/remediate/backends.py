"""Where the remediation service fences nodes: Slurm (``scontrol``) and Kubernetes (the API server).

Each backend reads a node's own state (:class:`~gpufleet.detector.remediate.policy.NodeState`: is it fenced, by
gpufleet, for which incident) and fences or resumes it. The node's state is the record of what was done: a
restarted service, or the other replica of an HA pair, reads it back and repeats nothing.

- **Slurm**: drained with ``scontrol update NodeName=N State=DRAIN Reason="gpufleet <incident>: <summary>"``;
  gpufleet's drains are those whose reason starts with ``gpufleet `` (:data:`SLURM_REASON`); only those are
  resumed (``State=RESUME``). The training job's id is kept in the reason (``job <id>``) for the per-job rail.
- **Kubernetes**: cordoned (``spec.unschedulable``), tainted ``gpufleet.io/unhealthy=<kind>:NoSchedule``, given
  the Node condition ``GpufleetUnhealthy`` and the annotations ``gpufleet.io/incident`` and ``gpufleet.io/job``,
  with PATCH requests (JSON merge patch on the node, strategic merge patch on its status) authenticated with a
  service-account token. Uncordoned only where the annotation says gpufleet cordoned it.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Sequence
from typing import Any, Protocol

import requests

from gpufleet.detector.remediate.policy import NodeState

SLURM_REASON = "gpufleet "
TAINT_KEY = "gpufleet.io/unhealthy"
CONDITION = "GpufleetUnhealthy"
ANN_INCIDENT = "gpufleet.io/incident"
ANN_JOB = "gpufleet.io/job"


class BackendError(Exception):
    """The scheduler refused or did not answer; the message is one line."""


class Backend(Protocol):
    name: str

    def state(self, node: str) -> NodeState: ...

    def fenced(self) -> list[NodeState]: ...

    def fence(self, node: str, incident: str, job: str, kind: str, summary: str) -> None: ...

    def resume(self, node: str) -> None: ...


def slurm_reason(incident: str, job: str, summary: str) -> str:
    """The drain reason: ``gpufleet <incident>: <summary>`` (one line, no quotes; the job id kept in it)."""
    text = re.sub(r"[\"'\n\r\t]+", " ", summary).strip()
    job_part = f" (job {job})" if job else ""
    return f"{SLURM_REASON}{incident}: {text}{job_part}"[:250]


_REASON_INCIDENT = re.compile(r"^gpufleet ([0-9a-z]+):")
_REASON_JOB = re.compile(r"\(job ([^)\s]+)\)")


class Slurm:
    name = "slurm"

    def __init__(self, scontrol: str = "scontrol", timeout: float = 30.0,
                 env: dict[str, str] | None = None) -> None:
        self.scontrol = scontrol
        self.timeout = timeout
        self.env = env

    def _run(self, args: Sequence[str]) -> str:
        try:
            p = subprocess.run([self.scontrol, *args], capture_output=True, text=True, timeout=self.timeout,
                               env=self.env, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise BackendError(f"scontrol {args[0]}: {e}") from e
        if p.returncode != 0:
            raise BackendError(f"scontrol {' '.join(args[:2])}: {(p.stderr or p.stdout).strip()[:300]}")
        return p.stdout

    def _parse(self, line: str) -> NodeState:
        fields = dict(re.findall(r"(\w+)=(\S*)", line.split(" Reason=")[0]))
        reason = line.split(" Reason=", 1)[1] if " Reason=" in line else ""
        reason = re.sub(r" \[[^\]]*\]\s*$", "", reason.strip())  # Slurm appends [user@time]
        state = fields.get("State", "")
        drained = "DRAIN" in state
        m = _REASON_INCIDENT.match(reason)
        j = _REASON_JOB.search(reason)
        return NodeState(fields.get("NodeName", ""), drained, drained and m is not None, m.group(1) if m else "",
                         j.group(1) if j else "")

    def state(self, node: str) -> NodeState:
        out = self._run(["show", "node", node, "--oneliner"]).strip()
        if not out:
            raise BackendError(f"scontrol show node {node}: no such node")
        return self._parse(out.splitlines()[0])

    def fenced(self) -> list[NodeState]:
        out = self._run(["show", "node", "--oneliner"])
        return [s for s in (self._parse(line) for line in out.splitlines() if line.strip()) if s.ours]

    def fence(self, node: str, incident: str, job: str, kind: str, summary: str) -> None:
        self._run(["update", f"NodeName={node}", "State=DRAIN", f"Reason={slurm_reason(incident, job, summary)}"])

    def resume(self, node: str) -> None:
        self._run(["update", f"NodeName={node}", "State=RESUME"])


class Kubernetes:
    name = "kubernetes"

    def __init__(self, api: str, token_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/token",
                 ca_file: str | None = None, timeout: float = 30.0,
                 session: requests.Session | None = None) -> None:
        self.api = api.rstrip("/")
        self.token_file = token_file
        self.timeout = timeout
        self.session = session or requests.Session()
        self.session.verify = ca_file or True

    def _request(self, method: str, path: str, body: object = None, content_type: str = "") -> Any:
        try:
            token = open(self.token_file).read().strip()  # noqa: SIM115 - re-read: tokens are rotated
        except OSError as e:
            raise BackendError(f"cannot read the service-account token: {e}") from e
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        try:
            r = self.session.request(method, self.api + path, json=body, headers=headers, timeout=self.timeout)
        except requests.RequestException as e:
            raise BackendError(f"{method} {path}: {type(e).__name__}: {e}") from e
        if r.status_code >= 300:
            raise BackendError(f"{method} {path}: HTTP {r.status_code}: {r.text[:200]}")
        return r.json()

    def _node(self, node: str) -> dict[str, Any]:
        doc = self._request("GET", f"/api/v1/nodes/{node}")
        if not isinstance(doc, dict):
            raise BackendError(f"GET node {node}: not an object")
        return doc

    @staticmethod
    def _state(doc: dict[str, Any]) -> NodeState:
        meta = doc.get("metadata") or {}
        ann = meta.get("annotations") or {}
        cordoned = bool((doc.get("spec") or {}).get("unschedulable"))
        incident = str(ann.get(ANN_INCIDENT, ""))
        return NodeState(str(meta.get("name", "")), cordoned, cordoned and bool(incident), incident,
                         str(ann.get(ANN_JOB, "")))

    def state(self, node: str) -> NodeState:
        return self._state(self._node(node))

    def fenced(self) -> list[NodeState]:
        doc = self._request("GET", "/api/v1/nodes")
        items = doc.get("items") if isinstance(doc, dict) else None
        return [s for s in (self._state(i) for i in items or [] if isinstance(i, dict)) if s.ours]

    def fence(self, node: str, incident: str, job: str, kind: str, summary: str) -> None:
        doc = self._node(node)
        taints = [t for t in (doc.get("spec") or {}).get("taints") or [] if t.get("key") != TAINT_KEY]
        taints.append({"key": TAINT_KEY, "value": kind, "effect": "NoSchedule"})
        rv = (doc.get("metadata") or {}).get("resourceVersion")
        # the node first (cordon, taint, who did it), its condition after: a node cordoned without the condition
        # is still gpufleet's to resume; a resourceVersion conflict (someone else changed it) is an error
        self._request("PATCH", f"/api/v1/nodes/{node}", {
            "metadata": {"resourceVersion": rv, "annotations": {ANN_INCIDENT: incident, ANN_JOB: job}},
            "spec": {"unschedulable": True, "taints": taints}}, "application/merge-patch+json")
        self._condition(node, "True", "GpufleetFenced", f"gpufleet {incident}: {summary}"[:1000])

    def resume(self, node: str) -> None:
        doc = self._node(node)
        taints = [t for t in (doc.get("spec") or {}).get("taints") or [] if t.get("key") != TAINT_KEY]
        rv = (doc.get("metadata") or {}).get("resourceVersion")
        self._request("PATCH", f"/api/v1/nodes/{node}", {
            "metadata": {"resourceVersion": rv, "annotations": {ANN_INCIDENT: None, ANN_JOB: None}},
            "spec": {"unschedulable": None, "taints": taints or None}}, "application/merge-patch+json")
        self._condition(node, "False", "GpufleetResumed", "gpufleet: the incident closed and the check passed")

    def _condition(self, node: str, status: str, reason: str, message: str) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        cond = {"type": CONDITION, "status": status, "reason": reason, "message": message,
                "lastHeartbeatTime": now, "lastTransitionTime": now}
        self._request("PATCH", f"/api/v1/nodes/{node}/status", {"status": {"conditions": [cond]}},
                      "application/strategic-merge-patch+json")
