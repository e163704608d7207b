"""What the live remediation run (:mod:`live_remediation`) watches and drives: the monitor polling the detector,
Prometheus' alerts and slurmctld; an Alertmanager receiver of its own; the remediation service as a process it
can kill and start again."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import requests
from prometheus_client.parser import text_string_to_metric_families
from support import BIN


@dataclass
class Observed:
    """What the monitor saw, each with the detector's evaluation count at the time."""

    evaluations: int = 0
    evaluation_log: list[tuple[float, int]] = field(default_factory=list)  # (time read, count) of every read
    pages: dict[str, tuple[str, float, int]] = field(default_factory=dict)  # incident -> (node, t, evaluation)
    drains: dict[str, tuple[str, float, int]] = field(default_factory=dict)  # node -> (reason, t, evaluation)
    incidents: dict[str, dict[str, str]] = field(default_factory=dict)  # incident -> labels (first seen)
    kinds: dict[str, set[str]] = field(default_factory=dict)  # incident -> its finding kinds (any time)
    degraded: set[str] = field(default_factory=set)  # the reasons the detector gave at any time
    errors: list[str] = field(default_factory=list)


class Monitor:
    """Polls the detector, Prometheus' alerts and slurmctld every ``period`` seconds (from its own thread)."""

    def __init__(self, detector: str, prometheus: str, env: dict[str, str], period: float = 0.25) -> None:
        self.detector, self.prometheus, self.env, self.period = detector, prometheus, env, period
        self.seen = Observed()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="live-monitor")
        self.session = requests.Session()

    def __enter__(self) -> Monitor:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.poll()
            except Exception as e:  # a poll that failed is noted, the next one tries again
                self.seen.errors.append(f"{time.time():.1f} {type(e).__name__}: {e}")

    def poll(self) -> None:
        """One look. A page takes the evaluation count read before it was seen and a drain the count read after:
        an evaluation completing during the look counts against the service, never for it."""
        seen = self.seen
        self._detector()
        with contextlib.suppress(requests.RequestException, ValueError):
            alerts = self.session.get(f"{self.prometheus}/api/v1/alerts", timeout=2).json()["data"]["alerts"]
            for a in alerts:
                lb = a.get("labels", {})
                if (lb.get("alertname") == "GpufleetStragglerFound" and a.get("state") == "firing"
                        and lb.get("incident") not in seen.pages):
                    seen.pages[lb["incident"]] = (lb.get("node", ""), time.time(), seen.evaluations)
        p = subprocess.run(["scontrol", "show", "node", "--oneliner"], capture_output=True, text=True,
                           env=self.env, timeout=10, check=False)
        t = time.time()
        drained = {}
        for line in p.stdout.splitlines():
            name = line.split()[0].removeprefix("NodeName=") if line.strip() else ""
            state = next((f for f in line.split() if f.startswith("State=")), "")
            if "DRAIN" in state and name not in seen.drains:
                drained[name] = line.split(" Reason=", 1)[1].strip() if " Reason=" in line else ""
        if drained:
            self._detector()
            for name, reason in drained.items():
                seen.drains[name] = (reason, t, seen.evaluations)

    def _detector(self) -> None:
        seen = self.seen
        try:
            text = self.session.get(f"{self.detector}/metrics", timeout=2).text
            evals = 0.0
            for fam in text_string_to_metric_families(text):
                for s in fam.samples:
                    if s.name == "gpufleet_detector_evaluations_total":
                        evals += s.value
                    elif s.name == "gpufleet_detector_incident":
                        seen.incidents.setdefault(s.labels.get("incident", ""), dict(s.labels))
                    elif s.name == "gpufleet_detector_incident_finding":
                        seen.kinds.setdefault(s.labels.get("incident", ""), set()).add(s.labels.get("kind", ""))
                    elif s.name == "gpufleet_detector_degraded" and s.value > 0:
                        seen.degraded.add(s.labels.get("reason", ""))
            seen.evaluations = max(seen.evaluations, int(evals))
            # read back by then: every evaluation it counts completed before this time
            seen.evaluation_log.append((time.time(), seen.evaluations))
        except requests.RequestException:
            pass


class _Sink(BaseHTTPRequestHandler):
    """The harness's own Alertmanager receiver: every notification, with its arrival time."""

    got: list[tuple[float, str, dict[str, Any]]]

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        for a in body.get("alerts", []):
            self.got.append((time.time(), self.path, a))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


@contextlib.contextmanager
def http_sink() -> Iterator[tuple[int, list[tuple[float, str, dict[str, Any]]]]]:
    got: list[tuple[float, str, dict[str, Any]]] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("Sink", (_Sink,), {"got": got}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_port, got
    finally:
        server.shutdown()
        server.server_close()


def wait(check: Any, what: str, timeout: float, step: float = 0.2, fail: bool = True) -> bool:
    """Wait for ``check()``; on a timeout raise (``fail``) or say False (what is measured then shows it)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if check():
            return True
        time.sleep(step)
    if fail:
        raise TimeoutError(f"{what}: not within {timeout:.0f} s")
    return False


def health(url: str) -> str:
    try:
        return requests.get(f"{url}/health", timeout=2).text
    except requests.RequestException as e:
        return f"unreachable: {e}"


@dataclass
class Service:
    """The remediation service as production runs it: ``gpufleet-detector remediate --config FILE``."""

    config: Path
    env: dict[str, str]
    d: Path
    runs: int = 0
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.runs += 1
        out = open(self.d / f"remediate-{self.runs}.log", "wb")  # noqa: SIM115 - the process keeps it
        self.proc = subprocess.Popen([str(BIN / "gpufleet-detector"), "remediate", "--config", str(self.config)],
                                     env={**os.environ, **self.env}, stdout=out, stderr=subprocess.STDOUT)
        out.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self, run: int) -> str:
        return (self.d / f"remediate-{run}.log").read_text(errors="replace")


