"""End to end, with real processes on 127.0.0.1: a simulated fleet served by real agents -> Prometheus ->
gpufleet-detector (evaluating against that Prometheus) -> gpufleet's alert rules -> Alertmanager (the
example config) -> a webhook receiver inside this test.

An injected straggler must page, naming its node and GPU; the same fleet without the fault must send
nothing. The rules Prometheus loads are generated from alerts/gpufleet.rules.yml by :func:`fast_rules`
(short `for` windows and evaluation intervals), never a hand-written copy. Every dashboard query must
return data from that Prometheus.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import pytest
import requests
import yaml
from prometheus_client.core import CollectorRegistry, GaugeMetricFamily, Metric
from prometheus_client.exposition import make_wsgi_app
from support import BIN, REPO, free_port, need_binary, running, wait_http

from gpufleet.dashboards import generate, panels
from gpufleet.vocab.catalog import spec

pytestmark = pytest.mark.slow

RULES = REPO / "alerts" / "gpufleet.rules.yml"
AM_CONFIG = REPO / "alerts" / "alertmanager.yml"
STRAGGLER = ("node-002", "1")

SCENARIO = """
name = "e2e"
description = "4 nodes x 4 GPUs, one synchronous job over all of them"
seed = 3
duration = "1h"
step = 1

[[sites]]
name = "site-a"
nodes = 4
gpus_per_node = 4

[jobs]
[[jobs.fixed]]
id = "job-e2e"
nodes = "all"
start = 0
"""
FAULT = f"""
[[faults]]
kind = "clock_stuck_low"
node = "{STRAGGLER[0]}"
gpu = {STRAGGLER[1]}
onset = "5s"
severity = 0.8
"""

DETECTOR_CONFIG = """
[detector]
profile = "gpufleet"
interval_seconds = 2
window_seconds = 12
listen = "127.0.0.1:{port}"

[prometheus]
url = "{prometheus}"
timeout_seconds = 5

