"""Scale-out: sharded replicas against a real Prometheus, and VictoriaMetrics as a second backend.

One recording of a fleet running four jobs (with stragglers, a congested NIC and an idle node) is backfilled
into Prometheus (``promtool tsdb create-blocks-from openmetrics``) and imported into a single-node
VictoriaMetrics (``/api/v1/import/prometheus``), both on free 127.0.0.1 ports and stopped afterwards.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import backfilled_prometheus, imported_victoria_metrics
from test_detector_core import T0, Fault, Synth, fast_cfg, synth

from gpufleet.detector.config import ConfigError, DetectorConfig, parse
from gpufleet.detector.engine import Detector
from gpufleet.detector.incidents.tracker import Finding
from gpufleet.detector.service.cli import main
from gpufleet.detector.sharding import shard, shard_source
from gpufleet.detector.sources.profiles import queries
from gpufleet.detector.sources.prometheus import PrometheusSource
from gpufleet.detector.sources.source import Source

pytestmark = pytest.mark.slow

NODES = 8
# Off the 15 s scrape grid: Prometheus' window [t-w, t] and VictoriaMetrics' (t-w, t] then hold the same samples.
TIMES = [T0 + 607.5 + 60.0 * i for i in range(8)]
FAULTS = [Fault("clock", 1, 2, 540.0), Fault("thermal", 2, 5, 540.0), Fault("link", 6, 1, 540.0)]


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("scale")
    return synth(tmp / "rec.om", Synth(nodes=NODES, seconds=1200.0, faults=FAULTS, idle_nodes=(7,), jobs=4,
                                       seed=3))


@pytest.fixture(scope="module")
def prometheus(recording: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with backfilled_prometheus(recording, tmp_path_factory.mktemp("prom")) as url:
        yield url


def prometheus_text(recording: Path) -> bytes:
    """The recording as Prometheus text exposition (timestamps in milliseconds), as VictoriaMetrics imports it."""
    out: list[str] = []
    for line in recording.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        head, value, ts = line.rsplit(" ", 2)
        out.append(f"{head} {value} {round(float(ts) * 1000)}")
    return ("\n".join(out) + "\n").encode()


@pytest.fixture(scope="module")
def victoria(recording: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with imported_victoria_metrics(prometheus_text(recording), tmp_path_factory.mktemp("vm")) as url:
        yield url


def run(cfg: DetectorConfig, source: Source) -> set[tuple[object, ...]]:
    det = Detector(cfg, source)
    for t in TIMES:
        det.evaluate(t)
    return {_key(f) for f in det.tracker.all_findings()}


def _key(f: Finding) -> tuple[object, ...]:
    return (f.kind, f.cause, f.node, f.gpu, f.job, f.site, f.nic, f.start, f.end)


def test_shard_spec_parsing_and_stable_assignment() -> None:
    assert shard.parse("1/4") == shard.Shard(1, 4)
    for bad in ("2/2", "1", "-1/2", "a/b", "0/0"):
        with pytest.raises(ValueError, match="shard"):
            shard.parse(bad)
    with pytest.raises(ConfigError, match=r"\[detector\] shard"):
        parse({"detector": {"shard": "3/2"}})
    assert parse({"detector": {"shard": "1/2"}}).shard == shard.Shard(1, 2)
    # consistent: growing from 4 to 5 replicas moves about a fifth of the jobs, never between old shards
    jobs = [f"job:train-{i}" for i in range(2000)]
    moved = [(shard.bucket(j, 4), shard.bucket(j, 5)) for j in jobs if shard.bucket(j, 4) != shard.bucket(j, 5)]
    assert all(new == 4 for _, new in moved)
    assert 0.15 < len(moved) / len(jobs) < 0.25
    counts = [sum(shard.bucket(j, 4) == b for j in jobs) for b in range(4)]
    assert min(counts) > 400  # balanced


def test_cli_rejects_a_bad_shard(capsys: pytest.CaptureFixture[str], recording: Path) -> None:
    assert main(["replay", str(recording), "--shard", "2/2"]) == 2
    assert "error: --shard: shard 2/2" in capsys.readouterr().err


def test_two_shards_find_exactly_what_one_detector_finds(prometheus: str) -> None:
    # the fleet's four jobs and the idle node land on both shards
    owners = {shard.bucket(k, 2) for k in ("job:job-0", "job:job-1", "job:job-2", "job:job-3")}
    assert owners == {0, 1}
    one = run(fast_cfg(), PrometheusSource(prometheus))
    kinds = {k[0] for k in one}
    assert {"straggler", "network"} <= kinds, one
    # each shard queries only the nodes of its jobs (shard_source: job map, node selectors sent to Prometheus)
    parts = [run(cfg, shard_source.view(PrometheusSource(prometheus), cfg))
             for cfg in (fast_cfg(detector__shard=f"{i}/2") for i in range(2))]
    assert parts[0] and parts[1]
    assert not parts[0] & parts[1]  # each finding reported by one shard only
    assert parts[0] | parts[1] == one
    # an HA pair (two replicas of one shard) reports identical findings: nothing replica-specific in them
    cfg = fast_cfg(detector__shard="1/2")
    assert run(cfg, shard_source.view(PrometheusSource(prometheus), cfg)) == parts[1]
    # queries in flight at once change nothing
    assert run(fast_cfg(), PrometheusSource(prometheus, parallel=4)) == one


def test_shards_on_victoriametrics_find_what_one_detector_finds(victoria: str) -> None:
    one = run(fast_cfg(), PrometheusSource(victoria))
    parts = [run(cfg, shard_source.view(PrometheusSource(victoria), cfg))
             for cfg in (fast_cfg(detector__shard=f"{i}/4") for i in range(4))]
    assert sum(len(p) for p in parts) == len(one) and set().union(*parts) == one


def test_victoriametrics_gives_the_same_features_and_findings(prometheus: str, victoria: str) -> None:
    prom, vm = PrometheusSource(prometheus), PrometheusSource(victoria)
    window = fast_cfg().window_seconds
    compared = {"exact": 0, "rate": 0}
    # T0 + 427.5: every counter steady over the window (the faults start at +540 s); the others span the onset
    counters = [dataclasses.replace(q, op="irate") for q in queries("gpufleet") if q.op in ("rate", "increase")]
    for t in (T0 + 427.5, *TIMES[::3]):
        for q in [*queries("gpufleet"), *counters]:
            want = {tuple(sorted(lab.items())): v for lab, v in prom.query(q, t, window)}
            got = {tuple(sorted(lab.items())): v for lab, v in vm.query(q, t, window)}
            assert set(want) == set(got), q.promql(window)
            for k, v in want.items():
                if q.op in ("rate", "increase"):
                    # VictoriaMetrics does not extrapolate to the window's edges; it counts the increase from
                    # the last sample before the window instead (one scrape interval more). For a steady
                    # counter both estimate the same rate; across a change of rate within the window they
                    # differ (by up to one interval's share). The detector compares ranks with their peers, all
                    # measured alike, so the findings below do not change.
                    if t == T0 + 427.5:
                        assert math.isclose(v, got[k], rel_tol=0.05, abs_tol=1e-6), (q.promql(window), k, v, got[k])
                        compared["rate"] += 1
                else:
                    assert math.isclose(v, got[k], rel_tol=1e-9, abs_tol=1e-9), (q.promql(window), k, v, got[k])
                    compared["exact"] += 1
    assert compared["exact"] > 1000 and compared["rate"] > 100
    assert run(fast_cfg(), vm) == run(fast_cfg(), prom)
    assert prom.query_errors == 0 and vm.query_errors == 0


def test_victoriametrics_query_errors_are_counted(victoria: str) -> None:
    vm = PrometheusSource(victoria)
    with pytest.raises(Exception, match=re.escape("HTTP 4")):
        vm.instant("rate(", T0)
    assert vm.query_errors == 1
