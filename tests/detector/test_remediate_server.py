"""The remediation service's listener: Alertmanager's webhook in, /metrics and /health out, basic auth from an
exporter-toolkit web config (issue 34)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import requests

from gpufleet.detector.remediate.backends import Slurm
from gpufleet.detector.remediate.policy import NodeState, Rails
from gpufleet.detector.remediate.server import make_server
from gpufleet.detector.remediate.service import RemediationConfig, Remediator
from gpufleet.serving.webconfig import parse_web_config

PAYLOAD: dict[str, Any] = {"version": "4", "status": "firing", "receiver": "remediate", "groupKey": "{}:{incident=\"inc1\"}",
           "alerts": [{"status": "firing", "labels": {"alertname": "GpufleetStragglerFound", "incident": "inc1",
                                                      "node": "node-001", "route": "hardware"}},
                      {"status": "firing", "labels": {"alertname": "GpufleetPueDrift", "incident": "inc2"}}]}


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[str, Remediator]]:
    cfg = RemediationConfig(rails=Rails(enabled=True), detectors=[["http://127.0.0.1:9"]],
                            lock_file=str(tmp_path / "lock"), journal=str(tmp_path / "journal"))
    rem = Remediator(cfg, Slurm(scontrol=str(tmp_path / "no-scontrol")))
    web = parse_web_config("basic_auth_users:\n  am: " + bcrypt.hashpw(b"pw", bcrypt.gensalt(4)).decode() + "\n")
    server = make_server(rem, "127.0.0.1:0", web)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", rem
    finally:
        server.shutdown()
        server.server_close()


def test_the_webhook_takes_firing_and_resolved_pages_behind_basic_auth(service: tuple[str, Remediator]) -> None:
    url, rem = service
    assert requests.post(f"{url}/webhook", json=PAYLOAD, timeout=5).status_code == 401
    assert requests.get(f"{url}/metrics", timeout=5).status_code == 401
    r = requests.post(f"{url}/webhook", json=PAYLOAD, auth=("am", "pw"), timeout=5)
    assert r.status_code == 200 and r.text == "1 alerts taken\n"
    assert set(rem.webhook_pages) == {"inc1"}  # only the alerts named in alertnames
    resolved = {**PAYLOAD, "alerts": [{**PAYLOAD["alerts"][0], "status": "resolved"}]}
    assert requests.post(f"{url}/webhook", json=resolved, auth=("am", "pw"), timeout=5).status_code == 200
    assert rem.webhook_pages == {}
    bad = requests.post(f"{url}/webhook", data=b"{not json", auth=("am", "pw"), timeout=5)
    assert bad.status_code == 400 and len(bad.text.splitlines()) == 1
    assert requests.post(f"{url}/webhook", json={"x": 1}, auth=("am", "pw"), timeout=5).status_code == 400


def test_an_unreachable_scheduler_or_detector_is_a_refusal_not_a_crash(service: tuple[str, Remediator]) -> None:
    url, rem = service
    rem.webhook(PAYLOAD)
    (d,) = rem.tick()
    assert not d.allowed and d.reason in ("backend_error", "unreachable"), d
    metrics = requests.get(f"{url}/metrics", auth=("am", "pw"), timeout=5).text
    assert "gpufleet_detector_remediation_decisions_total{" in metrics and 'outcome="refused"' in metrics
    assert "gpufleet_detector_remediation_leader 1.0" in metrics
    h = requests.get(f"{url}/health", auth=("am", "pw"), timeout=5).text
    assert h.startswith("OK\ndry-run, leader") and "no-scontrol" in h


class MemoryScheduler:
    name = "memory"

    def __init__(self) -> None:
        self.nodes: dict[str, NodeState] = {}
        self.calls: list[str] = []

    def state(self, node: str) -> NodeState:
        return self.nodes.get(node, NodeState(node))

    def fenced(self) -> list[NodeState]:
        return [s for s in self.nodes.values() if s.ours]

    def fence(self, node: str, incident: str, job: str, kind: str, summary: str) -> None:
        self.calls.append(f"fence {node}")
        self.nodes[node] = NodeState(node, True, True, incident, job)

    def resume(self, node: str) -> None:
        self.calls.append(f"resume {node}")
        self.nodes.pop(node, None)


def test_a_restart_mid_action_repeats_nothing_and_loses_nothing(tmp_path: Path) -> None:
    """The service stopped between draining the node and recording it: the restarted one finds the node's own
    state, reports the fence (once) and does not fence again."""
    sched = MemoryScheduler()
    cfg = RemediationConfig(rails=Rails(enabled=True, dry_run=False), detectors=[["http://127.0.0.1:9"]],
                            lock_file=str(tmp_path / "lock"), journal=str(tmp_path / "journal"))
    journal = tmp_path / "journal"
    journal.write_text(json.dumps({"t": 1.0, "action": "fence", "phase": "intent", "node": "node-001",
                                   "incident": "inc1", "job": "train"}) + "\n")
    sched.nodes["node-001"] = NodeState("node-001", True, True, "inc1", "train")  # the drain happened
    rem = Remediator(cfg, sched)
    rem.webhook(PAYLOAD)
    decisions = rem.tick()
    assert [(d.action, d.reason, d.detail) for d in decisions if d.allowed] == \
        [("fence", "ok", "found done on the node after a restart")]
    assert sched.calls == []  # nothing repeated (the page refused: the detector is unreachable)
    assert rem.counts[("fence", "done", "ok")] == 1
    assert [d for d in rem.tick() if d.allowed] == [] and rem.counts[("fence", "done", "ok")] == 1
    phases = [json.loads(x)["phase"] for x in journal.read_text().splitlines()]
    assert phases == ["intent", "done"]


def test_a_fence_begun_before_a_restart_is_not_repeated_while_its_call_may_be_under_way(tmp_path: Path) -> None:
    """The service was killed while its scontrol ran: the intent is in the journal and the node not drained yet
    (the orphaned call may still drain it). The restarted service waits the time it gives a call before it decides
    again; then the page is judged as any other (here: refused, the detector being unreachable)."""
    sched = MemoryScheduler()
    cfg = RemediationConfig(rails=Rails(enabled=True, dry_run=False), detectors=[["http://127.0.0.1:9"]],
                            lock_file=str(tmp_path / "lock"), journal=str(tmp_path / "journal"), timeout_seconds=10.0)
    (tmp_path / "journal").write_text(json.dumps({"t": 1000.0, "action": "fence", "phase": "intent",
                                                  "node": "node-001", "incident": "inc1", "job": "train"}) + "\n")
    rem = Remediator(cfg, sched)
    rem.webhook(PAYLOAD)
    (d,) = rem.tick(now=1003.0)
    assert (d.allowed, d.reason) == (False, "in_flight") and "before a restart" in d.detail
    assert sched.calls == []
    (d,) = rem.tick(now=1011.0)  # the call has had its time: no longer held as in flight
    assert d.reason == "unreachable" and sched.calls == []
    # and once the orphaned call's drain shows on the node, it is reported done, not repeated
    sched.nodes["node-001"] = NodeState("node-001", True, True, "inc1", "train")
    assert [(x.reason, x.detail) for x in rem.tick(now=1012.0) if x.allowed] == \
        [("ok", "found done on the node after a restart")]
    assert sched.calls == []
