"""A real Prometheus (and vmagent) remote-writing a fleet to the detector's receiver: the streaming path gives the
query path's features and findings.

A synthetic fleet (a thermal straggler planted halfway) is served to the sender as a scrape target, one
timestamped frame per scrape (``honor_timestamps``, ``honor_labels``: the recording's own times and labels),
its time moved to begin a minute from now and quickened (remote write sends only samples newer than the
sender's start; a scrape takes samples at most 10 minutes ahead of the clock). Prometheus remote-writes what the
detector's ``remote-write-config`` prints (the profile's keep-list) over TLS with basic auth, and keeps the same
samples in its TSDB for the query API. Every query of the profile is then answered from the stream and from
Prometheus' query API alike, and two detectors, one on each path, evaluate the same instants: their findings are
identical.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import requests
import trustme
import yaml
from support import free_port, need_binary, running, wait_http
from test_detector_core import STEP, T0, Fault, Synth, fast_cfg, synth

from gpufleet.detector.config import DetectorConfig
from gpufleet.detector.engine import Detector
from gpufleet.detector.receiver import prometheus_config as remote_write_config
from gpufleet.detector.receiver.server import RemoteWriteReceiver
from gpufleet.detector.sources.profiles import queries
from gpufleet.detector.sources.prometheus import PrometheusSource
from gpufleet.detector.sources.remote_write import StreamStore
from gpufleet.detector.sources.source import Source
from gpufleet.serving.webconfig import load_web_config

pytestmark = pytest.mark.slow

SECONDS = 1200.0
#: The fleet's time runs this much faster than the recording's (3.75 s between scrapes, a 30 s window): a
#: sender takes samples at most 10 minutes ahead of its clock and sends only those newer than its start.
PACE = 4.0


def at(start: float, seconds: float) -> float:
    """The fleet's time ``seconds`` (of the recording) after its start."""
    return start + seconds / PACE


def cfg_paced() -> DetectorConfig:
    return fast_cfg(detector__window_seconds=120.0 / PACE, detector__interval_seconds=60.0 / PACE)
#: Seconds between the sender's scrapes: each scrape serves the next frame (15 s of the fleet).
SCRAPE = "200ms"


def frames(recording: Path, start: float) -> list[bytes]:
    """The recording as Prometheus text expositions, one per timestamp, in time order: its time ``T0`` moved to
    ``start`` and its pace quickened :data:`PACE` times."""
    by_t: dict[float, list[str]] = {}
    for line in recording.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        series, value, ts = line.rsplit(" ", 2)
        t = at(start, float(ts) - T0)
        by_t.setdefault(t, []).append(f"{series} {value} {round(t * 1000)}")
    return [("\n".join(by_t[t]) + "\n").encode() for t in sorted(by_t)]