[findings]
open_after = 2
close_after = 3
"""

#: Queries whose series exist only when an event happens, on hardware the simulated H100 SXM lacks, or after
#: hours of history: they may be empty in a short healthy-ish run. Everything else must return data.
NO_DATA_EXPECTED = (
    re.compile(r"gpufleet_gpu_xid_(errors_total|last_seen_timestamp_seconds)\b"),  # no XID events injected
    re.compile(r"gpufleet_nvml_errors_total\b"),  # no NVML errors
    re.compile(r"gpufleet_nvml_call_stalled_seconds\b"),  # no NVML call hangs (tests/agent/test_stall_faults.py)
    re.compile(r"gpufleet_gpu_fan_speed_ratio\b"),  # SXM boards have no fans
    re.compile(r"gpufleet_gpu_retired_pages(_pending)?\b"),  # Hopper remaps rows instead of retiring pages
    re.compile(r'gpufleet_detector_finding\{.*kind="(network|pue_drift)"'),  # fault kinds not injected here
    re.compile(r"gpufleet_detector_site_pue_expected\b"),  # the PUE model needs hours of baseline
    re.compile(r"gpufleet_detector_missing_inputs\b"),  # empty when the detector finds all it needs
    re.compile(r"gpufleet_gpu_pod_info\b"),  # not a Kubernetes node: no pods hold the GPUs
    re.compile(r"gpufleet_pcie_aer_errors_total\b"),  # per-type AER series exist only once an error was seen
    re.compile(r"gpufleet_job_pressure_stalled_seconds_total\b"),  # simulated hosts have no job cgroups
    # no MIG and no GPU processes in the simulated fleet: test_shared_gpu_dashboards.py checks these panels
    re.compile(r"gpufleet_(mig_|gpu_mig_|gpu_owner_|gpu_processes\b|gpu_process_)"),
    # RoCE driver statistics and NCCL timing: the live fleet is InfiniBand-only and runs no NCCL (test_fabric_dashboards)
    re.compile(r"gpufleet_(nic_(pause|discards|phy_errors|ethtool|netdev)|nccl_)"),
    # NVL72 racks: the live fleet is H100 HGX, no rack (test_rack_dashboards.py checks these panels)
    re.compile(r"gpufleet_gpu_(platform_info|fabric_|c2c_|thermal_margin|repair_|nvlink_bandwidth_mode|nvlink_link_events)"),
    re.compile(r'gpufleet_detector_finding\{kind=~"nvlink_domain\|tray_health"'),
)


def _seconds(duration: str) -> float:
    m = re.fullmatch(r"(\d+)([smh])", duration)
    if not m:
        raise ValueError(f"unsupported duration {duration!r}")
    return int(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]


def fast_rules(text: str, *, scale: float = 1 / 60, interval: str = "1s", at_least: dict[str, int] | None = None) -> str:
    """The rules file with every group evaluated each ``interval`` and every `for` scaled by ``scale`` (but no
    less than ``at_least`` seconds for the alerts named there).

    Expressions, labels and annotations are kept exactly: this is the production file, run faster.
    """
    doc = yaml.safe_load(text)
    floor = at_least or {}
    for group in doc["groups"]:
        group["interval"] = interval
        for rule in group["rules"]:
            if "for" in rule:
                scaled = max(1, round(_seconds(rule["for"]) * scale))
                rule["for"] = f"{max(scaled, floor.get(rule.get('alert', ''), 0))}s"
    return yaml.safe_dump(doc, sort_keys=False)


def test_fast_rules_rewrites_only_timing(tmp_path: Path) -> None:
    original = yaml.safe_load(RULES.read_text())
    fast = yaml.safe_load(fast_rules(RULES.read_text()))
    rules = [(a, b) for ga, gb in zip(original["groups"], fast["groups"], strict=True)
             for a, b in zip(ga["rules"], gb["rules"], strict=True)]
    assert all(g["interval"] == "1s" for g in fast["groups"])
    for a, b in rules:
        assert {k: v for k, v in a.items() if k != "for"} == {k: v for k, v in b.items() if k != "for"}
        if "for" in a:
            assert _seconds(b["for"]) == max(1, round(_seconds(a["for"]) / 60))
    floored = yaml.safe_load(fast_rules(RULES.read_text(), at_least={"GpufleetDetectorDown": 30}))
    fors = {r.get("alert"): r.get("for") for g in floored["groups"] for r in g["rules"]}
    assert fors["GpufleetDetectorDown"] == "30s"
    assert {k: v for k, v in fors.items() if k != "GpufleetDetectorDown"} == {
        r.get("alert"): r.get("for") for _, r in rules if r.get("alert") != "GpufleetDetectorDown"}
    path = tmp_path / "fast.yml"
    path.write_text(fast_rules(RULES.read_text()))
    proc = subprocess.run([need_binary("promtool"), "check", "rules", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------------------------------------------ the stack
class _Receiver(BaseHTTPRequestHandler):
    """Alertmanager webhook receiver: records (receiver path, alert labels) of every notification."""

    sink: list[tuple[str, dict[str, str]]]

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        for alert in body.get("alerts", []):
            self.sink.append((self.path, dict(alert["labels"])))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


class FacilityCollector:
    """The simulated sites' facility data (a BMS/DCIM would export it), scraped as job="facility"."""

    def __init__(self, fleet: Any) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[Metric]:
        sim = self.fleet.simulator
        names = [s.name for s in sim.scenario.sites]
        fams = {n: spec(n).family() for n in ("gpufleet_site_facility_power_watts", "gpufleet_site_it_power_watts",
                                              "gpufleet_site_outdoor_temperature_celsius")}
        with self.fleet.lock:
            phys = sim.physics
            for i, site in enumerate(names):
                fams["gpufleet_site_facility_power_watts"].add_metric([site], float(phys.facility_power[i]))
                fams["gpufleet_site_it_power_watts"].add_metric([site], float(phys.it_power[i]))
                fams["gpufleet_site_outdoor_temperature_celsius"].add_metric([site], float(phys.outdoor[i]))
        for fam in fams.values():
            if isinstance(fam, GaugeMetricFamily) and fam.samples:
                yield fam


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def serve_http(server: Any) -> Iterator[int]:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class Stack:
    fleet: Any
    prometheus: str
    alertmanager: str
    received: list[tuple[str, dict[str, str]]] = field(default_factory=list)

    def query(self, expr: str) -> list[dict[str, Any]]:
        r = requests.get(f"{self.prometheus}/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert body["status"] == "success", f"{expr}: {body}"
        return list(body["data"]["result"])


def start_prometheus(es: contextlib.ExitStack, tmp_path: Path, config: dict[str, Any]) -> str:
    """A real Prometheus with ``config`` on a free 127.0.0.1 port, stopped with ``es``; its URL once it is ready."""
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    es.enter_context(running([
        need_binary("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
    ], log=tmp_path / "prometheus.log"))
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/-/ready", timeout=30)
    return url


def scrape_agents(es: contextlib.ExitStack, tmp_path: Path, ports: list[int]) -> str:
    """A real Prometheus scraping the agents on these 127.0.0.1 ports every second (site ``dc1``), stopped with
    ``es``; its URL once it is ready."""
    return start_prometheus(es, tmp_path, {
        "global": {"scrape_interval": "1s", "scrape_timeout": "900ms"},
        "scrape_configs": [{"job_name": "gpufleet-agent", "static_configs": [
            {"targets": [f"127.0.0.1:{p}" for p in ports], "labels": {"site": "dc1"}}]}],
    })


def panels_without_data(prometheus: str, queries: list[tuple[str, str, str]], timeout: float = 60.0) -> list[str]:
    """The panels ("uid / title: expr") whose query still returns nothing after up to ``timeout`` seconds."""
    def empty() -> list[str]:
        out = []
        for uid, title, expr in queries:
            r = requests.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10)
            r.raise_for_status()
            if not r.json()["data"]["result"]:
                out.append(f"{uid} / {title}: {expr}")
        return out

    deadline = time.monotonic() + timeout
    missing = empty()
    while missing and time.monotonic() < deadline:
        time.sleep(2)
        missing = empty()
    return missing


def alertmanager_config(receiver_url: str) -> dict[str, Any]:
    """The example Alertmanager config with local webhook receivers and short group timings."""
    config: dict[str, Any] = yaml.safe_load(AM_CONFIG.read_text())
    config["receivers"] = [
        {"name": r["name"], "webhook_configs": [{"url": f"{receiver_url}/{r['name']}", "send_resolved": False}]}
        for r in config["receivers"] if r["name"] != "null"
    ] + [{"name": "null"}]
    config["route"].update(group_wait="1s", group_interval="2s")
    return config


@contextlib.contextmanager
def stack(tmp_path: Path, scenario: str) -> Iterator[Stack]:
    from gpufleet.sim.live import LiveFleet

    (tmp_path / "scenario.toml").write_text(scenario)
    received: list[tuple[str, dict[str, str]]] = []
    handler = type("Receiver", (_Receiver,), {"sink": received})
    with contextlib.ExitStack() as es:
        receiver_port = es.enter_context(serve_http(HTTPServer(("127.0.0.1", 0), handler)))
        fleet = es.enter_context(LiveFleet(str(tmp_path / "scenario.toml"), seed=3, speed=1.0, tick=1.0,
                                           startup_timeout=30))
        registry = CollectorRegistry()
        registry.register(FacilityCollector(fleet))
        facility_port = es.enter_context(serve_http(make_server(
            "127.0.0.1", 0, make_wsgi_app(registry), handler_class=_QuietHandler)))

        am_port, det_port = free_port(), free_port()
        (tmp_path / "am.yml").write_text(yaml.safe_dump(alertmanager_config(f"http://127.0.0.1:{receiver_port}")))
        am_bin = shutil.which("prometheus-alertmanager") or need_binary("alertmanager")
        es.enter_context(running([
            am_bin, f"--config.file={tmp_path / 'am.yml'}", f"--storage.path={tmp_path / 'am'}",
            f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address=",
        ], log=tmp_path / "alertmanager.log"))

        # The detector-down alert's 5 minutes cover a start of the detector, which does not get 60 times faster:
        # under load (CI's two cores, other tests beside) its imports and first evaluation can take longer than 5 s.
        (tmp_path / "rules.yml").write_text(fast_rules(RULES.read_text(), at_least={"GpufleetDetectorDown": 30}))
        prom_config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
            "rule_files": [str(tmp_path / "rules.yml")],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
            "scrape_configs": [
                {"job_name": "gpufleet-agent", "file_sd_configs": [{"files": [str(fleet.targets_file)]}]},
                {"job_name": "gpufleet-detector", "honor_labels": True,
                 "static_configs": [{"targets": [f"127.0.0.1:{det_port}"]}]},
                {"job_name": "facility", "honor_labels": True,
                 "static_configs": [{"targets": [f"127.0.0.1:{facility_port}"]}]},
            ],
        }
        prometheus = start_prometheus(es, tmp_path, prom_config)
        wait_http(f"http://127.0.0.1:{am_port}/-/ready", timeout=30)

        (tmp_path / "detector.toml").write_text(DETECTOR_CONFIG.format(port=det_port, prometheus=prometheus))
        es.enter_context(running([str(BIN / "gpufleet-detector"), "serve", "--config", str(tmp_path / "detector.toml")],
                                 log=tmp_path / "detector.log"))
        wait_http(f"http://127.0.0.1:{det_port}/metrics", timeout=30)
        yield Stack(fleet, prometheus, f"http://127.0.0.1:{am_port}", received)


