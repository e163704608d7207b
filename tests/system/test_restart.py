"""A detector killed mid-incident and restarted loses nothing (issue 24), with real processes on 127.0.0.1.

A simulated fleet served by real agents (and its site's facility data) -> Prometheus -> gpufleet-detector ->
gpufleet's alert rules -> Alertmanager (the example config, every receiver a webhook in this test, resolves
included). A straggler pages and the site's PUE drifts (a ticket); the detector is killed with SIGKILL and started
again: once ready it has both incidents with the same ids and starts, and Alertmanager sends neither a resolve
nor a second notification. A second replica (an HA partner) started after both began names them the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any
from wsgiref.simple_server import make_server

import pytest
import requests
import yaml
from prometheus_client.core import CollectorRegistry
from prometheus_client.exposition import make_wsgi_app
from support import BIN, free_port, need_binary, running, wait_http
from test_e2e import (
    AM_CONFIG,
    DETECTOR_CONFIG,
    FAULT,
    RULES,
    SCENARIO,
    FacilityCollector,
    _QuietHandler,
    fast_rules,
    serve_http,
    start_prometheus,
    wait_for,
)

pytestmark = pytest.mark.slow

DETECTOR = DETECTOR_CONFIG + """
# The PUE model scaled down to this test's minutes (the defaults need 12 hours of history): fitted after
# 15 s (and 8 evaluations), a drift of 0.01 PUE flagged about 15 s after it begins (CUSUM: (0.01 - 0.005) PUE
# for 14.4 s reaches h). The simulated PUE has no noise (its weather moves by hundredths of a degree in these
# minutes), so the small h flags nothing before the onset.
[pue]
baseline_hours = 0.004
refit_hours = 0.004
history_days = 1
min_drift = 0.01
h = 0.000005
"""

#: The site's cooling degrades from 32 s on (+0.01 PUE at first, growing): a PUE drift under way at the kill.
#: The detector starts a few seconds after the fleet and fits its PUE model some 16 s later: about 10 s before.
PUE_FAULT = """
[[faults]]
kind = "pue_drift"
site = "site-a"
onset = "32s"
severity = 1.0
"""


class _Receiver(BaseHTTPRequestHandler):
    """Alertmanager webhook: records (receiver path, status, alert labels with the alert's ``startsAt``) of every
    alert in every notification."""

    sink: list[tuple[str, str, dict[str, str]]]

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        for alert in body.get("alerts", []):
            labels = {**alert["labels"], "startsAt": str(alert.get("startsAt"))}
            self.sink.append((self.path, str(alert.get("status")), labels))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def incidents(port: int, kind: str = "straggler") -> dict[str, float]:
    """The detector's open incidents of ``kind`` on /metrics: incident id -> its finding's start."""
    body = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    series = [(name, dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value)) for name, labels, value in
              re.findall(r"^(gpufleet_detector_\w+)\{([^}]*)\} (\S+)$", body, re.M)]
    ids = [lb["incident"] for name, lb, _ in series
           if name == "gpufleet_detector_incident_finding" and lb["kind"] == kind]
    starts = [v for name, lb, v in series
              if name == "gpufleet_detector_finding_start_timestamp_seconds" and lb["kind"] == kind]
    return dict(zip(ids, starts, strict=True)) if len(ids) == len(starts) else {}


def ready(port: int) -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200
    except requests.RequestException:
        return False


@contextlib.contextmanager
def detector(tmp_path: Path, name: str, port: int, prometheus: str) -> Iterator[subprocess.Popen[bytes]]:
    config = tmp_path / f"{name}.toml"
    config.write_text(DETECTOR.format(port=port, prometheus=prometheus))
    with running([str(BIN / "gpufleet-detector"), "serve", "--config", str(config)],
                 log=tmp_path / f"{name}.log") as proc:
        yield proc


def logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-12:])
                     for p in sorted(tmp_path.glob("*.log")))


@pytest.mark.timeout(300)
def test_a_killed_detector_restarts_with_its_incident_and_pages_once(tmp_path: Path) -> None:
    from gpufleet.sim.live import LiveFleet

    (tmp_path / "scenario.toml").write_text(SCENARIO + FAULT + PUE_FAULT)
    got: list[tuple[str, str, dict[str, str]]] = []
    with contextlib.ExitStack() as es:
        receiver = es.enter_context(serve_http(HTTPServer(("127.0.0.1", 0), type("R", (_Receiver,), {"sink": got}))))
        fleet = es.enter_context(LiveFleet(str(tmp_path / "scenario.toml"), seed=3, speed=1.0, tick=1.0,
                                           startup_timeout=30))
        registry = CollectorRegistry()
        registry.register(FacilityCollector(fleet))
        facility = es.enter_context(serve_http(make_server("127.0.0.1", 0, make_wsgi_app(registry),
                                                           handler_class=_QuietHandler)))
        am_port, port_a, port_b = free_port(), free_port(), free_port()
        am: dict[str, Any] = yaml.safe_load(AM_CONFIG.read_text())
        am["receivers"] = [{"name": r["name"], "webhook_configs": [
            {"url": f"http://127.0.0.1:{receiver}/{r['name']}", "send_resolved": True}]}
            for r in am["receivers"] if r["name"] != "null"] + [{"name": "null"}]
        am["route"].update(group_wait="1s", group_interval="2s")
        (tmp_path / "am.yml").write_text(yaml.safe_dump(am))
        es.enter_context(running([
            shutil.which("prometheus-alertmanager") or need_binary("alertmanager"), f"--config.file={tmp_path / 'am.yml'}",
            f"--storage.path={tmp_path / 'am'}", f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address=",
        ], log=tmp_path / "alertmanager.log"))
        # The rules 180 times faster (the drift ticket's 15 minutes are 5 s, the straggler page's 2 minutes 1 s, the
        # detector-down alert's 5 minutes 2 s: the kill below is longer); keep_firing_for stays 10 minutes.
        (tmp_path / "rules.yml").write_text(fast_rules(RULES.read_text(), scale=1 / 180))
        prometheus = start_prometheus(es, tmp_path, {
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
            "rule_files": [str(tmp_path / "rules.yml")],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
            "scrape_configs": [
                {"job_name": "gpufleet-agent", "file_sd_configs": [{"files": [str(fleet.targets_file)]}]},
                {"job_name": "gpufleet-detector", "honor_labels": True,
                 "static_configs": [{"targets": [f"127.0.0.1:{port_a}", f"127.0.0.1:{port_b}"]}]},
                {"job_name": "facility", "honor_labels": True,
                 "static_configs": [{"targets": [f"127.0.0.1:{facility}"]}]},
            ],
        })
        wait_http(f"http://127.0.0.1:{am_port}/-/ready", timeout=30)

        def pages(alert: str = "GpufleetStragglerFound", receiver: str = "/pager") -> list[tuple[str, dict[str, str]]]:
            return [(status, labels) for path, status, labels in got
                    if path == receiver and labels.get("alertname") == alert]

        def drift_ticketed() -> bool:
            return len(pages("GpufleetPueDrift", "/ticket")) >= 1

        a = es.enter_context(detector(tmp_path, "a", port_a, prometheus))
        assert wait_for(lambda: len(pages()) >= 1 and drift_ticketed(), timeout=150), f"{got}\n{logs(tmp_path)}"
        before, drift = incidents(port_a), incidents(port_a, "pue_drift")
        assert len(before) == 1 and len(drift) == 1, (before, drift)
        (incident, start), = before.items()
        assert pages()[0][1]["incident"] == incident
        assert pages("GpufleetPueDrift", "/ticket")[0][1]["incident"] == next(iter(drift))

        os.kill(a.pid, signal.SIGKILL)  # mid-incident and mid-drift, no goodbye
        a.wait(timeout=10)
        time.sleep(6)  # scrapes fail, the series go stale, the rules see no incident for a while
        a = es.enter_context(detector(tmp_path, "a2", port_a, prometheus))
        assert wait_for(lambda: ready(port_a), timeout=60), logs(tmp_path)
        # ready means rebuilt: the incidents are there from the first evaluation on, with their ids and starts
        assert wait_for(lambda: incidents(port_a) != {}, timeout=2 * 2 + 2), logs(tmp_path)
        assert incidents(port_a) == {incident: start}
        assert incidents(port_a, "pue_drift") == drift  # the drift flagged as if nothing happened

        b = es.enter_context(detector(tmp_path, "b", port_b, prometheus))  # its HA partner, started late
        assert wait_for(lambda: ready(port_b), timeout=60), logs(tmp_path)
        assert wait_for(lambda: incidents(port_b) != {}, timeout=6), logs(tmp_path)
        assert incidents(port_b) == incidents(port_a) == {incident: start}
        assert incidents(port_b, "pue_drift") == drift

        time.sleep(8)  # Alertmanager's group interval is 2 s: anything it were to send has been sent
        assert [status for status, _ in pages()] == ["firing"], (pages(), logs(tmp_path))
        # The ticket group is notified again when the detector-down alerts join it (the detector was down), and
        # each notification lists the drift: it must be the one alert, never resolved, never fired anew.
        drift_alerts = pages("GpufleetPueDrift", "/ticket")
        assert {status for status, _ in drift_alerts} == {"firing"}, drift_alerts
        assert len({labels["startsAt"] for _, labels in drift_alerts}) == 1, drift_alerts
        assert b.poll() is None and a.poll() is None
