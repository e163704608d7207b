"""Fencing measured in a live run (issue 34): every process real, in real time, faults injected while it runs.

A simulated fleet of 12 nodes x 4 GPUs in three jobs (:mod:`gpufleet.sim.live`: one real ``gpufleet-agent`` per
node on the fake NVML), scraped every second by a real Prometheus that evaluates the production alert rules
(``alerts/gpufleet.rules.yml``, their timing scaled as the detector's interval is: ``for: 2m`` at 15 s evaluations
is eight evaluations, so 16 s at 2 s), ``gpufleet-detector serve`` evaluating every 2 s against it, a real
Alertmanager routing ``GpufleetStragglerFound`` to the remediation service's webhook, and the service itself
(``gpufleet-detector remediate``, acting, not dry-run) draining nodes in a real Slurm cluster (munged, slurmctld,
slurmd on 127.0.0.1: :mod:`slurm_cluster`), its ``scontrol`` a wrapper that logs every call.

While it runs: a workload-routed slowness (data skew on one node of the third job, whose checkpoints make phase
edges), a frozen exporter (a node's readings stop changing), Prometheus killed with SIGKILL and restarted on its
data dir, then hardware faults injected (several kinds, one node each); the service is killed with SIGKILL in the
middle of its first drain (the journal's intent written, ``scontrol update`` under way) and started again.

Measured from the outside (a monitor polling the detector's ``/metrics``, Prometheus' ``/api/v1/alerts`` and
``scontrol show node`` every quarter second): per hardware fault, the detector's evaluation count when its page
fired (``GpufleetStragglerFound`` firing in Prometheus) and when slurmctld first showed the node drained; every
other node drained is a false fence. After the run: the journal and the scontrol log say whether anything was
repeated, and the restarted service's log, counts and Alertmanager notifications whether anything was lost.

``.venv/bin/python tests/system/live_remediation.py [--short] [--json FILE]``
(tests/system/test_remediate_live.py runs ``--short`` and asserts the targets).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import requests
import yaml
from live_watch import Monitor, Observed, Service, health, http_sink, wait
from slurm_cluster import slurm_cluster
from support import BIN, REPO, free_port, need_binary, running, stop, wait_http
from test_e2e import fast_rules

from gpufleet.sim.faults import SEVERITY_WORDS
from gpufleet.sim.live import LiveFleet

NODES = [f"node-{i:03d}" for i in range(12)]
JOBS = {"job-a": NODES[0:4], "job-b": NODES[4:8], "job-c": NODES[8:12]}
#: The detector's evaluation interval here; production's is 15 s: the alert rules' ``for`` and the service's
#: ``min_open_seconds`` are scaled by INTERVAL / 15 so that they last as many evaluations as in production.
INTERVAL = 2.0
SCALE = INTERVAL / 15.0
WORKLOAD_NODE, FROZEN_NODE = "node-009", "node-010"

SCENARIO = f"""
name = "remediate-live"
description = "12 nodes x 4 GPUs, three synchronous jobs; the third checkpoints and has a data-skewed node"
seed = 34
duration = "2h"
step = 1

[[sites]]
name = "site-a"
nodes = 12
gpus_per_node = 4

[jobs]
[[jobs.fixed]]
id = "job-a"
nodes = {json.dumps(JOBS["job-a"])}
[[jobs.fixed]]
id = "job-b"
nodes = {json.dumps(JOBS["job-b"])}
parallel = "hybrid"
compute_s = 1.4
intensity = 0.7
[[jobs.fixed]]
id = "job-c"
nodes = {json.dumps(JOBS["job-c"])}
checkpoint_every = "60s"
checkpoint_seconds = 10