def wait_for(predicate: Any, timeout: float, step: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return False


def logs(tmp_path: Path) -> str:
    out = []
    for name in ("detector.log", "prometheus.log", "alertmanager.log"):
        path = tmp_path / name
        if path.exists():
            out.append(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:]))
    return "\n".join(out)


class BackgroundStack:
    """A :func:`stack` run in a thread of its own, started by the module's :func:`live_stacks` so that this
    module's stacks start and run side by side (each test waits only for its own) and closed by the test using it.
    The thread lives as long as the stack (the agents' parent-death signal is the thread's)."""

    def __init__(self, path: Path, scenario: str) -> None:
        self.path = path
        self.started = time.monotonic()
        self._ready, self._closing = threading.Event(), threading.Event()
        self._stack: Stack | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(scenario,), name=f"stack-{path.name}", daemon=True)
        self._thread.start()

    def _run(self, scenario: str) -> None:
        try:
            with stack(self.path, scenario) as s:
                self._stack = s
                self._ready.set()
                self._closing.wait()
        except BaseException as e:  # raised in the test (start-up) or at its teardown (stopping)
            self._error = e
        finally:
            self._ready.set()

    def get(self, timeout: float = 120.0) -> Stack:
        """The stack once it is up (its start-up's error, if it failed)."""
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the stack under {self.path} is not up after {timeout:.0f} s\n{logs(self.path)}")
        if self._stack is None:
            raise RuntimeError(f"the stack under {self.path} did not start") from self._error
        return self._stack

    def close(self) -> None:
        """Stop the stack (once); an error while stopping it fails the test."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._thread.join(timeout=60)
        if self._stack is not None and self._error is not None:
            raise self._error


#: The live stacks of this module's tests: fixture name -> scenario.
LIVE_STACKS = {"straggler_stack": SCENARIO + FAULT, "healthy_stack": SCENARIO}


@pytest.fixture(scope="module")
def live_stacks(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, BackgroundStack]]:
    """The live stacks that this module's selected tests use, all started at once: the healthy fleet's detector
    evaluates while the straggler test (and the dcgm one) runs; the stacks a test did not close stop here."""
    wanted = [name for name in LIVE_STACKS if any(
        getattr(item, "module", None) is request.module and name in getattr(item, "fixturenames", ())
        for item in request.session.items)]
    started = {name: BackgroundStack(tmp_path_factory.mktemp(name), LIVE_STACKS[name]) for name in wanted}
    try:
        yield started
    finally:
        for b in started.values():
            b.close()


def _live_stack(stacks: dict[str, BackgroundStack], name: str, factory: pytest.TempPathFactory) -> Iterator[
        BackgroundStack]:
    if name not in stacks:  # not among the selected items (a test run some other way): started now
        stacks[name] = BackgroundStack(factory.mktemp(name), LIVE_STACKS[name])
    yield stacks[name]
    stacks[name].close()


@pytest.fixture
def straggler_stack(live_stacks: dict[str, BackgroundStack],
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundStack]:
    """The fleet with the injected straggler, its stack started with the module's others."""
    yield from _live_stack(live_stacks, "straggler_stack", tmp_path_factory)