class FrameTarget:
    """A scrape target serving the next frame at each scrape (the last one again once all were served)."""

    def __init__(self, pages: list[bytes]) -> None:
        self.pages, self.served = pages, 0
        target = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = target.pages[min(target.served, len(target.pages) - 1)]
                target.served += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FrameTarget:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def secured_receiver(tmp: Path, store: StreamStore) -> tuple[RemoteWriteReceiver, Path, str]:
    """A receiver with TLS and basic auth (user prometheus); its CA file and password."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_pem.write_to_path(str(tmp / "rw.key"))
    cert.cert_chain_pems[0].write_to_path(str(tmp / "rw.crt"))
    ca.cert_pem.write_to_path(str(tmp / "ca.crt"))
    pw_hash = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    (tmp / "web.yml").write_text("tls_server_config:\n  cert_file: rw.crt\n  key_file: rw.key\n"
                                 f"basic_auth_users:\n  prometheus: '{pw_hash}'\n")
    rx = RemoteWriteReceiver("127.0.0.1:0", store, load_web_config(tmp / "web.yml"))
    return rx, tmp / "ca.crt", "s3cret"


def wait_for(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, StreamStore, float]]:
    """Prometheus scraping the fleet and remote-writing it to a receiver: (its URL, the store, the time offset)."""
    tmp = tmp_path_factory.mktemp("rw")
    rec = synth(tmp / "rec.om", Synth(nodes=2, seconds=SECONDS, faults=[Fault("thermal", 1, 3, 600.0)], seed=7))
    # Remote write sends the samples newer than the sender's start: the fleet's time begins a little after now
    # (its 5 minutes are scraped in seconds: a scrape takes samples up to 10 minutes ahead of the clock)
    start = float(math.ceil(time.time() / 60.0) * 60.0 + 60.0)
    cfg = cfg_paced()
    store = StreamStore(remote_write_config.sample_names(cfg), retention=2 * SECONDS)
    rx, ca_file, password = secured_receiver(tmp, store)
    rw = yaml.safe_load(remote_write_config.render(cfg, rx.url, batch_send_deadline="1s"))["remote_write"]
    rw[0]["basic_auth"] = {"username": "prometheus", "password": password}
    rw[0]["tls_config"] = {"ca_file": str(ca_file)}
    pages = frames(rec, start)
    with FrameTarget(pages) as target:
        prom_cfg = {"global": {"scrape_interval": SCRAPE, "scrape_timeout": SCRAPE},
                    "scrape_configs": [{"job_name": "fleet", "honor_labels": True, "honor_timestamps": True,
                                        "static_configs": [{"targets": [f"127.0.0.1:{target.port}"]}]}],
                    "remote_write": rw}
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(prom_cfg))
        port = free_port()
        argv = [need_binary("prometheus"), f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"]
        rx.serve_in_thread()
        try:
            with running(argv, log=tmp / "prometheus.log"):
                url = f"http://127.0.0.1:{port}"
                wait_http(f"{url}/-/ready", timeout=60)
                last = at(start, SECONDS)
                wait_for(lambda: target.served > len(pages) + 5 and store.newest >= last, 120,
                         "the stream did not reach the fleet's end")
                yield url, store, start
        finally:
            rx.shutdown()
            if rx.stats.requests["ok"] == 0:
                print((tmp / "prometheus.log").read_text()[-3000:])


def test_stream_answers_every_query_as_prometheus_does(fed: tuple[str, StreamStore, float]) -> None:
    url, store, start = fed
    prom = PrometheusSource(url, timeout=10)
    compared = 0
    w = cfg_paced().window_seconds
    for t in (at(start, 300.0), at(start, 660.0 + STEP / 3), at(start, SECONDS)):
        for q in queries("gpufleet"):
            want = {tuple(sorted(lab.items())): v for lab, v in prom.query(q, t, w)}
            got = {tuple(sorted(lab.items())): v for lab, v in store.query(q, t, w)}
            assert set(want) == set(got), (q.promql(w), t)
            for k, v in want.items():
                assert math.isclose(v, got[k], rel_tol=1e-9, abs_tol=1e-12), (q.promql(w), t, k, v, got[k])
                compared += 1
    assert compared > 500
    assert prom.query_errors == 0


def test_findings_are_identical_on_the_query_and_streaming_paths(fed: tuple[str, StreamStore, float]) -> None:
    url, store, start = fed
    cfg = cfg_paced()
    paths: dict[str, Source] = {"query": PrometheusSource(url, timeout=10), "stream": store}
    found = {}
    for name, src in paths.items():
        det = Detector(cfg, src)
        for i in range(8):
            det.evaluate(at(start, 720.0 + 60.0 * i))
        found[name] = [f.to_json() for f in det.tracker.all_findings()]
    assert found["query"] == found["stream"]
    assert any(f["kind"] == "straggler" and f["node"] == "node-001" and f["gpu"] == "3" and f["cause"] == "thermal"
               for f in found["stream"])


def test_the_sender_was_authenticated_and_only_the_keep_list_arrived(fed: tuple[str, StreamStore, float]) -> None:
    url, store, _ = fed
    wanted = set(remote_write_config.sample_names(cfg_paced()))
    assert store.metric_names() <= wanted
    assert "up" not in store.metric_names() and "scrape_duration_seconds" not in store.metric_names()
    # Prometheus holds the series the keep-list dropped: they never left it
    up = requests.get(f"{url}/api/v1/query", params={"query": "up"}, timeout=10).json()["data"]["result"]
    assert up


@pytest.fixture(scope="module")
def fed_by_vmagent(fed: tuple[str, StreamStore, float],
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[StreamStore]:
    """vmagent scraping the same fleet (the same times) and remote-writing it to a receiver of its own, with the
    keep-list as its ``-remoteWrite.urlRelabelConfig``."""
    _, _, start = fed
    tmp = tmp_path_factory.mktemp("vmagent")
    rec = synth(tmp / "rec.om", Synth(nodes=2, seconds=SECONDS, faults=[Fault("thermal", 1, 3, 600.0)], seed=7))
    cfg = cfg_paced()
    store = StreamStore(remote_write_config.sample_names(cfg), retention=2 * SECONDS)
    rx, ca_file, password = secured_receiver(tmp, store)
    rw = yaml.safe_load(remote_write_config.render(cfg, rx.url))["remote_write"][0]
    (tmp / "relabel.yml").write_text(yaml.safe_dump(rw["write_relabel_configs"]))
    pages = frames(rec, start)
    with FrameTarget(pages) as target:
        (tmp / "scrape.yml").write_text(yaml.safe_dump(
            {"global": {"scrape_interval": SCRAPE},
             "scrape_configs": [{"job_name": "fleet", "honor_labels": True, "honor_timestamps": True,
                                 "static_configs": [{"targets": [f"127.0.0.1:{target.port}"]}]}]}))
        argv = [need_binary("vmagent"), f"-promscrape.config={tmp / 'scrape.yml'}",
                f"-httpListenAddr=127.0.0.1:{free_port()}", f"-remoteWrite.url={rx.url}",
                "-remoteWrite.basicAuth.username=prometheus", f"-remoteWrite.basicAuth.password={password}",
                f"-remoteWrite.tlsCAFile={ca_file}", f"-remoteWrite.urlRelabelConfig={tmp / 'relabel.yml'}",
                "-remoteWrite.flushInterval=1s", f"-remoteWrite.tmpDataPath={tmp / 'vmagent-data'}",
                "-loggerLevel=ERROR"]
        rx.serve_in_thread()
        try:
            with running(argv, log=tmp / "vmagent.log"):
                wait_for(lambda: target.served > len(pages) + 5 and store.newest >= at(start, SECONDS), 120,
                         "vmagent's stream did not reach the fleet's end")
                yield store
        finally:
            rx.shutdown()


def test_vmagent_stream_gives_the_same_findings(fed: tuple[str, StreamStore, float],
                                                fed_by_vmagent: StreamStore) -> None:
    url, _, start = fed
    cfg = cfg_paced()
    w = cfg.window_seconds
    prom = PrometheusSource(url, timeout=10)
    t = at(start, 660.0 + STEP / 3)
    for q in queries("gpufleet"):
        want = {tuple(sorted(lab.items())): v for lab, v in prom.query(q, t, w)}
        got = {tuple(sorted(lab.items())): v for lab, v in fed_by_vmagent.query(q, t, w)}
        assert set(want) == set(got), q.promql(w)
        assert all(math.isclose(v, got[k], rel_tol=1e-9, abs_tol=1e-12) for k, v in want.items()), q.promql(w)
    found = {}
    for name, src in (("query", prom), ("vmagent", fed_by_vmagent)):
        det = Detector(cfg, src)
        for i in range(8):
            det.evaluate(at(start, 720.0 + 60.0 * i))
        found[name] = [f.to_json() for f in det.tracker.all_findings()]
    assert found["query"] == found["vmagent"] and found["vmagent"]



def test_serve_warms_up_from_the_query_api_then_reads_the_stream(tmp_path: Path) -> None:
    """``serve`` with ``remote_write_listen``: Prometheus scrapes a live target and remote-writes what
    ``remote-write-config`` prints; the detector evaluates from the query API until the stream holds a window,
    then from the stream, and counts the requests it received."""
    import subprocess
    import sys

    body = "".join(f'gpufleet_gpu_utilization_ratio{{instance="node-{n}:9445",gpu="{g}"}} 0.9\n'
                   f'gpufleet_gpu_power_watts{{instance="node-{n}:9445",gpu="{g}"}} 500\n'
                   for n in range(2) for g in range(4)) + "not_read_by_the_detector 1\n"
    live = FrameTarget([body.encode()])
    rw_port, port, prom_port = free_port(), free_port(), free_port()
    cfg = tmp_path / "d.toml"
    cfg.write_text(f'[detector]\ninterval_seconds = 0.5\nwindow_seconds = 3\nlisten = "127.0.0.1:{port}"\n'
                   f'remote_write_listen = "127.0.0.1:{rw_port}"\n'
                   f'[prometheus]\nurl = "http://127.0.0.1:{prom_port}"\n')
    printed = subprocess.run([sys.executable, "-m", "gpufleet.detector.service.cli", "remote-write-config", "--config",
                              str(cfg)], check=True, capture_output=True, text=True, timeout=60).stdout
    rw = yaml.safe_load(printed)["remote_write"]
    assert rw[0]["url"] == f"http://127.0.0.1:{rw_port}/api/v1/write"
    rw[0]["queue_config"]["batch_send_deadline"] = "200ms"
    with live:
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(
            {"global": {"scrape_interval": "500ms"}, "remote_write": rw,
             "scrape_configs": [{"job_name": "fleet", "static_configs": [{"targets": [f"127.0.0.1:{live.port}"]}]}]}))
        prom = [need_binary("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"]
        serve = [sys.executable, "-m", "gpufleet.detector.service.cli", "serve", "--config", str(cfg)]
        with running(prom, log=tmp_path / "prometheus.log"), running(serve, log=tmp_path / "serve.log") as proc:
            wait_http(f"http://127.0.0.1:{port}/metrics", timeout=30)
            text = ""
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
                if "evaluating from the remote write stream" in (tmp_path / "serve.log").read_text() and \
                        'gpufleet_detector_evaluations_total{result="success"} 3' in text:
                    break
                time.sleep(0.3)
            log = (tmp_path / "serve.log").read_text()
            assert "evaluating from the remote write stream" in log, log[-3000:]
            assert "state rebuilt" in log  # warm start from the query API first
            ok = re.search(r'^gpufleet_detector_remote_write_requests_total\{result="ok"\} (\d+)', text, re.M)
            assert ok and int(ok.group(1)) > 0, text[-3000:]
            assert re.search(r"^gpufleet_detector_remote_write_series 16\.0", text, re.M)
            assert 'gpufleet_detector_remote_write_samples_total{result="not_kept"} 0.0' in text  # the keep-list
            assert re.search(r'^gpufleet_detector_evaluations_total\{result="success"\} [1-9]', text, re.M)
            assert proc.poll() is None
