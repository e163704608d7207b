"""A detector restart loses nothing (issue 24): incident ids from the problem, state rebuilt from the history.

A detector started at any instant T (``replay --from T``: the recording before T is the history a restarted
detector finds in Prometheus) must have, after its warm start, exactly the findings a detector that evaluated
the whole recording has open at T: same kind, entity, incident id and start. Simulated end to end: the fleet
simulator's recording replayed through the detector, uninterrupted and restarted.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import backfilled_prometheus

from gpufleet.detector.config import parse
from gpufleet.detector.core.identity import incident_id
from gpufleet.detector.incidents.tracker import Finding
from gpufleet.detector.service import cli, warmstart
from gpufleet.detector.service.replay import replay
from gpufleet.detector.sources.profiles import sample_names
from gpufleet.detector.sources.prometheus import PrometheusSource
from gpufleet.detector.sources.prometheus_range import RangeSource
from gpufleet.detector.sources.recording import RecordingSource
from gpufleet.sim.quality import _config
from gpufleet.sim.recording import record
from gpufleet.sim.scenario import parse_scenario
from gpufleet.sim.simulator import Simulator

START = 1_750_000_000.0
MIN = 60.0

# A straggler open from 10 min to the end (its run reaches back past any short replay), an intermittent fault
# opening and closing incidents, and a job-wide evaluation pass during which findings are held.
FLEET = """
name = "restart"
hours = 1
step = 15
[[sites]]
name = "a"
nodes = 4
gpus_per_node = 4
[jobs]
[[jobs.fixed]]
id = "train"
nodes = ["node-000", "node-001", "node-002", "node-003"]
evals = [["40m", "47m"]]
[[faults]]
kind = "clock_stuck_low"
node = "node-001"
gpu = 2
onset = "10m"
severity = "moderate"
[[faults]]
kind = "intermittent_thermal"
node = "node-003"
gpu = 0
onset = "25m"
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, float]:
    tmp = tmp_path_factory.mktemp("restart")
    res = record(Simulator(parse_scenario(tomllib.loads(FLEET)), seed=1, start=START), tmp, ("gpufleet",),
                 series="core")
    return str(res.files["gpufleet"]), float(json.loads(res.labels.read_text())["step"])


def open_at(findings: list[Finding]) -> set[tuple[str, str | None, str | None, str, float]]:
    return {(f.kind, f.node, f.gpu, f.incident, f.start) for f in findings if f.end is None}


def test_incident_ids_name_the_problem_not_the_process() -> None:
    key = ("straggler", "node-001", "2", "", "", "")
    assert incident_id(key, START) == incident_id(key, START)
    assert incident_id(key, START) != incident_id(key, START + 15)
    assert incident_id(key, START) != incident_id(("throttling", "node-001", "2", "", "", ""), START)
    assert len(incident_id(key, START)) == 12


@pytest.mark.parametrize("minute", [7, 26, 44, 59])
def test_a_detector_started_at_any_time_has_the_findings_an_uninterrupted_one_has(
        fleet: tuple[str, float], minute: int) -> None:
    path, step = fleet
    cfg = _config("gpufleet")
    t = START + minute * MIN
    _, straight = replay([path], cfg, step, t_until=t + step)  # up to the first grid instant at or after t
    _, restarted = replay([path], cfg, step, t_from=t, t_until=t + step)
    assert open_at(restarted) == open_at(straight)
    if minute >= 26:  # the straggler from 10 min is open, with its start and id: the restart changed nothing
        assert any(f.node == "node-001" and f.gpu == "2" and f.start < START + 15 * MIN for f in restarted
                   if f.end is None)


def test_the_replay_reaches_back_only_as_far_as_an_open_finding_needs(fleet: tuple[str, float]) -> None:
    path, step = fleet
    cfg = _config("gpufleet")
    src = RecordingSource.load([path], sample_names("gpufleet"))
    first = src.time_range()[0] + cfg.window_seconds
    quiet, info = warmstart.rebuild(cfg, src, START + 8 * MIN, earliest=first, step=step)
    assert info.attempts == 1 and not quiet.tracker.active  # nothing open: the first horizon is enough
    busy, info = warmstart.rebuild(cfg, src, START + 59 * MIN, earliest=first, step=step)
    assert info.attempts > 1 and info.horizon > 45 * MIN  # the straggler's run began 49 min before
    assert info.truncated == 0
    capped, info = warmstart.rebuild(cfg, src, START + 59 * MIN, earliest=first, step=step, max_seconds=20 * MIN)
    assert info.horizon == 20 * MIN and info.truncated >= 1  # bounded, and says what it could not reach
    assert busy.tracker.active and capped.tracker.active