@pytest.fixture
def healthy_stack(live_stacks: dict[str, BackgroundStack],
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundStack]:
    """The same fleet without the fault, its stack started with the module's others."""
    yield from _live_stack(live_stacks, "healthy_stack", tmp_path_factory)


# ------------------------------------------------------------------------------------------ the tests
DASH_VARS = {"$__rate_interval": "30s", "$__interval": "5s", "$__range": "1m",
             "$site": ".*", "$node": ".*", "$gpu": ".*", "$job_id": ".*", "$namespace": ".*", "$rack": ".*"}


def dashboard_queries(dcgm: bool = False, **values: str) -> Iterator[tuple[str, str, str]]:
    """(dashboard uid, panel title, PromQL with the variables set to "All") of the gpufleet dashboards, or of
    the dcgm flavour."""
    subs = {**DASH_VARS, **{f"${k}": v for k, v in values.items()}}
    for text in generate.generate().values():
        dash = json.loads(text)
        if (dash["uid"] == panels.UIDS["dcgm"]) != dcgm:
            continue
        for panel in dash["panels"]:
            for target in panel.get("targets", []):
                expr = target["expr"]
                for var, value in sorted(subs.items(), key=lambda kv: -len(kv[0])):
                    expr = expr.replace(var, value)
                yield dash["uid"], panel["title"], expr


