"""``gpufleet-detector serve`` says it is degraded, and why, within an evaluation of a backend fault (issue 34).

Real processes on 127.0.0.1: a small exporter (four nodes' GPU readings, each moving every scrape), a real
Prometheus scraping it every second, and the detector. A node's exporter freezes (serves the same answer): the
detector holds that node (``frozen_target``) and says so; Prometheus is killed with SIGKILL: the next evaluation
fails and ``/health`` says so; Prometheus is started again on its data dir (WAL replayed): the detector is whole
again. No finding opens on any of it.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from wsgiref.simple_server import make_server

import pytest
import requests
import yaml
from prometheus_client.core import CollectorRegistry, GaugeMetricFamily, Metric
from prometheus_client.exposition import make_wsgi_app
from support import BIN, free_port, need_binary, running, wait_http
from test_e2e import _QuietHandler, serve_http

pytestmark = pytest.mark.slow

NODES = [f"node-00{i}" for i in range(4)]
#: The detector's window: room for the four intervals (8 s) a frozen node's readings stay flat before it is held and a
#: missed scrape or two on a loaded machine (a node back is held until its frozen stretch has left the window).
WINDOW = 12


class Readings:
    """Four nodes of two busy GPUs; a node in :attr:`frozen` serves the answer it gave last."""

    def __init__(self) -> None:
        self.frozen: set[str] = set()
        self.last: dict[str, list[tuple[str, str, dict[str, str], float]]] = {}
        self.rng = random.Random(1)

    def node(self, node: str) -> list[tuple[str, str, dict[str, str], float]]:
        if node in self.frozen and node in self.last:
            return self.last[node]
        out = []
        for gpu in ("0", "1"):
            base = {"gpu": gpu, "instance": f"{node}:9445"}
            out += [("gpufleet_gpu_utilization_ratio", "", base, 0.97 + 0.02 * self.rng.random()),
                    ("gpufleet_gpu_power_watts", "", base, 600 + 10 * self.rng.random()),
                    ("gpufleet_gpu_clock_hertz", "sm", base, 1.98e9 + 1e6 * self.rng.random())]
        self.last[node] = out
        return out

    def collect(self) -> Iterator[Metric]:
        fams: dict[str, GaugeMetricFamily] = {}
        for node in NODES:
            for name, clock, labels, value in self.node(node):
                keys = ["gpu", "instance", *(["clock"] if clock else [])]
                fam = fams.setdefault(name, GaugeMetricFamily(name, name, labels=keys))
                fam.add_metric([labels["gpu"], labels["instance"], *([clock] if clock else [])], value)
        yield from fams.values()


def health(url: str) -> str:
    try:
        return requests.get(f"{url}/health", timeout=5).text
    except requests.RequestException as e:
        return f"unreachable: {e}"


def wait_until(check: object, what: str, timeout: float, url: str = "") -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if callable(check) and check():
            return time.monotonic() - start
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout:.0f} s" + (f"; /health: {health(url)!r}" if url else ""))


@contextlib.contextmanager
def prometheus(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with running(argv, log=log) as proc:
        yield proc


def test_serve_says_degraded_and_why_and_opens_nothing(tmp_path: Path) -> None:
    readings = Readings()
    registry = CollectorRegistry()
    registry.register(readings)
    with contextlib.ExitStack() as es:
        exporter = es.enter_context(serve_http(make_server("127.0.0.1", 0, make_wsgi_app(registry),
                                                           handler_class=_QuietHandler)))
        prom_port, det_port = free_port(), free_port()
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms"},
            "scrape_configs": [{"job_name": "gpufleet-agent", "honor_labels": True,
                                "static_configs": [{"targets": [f"127.0.0.1:{exporter}"]}]}]}))
        argv = [need_binary("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"]
        prom_url = f"http://127.0.0.1:{prom_port}"
        first = subprocess.Popen(argv, stdout=open(tmp_path / "prom1.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
        try:
            wait_http(f"{prom_url}/-/ready", timeout=30)
            scraping = time.monotonic()
            cfg = tmp_path / "detector.toml"
            cfg.write_text(f"""
[detector]
profile = "gpufleet"
interval_seconds = 2
window_seconds = {WINDOW}
listen = "127.0.0.1:{det_port}"

[prometheus]
url = "{prom_url}"
timeout_seconds = 1

[findings]
open_after = 2
close_after = 3
""")
            det = es.enter_context(running([str(BIN / "gpufleet-detector"), "serve", "--config", str(cfg)],
                                           log=tmp_path / "detector.log"))
            url = f"http://127.0.0.1:{det_port}"
            wait_http(f"{url}/ready", timeout=60)  # (the detector started while the first window fills)
            time.sleep(max(0.0, scraping + WINDOW + 1 - time.monotonic()))  # a full window of samples
            wait_until(lambda: health(url).startswith("OK\nOK"), "healthy", 30, url)

            # a frozen exporter: the node is held once its readings stayed flat four intervals (8 s)
            readings.frozen = {"node-002"}
            took = wait_until(lambda: "frozen_target: 1 node(s) held: node-002" in health(url), "frozen", 30)
            assert took < 8 + 3 * 2 + 2, took
            metrics = requests.get(f"{url}/metrics", timeout=5).text
            assert 'gpufleet_detector_held_node{node="node-002",reason="frozen_target"} 1.0' in metrics
            assert 'gpufleet_detector_degraded{reason="frozen_target"} 1.0' in metrics
            readings.frozen = set()
            wait_until(lambda: health(url).startswith("OK\nOK"), "healthy again", 30, url)

            # Prometheus killed: degraded within an evaluation (2 s) or two
            os.kill(first.pid, signal.SIGKILL)
            first.wait(timeout=10)
            took = wait_until(lambda: "evaluation_failed" in health(url), "degraded on the kill", 10)
            assert took <= 2 * 2 + 1, took
            assert "DEGRADED" in health(url)
            # started again on its data dir (the WAL replayed): whole again
            with prometheus(argv, tmp_path / "prom2.log"):
                wait_http(f"{prom_url}/-/ready", timeout=60)
                wait_until(lambda: health(url).startswith("OK\nOK"), "healthy after the restart", 60, url)
                metrics = requests.get(f"{url}/metrics", timeout=5).text
                assert "gpufleet_detector_finding{" not in metrics, "no finding on the faults' account"
                assert 'gpufleet_detector_evaluations_total{result="failure"}' in metrics
                assert det.poll() is None
        finally:
            if first.poll() is None:
                first.kill()
                first.wait(timeout=10)
