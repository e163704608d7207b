"""Prometheus rules, their promtool unit tests, the runbook, the Alertmanager example (routing checked with
amtool, inhibition with a real Alertmanager) and the Prometheus example config."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from support import REPO, free_port, need_binary, running, wait_http

from gpufleet.dashboards.panels import UIDS
from gpufleet.vocab.catalog import BY_NAME

ALERTS = REPO / "alerts"
RULES = ALERTS / "gpufleet.rules.yml"
RUNBOOK = ALERTS / "runbook.md"
AM_CONFIG = ALERTS / "alertmanager.yml"
PROM_DIR = REPO / "packaging" / "prometheus"
RUNBOOK_BASE = "https://github.com/gpufleet/gpufleet/blob/main/alerts/runbook.md#"
#: Series Prometheus itself produces, allowed in rules besides the catalog's.
PROMETHEUS_SERIES = {"up"}


def groups() -> list[dict[str, Any]]:
    return list(yaml.safe_load(RULES.read_text())["groups"])


def alert_rules() -> list[dict[str, Any]]:
    return [r for g in groups() for r in g["rules"] if "alert" in r]


def recording_rules() -> list[dict[str, Any]]:
    return [r for g in groups() for r in g["rules"] if "record" in r]


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([need_binary("promtool"), *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_promtool_check_rules_is_clean() -> None:
    proc = promtool("check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(alert_rules()) + len(recording_rules())} rules found" in proc.stdout
    assert "WARNING" not in (proc.stdout + proc.stderr).upper()


def test_promtool_unit_tests_pass() -> None:
    files = sorted(p.name for p in (ALERTS / "tests").glob("*.yml"))
    assert files
    proc = promtool("test", "rules", *files, cwd=ALERTS / "tests")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("SUCCESS") + proc.stderr.count("SUCCESS") == len(files)


def test_the_required_alerts_exist() -> None:
    """One alert per failure the fleet must page on: agent, GPU, NVLink, InfiniBand, straggler, PUE, detector."""
    names = {r["alert"] for r in alert_rules()}
    required = {
        "GpufleetAgentDown", "GpufleetGpuLost", "GpufleetGpuMissing", "GpufleetXidCritical",
        "GpufleetEccUncorrectable", "GpufleetRowRemapPending", "GpufleetRowRemapFailed",
        "GpufleetThermalThrottling", "GpufleetPowerThrottling", "GpufleetPcieLinkDowngraded",
        "GpufleetNvlinkDown", "GpufleetNvlinkErrors", "GpufleetIbLinkDown", "GpufleetIbLinkFlapping",
        "GpufleetIbLinkErrors", "GpufleetIbCongested", "GpufleetStragglerFound", "GpufleetWorkloadImbalance",
        "GpufleetPueDrift",
        "GpufleetDetectorStale", "GpufleetDetectorFailing",
    }
    assert required <= names
    assert len(names) == len(alert_rules()), "duplicate alert names"


def runbook_anchors() -> set[str]:
    """GitHub-style anchors of the runbook's headings."""
    anchors = set()
    for line in RUNBOOK.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^a-z0-9 _-]", "", title).replace(" ", "-"))
    return anchors


def test_every_alert_has_labels_annotations_and_a_runbook_section() -> None:
    anchors = runbook_anchors()
    for rule in alert_rules():
        name = rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), name
        ann = rule["annotations"]
        assert ann["summary"] and "{{" not in ann["summary"], f"{name}: summary must be fixed text"
        assert "{{" in ann["description"], f"{name}: description must be templated"
        assert ann["runbook_url"].startswith(RUNBOOK_BASE), name
        assert ann["runbook_url"].removeprefix(RUNBOOK_BASE) == name.lower(), name
        assert name.lower() in anchors, f"{name}: no section in alerts/runbook.md"
        m = re.match(r"/d/([a-z0-9-]+)/", ann["dashboard"])
        assert m and m.group(1) in UIDS.values(), f"{name}: dashboard link"
    section = RUNBOOK.read_text().split("## ")[1:]
    for text in section:
        for part in ("**Means**", "**Impact**", "**Confirm**", "**Do**"):
            assert part in text, f"runbook section {text.splitlines()[0]} lacks {part}"
    severities = {r["labels"]["severity"] for r in alert_rules()}
    assert severities == {"critical", "warning", "info"}