@pytest.mark.timeout(170)
def test_straggler_pages_with_node_and_gpu_and_dashboards_have_data(straggler_stack: BackgroundStack) -> None:
    s, tmp_path = straggler_stack.get(), straggler_stack.path

    def paged() -> bool:
        return any(path == "/pager" and labels.get("alertname") == "GpufleetStragglerFound"
                   for path, labels in s.received)

    assert wait_for(paged, timeout=75), f"no straggler page; received {s.received}\n{logs(tmp_path)}"
    pages = [labels for path, labels in s.received
             if path == "/pager" and labels["alertname"] == "GpufleetStragglerFound"]
    truth = {(f["node"], str(f["gpu"])) for f in s.fleet.simulator.labels()["faults"]}
    assert truth == {STRAGGLER}
    assert {(p["node"], p["gpu"]) for p in pages} == truth, pages
    assert pages[0]["job_id"] == "job-e2e" and pages[0]["severity"] == "critical"
    other_pages = [labels for path, labels in s.received
                   if path == "/pager" and labels["alertname"] != "GpufleetStragglerFound"]
    assert not other_pages, other_pages

    empty = []
    for uid, title, expr in dashboard_queries():
        if any(p.search(expr) for p in NO_DATA_EXPECTED):
            continue
        if not s.query(expr):
            empty.append(f"{uid} / {title}: {expr}")
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
    straggler_stack.close()
    assert time.monotonic() - straggler_stack.started < 150


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))


DCGM_SCENARIO = """
name = "e2e-dcgm"
description = "2 nodes x 4 GPUs on dcgm-exporter + node_exporter, one job, a straggler"
seed = 3
start = "{start}"
duration = "10m"
step = 15

[[sites]]
name = "site-a"
nodes = 2
gpus_per_node = 4

[jobs]
[[jobs.fixed]]
id = "job-dcgm"
nodes = "all"
start = 0

[[faults]]
kind = "clock_stuck_low"
node = "node-001"
gpu = 2
onset = "2m"
severity = 0.8
"""


