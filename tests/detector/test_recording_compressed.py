"""Compressed recordings: ``replay`` reads ``.gz`` and ``.zst`` as they are, with the findings of the plain file,
and a corrupt or truncated compressed file is one line naming it (never a traceback)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from test_detector_core import Fault, Synth, synth

from gpufleet.detector.config import DetectorConfig, parse
from gpufleet.detector.service.cli import main as detector_main
from gpufleet.detector.service.replay import replay
from gpufleet.detector.sources.recording import RecordingError, RecordingSource


def _cfg() -> DetectorConfig:
    return parse({"detector": {"window_seconds": 120.0, "interval_seconds": 30.0},
                  "findings": {"open_after": 2, "close_after": 2}})


def _zstd(data: bytes) -> bytes:
    zstandard = pytest.importorskip("zstandard")
    out: bytes = zstandard.ZstdCompressor().compress(data)
    return out


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth(tmp_path_factory.mktemp("rec") / "r.om",
                 Synth(nodes=3, seconds=900.0, faults=[Fault("clock", 1, 3, 300.0)]))


def _findings(path: Path) -> list[dict[str, object]]:
    _, found = replay([str(path)], _cfg(), parallel=False)
    return [f.to_json() for f in found]


@pytest.mark.parametrize("kind", ["gz", "zst"])
def test_compressed_recording_gives_the_plain_files_findings(recording: Path, tmp_path: Path, kind: str) -> None:
    data = recording.read_bytes()
    packed = tmp_path / f"r.om.{kind}"
    packed.write_bytes(gzip.compress(data) if kind == "gz" else _zstd(data))
    plain = _findings(recording)
    assert any(f["kind"] == "straggler" and f["node"] == "node-001" for f in plain)  # the fault is found at all
    assert _findings(packed) == plain
    a, b = RecordingSource.load([recording]), RecordingSource.load([packed])
    assert a.samples == b.samples > 0


def test_compression_is_recognised_by_content_not_name(recording: Path, tmp_path: Path) -> None:
    renamed = tmp_path / "r.om"  # gzip content under a plain name
    renamed.write_bytes(gzip.compress(recording.read_bytes()))
    assert _findings(renamed) == _findings(recording)


def test_multi_member_gzip_reads_every_member(recording: Path, tmp_path: Path) -> None:
    data = recording.read_bytes()
    cut = data.index(b"\n", len(data) // 2) + 1
    joined = tmp_path / "r.om.gz"  # as `cat a.gz b.gz` makes it
    joined.write_bytes(gzip.compress(data[:cut]) + gzip.compress(data[cut:]))
    assert RecordingSource.load([joined]).samples == RecordingSource.load([recording]).samples


@pytest.mark.parametrize("kind", ["gz", "zst"])
@pytest.mark.parametrize("damage", ["truncated", "garbled"])
def test_corrupt_compressed_recording_is_one_line(recording: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  kind: str, damage: str) -> None:
    data = recording.read_bytes()[:20000]
    packed = gzip.compress(data) if kind == "gz" else _zstd(data)
    if damage == "truncated":
        packed = packed[: len(packed) // 2]
    else:  # the header stays, the compressed stream is noise
        packed = packed[:12] + bytes((b * 7 + 3) & 0xFF for b in packed[12:])
    path = tmp_path / f"bad.om.{kind}"
    path.write_bytes(packed)
    with pytest.raises(RecordingError, match="corrupt or truncated"):
        RecordingSource.load([path])
    assert detector_main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert str(path) in err and "corrupt or truncated" in err


def test_errors_inside_a_compressed_recording_keep_their_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    series = 'gpufleet_gpu_power_watts{gpu="0",instance="n:9445"}'
    body = f"# TYPE gpufleet_gpu_power_watts gauge\n{series} 1 1\n{series} x 2\n# EOF\n"
    path = tmp_path / "bad.om.gz"
    path.write_bytes(gzip.compress(body.encode()))
    assert detector_main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:3: not valid OpenMetrics" in err and len(err.strip().splitlines()) == 1, err
    path.write_bytes(gzip.compress(f"# TYPE gpufleet_gpu_power_watts gauge\n{series} 1 1\n".encode()
                                   + b"\xff\xfe 2 2\n# EOF\n"))
    assert detector_main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:3: not UTF-8" in err and len(err.strip().splitlines()) == 1, err


def test_replay_cli_reads_gzip(recording: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    packed = tmp_path / "r.om.gz"
    packed.write_bytes(gzip.compress(recording.read_bytes()))
    cfg = tmp_path / "d.toml"
    cfg.write_text("[detector]\nwindow_seconds = 120.0\ninterval_seconds = 30.0\n")
    assert detector_main(["replay", str(recording), "--config", str(cfg)]) == 0
    plain = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert detector_main(["replay", str(packed), "--config", str(cfg)]) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == plain != []


def test_zstd_without_the_library_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "r.om.zst"
    path.write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 16)
    monkeypatch.setitem(__import__("sys").modules, "zstandard", None)  # as if not installed: import fails
    assert detector_main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "zstandard is not installed" in err and len(err.strip().splitlines()) == 1, err
