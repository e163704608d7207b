"""The live detector survives faults of its metrics backend with nothing false and nothing lost (issue 34).

A simulated fleet (a straggler from 3 min on, a job-wide evaluation pass at 8-10 min) is served by a real
Prometheus (backfilled with promtool) and a real VictoriaMetrics, behind a small proxy that injects the faults:
a query that times out or answers 503, Thanos' ``warnings``, VictoriaMetrics' ``isPartial``, every query failing,
Prometheus killed with SIGKILL and restarted on its data dir. The recording itself is edited as a broken exporter
or backend would have stored it: a node whose exporter froze during the evaluation pass (its power stays low
while its peers come back), the straggler's node going stale, every node losing samples at once (a gap). In each
fault the detector with its guard opens nothing, closes nothing, names the reason; the same detector without the
guard (replay's) is shown to go wrong on the edited recordings, so the checks can fail.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import threading
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from backend_faults import FaultProxy, edit_recording
from support import (
    backfilled_prometheus,
    free_port,
    imported_victoria_metrics,
    need_binary,
    running,
    wait_http,
)

from gpufleet.detector.config import DetectorConfig
from gpufleet.detector.engine import Detector
from gpufleet.detector.frame.backend_guard import Degraded, guard_for
from gpufleet.detector.outputs.exporter import Exposer, Health, registry_for
from gpufleet.detector.sources.prometheus import PrometheusSource, settled_session
from gpufleet.detector.sources.source import SourceError
from gpufleet.sim.quality import _config
from gpufleet.sim.recording import record
from gpufleet.sim.scenario import parse_scenario
from gpufleet.sim.simulator import Simulator

pytestmark = pytest.mark.slow

START = 1_750_000_000.0
MIN = 60.0
STEP = 15.0
FLEET = """
name = "backend-faults"
hours = 0.5
step = 15
[[sites]]
name = "a"
nodes = 5
gpus_per_node = 4
[jobs]
[[jobs.fixed]]
id = "train"
nodes = ["node-000", "node-001", "node-002", "node-003", "node-004"]
evals = [["8m", "10m"]]
[[faults]]
kind = "clock_stuck_low"
node = "node-001"
gpu = 2
onset = "3m"
severity = "moderate"
"""
STRAGGLER = ("straggler", "node-001", "2")


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("backend-faults")
    res = record(Simulator(parse_scenario(tomllib.loads(FLEET)), seed=1, start=START), tmp, ("gpufleet",),
                 series="core")
    return Path(res.files["gpufleet"])


def config() -> DetectorConfig:
    cfg = _config("gpufleet")
    cfg.findings.stale_after = 4  # a minute without data closes a finding (the default 20 makes the test long)
    return cfg


def grid(lo_min: float, hi_min: float) -> list[float]:
    n = round((hi_min - lo_min) * MIN / STEP)
    return [START + lo_min * MIN + i * STEP for i in range(n)]


def detector(url: str, guarded: bool, cfg: DetectorConfig | None = None) -> tuple[Detector, PrometheusSource]:
    cfg = cfg or config()
    prom = PrometheusSource(url, timeout=1.0)
    det = Detector(cfg, prom)
    if guarded:
        det.guard = guard_for(prom, det.queries, cfg.window_seconds, det.naming, cfg.interval_seconds)
    return det, prom


def state(det: Detector) -> tuple[object, ...]:
    """What a held evaluation must leave as it was: the open findings (with their incidents, starts, last
    sightings, clear and unseen runs), the pending ones and the closed ones."""
    tr = det.tracker
    active = sorted((k, f.incident, f.start, f.last_seen) for k, f in tr.active.items())
    return (active, sorted((k, p.count) for k, p in tr.pending.items()), dict(tr.clear), dict(tr.unseen),
            len(tr.closed))


def straggler_of(det: Detector) -> list[tuple[str, float]]:
    return [(f.incident, f.start) for k, f in det.tracker.active.items() if k[:3] == STRAGGLER]


def run(det: Detector, times: list[float]) -> dict[float, Degraded]:
    held = {}
    for t in times:
        try:
            det.evaluate(t)
        except Degraded as e:
            held[t] = e
    return held


def fork(det: Detector) -> Detector:
    """An independent copy of ``det``: its tracker, guard, memos and its source's series table copied, a fresh HTTP
    session (the tests that go on from one warmed-up detector share its warm-up)."""
    src = det.source
    assert isinstance(src, PrometheusSource)
    # the tracker's summaries close over det.places: the copy shares that dict (the fleet's racks, none here)
    # rather than keep a copy its summaries would not read
    out = copy.deepcopy(det, {id(src.session): settled_session(src.url), id(src._lock): threading.Lock(), id(det.places): det.places})
    assert out.source is not src and out.guard is not None and out.guard.prom is out.source  # type: ignore[attr-defined]
    assert state(out) == state(det)
    return out


@pytest.fixture(scope="module")
def prometheus(recording: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with backfilled_prometheus(recording, tmp_path_factory.mktemp("prom")) as url:
        yield url


@dataclass
class Warm:
    """The guarded detector through the fault proxy (no fault yet), evaluated from 2.25 to 7 min."""

    proxy: FaultProxy
    det: Detector
    held: dict[float, dict[str, str]]  # the guard's held nodes at each evaluation
    degraded: dict[float, Degraded]  # the evaluations it held (none on a healthy backend)


@pytest.fixture(scope="module")
def warm(prometheus: str) -> Iterator[Warm]:
    with FaultProxy(prometheus).serving() as proxy:
        det, _ = detector(proxy.url, guarded=True)
        assert det.guard is not None
        held, degraded = {}, {}
        for t in grid(2.25, 7):
            try:
                det.evaluate(t)
            except Degraded as e:
                degraded[t] = e
            held[t] = dict(det.guard.last.held)  # type: ignore[attr-defined]
        yield Warm(proxy, det, held, degraded)


@pytest.fixture
def warmed(warm: Warm) -> Iterator[tuple[Detector, FaultProxy]]:
    """A copy of the warmed-up detector (at 7 min, the straggler open) and the proxy, no fault set."""
    assert warm.degraded == {}, warm.degraded  # a healthy backend: nothing held
    proxy = warm.proxy
    proxy.mode, proxy.match, proxy.delay, proxy.injected = "", "", 2.0, 0
    try:
        yield fork(warm.det), proxy
    finally:
        proxy.mode = ""


@pytest.mark.parametrize(("mode", "match", "reason"), [
    ("5xx", "gpufleet_gpu_power_watts", "query_error"),
    ("timeout", "clock=\"sm\"", "query_error"),
    ("warnings", "", "partial_response"),
    ("partial", "gpufleet_gpu_utilization_ratio", "partial_response"),
])
def test_a_failing_or_partial_query_holds_the_evaluation(warmed: tuple[Detector, FaultProxy], mode: str, match: str,
                                                        reason: str) -> None:
    det, proxy = warmed  # evaluated through the proxy from 2.25 to 7 min, nothing held (the warm fixture)
    assert straggler_of(det), "the straggler opened before the fault"
    before, opened = state(det), straggler_of(det)
    proxy.mode, proxy.match, proxy.delay = mode, match, 2.0
    for t in grid(7, 8):  # a minute of the fault: four evaluations, each held, nothing changed
        with pytest.raises(Degraded) as held:
            det.evaluate(t)
        assert set(held.value.reasons) == {reason}, held.value.reasons
        assert state(det) == before
    assert proxy.injected >= 4
    proxy.mode = ""
    assert run(det, grid(8, 9)) == {}
    assert straggler_of(det) == opened and len(det.tracker.closed) == 0


def test_every_query_failing_is_an_evaluation_failure_that_changes_nothing(
        warm: Warm, warmed: tuple[Detector, FaultProxy]) -> None:
    # a healthy backend and fleet (the evaluation pass included): nothing held, from 2.25 min (the warm fixture)
    assert warm.held and all(h == {} for h in warm.held.values()), warm.held
    det, proxy = warmed
    assert det.guard is not None
    for t in grid(7, 11):
        det.evaluate(t)
        assert det.guard.last.held == {}  # type: ignore[attr-defined]
    before = state(det)
    proxy.mode = "5xx"
    with pytest.raises(SourceError, match="every query failed"):
        det.evaluate(START + 11 * MIN)
    assert state(det) == before


def test_prometheus_killed_and_restarted_on_its_data_dir_loses_nothing(recording: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    subprocess.run([need_binary("promtool"), "tsdb", "create-blocks-from", "openmetrics", str(recording), str(data)],
                   check=True, capture_output=True, timeout=120)
    cfg_file = tmp_path / "prometheus.yml"
    cfg_file.write_text("global:\n  scrape_interval: 1h\nscrape_configs: []\n")
    port = free_port()
    argv = [need_binary("prometheus"), f"--config.file={cfg_file}", f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=100y"]
    url = f"http://127.0.0.1:{port}"
    det, _ = detector(url, guarded=True)
    with running(argv, log=tmp_path / "prom1.log") as proc:
        wait_http(f"{url}/-/ready", timeout=60)
        assert run(det, grid(4.5, 6)) == {}  # from 4.5 min: the straggler's onset (3 min) well inside the window
        before, opened = state(det), straggler_of(det)
        assert opened
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    with pytest.raises(SourceError):  # down: every query refused
        det.evaluate(START + 6 * MIN)
    assert state(det) == before
    with running(argv, log=tmp_path / "prom2.log"):  # the same data dir: the WAL replayed, blocks reopened
        wait_http(f"{url}/-/ready", timeout=60)
        assert run(det, grid(6, 7)) == {}
    assert straggler_of(det) == opened and len(det.tracker.closed) == 0


def test_victoria_metrics_partial_answers_hold_the_evaluation(recording: Path, tmp_path: Path) -> None:
    body = b"".join(_ms_lines(recording))
    with imported_victoria_metrics(body, tmp_path) as vm, FaultProxy(vm).serving() as proxy:
        det, _ = detector(proxy.url, guarded=True)
        assert run(det, grid(4.5, 6)) == {}  # from 4.5 min: the straggler's onset (3 min) well inside the window
        before, opened = state(det), straggler_of(det)
        assert opened
        proxy.mode = "partial"
        with pytest.raises(Degraded, match="isPartial"):
            det.evaluate(START + 6 * MIN)
        assert state(det) == before
        proxy.mode = ""
        assert run(det, grid(6, 7)) == {} and straggler_of(det) == opened


def _ms_lines(recording: Path) -> Iterator[bytes]:
    """The recording as Prometheus text with millisecond timestamps (VictoriaMetrics' import format)."""
    with recording.open() as f:
        for line in f:
            if line.startswith("#"):
                continue
            head, _, ts = line.rstrip("\n").rpartition(" ")
            if head:
                yield f"{head} {round(float(ts) * 1000)}\n".encode()


@pytest.fixture(scope="module")
def broken(recording: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """node-004's exporter frozen from 9 to 16 min (from inside the evaluation pass on), the straggler's node-001 stale from 17 to 21 min, every node without samples from 24 to
    27 min (the backend down)."""
    tmp = tmp_path_factory.mktemp("broken")
    edited = tmp / "broken.om"
    edit_recording(recording, edited, freeze=("node-004", START + 9 * MIN, START + 16 * MIN),
                   stale=("node-001", START + 17 * MIN, START + 21 * MIN), gap=(START + 24 * MIN, START + 27 * MIN))
    with backfilled_prometheus(edited, tmp) as url:
        yield url


def test_frozen_stale_and_gap_open_nothing_and_close_nothing(broken: str) -> None:
    # the unguarded detector from 15 min (the straggler open, two minutes before its node goes stale) to 28 min
    # (a minute past the gap's end): the stretch its closures are looked for in
    bare, _ = detector(broken, guarded=False)
    closed, seen = [], False
    for t in grid(15, 28):
        bare.evaluate(t)
        seen = seen or bool(straggler_of(bare))
        if seen and not straggler_of(bare):
            closed.append((t - START) / MIN)
    assert seen, "the straggler opened in the unguarded run"
    # without the guard the faults go wrong (so the checks below can fail): the straggler's finding closed by its
    # node going stale and by the gap (and reopened when the data came back)
    assert any(17 <= m <= 22 for m in closed) and any(m >= 24 for m in closed), closed
    # the guarded one from 4.5 min (the straggler open from its first evaluation: its onset, 3 min, well inside
    # the window), through the evaluation pass, the freeze, the stale node, the gap and three minutes after it
    times = grid(4.5, 30)
    det, _ = detector(broken, guarded=True)
    assert det.guard is not None
    reasons: dict[float, set[str]] = {}
    held: dict[float, dict[str, str]] = {}
    incident = None
    for t in times:
        try:
            det.evaluate(t)
            reasons[t] = set(det.guard.last.reasons)  # type: ignore[attr-defined]
            held[t] = dict(det.guard.last.held)  # type: ignore[attr-defined]
        except Degraded as e:
            reasons[t] = set(e.reasons)
        s = straggler_of(det)
        if t >= START + 5 * MIN:
            assert len(s) == 1, (t - START, s)
            incident = incident or s[0][0]
            assert s[0][0] == incident
    every = [*det.tracker.active.values(), *det.tracker.closed]
    assert {(f.node, f.gpu) for f in every} == {STRAGGLER[1:]}, [(f.kind, f.node, f.gpu) for f in every]
    assert not det.tracker.closed
    # the reason within one evaluation of the fault being visible: a frozen target once its readings stayed flat
    # four intervals (a minute), a stale one or a gap once the samples in the window are missing
    first = {r: min((t for t, rs in reasons.items() if r in rs), default=None) for r in
             ("frozen_target", "stale_target", "gap")}
    assert first["frozen_target"] is not None and first["frozen_target"] <= START + 10 * MIN + STEP, first
    assert first["stale_target"] is not None and first["stale_target"] <= START + 17 * MIN + 2 * STEP, first
    assert first["gap"] is not None and first["gap"] <= START + 26 * MIN + STEP, first
    assert any(h.get("node-004") == "frozen_target" for h in held.values())
    assert any(h.get("node-001") == "stale_target" for h in held.values())
    assert not reasons[times[-1]], reasons[times[-1]]  # the data back: nothing degraded


def test_health_and_metrics_say_degraded_and_why() -> None:
    from gpufleet.detector.sources.memory import MemorySource
    from gpufleet.serving.http import Request
    from gpufleet.serving.responder import Responder
    from gpufleet.serving.webconfig import WebConfig

    det = Detector(config(), MemorySource())
    health = Health()
    exposer = Exposer(registry_for(det, health), health)
    responder = Responder(exposer, WebConfig(), "/metrics", "t")

    def get(path: str) -> bytes:
        return responder.route(Request("GET", path, path, "HTTP/1.1", {}, True))[0]

    assert b"\r\n\r\nOK\n" in get("/health")
    health.degraded = {"gap": "5 of 5 nodes have no fresh samples (first: node-000)"}
    health.held_nodes = {"node-004": "frozen_target"}
    text = get("/health").decode()
    assert "DEGRADED" in text and "gap: 5 of 5 nodes" in text
    metrics = get("/metrics").decode()
    assert 'gpufleet_detector_degraded{reason="gap"} 1.0' in metrics
    assert 'gpufleet_detector_degraded{reason="frozen_target"} 1.0' in metrics
    assert 'gpufleet_detector_degraded{reason="query_error"} 0.0' in metrics
    assert 'gpufleet_detector_held_node{node="node-004",reason="frozen_target"} 1.0' in metrics
