"""``gpufleet-detector export``: a recording out of a real Prometheus replays to the same findings as the
recording Prometheus was filled from (docs/wrong-finding.md, "Send a recording"), and promtool backfills it."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import backfilled_prometheus, free_port, need_binary
from test_detector_core import T0, Fault, Synth, synth

from gpufleet.detector.service import cli


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    tmp = tmp_path_factory.mktemp("export")
    rec = synth(tmp / "rec.om", Synth(nodes=2, seconds=1200.0, faults=[Fault("thermal", 1, 3, 600.0)], seed=7))
    with backfilled_prometheus(rec, tmp) as url:
        yield rec, url


def _findings(path: Path, capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    assert cli.main(["replay", str(path), "--format", "json", "--no-progress"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


@pytest.mark.slow
def test_an_exported_recording_replays_to_the_same_findings(served: tuple[Path, str], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    rec, url = served
    out = tmp_path / "finding.om.gz"
    assert cli.main(["export", "--url", url, "--from", str(T0), "--until", "2023-11-14T22:33:20Z",
                     "--out", str(out)]) == 0
    assert "samples of" in capsys.readouterr().err
    want = _findings(rec, capsys)
    assert any(f["kind"] == "straggler" and f["node"] == "node-001" and f["gpu"] == "3" for f in want)
    assert _findings(out, capsys) == want
    plain = tmp_path / "finding.om"
    subprocess.run(["sh", "-c", f"gunzip -c {out} > {plain}"], check=True)
    r = subprocess.run([need_binary("promtool"), "tsdb", "create-blocks-from", "openmetrics", str(plain),
                        str(tmp_path / "data")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_export_failures_are_one_line(served: tuple[Path, str], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    _, url = served
    out = tmp_path / "x.om"
    assert cli.main(["export", "--url", url, "--profile", "dcgm", "--from", str(T0), "--until", str(T0 + 600),
                     "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no samples of the dcgm profile's metrics" in err and not out.exists()
    assert cli.main(["export", "--url", f"http://127.0.0.1:{free_port()}", "--from", str(T0), "--until",
                     str(T0 + 600), "--out", str(out)]) == 2
    assert "ConnectionError" in capsys.readouterr().err