#: Alerts about a whole NVLink domain (rack): aggregated by the domain, they are about no one node.
DOMAIN_ALERTS = {"GpufleetNvlinkDomainDegraded"}


def test_alerts_about_nodes_carry_a_node_label_for_grouping_and_inhibition() -> None:
    for rule in alert_rules():
        expr = rule["expr"]
        if rule["alert"] in DOMAIN_ALERTS:
            assert expr.startswith("count by (cluster_uuid, clique_id)"), rule["alert"]
            continue
        if 'job="gpufleet-agent"' in expr or "instance_" in expr:
            assert 'label_replace(' in expr and '"node"' in expr, rule["alert"]


def unit_test_checks() -> Iterator[tuple[str, bool]]:
    """(alertname, fires) of every check in the promtool unit tests."""
    for path in (ALERTS / "tests").glob("*.yml"):
        doc = yaml.safe_load(path.read_text())
        assert doc["rule_files"] == ["../gpufleet.rules.yml"], path
        for test in doc["tests"]:
            for check in test.get("alert_rule_test", []):
                yield check["alertname"], bool(check.get("exp_alerts"))


def test_every_alert_has_firing_and_quiet_unit_tests() -> None:
    checks = list(unit_test_checks())
    firing = {name for name, fires in checks if fires}
    quiet = {name for name, fires in checks if not fires}
    for rule in alert_rules():
        name = rule["alert"]
        assert name in firing, f"{name}: no promtool test where it fires"
        if "for" in rule:
            assert name in quiet, f"{name}: no promtool test of its `for` window or a negative case"


def test_for_windows_are_tested_just_before_they_end() -> None:
    """A rule with `for: Nm` has a quiet check at N-1 minutes or later in the same test case."""
    fors = {r["alert"]: int(r["for"].removesuffix("m")) for r in alert_rules() if "for" in r}
    seen: dict[str, bool] = dict.fromkeys(fors, False)
    for path in (ALERTS / "tests").glob("*.yml"):
        for test in yaml.safe_load(path.read_text())["tests"]:
            checks = test.get("alert_rule_test", [])
            for check in checks:
                name = check["alertname"]
                if name in fors and not check.get("exp_alerts"):
                    t = int(check["eval_time"].removesuffix("m"))
                    fired_later = any(c["alertname"] == name and c.get("exp_alerts")
                                      and int(c["eval_time"].removesuffix("m")) > t for c in checks)
                    if fired_later and t >= fors[name] - 1:
                        seen[name] = True
    assert [n for n, ok in seen.items() if not ok] == []


def test_metric_names_in_rules_exist() -> None:
    recorded = {r["record"] for r in recording_rules()}
    for rule in recording_rules():
        assert re.fullmatch(r"[a-z_]+:[a-z0-9_]+:[a-z0-9_]+", rule["record"]), rule["record"]
    for rule in recording_rules() + alert_rules():
        expr = re.sub(r'"[^"]*"', '""', rule["expr"])  # drop label values
        for name in re.findall(r"\b([a-z_][a-z0-9_]*:[a-z0-9_:]+)\b", expr):
            assert name in recorded, f"{name} is not a recording rule"
        for name in re.findall(r"(?<![:\w])gpufleet_[a-z0-9_]+(?![:\w])", expr):
            assert name in BY_NAME, f"{name} is not in vocab/catalog.py"
        for name in re.findall(r"(?<![:\w])([a-zA-Z_:][\w:]*)\{", expr):
            assert name in BY_NAME or name in recorded or name in PROMETHEUS_SERIES, name


def amtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([need_binary("amtool"), *args], capture_output=True, text=True, timeout=60)


def test_amtool_check_config_is_clean() -> None:
    proc = amtool("check-config", str(AM_CONFIG))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout and "5 inhibit rules" in proc.stdout


