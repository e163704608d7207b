"""Incident ids: a function of the problem, never of the process that found it.

An incident is named after its first finding's identity (kind, node, GPU or MIG slice, NIC, site) and that
finding's start, and the start is itself a function of the data: the first evaluation instant, on the
``interval_seconds`` grid, of the candidate run that opened the finding (or the onset the evidence
estimates, for PUE drift). So a detector that restarted and rebuilt its state from Prometheus, its HA
partner that never stopped and a ``replay`` of the same history all name one incident alike, and
Alertmanager sees one alert, not a resolve and a second page.
"""

from __future__ import annotations

import hashlib

#: kind, node, gpu (with ``/instance`` for a MIG slice), nic, site, group (a job-level candidate's identity, else
#: ""): :data:`gpufleet.detector.incidents.tracker.Key`.
Identity = tuple[str, str, str, str, str, str]


def incident_id(key: Identity, start: float) -> str:
    """12 hex digits naming the incident whose first finding is ``key``, started at ``start`` (unix seconds)."""
    kind, node, gpu, nic, site, group = key
    what = f"{kind}|{node}|{gpu}|{nic}|{site}|{start:.0f}" + (f"|{group}" if group else "")
    return hashlib.sha1(what.encode(), usedforsecurity=False).hexdigest()[:12]