[[workloads]]  # longer sequences routed to one node: the job's owner's business, never the node's
job = "job-c"
pattern = "data_skew"
owner = "team-c"
node = "{WORKLOAD_NODE}"
extra = 0.3
start = "30s"
"""

#: (kind, node, gpu; rail for a NIC fault) of the hardware faults, each on a node of its own, two per job at most.
HARDWARE = [("clock_stuck_low", "node-001", 2), ("power_brake", "node-006", None),
            ("pcie_downgrade", "node-008", 1), ("ib_link_degraded", "node-005", 1)]
#: Injected at the start, before the controls: a failed fan heats the node's GPUs over a minute or so before they
#: throttle (the simulator's thermal RC), so it starts early to page within the run.
EARLY = [("cooling_failure", "node-003", None)]
SHORT_HARDWARE = HARDWARE[:2]

DETECTOR = """
[detector]
profile = "gpufleet"
interval_seconds = {interval}
window_seconds = 12
listen = "127.0.0.1:{port}"

[prometheus]
url = "{prometheus}"
timeout_seconds = 1

[findings]
open_after = 2
close_after = 3
"""

REMEDIATE = """
[remediation]
enabled = true
dry_run = false
backend = "slurm"
detectors = ["{detector}"]
alertmanager = "{alertmanager}"
listen = "127.0.0.1:{port}"
lock_file = "{d}/remediate.lock"
journal = "{d}/remediate.jsonl"
interval_seconds = 1
timeout_seconds = 5
scontrol = "{d}/scontrol"
min_open_seconds = {min_open}
max_per_hour = 8
max_per_job = 2
"""

#: scontrol as the service runs it: every call logged; the first drain is held (a marker file says so) long
#: enough for the run to kill the service in the middle of it, then carried out.
SCONTROL = """#!/bin/sh
echo "$*" >> {d}/scontrol.calls
case "$*" in
  *State=DRAIN*) if [ ! -e {d}/held-once ]; then : > {d}/held-once; : > {d}/in-drain; sleep 1.5; fi ;;
