"""The remediation service fences a confirmed straggler's node in a real Slurm cluster, safely (issue 34).

Real parts: munged, slurmctld and slurmd (Debian's) on 127.0.0.1; Alertmanager (Debian's) taking the page,
sending it to the service's webhook and receiving the service's notifications (checked with amtool); the detector
is gpufleet's own, replayed over a simulated fleet with a straggler and served by its exporter. The service
drains the node with a reason naming the incident, repeats nothing after a restart or on its HA partner, refuses
while the detector is degraded, leaves a node someone else drained alone, and resumes its node only after the
incident closed and the health check passed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import tomllib
from pathlib import Path

import pytest
import requests
import yaml
from slurm_cluster import scontrol, slurm_cluster
from support import free_port, need_binary, running, wait_http

from gpufleet.detector.outputs.exporter import Exposer, Health, registry_for
from gpufleet.detector.remediate.backends import Slurm
from gpufleet.detector.remediate.policy import Rails
from gpufleet.detector.remediate.server import make_server
from gpufleet.detector.remediate.service import RemediationConfig, Remediator
from gpufleet.detector.service.replay import replay
from gpufleet.serving.server import MetricsServer
from gpufleet.serving.webconfig import WebConfig
from gpufleet.sim.quality import _config
from gpufleet.sim.recording import record
from gpufleet.sim.scenario import parse_scenario
from gpufleet.sim.simulator import Simulator

pytestmark = pytest.mark.slow

NODES = ["node-001", "node-000", "node-002", "node-003"]  # slurmd runs as the first: the straggler's node
FLEET = """
name = "remediate"
hours = 0.25
step = 15
[[sites]]
name = "a"
nodes = 4
gpus_per_node = 4
[jobs]
[[jobs.fixed]]
id = "train"
nodes = ["node-000", "node-001", "node-002", "node-003"]
[[faults]]
kind = "clock_stuck_low"
node = "node-001"
gpu = 2
onset = "3m"
severity = "moderate"
"""


def amtool(am: str, *args: str) -> str:
    p = subprocess.run([need_binary("amtool"), f"--alertmanager.url={am}", *args], capture_output=True, text=True,
                       timeout=30, check=False)
    return p.stdout + p.stderr


def test_fence_and_resume_a_slurm_node_through_alertmanager(tmp_path: Path) -> None:
    rec = record(Simulator(parse_scenario(tomllib.loads(FLEET)), seed=1, start=1_750_000_000.0), tmp_path,
                 ("gpufleet",), series="core")
    det, _ = replay([str(rec.files["gpufleet"])], _config("gpufleet"), 15.0)
    hw = [f for f in det.tracker.active.values() if f.node == "node-001" and f.route == "hardware"]
    assert hw, "the straggler's incident is open at the end of the replay"
    incident = hw[0].incident
    health = Health()
    detector = MetricsServer("127.0.0.1:0", Exposer(registry_for(det, health), health), title="gpufleet detector")
    detector.serve_in_thread()
    det_url = f"http://127.0.0.1:{detector.port}"

    with slurm_cluster(tmp_path, NODES) as senv:
        env = {**os.environ, **senv}
        hook_port, am_port = free_port(), free_port()
        am = f"http://127.0.0.1:{am_port}"
        (tmp_path / "am.yml").write_text(yaml.safe_dump({
            "route": {"receiver": "remediate", "group_by": ["incident"], "group_wait": "1s",
                      "group_interval": "1s", "repeat_interval": "1h",
                      "routes": [{"matchers": ['alertname="GpufleetRemediation"'], "receiver": "null"}]},
            "receivers": [{"name": "remediate", "webhook_configs": [
                {"url": f"http://127.0.0.1:{hook_port}/webhook", "send_resolved": True}]}, {"name": "null"}]}))
        am_bin = _am_binary()
        with running([am_bin, f"--config.file={tmp_path / 'am.yml'}", f"--storage.path={tmp_path / 'am'}",
                      f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="],
                     log=tmp_path / "alertmanager.log"):
            wait_http(f"{am}/-/ready", timeout=60)
            check = tmp_path / "check-ok"

            def service() -> Remediator:
                cfg = RemediationConfig(
                    rails=Rails(enabled=True, dry_run=False, min_open_seconds=0.0, max_per_hour=2, max_per_job=1,
                                health_check=("test", "-e", str(check))),
                    detectors=[[det_url]], alertmanager="", lock_file=str(tmp_path / "remediate.lock"),
                    journal=str(tmp_path / "remediate.jsonl"), timeout_seconds=10.0)
                return Remediator(cfg, Slurm(env=env))

            rem = service()
            rem.cfg.alertmanager = am  # notifications (the pages come by the webhook)
            server = make_server(rem, f"127.0.0.1:{hook_port}", WebConfig())
            threading.Thread(target=server.serve_forever, daemon=True).start()
            try:
                # the page, as GpufleetStragglerFound fires it (the incident series' labels)
                page = {"alertname": "GpufleetStragglerFound", "job": "gpufleet-detector", "incident": incident,
                        "node": "node-001", "gpu": "2", "site": "a", "job_id": "train", "route": "hardware",
                        "severity": "critical"}
                r = requests.post(f"{am}/api/v2/alerts", json=[{"labels": page}], timeout=10)
                assert r.status_code == 200, r.text
                deadline = time.monotonic() + 30
                while incident not in rem.webhook_pages and time.monotonic() < deadline:
                    time.sleep(0.2)
                assert incident in rem.webhook_pages, "Alertmanager's webhook brought the page"

                # degraded: nothing is done
                health.degraded = {"gap": "4 of 4 nodes have no fresh samples"}
                (d,) = rem.tick()
                assert (d.allowed, d.reason) == (False, "degraded")
                assert "DRAIN" not in scontrol(env, "show", "node", "node-001", "--oneliner")
                health.degraded = {}

                # fenced: drained with the incident in its reason
                (d,) = rem.tick()
                assert (d.action, d.allowed, d.reason) == ("fence", True, "ok")
                shown = scontrol(env, "show", "node", "node-001", "--oneliner")
                assert "DRAIN" in shown and f"Reason=gpufleet {incident}: " in shown and "(job train)" in shown
                # again, after a restart, and on the HA partner: nothing repeated
                assert [x.reason for x in rem.tick()] == ["already_fenced"]
                partner = service()
                partner.webhook_pages = dict(rem.webhook_pages)
                assert [x.reason for x in partner.tick()] == ["not_leader"]
                rem.leader.release()  # the leader "dies": the partner takes the lock and finds the node fenced
                assert [x.reason for x in partner.tick()] == ["already_fenced"]
                lines = [json.loads(x) for x in (tmp_path / "remediate.jsonl").read_text().splitlines()]
                assert [(x["phase"], x["incident"]) for x in lines] == [("intent", incident), ("done", incident)]
                partner.leader.release()

                # a node someone else drained is left alone
                scontrol(env, "update", "NodeName=node-002", "State=DRAIN", "Reason=maintenance by hand")
                assert [s.node for s in rem.backend.fenced()] == ["node-001"]

                # the incident closes: resumed only after the health check passes
                for k in [k for k, f in det.tracker.active.items() if f.incident == incident]:
                    det.tracker.active.pop(k)
                fence, d = rem.tick()  # the page still fires: its incident is no longer open
                assert (fence.action, fence.reason) == ("fence", "not_open")
                assert (d.action, d.allowed, d.reason) == ("resume", False, "health_check_failed")
                assert "DRAIN" in scontrol(env, "show", "node", "node-001", "--oneliner")
                check.write_text("")
                _, d = rem.tick()
                assert (d.action, d.allowed, d.reason) == ("resume", True, "ok")
                assert "DRAIN" not in scontrol(env, "show", "node", "node-001", "--oneliner")
                assert "DRAIN" in scontrol(env, "show", "node", "node-002", "--oneliner")  # not gpufleet's

                # every action and refusal: counted, and in Alertmanager
                metrics = rem.exposition().decode()
                assert 'gpufleet_detector_remediation_decisions_total{action="fence",outcome="done",reason="ok"} 1.0' \
                    in metrics
                assert 'outcome="refused",reason="degraded"' in metrics
                listed = amtool(am, "alert", "query", "alertname=GpufleetRemediation", "-o", "json")
                got = {(a["labels"]["action"], a["labels"]["outcome"], a["labels"]["reason"])
                       for a in json.loads(listed)}
                assert {("fence", "refused", "degraded"), ("fence", "done", "ok"),
                        ("resume", "refused", "health_check_failed"), ("resume", "done", "ok")} <= got, got
            finally:
                server.shutdown()
                detector.shutdown()


def _am_binary() -> str:
    return shutil.which("prometheus-alertmanager") or need_binary("alertmanager")
