"""Sharded streaming through the fan-out: a real Prometheus remote-writes the detector's families once, to the
vmagent that ``remote-write-config --fanout`` prints, which copies them to two shard receivers; the shards
together find exactly what one detector finds, each finding on one shard only.

The fleet (8 nodes, 4 jobs, a clock, a thermal and a link fault planted halfway, as the sharding tests' fleet)
is served and paced as in :mod:`test_remote_write_prometheus`. Replica 1 is down for the first half of the
stream: replica 0 keeps receiving meanwhile, and once replica 1 comes up vmagent sends it what it missed, so both
replicas end with the same stream and the same answers as Prometheus' query API.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from support import free_port, need_binary, running, wait_http
from test_detector_core import Synth, synth
from test_remote_write_prometheus import SCRAPE, SECONDS, FrameTarget, at, cfg_paced, frames, wait_for
from test_shard_source import FAULTS

from gpufleet.detector.config import DetectorConfig
from gpufleet.detector.engine import Detector
from gpufleet.detector.receiver import fanout
from gpufleet.detector.receiver import prometheus_config as remote_write_config
from gpufleet.detector.receiver.server import RemoteWriteReceiver
from gpufleet.detector.sharding import shard_source
from gpufleet.detector.sharding.shard import Shard
from gpufleet.detector.sources.profiles import queries
from gpufleet.detector.sources.prometheus import PrometheusSource
from gpufleet.detector.sources.remote_write import StreamStore
from gpufleet.detector.sources.source import Source

pytestmark = pytest.mark.slow

#: Evaluation instants (the recording's seconds): the faults begin at 540 s.
EVALUATIONS = [607.5 + 60.0 * i for i in range(8)]


def findings(cfg: DetectorConfig, src: Source, start: float) -> set[tuple[object, ...]]:
    det = Detector(cfg, src)
    for s in EVALUATIONS:
        det.evaluate(at(start, s))
    return {(f.kind, f.cause, f.node, f.gpu, f.job, f.nic, f.start, f.end) for f in det.tracker.all_findings()}


Answers = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def answers(src: Source, t: float, window: float) -> Answers:
    return {(q.promql(window), tuple(sorted(lab.items()))): v for q in queries("gpufleet") for lab, v in src.query(q, t, window)}


def same(a: Answers, b: Answers) -> bool:
    return set(a) == set(b) and all(math.isclose(v, b[k], rel_tol=1e-9, abs_tol=1e-12) for k, v in a.items())


def test_two_shards_fed_once_through_the_fanout_find_what_one_detector_finds(tmp_path: Path) -> None:
    rec = synth(tmp_path / "rec.om", Synth(nodes=8, seconds=SECONDS, faults=FAULTS, idle_nodes=(7,), jobs=4, seed=3))
    start = float(math.ceil(time.time() / 60.0) * 60.0 + 60.0)
    cfg = cfg_paced()
    stores = [StreamStore(remote_write_config.sample_names(cfg), retention=2 * SECONDS) for _ in range(2)]
    rx0 = RemoteWriteReceiver("127.0.0.1:0", stores[0])
    down_port = free_port()  # replica 1's address: nothing listens there for the first half of the stream
    fan_url = f"http://127.0.0.1:{free_port()}"
    printed = yaml.safe_load(remote_write_config.render(cfg, "http://replica-{shard}:9447/api/v1/write", 2,
                                                        fanout=fan_url, batch_send_deadline="1s"))
    [entry] = printed["remote_write"]
    assert entry["url"] == f"{fan_url}/api/v1/write"
    vmagent = fanout.vmagent_args(fan_url, [rx0.url, f"http://127.0.0.1:{down_port}/api/v1/write"],
                                  str(tmp_path / "fanout"))
    vmagent[0] = need_binary(vmagent[0])
    pages = frames(rec, start)
    rx1: RemoteWriteReceiver | None = None
    with FrameTarget(pages) as target:
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(
            {"global": {"scrape_interval": SCRAPE, "scrape_timeout": SCRAPE}, "remote_write": [entry],
             "scrape_configs": [{"job_name": "fleet", "honor_labels": True, "honor_timestamps": True,
                                 "static_configs": [{"targets": [f"127.0.0.1:{target.port}"]}]}]}))
        port = free_port()
        prom = [need_binary("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"]
        rx0.serve_in_thread()
        try:
            with running([*vmagent, "-loggerLevel=ERROR"], log=tmp_path / "vmagent.log"), \
                    running(prom, log=tmp_path / "prometheus.log"):
                url = f"http://127.0.0.1:{port}"
                wait_http(f"{url}/-/ready", timeout=60)
                wait_for(lambda: target.served > len(pages) // 2, 60, "the fleet's first half was not scraped")
                # replica 1 down does not hold up replica 0
                wait_for(lambda: stores[0].newest >= at(start, SECONDS / 3), 30, "replica 0 stalled")
                assert stores[1].series_count == 0
                rx1 = RemoteWriteReceiver(f"127.0.0.1:{down_port}", stores[1])
                rx1.serve_in_thread()
                end = at(start, SECONDS)
                wait_for(lambda: target.served > len(pages) + 5 and min(s.newest for s in stores) >= end, 90,
                         "the stream did not reach both replicas")
                time.sleep(2.0)  # the last blocks of replica 1's backlog
                prom_src = PrometheusSource(url, timeout=10)
                w = cfg.window_seconds
                # both replicas hold the whole stream, what replica 1 missed while down included
                for s in (120.0, 300.0, 660.0, SECONDS):
                    want = answers(prom_src, at(start, s), w)
                    assert want and all(same(want, answers(st, at(start, s), w)) for st in stores), s
                one = findings(cfg, prom_src, start)
                parts = []
                for i, st in enumerate(stores):
                    cfg_i = replace(cfg, shard=Shard(i, 2))
                    parts.append(findings(cfg_i, shard_source.view(st, cfg_i), start))
        finally:
            rx0.shutdown()
            if rx1 is not None:
                rx1.shutdown()
            for log in ("vmagent.log", "prometheus.log"):
                if (tmp_path / log).exists():
                    print(log, (tmp_path / log).read_text()[-2000:])
    assert {"straggler", "network"} <= {k[0] for k in one}, one
    assert all(parts), parts  # each shard owns a job with a fault
    assert set().union(*parts) == one
    assert sum(len(p) for p in parts) == len(one)  # each finding from exactly one shard
    assert rx1 is not None and rx1.stats.requests["ok"] > 0 and rx0.stats.requests["error"] == 0