esac
exec {scontrol} "$@"
"""


def settle(det: str) -> None:
    """Wait until the detector is healthy and stays so for a window and two evaluations (the window refilled
    after a gap, so that what follows starts from a whole detector)."""
    wait(lambda: health(det).startswith("OK\nOK"), "the detector healthy", 60)
    time.sleep(12 + 2 * INTERVAL)
    wait(lambda: health(det).startswith("OK\nOK"), "the detector healthy, a window later", 60)


def run_live(d: Path, short: bool = False, say: Any = None) -> dict[str, Any]:
    """One live run under ``d``; the report (:func:`report`'s input)."""
    say = say or (lambda msg: sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n"))
    hardware = SHORT_HARDWARE if short else HARDWARE
    (d / "scenario.toml").write_text(SCENARIO)
    events: list[tuple[float, str]] = []

    def event(what: str) -> None:
        events.append((time.time(), what))
        say(what)

    t_start = time.monotonic()
    with contextlib.ExitStack() as es:
        senv = es.enter_context(slurm_cluster(d, NODES))
        env = {**os.environ, **senv}
        (d / "scontrol").write_text(SCONTROL.format(d=d, scontrol=need_binary("scontrol")))
        (d / "scontrol").chmod(0o755)
        sink_port, notifications = es.enter_context(http_sink())
        fleet = es.enter_context(LiveFleet(str(d / "scenario.toml"), seed=34, speed=1.0, tick=1.0,
                                           startup_timeout=60))
        am_port, det_port, rem_port, prom_port = free_port(), free_port(), free_port(), free_port()
        am, det = f"http://127.0.0.1:{am_port}", f"http://127.0.0.1:{det_port}"
        prom = f"http://127.0.0.1:{prom_port}"
        (d / "am.yml").write_text(yaml.safe_dump({
            "route": {"receiver": "sink", "group_by": ["alertname", "incident"], "group_wait": "0s",
                      "group_interval": "1s", "repeat_interval": "1h",
                      "routes": [{"matchers": ['alertname="GpufleetStragglerFound"'], "receiver": "remediate"}]},
            "receivers": [{"name": "remediate", "webhook_configs": [
                {"url": f"http://127.0.0.1:{rem_port}/webhook", "send_resolved": True},
                {"url": f"http://127.0.0.1:{sink_port}/page", "send_resolved": True}]},
                {"name": "sink", "webhook_configs": [{"url": f"http://127.0.0.1:{sink_port}/other"}]}]}))
        am_bin = shutil.which("prometheus-alertmanager") or need_binary("alertmanager")
        es.enter_context(running([am_bin, f"--config.file={d / 'am.yml'}", f"--storage.path={d / 'am'}",
                                  f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="],
                                 log=d / "alertmanager.log"))
        (d / "rules.yml").write_text(fast_rules((REPO / "alerts" / "gpufleet.rules.yml").read_text(), scale=SCALE))
        (d / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
            "rule_files": [str(d / "rules.yml")],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
            "scrape_configs": [
                {"job_name": "gpufleet-agent", "file_sd_configs": [{"files": [str(fleet.targets_file)]}]},
                {"job_name": "gpufleet-detector", "honor_labels": True,
                 "static_configs": [{"targets": [f"127.0.0.1:{det_port}"]}]}]}))
        prom_argv = [need_binary("prometheus"), f"--config.file={d / 'prometheus.yml'}",
                     f"--storage.tsdb.path={d / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"]
        prom_proc = subprocess.Popen(prom_argv, stdout=open(d / "prometheus-1.log", "wb"),  # noqa: SIM115
                                     stderr=subprocess.STDOUT)
        es.callback(lambda: stop(prom_proc))
        wait_http(f"{prom}/-/ready", timeout=60)
        wait_http(f"{am}/-/ready", timeout=60)
        (d / "detector.toml").write_text(DETECTOR.format(interval=INTERVAL, port=det_port, prometheus=prom))
        (d / "remediate.toml").write_text(REMEDIATE.format(detector=det, alertmanager=am, port=rem_port, d=d,
                                                           min_open=round(120 * SCALE, 3)))
        time.sleep(4)  # samples before the detector starts (it takes a few seconds more to evaluate)
        es.enter_context(running([str(BIN / "gpufleet-detector"), "serve", "--config", str(d / "detector.toml")],
                                 log=d / "detector.log"))
        wait_http(f"{det}/ready", timeout=60)
        wait(lambda: health(det).startswith("OK\nOK"), "the detector healthy", 60)
        service = Service(d / "remediate.toml", senv, d)
        es.callback(service.stop)
        service.start()
        wait_http(f"http://127.0.0.1:{rem_port}/health", timeout=30)
        mon = es.enter_context(Monitor(det, prom, env))

        def kill_mid_drain() -> None:  # the service killed in its first drain, started again once it went through
            wait(lambda: (d / "in-drain").exists() or finished.is_set(), "the first drain begun", 400, 0.05,
                 fail=False)
            if not (d / "in-drain").exists():
                return
            service.kill()
            event("remediation service killed (SIGKILL) mid-drain")
            wait(lambda: len(mon.seen.drains) >= 1, "the held drain carried out", 15, 0.05)
            service.start()
            event("remediation service started again")

        finished = threading.Event()
        killer = threading.Thread(target=kill_mid_drain, daemon=True, name="kill-mid-drain")
        killer.start()
        event("up: fleet, Slurm, Prometheus, Alertmanager, detector, remediation service")
        truth = []

        def inject(kind: str, node: str, gpu: int | None) -> None:
            onset = fleet.inject(kind, node, gpu, SEVERITY_WORDS["obvious"])
            truth.append({"kind": kind, "node": node, "gpu": gpu, "onset": onset, "t": time.time()})
            event(f"injected {kind} on {node}" + (f" GPU {gpu}" if gpu is not None else ""))

        for kind, node, gpu in [] if short else EARLY:
            inject(kind, node, gpu)

        # controls: the workload node (data skew from 30 s) and the checkpoints run all along; a frozen exporter
        fleet.freeze(FROZEN_NODE)
        event(f"frozen exporter on {FROZEN_NODE}")
        if short:  # the hardware faults while the exporter is frozen (a held node holds only itself)
            for kind, node, gpu in hardware:
                inject(kind, node, gpu)
                time.sleep(3)
        wait(lambda: "frozen_target" in mon.seen.degraded, "the frozen target held", 30)
        fleet.freeze(FROZEN_NODE, False)
        event(f"{FROZEN_NODE} moving again")
        if not short:  # Prometheus killed and started again, then the hardware faults, a few seconds apart
            settle(det)
            prom_proc.send_signal(signal.SIGKILL)
            prom_proc.wait(timeout=10)
            event("Prometheus killed (SIGKILL)")
            wait(lambda: "evaluation_failed" in health(det), "the detector degraded", 20)
            time.sleep(3)
            prom_proc = subprocess.Popen(prom_argv, stdout=open(d / "prometheus-2.log", "wb"),  # noqa: SIM115
                                         stderr=subprocess.STDOUT)
            es.callback(lambda: stop(prom_proc))
            event("Prometheus started again on its data dir")
            wait_http(f"{prom}/-/ready", timeout=60)
            settle(det)
            event("the detector healthy again")
            for kind, node, gpu in hardware:
                inject(kind, node, gpu)
                time.sleep(5)
        hw_nodes = {t["node"] for t in truth}
        wait(lambda: hw_nodes <= set(mon.seen.drains), "every hardware fault's node drained", 40 if short else 90,
             fail=False)
        finished.set()
        killer.join(timeout=20)
        time.sleep(4)  # three more rounds of the service at least: anything repeated or fenced late would show
        event("done")
        metrics = requests.get(f"http://127.0.0.1:{rem_port}/metrics", timeout=5).text
        am_alerts = requests.get(f"{am}/api/v2/alerts", timeout=5).json()
        fleet.check()
        result = {"short": short, "truth": truth, "events": events, "seen": mon.seen,
                  "journal": [json.loads(x) for x in _lines(d / "remediate.jsonl")],
                  "scontrol_calls": _lines(d / "scontrol.calls"),
                  "service_logs": [service.log(i) for i in range(1, service.runs + 1)],
                  "service_metrics": metrics, "am_alerts": am_alerts, "notifications": list(notifications),
                  "seconds": time.monotonic() - t_start}
    return result


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def report(r: dict[str, Any]) -> dict[str, Any]:
    """Per fault (kind, node, page eval, drain eval, evaluations after page) and the totals."""
    seen: Observed = r["seen"]
    rows = []
    hw_nodes = {t["node"] for t in r["truth"]}
    for t in r["truth"]:
        pages = sorted((v[1], inc) for inc, v in seen.pages.items() if v[0] == t["node"])
        inc = pages[0][1] if pages else None
        delivered = [at for at, path, a in r["notifications"] if inc and path == "/page"
                     and a["labels"].get("incident") == inc and a.get("status") == "firing"]
        # the page: the alert seen firing or its notification delivered (to the service's webhook and the
        # harness's receiver at once), whichever came first; its evaluation: the count read last before it
        page_t = min([pages[0][0], *delivered]) if pages else None
        page_eval = None if page_t is None else max(
            (n for at, n in seen.evaluation_log if at <= page_t), default=0)
        drain = seen.drains.get(t["node"])
        drain_eval = drain[2] if drain else None
        after = drain_eval - page_eval if page_eval is not None and drain_eval is not None else None
        rows.append({"kind": t["kind"], "node": t["node"], "incident": inc,
                     "page_eval": page_eval, "drain_eval": drain_eval, "evaluations_after_page": after,
                     "seconds_after_page": round(drain[1] - page_t, 1) if page_t and drain else None,
                     "seconds_onset_to_page": round(page_t - t["t"], 1) if page_t else None})
    false = {n: v[0] for n, v in seen.drains.items() if n not in hw_nodes}
    drain_calls: dict[str, int] = {}
    for c in r["scontrol_calls"]:
        if "State=DRAIN" in c:
            node = next(f.removeprefix("NodeName=") for f in c.split() if f.startswith("NodeName="))
            drain_calls[node] = drain_calls.get(node, 0) + 1
    phases: dict[tuple[str, str], list[str]] = {}
    for rec in r["journal"]:
        phases.setdefault((rec["node"], rec["incident"]), []).append(rec["phase"])
    restarted = r["service_logs"][-1] if len(r["service_logs"]) > 1 else ""
    control_nodes = sorted(set(NODES) - hw_nodes)
    return {
        "rows": rows,
        "hardware_faults": len(rows),
        "paged": sum(1 for x in rows if x["page_eval"] is not None),
        "fenced_within_2_evaluations_of_page": sum(1 for x in rows if x["evaluations_after_page"] is not None
                                                   and x["evaluations_after_page"] <= 2),
        "evaluations_after_page_max": max((x["evaluations_after_page"] for x in rows
                                           if x["evaluations_after_page"] is not None), default=None),
        "false_fences": false,
        "control_nodes": control_nodes,
        "incidents": {i: {"node": lb.get("node"), "route": lb.get("route"), "kinds": sorted(seen.kinds.get(i, ()))}
                      for i, lb in sorted(seen.incidents.items(), key=lambda kv: kv[1].get("node", ""))},
        "detector_degraded_reasons": sorted(seen.degraded),
        "drain_calls_per_node": drain_calls,
        "journal_phases": {f"{n}/{i}": p for (n, i), p in phases.items()},
        "repeated": {n: c for n, c in drain_calls.items() if c > 1}
                    | {f"{n}/{i}": p for (n, i), p in phases.items() if p != ["intent", "done"]},
        "found_done_after_restart": "found done on the node after a restart" in restarted,
        "restarted_counts_done": 'gpufleet_detector_remediation_decisions_total{action="fence",outcome="done",'
                                 'reason="ok"}' in r["service_metrics"],
        "notified_done": sorted({a["labels"].get("node", "") for a in r["am_alerts"]
                                 if a["labels"].get("alertname") == "GpufleetRemediation"
                                 and a["labels"].get("outcome") == "done"}),
        "events": [f"{time.strftime('%H:%M:%S', time.gmtime(t))} {what}" for t, what in r["events"]],
        "monitor_errors": seen.errors[:5],
        "seconds": round(r["seconds"], 1),
    }


def table(rep: dict[str, Any]) -> str:
    lines = ["| kind | node | onset to page (s) | page eval | drain eval | evaluations after page | "
             "seconds after page |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for x in rep["rows"]:
        lines.append(f"| {x['kind']} | {x['node']} | {x['seconds_onset_to_page']} | {x['page_eval']} | "
                     f"{x['drain_eval']} | {x['evaluations_after_page']} | {x['seconds_after_page']} |")
    lines.append("")
    lines.append(f"{rep['fenced_within_2_evaluations_of_page']} of {rep['hardware_faults']} hardware faults fenced "
                 f"within 2 evaluations of their page (max {rep['evaluations_after_page_max']}); "
                 f"false fences: {len(rep['false_fences'])} {rep['false_fences'] or ''}; "
                 f"repeated: {rep['repeated'] or 'nothing'}; the drain begun before the restart reported by the "
                 f"restarted service: {rep['found_done_after_restart']}; {rep['seconds']} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tests/system/live_remediation.py")
    ap.add_argument("--short", action="store_true",
                    help="two hardware faults while an exporter is frozen, no Prometheus kill (the slow test)")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--keep", help="run under this directory and keep it (logs, journal, scontrol calls)")
    args = ap.parse_args(argv)
    with contextlib.ExitStack() as es:
        d = Path(args.keep) if args.keep else Path(es.enter_context(tempfile.TemporaryDirectory(prefix="live-rem-")))
        d.mkdir(parents=True, exist_ok=True)
        rep = report(run_live(d, args.short))
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1) + "\n")
    sys.stdout.write(table(rep) + "\n" + json.dumps({k: v for k, v in rep.items() if k != "rows"}, indent=1) + "\n")
    ok = (rep["fenced_within_2_evaluations_of_page"] == rep["hardware_faults"] and not rep["false_fences"]
          and not rep["repeated"] and rep["found_done_after_restart"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