@pytest.mark.parametrize(("labels", "receiver"), [
    (["severity=critical", "alertname=GpufleetStragglerFound", "node=node-002", "job_id=llm-7"], "pager"),
    (["severity=critical", "alertname=GpufleetAgentDown", "node=node-001"], "pager"),
    (["severity=warning", "alertname=GpufleetThermalThrottling", "node=node-003"], "ticket"),
    (["severity=info", "alertname=GpufleetRetiredPagesPending"], "null"),
    (["alertname=SomethingWithoutSeverity"], "null"),
    (["severity=critical", "alertname=GpufleetStragglerFound", "namespace=research", "pod=llama-worker-2",
      "job_id=llama"], "team-research"),
    (["severity=warning", "alertname=GpufleetStragglerFound", "namespace=research-eval"], "team-research"),
    (["severity=info", "alertname=GpufleetStragglerFound", "namespace=research"], "null"),
    (["severity=critical", "alertname=GpufleetStragglerFound", "namespace=serving"], "pager"),
    (["severity=critical", "alertname=GpufleetStragglerFound", "route=hardware", "owner=team-llm"], "pager"),
    # issue 19: slowness the workload causes is the owner's ticket, whatever its severity, never the pager
    (["severity=warning", "alertname=GpufleetWorkloadImbalance", "route=workload", "owner=team-llm",
      "job_id=job-pp"], "workload-tickets"),
    (["severity=critical", "alertname=GpufleetWorkloadImbalance", "owner=team-llm"], "workload-tickets"),
    (["severity=warning", "alertname=GpufleetWorkloadImbalance", "owner=research"], "team-research-tickets"),
    (["severity=warning", "alertname=GpufleetWorkloadImbalance", "namespace=research-eval", "owner=research-eval"],
     "team-research-tickets"),
])
def test_routing(labels: list[str], receiver: str) -> None:
    proc = amtool("config", "routes", "test", f"--config.file={AM_CONFIG}", f"--verify.receivers={receiver}", *labels)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == receiver


def test_the_straggler_page_needs_hardware_evidence_and_workload_tickets_group_by_owner() -> None:
    rules = {r["alert"]: r for r in alert_rules()}
    assert 'route!="workload"' in rules["GpufleetStragglerFound"]["expr"]
    assert 'route="workload"' in rules["GpufleetWorkloadImbalance"]["expr"]
    assert rules["GpufleetWorkloadImbalance"]["labels"]["severity"] == "warning"
    route = yaml.safe_load(AM_CONFIG.read_text())["route"]
    first = route["routes"][0]
    assert first["matchers"] == ['alertname="GpufleetWorkloadImbalance"'] and "continue" not in first
    assert set(first["group_by"]) == {"owner", "namespace", "job_id"}
    assert {first["receiver"], *(r["receiver"] for r in first["routes"])} <= {"workload-tickets",
                                                                              "team-research-tickets"}


def test_routes_group_by_job_and_node() -> None:
    route = yaml.safe_load(AM_CONFIG.read_text())["route"]
    assert set(route["group_by"]) == {"namespace", "job_id", "node"}
    team = next(r for r in route["routes"] if r["receiver"] == "team-research")
    assert set(team["group_by"]) == {"namespace", "job_id"}


