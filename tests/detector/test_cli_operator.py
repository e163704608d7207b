"""The detector's command line as an operator meets it: --version, one time syntax, a wrong --profile named."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from gpufleet.agent.settings import build_parser
from gpufleet.detector.service import cli
from gpufleet.sim.recording import record
from gpufleet.sim.scenario import parse_scenario
from gpufleet.sim.simulator import Simulator

START = 1_750_000_000.0
SCENARIO = {
    "name": "cli", "description": "one straggler", "hours": 0.5, "step": 15,
    "sites": [{"name": "site-a", "nodes": 4, "gpus_per_node": 8}],
    "jobs": {"fixed": [{"id": "job-a", "nodes": "all"}]},
    "faults": [{"kind": "clock_stuck_low", "node": "node-002", "gpu": 5, "onset": "10m", "severity": "moderate"}],
}


@pytest.fixture(scope="module")
def recordings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    sim = Simulator(parse_scenario(SCENARIO, "cli"), start=START)
    rec = record(sim, tmp_path_factory.mktemp("cli"), ("gpufleet", "dcgm"))
    return {k: Path(v) for k, v in rec.files.items()}


def test_version_is_the_package_metadata() -> None:
    out = subprocess.run([sys.executable, "-m", "gpufleet.detector.service.cli", "--version"], capture_output=True,
                         text=True, check=True).stdout
    assert out == f"gpufleet-detector {version('gpufleet')}\n"


@pytest.mark.parametrize(("profile", "holds"), [(None, "dcgm"), ("dcgm", "gpufleet")])
def test_a_recording_of_the_other_profile_is_named_in_one_line(recordings: dict[str, Path], profile: str | None,
                                                               holds: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["replay", str(recordings[holds]), "--format", "json", "--no-progress"]
    assert cli.main(args + (["--profile", profile] if profile else [])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"gpufleet-detector: error: the recording holds {holds} metrics (")
    assert err.rstrip().endswith(f"replay it with --profile {holds}")


def test_the_right_profile_replays(recordings: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["replay", str(recordings["dcgm"]), "--profile", "dcgm", "--no-progress"]) == 0
    found = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert any((f["kind"], f["node"], f["gpu"]) == ("straggler", "node-002", "5") for f in found)


def _report(rec: Path, *flags: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(["report", str(rec), "--no-progress", *flags]) == 0
    return capsys.readouterr().out


@pytest.mark.slow
def test_report_and_replay_take_both_time_syntaxes(recordings: dict[str, Path],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    rec = recordings["gpufleet"]
    late = START + 1500  # after the straggler opened (onset 10 min)
    rfc = "2025-06-15T15:31:40Z"
    assert cli.timestamp(rfc) == late
    whole = _report(rec, capsys=capsys)
    assert "node-002" in whole
    # before the onset: the straggler is not in the range, whichever syntax and flag name
    early = [_report(rec, "--to", str(START + 300), capsys=capsys),
             _report(rec, "--until", "2025-06-15T15:10:00+00:00", capsys=capsys)]
    assert early[0] == early[1] and "node-002" not in early[0]
    assert _report(rec, "--from", rfc, capsys=capsys) == _report(rec, "--from", str(late), capsys=capsys)
    assert cli.main(["replay", str(rec), "--no-progress", "--from", rfc, "--to", str(START + 1800)]) == 0
    assert "node-002" in capsys.readouterr().out
    assert cli.main(["report", str(rec), "--no-progress", "--from", str(late), "--until", str(START)]) == 2
    assert "--until is before --from" in capsys.readouterr().err


def test_the_fake_nvml_help_lists_its_specs() -> None:
    text = " ".join(build_parser().format_help().split())
    for spec in ("sim:N", "sim:PATH", "trace:PATH", "mig:N[:LAYOUT]", "procs:N:P", "live:PATH", "hang=", "slow="):
        assert spec in text, spec


def test_the_simulator_start_takes_unix_seconds_and_rfc3339(tmp_path: Path) -> None:
    from gpufleet.sim.cli import main as sim_main

    for value in ("1750000000", "2025-06-15T15:06:40Z"):
        out = tmp_path / value.replace(":", "")
        assert sim_main(["generate", "--scenario", "healthy", "--series", "core", "--hours", "0.05", "--start", value,
                         "--out", str(out), "--quiet"]) == 0
        assert json.loads((out / "labels.json").read_text())["start"] == START
    assert sim_main(["generate", "--scenario", "healthy", "--start", "nan", "--out", str(tmp_path / "x")]) == 2