@pytest.mark.timeout(120)
def test_dcgm_flavour_dashboard_has_data_from_a_dcgm_fleet(tmp_path: Path) -> None:
    """The dcgm straggler dashboard against a dcgm-exporter + node_exporter recording of the last 10 minutes,
    backfilled into a real Prometheus, with the detector's dcgm profile evaluating against it."""
    start = dt.datetime.fromtimestamp(int(time.time()) - 640, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    (tmp_path / "scenario.toml").write_text(DCGM_SCENARIO.format(start=start))
    subprocess.run([str(BIN / "gpufleet-sim"), "generate", "--scenario", str(tmp_path / "scenario.toml"),
                    "--out", str(tmp_path / "rec"), "--profile", "dcgm", "--quiet"], check=True, timeout=60)
    recording = next((tmp_path / "rec").glob("*.om"))
    subprocess.run([need_binary("promtool"), "tsdb", "create-blocks-from", "openmetrics", str(recording),
                    str(tmp_path / "tsdb")], check=True, timeout=60, capture_output=True)
    prom_port, det_port = free_port(), free_port()
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "gpufleet-detector", "honor_labels": True,
                            "static_configs": [{"targets": [f"127.0.0.1:{det_port}"]}]}],
    }))
    prometheus = f"http://127.0.0.1:{prom_port}"
    config = DETECTOR_CONFIG.format(port=det_port, prometheus=prometheus).replace(
        'profile = "gpufleet"', 'profile = "dcgm"').replace("window_seconds = 12", "window_seconds = 120")
    (tmp_path / "detector.toml").write_text(config)
    with running([need_binary("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
                  f"--storage.tsdb.path={tmp_path / 'tsdb'}", "--storage.tsdb.retention.time=10y",
                  f"--web.listen-address=127.0.0.1:{prom_port}"], log=tmp_path / "prometheus.log"), \
         running([str(BIN / "gpufleet-detector"), "serve", "--config", str(tmp_path / "detector.toml")],
                 log=tmp_path / "detector.log"):
        wait_http(f"{prometheus}/-/ready", timeout=30)

        def query(expr: str) -> list[dict[str, Any]]:
            body = requests.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10).json()
            assert body["status"] == "success", f"{expr}: {body}"
            return list(body["data"]["result"])

        assert wait_for(lambda: query('gpufleet_detector_finding{kind="straggler"}'), timeout=45), logs(tmp_path)
        finding = query('gpufleet_detector_finding{kind="straggler"}')[0]["metric"]
        assert (finding["node"], finding["gpu"], finding["job_id"]) == ("node-001", "2", "job-dcgm")
        empty = [f"{title}: {expr}" for _, title, expr in dashboard_queries(dcgm=True, __rate_interval="2m")
                 if not query(expr)]
        assert not empty, "dcgm dashboard queries without data:\n" + "\n".join(empty)


#: How long the healthy fleet is watched, in the detector's evaluations: the straggler pages some 8 evaluations
#: after its detector starts, the healthy fleet is watched for 20 (the 16 scores, then 30 s at 2 s), counted
#: rather than slept so that a loaded machine watches as many.
HEALTHY_EVALUATIONS = 20


# Last in the module: its stack started with the straggler's and has been evaluating since.
@pytest.mark.timeout(180)
def test_healthy_fleet_sends_nothing(healthy_stack: BackgroundStack) -> None:
    s, tmp_path = healthy_stack.get(), healthy_stack.path

    def evaluations() -> float:
        return sum(float(r["value"][1]) for r in s.query('gpufleet_detector_evaluations_total{result="success"}'))

    # Run as long as the straggler needed to page (twice over), with the detector evaluating all along.
    assert wait_for(lambda: len(s.query("gpufleet_detector_straggler_score")) == 16, timeout=40), logs(tmp_path)
    assert wait_for(lambda: evaluations() >= HEALTHY_EVALUATIONS, timeout=120), (evaluations(), logs(tmp_path))
    assert s.query('gpufleet_detector_evaluations_total{result="success"} > 5'), logs(tmp_path)
    assert not s.query("ALERTS"), s.query("ALERTS")
    assert s.received == []