def test_replay_range_options_take_unix_seconds_and_rfc3339(fleet: tuple[str, float],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    path, step = fleet
    assert cli.timestamp("1750000000") == START
    assert cli.timestamp("2025-06-15T15:06:40Z") == START
    assert cli.timestamp("2025-06-15T17:06:40+02:00") == START
    assert cli.main(["replay", path, "--step", str(step), "--from", "2025-06-15T15:36:40Z",
                     "--until", str(START + 40 * MIN)]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert any(r["node"] == "node-001" and r["gpu"] == "2" and r["start"] < START + 15 * MIN for r in rows)
    assert all(r["end"] is None or r["end"] >= START + 30 * MIN for r in rows)


@pytest.mark.parametrize("argv, message", [
    (["--from", "yesterday"], "not unix seconds or an RFC 3339 time"),
    (["--from", "2025-06-15T15:06:40"], "needs its offset"),
])
def test_bad_range_options_are_usage_errors(fleet: tuple[str, float], capsys: pytest.CaptureFixture[str],
                                            argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["replay", fleet[0], *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_an_empty_range_is_a_one_line_error(fleet: tuple[str, float], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["replay", fleet[0], "--from", "1750002000", "--until", "1750001000"]) == 2
    assert capsys.readouterr().err == "gpufleet-detector: error: --until is before --from\n"
    assert cli.main(["replay", fleet[0], "--from", "1750001001", "--until", "1750001002"]) == 2
    assert "no evaluation instant in the range" in capsys.readouterr().err


PUE_SITE = """
name = "pue-restart"
description = "14 days of one site; its cooling degrades by +0.03 PUE at day 9, after a heatwave"
hours = 336
step = 300
[[sites]]
name = "site-a"
nodes = 2
gpus_per_node = 2
outdoor_mean_c = 18
[jobs]
auto = true
fill = 0.8
mean_hours = 6
[[faults]]
kind = "pue_drift"
site = "site-a"
onset = "9d"
severity = 0.0
[[heatwaves]]
site = "site-a"
start = "4d"
end = "6d"
delta_c = 8
"""


@pytest.fixture(scope="module")
def site_days(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("pue")
    res = record(Simulator(parse_scenario(tomllib.loads(PUE_SITE)), seed=2, start=START), tmp, ("gpufleet",),
                 series="core")
    yield str(res.files["gpufleet"])


@pytest.mark.slow
def test_a_pue_drift_is_flagged_as_if_the_detector_never_restarted(site_days: str) -> None:
    """The issue's case: 14 days, +0.03 PUE; a detector started 10 h after the onset used to learn the degraded
    PUE as normal and never flag it. Restarted at 10 h (before the drift is flagged) or at 30 h (after), it
    flags it with the same incident id and start, detected when it was (within one evaluation)."""
    cfg, step = parse({"detector": {"window_seconds": 600}}), 300.0  # the site is scraped every 300 s
    onset = START + 9 * 86400.0
    until = onset + 30 * 3600.0 + step
    _, straight = replay([site_days], cfg, step, t_until=until)
    want = [f for f in straight if f.kind == "pue_drift" and f.end is None]
    assert len(want) == 1 and want[0].detected - onset < 13 * 3600.0
    for hours in (10, 30):
        _, restarted = replay([site_days], cfg, step, t_from=onset + hours * 3600.0, t_until=until)
        got = [f for f in restarted if f.kind == "pue_drift" and f.end is None]
        assert len(got) == 1, (hours, got)
        assert (got[0].site, got[0].incident, got[0].start) == (want[0].site, want[0].incident, want[0].start)
        assert abs(got[0].detected - want[0].detected) <= step, hours


@pytest.mark.slow
def test_a_restart_against_a_real_prometheus_rebuilds_what_the_recording_does(fleet: tuple[str, float],
                                                                          tmp_path: Path) -> None:
    """The same history served by a real Prometheus (backfilled with promtool) and read with query_range on the
    grid gives the warm start the same state: the same findings open, with the same incident ids and starts."""
    path, step = fleet
    cfg = _config("gpufleet")
    src = RecordingSource.load([path], sample_names("gpufleet"))
    first = src.time_range()[0] + cfg.window_seconds
    at = START + 44 * MIN
    offline, _ = warmstart.rebuild(cfg, src, at, earliest=first, step=step)
    with backfilled_prometheus(Path(path), tmp_path) as url:
        ranged = RangeSource(PrometheusSource(url, timeout=30))
        live, info = warmstart.rebuild(cfg, ranged, at, earliest=first, step=step)
        assert ranged.requests > 0 and ranged.points > 0 and ranged.query_errors == 0
    want = {(f.kind, f.node, f.gpu, f.incident, f.start) for f in offline.tracker.active.values()}
    assert want and {(f.kind, f.node, f.gpu, f.incident, f.start) for f in live.tracker.active.values()} == want
    assert info.truncated == 0


def test_ready_answers_503_until_the_state_is_rebuilt_and_health_stays_ok() -> None:
    from gpufleet.detector.engine import Detector
    from gpufleet.detector.outputs.exporter import Exposer, Health, registry_for
    from gpufleet.detector.sources.memory import MemorySource
    from gpufleet.serving.http import Request
    from gpufleet.serving.responder import Responder
    from gpufleet.serving.webconfig import WebConfig

    health = Health()
    health.not_ready = "rebuilding its state from Prometheus"
    det = Detector(parse({}), MemorySource())
    responder = Responder(Exposer(registry_for(det, health), health), WebConfig(), "/metrics", "gpufleet detector")

    def get(path: str) -> bytes:
        return responder.route(Request("GET", path, path, "HTTP/1.1", {}, True))[0]

    assert get("/ready").startswith(b"HTTP/1.1 503") and b"not ready: rebuilding" in get("/ready")
    assert get("/health").startswith(b"HTTP/1.1 200")  # liveness is never blocked by the rebuild
    health.not_ready = ""
    assert get("/ready").startswith(b"HTTP/1.1 200")