class _Sink(BaseHTTPRequestHandler):
    received: list[dict[str, Any]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).received.append({"path": self.path, **json.loads(body)})
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def local_receivers(config: dict[str, Any], url: str) -> dict[str, Any]:
    """The example config with every receiver posting to a local webhook instead (path = receiver name)."""
    config = json.loads(json.dumps(config))
    config["receivers"] = [
        {"name": r["name"], "webhook_configs": [{"url": f"{url}/{r['name']}", "send_resolved": False}]}
        for r in config["receivers"] if r["name"] != "null"
    ] + [{"name": "null"}]
    return config


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[str]:
    binary = shutil.which("prometheus-alertmanager") or need_binary("alertmanager")
    sink = HTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    config = local_receivers(yaml.safe_load(AM_CONFIG.read_text()), f"http://127.0.0.1:{sink.server_port}")
    config["route"]["group_wait"] = "1s"
    (tmp_path / "am.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    argv = [binary, f"--config.file={tmp_path / 'am.yml'}", f"--storage.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="]
    with running(argv, log=tmp_path / "am.log"):
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/-/ready", timeout=30)
        try:
            yield url
        finally:
            sink.shutdown()


def test_inhibition_with_a_real_alertmanager(alertmanager: str) -> None:
    base = {"job": "gpufleet-agent", "site": "s1"}
    alerts = [
        {"alertname": "GpufleetAgentDown", "node": "node-001", "severity": "critical"},
        {"alertname": "GpufleetXidCritical", "node": "node-001", "gpu": "1", "xid": "79", "severity": "critical"},
        {"alertname": "GpufleetXidCritical", "node": "node-002", "gpu": "1", "xid": "79", "severity": "critical"},
        {"alertname": "GpufleetGpuLost", "node": "node-003", "gpu": "4", "severity": "critical"},
        {"alertname": "GpufleetThermalThrottling", "node": "node-003", "gpu": "4", "severity": "warning"},
        {"alertname": "GpufleetThermalThrottling", "node": "node-003", "gpu": "5", "severity": "warning"},
        # one detector incident: its straggler pages, its network finding does not page again
        {"alertname": "GpufleetStragglerFound", "node": "node-004", "incident": "i1", "severity": "critical"},
        {"alertname": "GpufleetNetworkOutlier", "node": "node-004", "incident": "i1", "severity": "warning"},
        {"alertname": "GpufleetNetworkOutlier", "node": "node-005", "incident": "i2", "severity": "warning"},
    ]
    r = requests.post(f"{alertmanager}/api/v2/alerts", json=[{"labels": {**base, **a}} for a in alerts], timeout=5)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 20
    state: dict[tuple[str, str, str], bool] = {}
    while time.monotonic() < deadline:
        got = requests.get(f"{alertmanager}/api/v2/alerts", timeout=5).json()
        state = {(a["labels"]["alertname"], a["labels"]["node"], a["labels"].get("gpu", "")):
                 bool(a["status"]["inhibitedBy"]) for a in got}
        if len(state) == len(alerts) and any(state.values()):
            break
        time.sleep(0.2)
    assert state == {
        ("GpufleetAgentDown", "node-001", ""): False,
        ("GpufleetXidCritical", "node-001", "1"): True,  # its node's agent is down
        ("GpufleetXidCritical", "node-002", "1"): False,
        ("GpufleetGpuLost", "node-003", "4"): False,
        ("GpufleetThermalThrottling", "node-003", "4"): True,  # the GPU is lost
        ("GpufleetThermalThrottling", "node-003", "5"): False,
        ("GpufleetStragglerFound", "node-004", ""): False,
        ("GpufleetNetworkOutlier", "node-004", ""): True,  # the straggler of its incident pages instead
        ("GpufleetNetworkOutlier", "node-005", ""): False,
    }
    # Each (job_id, node) group is its own notification: wait for all the expected ones, not just any two.
    expected = {("/pager", "GpufleetXidCritical", "node-002"), ("/ticket", "GpufleetThermalThrottling", "node-003")}
    sent: set[tuple[str, str, str]] = set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not expected <= sent:
        time.sleep(0.2)
        sent = {(n["path"], a["labels"]["alertname"], a["labels"]["node"]) for n in _Sink.received for a in n["alerts"]}
    assert expected <= sent
    assert not any(a == "GpufleetXidCritical" and node == "node-001" for _, a, node in sent)


def test_prometheus_example_config_is_valid(tmp_path: Path) -> None:
    # in place (its gpufleet.rules.yml links to the rules), and copied as the docs say (cp -rL: links followed)
    assert (PROM_DIR / "gpufleet.rules.yml").resolve() == RULES.resolve()
    shutil.copytree(PROM_DIR, tmp_path / "gpufleet")
    for where in (PROM_DIR, tmp_path / "gpufleet"):
        proc = promtool("check", "config", str(where / "prometheus.yml"))
        assert proc.returncode == 0, proc.stdout + proc.stderr
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    jobs = {c["job_name"]: c for c in config["scrape_configs"]}
    assert set(jobs) == {"gpufleet-agent", "gpufleet-detector"}
    assert jobs["gpufleet-detector"]["honor_labels"] is True
    for job in jobs.values():
        assert job["static_configs"] and job["file_sd_configs"]
    for path in (PROM_DIR / "targets").glob("*.json"):
        for group in json.loads(path.read_text()):
            assert group["targets"]
