"""Bad input gets one clear line (exit 2) or an error metric, never a traceback and never garbage.

Covers every kind of input the programs take: flags, config files, traces, live snapshots,
readings outside physical bounds, job mapping files and detector recordings.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from support import BIN

from gpufleet.agent import cli, settings
from gpufleet.agent.collectors.gpu import GpuCollector
from gpufleet.agent.collectors.jobs import JobsCollector
from gpufleet.agent.nvml.model import Snapshot, write_snapshot
from gpufleet.agent.nvml.trace import TraceError, TraceWriter, read_trace
from gpufleet.agent.registry import AgentCollector
from gpufleet.detector.service.cli import main as detector_main
from gpufleet.sim.fake.live_source import LiveSource
from gpufleet.sim.fake.sim_source import SimSource
from gpufleet.sim.fake.smi_xml import builtin_host
from gpufleet.sim.fake.spec import fake_backend


def one_line_error(err: str, *needles: str) -> None:
    """``err`` is exactly one line, no traceback, and contains every needle."""
    assert "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    for n in needles:
        assert n in err, (n, err)


def agent(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = cli.main(list(argv))
    return rc, capsys.readouterr().err


@pytest.fixture(autouse=True)
def _no_gpufleet_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("GPUFLEET_"):
            monkeypatch.delenv(k)


# ------------------------------------------------------------------ flags and config file


@pytest.mark.parametrize("argv", [
    ["--config.file", "record"], ["--config.file=record"], ["--config", "record"], ["once", "--config.file", "record"],
])
def test_a_flag_value_is_not_the_record_subcommand(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    rc, err = agent(capsys, *argv)
    assert rc == 2
    one_line_error(err, "cannot read config file record")


def test_record_is_found_after_flags_and_values() -> None:
    assert settings.record_index(["--log.level", "debug", "record", "--output", "x"]) == 2
    assert settings.record_index(["--log.level=debug", "record"]) == 1
    assert settings.record_index(["record"]) == 0
    assert settings.record_index(["--nvml.fake", "record"]) is None
    assert settings.record_index(["--no-collector.nic", "record"]) == 1
    assert settings.record_index(["once", "record"]) is None  # the mode is "once"; "record" is an extra argument
    assert settings.record_index(["--nvml.fake", "once"]) is None


def test_non_utf8_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "agent.toml"
    path.write_bytes(b'[web]\nlisten_address = "\xff\xfe:9445"\n')
    rc, err = agent(capsys, "once", f"--config.file={path}")
    assert rc == 2
    one_line_error(err, str(path), "not UTF-8")


@pytest.mark.parametrize(("toml", "needle"), [
    ("[scrape]\ncache_seconds = 1" + "0" * 400 + "\n", "out of range"),
    ('[path]\nsysfs = "/sys\\u0000x"\n', "NUL"),
    ("[scrape]\ncache_seconds = 1979-05-27\n", "expected a number"),
    ("[scrape]\ncache_seconds = [1]\n", "expected a number"),
])
def test_impossible_config_values(tmp_path: Path, capsys: pytest.CaptureFixture[str], toml: str, needle: str) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(toml)
    rc, err = agent(capsys, "once", f"--config.file={path}")
    assert rc == 2
    one_line_error(err, str(path), needle)


# ------------------------------------------------------------------ traces


def _trace(path: Path, lines: int = 40) -> Path:
    sim = SimSource(2, clock=lambda: 1_763_780_000.0)
    with TraceWriter(path, hostname="h", interval_s=1.0, driver=sim.driver(), gpus=sim.inventory()) as w:
        for i in range(lines):
            w.write(1_763_780_000.0 + i, [sim.sample(g) for g in range(2)])
    return path


def test_gzip_corrupt_trace_is_one_line_at_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _trace(tmp_path / "t.jsonl.gz")
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):  # flip bits in the middle of the deflate stream
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    # Where the flipped bits land decides what fails first: the deflate stream, or a line that inflates to bad JSON.
    with pytest.raises(TraceError, match=r"t\.jsonl\.gz(:\d+)?: (cannot read|not valid JSON).*corrupt or truncated"):
        read_trace(path)
    rc, err = agent(capsys, "once", f"--nvml.fake=trace:{path}")
    assert rc == 2
    one_line_error(err, str(path), "corrupt")


def test_not_gzip_at_all(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(b"\x00garbage" * 100)
    rc, err = agent(capsys, "once", f"--nvml.fake=trace:{path}")
    assert rc == 2
    one_line_error(err, str(path))


def _edit_line(path: Path, lineno: int, edit: dict[str, object], gpu: int = 0) -> None:
    lines = gzip.decompress(path.read_bytes()).decode().splitlines() if path.suffix == ".gz" else \
        path.read_text().splitlines()
    obj = json.loads(lines[lineno - 1])
    obj["samples"][gpu].update(edit)
    lines[lineno - 1] = json.dumps(obj)
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(("edit", "needle"), [
    ({"gpm": 5}, "samples[1].gpm: expected an object, got 5"),
    ({"power_mw": 1e30}, "samples[1].power_mw: expected an integer"),
    ({"power_mw": 10**30}, "samples[1].power_mw: 1e+30 is not a plausible reading"),
    ({"clock_sm_mhz": -1}, "samples[1].clock_sm_mhz: -1 is not a plausible reading"),
    ({"temperature_gpu_c": 900}, "samples[1].temperature_gpu_c: 900 is not a plausible reading"),
    ({"nvlink": [{"tx_kib": "lots"}]}, "samples[1].nvlink[0].tx_kib: expected an integer"),
    ({"nvlink": [7]}, "samples[1].nvlink[0]: expected an object"),
    ({"ecc": {"volatile_corrected": -3}}, "samples[1].ecc.volatile_corrected: -3 is not a plausible"),
    ({"timestamp": "now"}, "samples[1].timestamp: expected a finite number"),
    ({"lost": "no"}, "samples[1].lost: expected true or false"),
    ({"gpm": {"sm_active_s": -5.0}}, "samples[1].gpm.sm_active_s: -5.0 is not a plausible reading"),
])
def test_wrong_typed_or_impossible_sample_names_file_line_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: dict[str, object], needle: str,
) -> None:
    path = _trace(tmp_path / "t.jsonl", lines=10)
    _edit_line(path, 7, edit, gpu=1)
    with pytest.raises(TraceError) as e:
        read_trace(path)
    assert f"{path}:7: bad sample line: {needle}" in str(e.value)
    rc, err = agent(capsys, "once", f"--nvml.fake=trace:{path}")
    assert rc == 2
    one_line_error(err, f"{path}:7:", needle)


@pytest.mark.parametrize(("line", "needle"), [
    ('{"t": 1e400, "samples": []}', "t is not finite"),
    ('{"t": 5, "samples": "ab"}', "samples: expected a list of objects"),
    ('{"t": 5, "samples": [{}, {}], "xid": [{"gpu": 9, "xid": 79, "timestamp": 1}]}', "xid[0].gpu: no GPU 9"),
    ('{"t": 5, "samples": [{}, {}], "ib": {"": "1"}}', "leaves class/infiniband"),
    ('{"t": 5, "samples": [{}, {}], "ib": {"a/./b": "1"}}', "leaves class/infiniband"),
    ('{"t": ' + "9" * 5000 + "}", "not a usable JSON line"),
    ("[" * 100_000, "not"),
])
def test_malformed_sample_lines(tmp_path: Path, line: str, needle: str) -> None:
    path = _trace(tmp_path / "t.jsonl", lines=3)
    with open(path, "a") as f:
        f.write(line + "\n")
    with pytest.raises(TraceError) as e:
        read_trace(path)
    assert f"{path}:5:" in str(e.value) and needle in str(e.value)
    assert len(str(e.value)) < 400


@pytest.mark.parametrize(("edit", "needle"), [
    ({"cuda_compute_capability": [9]}, "bad header"),
    ({"uuid": 5}, "gpus[0].uuid: expected a string"),
    ({"max_clock_sm_mhz": 2**40}, "gpus[0].max_clock_sm_mhz"),
])
def test_bad_header_inventory(tmp_path: Path, edit: dict[str, object], needle: str) -> None:
    path = _trace(tmp_path / "t.jsonl", lines=2)
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    header["gpus"][0].update(edit)
    path.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    with pytest.raises(TraceError, match=rf"t\.jsonl:1: .*{re.escape(needle)}"):
        read_trace(path)


def test_ib_files_that_cannot_form_a_tree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _trace(tmp_path / "t.jsonl", lines=3)
    with open(path, "a") as f:
        f.write(json.dumps({"t": 1e10, "samples": [{}, {}], "ib": {"mlx5_0": "x", "mlx5_0/ports": "y"}}) + "\n")
    rc, err = agent(capsys, "once", f"--nvml.fake=trace:{path}")
    assert rc == 2
    one_line_error(err, f"{path}:5:", "'mlx5_0/ports' is both a file and a directory")


# ------------------------------------------------------------------ live snapshots


@pytest.mark.parametrize("content", [None, b"", b"\xff\xfe", b'{"format": "gpufleet-snapshot"', b"[1, 2]"])
def test_live_source_must_be_usable_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes | None,
) -> None:
    path = tmp_path / "snapshot.json"
    if content is not None:
        path.write_bytes(content)
    rc, err = agent(capsys, "once", f"--nvml.fake=live:{path}")
    assert rc == 2
    one_line_error(err, str(path))


def test_live_nonexistent_through_the_real_binary() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    r = subprocess.run([str(BIN / "gpufleet-agent"), "once", "--nvml.fake=live:/nonexistent"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and r.stdout == ""
    one_line_error(r.stderr, "/nonexistent", "does not exist")


def _snapshot() -> Snapshot:
    host = builtin_host()
    return Snapshot(driver=host.driver, gpus=host.gpus[:2], samples=host.samples[:2])


def _families(collector: GpuCollector) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in collector.collect():
        out.setdefault(fam.name, []).extend((dict(s.labels), s.value) for s in fam.samples)
    return out


def test_live_file_gone_at_runtime_is_nvml_down_not_zero_gpus(tmp_path: Path) -> None:
    path = tmp_path / "snapshot.json"
    write_snapshot(path, _snapshot())
    backend = fake_backend(f"live:{path}")
    assert isinstance(backend.source, LiveSource)
    backend.source._min_check = 0
    try:
        assert backend.start()
        collector = GpuCollector(backend)
        got = _families(collector)
        assert got["gpufleet_nvml_up"] == [({}, 1)] and got["gpufleet_gpus"] == [({}, 2)]
        path.unlink()
        got = _families(collector)
        assert got["gpufleet_nvml_up"] == [({}, 0)]
        assert "gpufleet_gpus" not in got  # never "a host with 0 GPUs"
        assert any(v > 0 for _, v in got["gpufleet_nvml_errors"])
        write_snapshot(path, _snapshot())  # the simulator writes it again: back up
        got = _families(collector)
        assert got["gpufleet_nvml_up"] == [({}, 1)] and got["gpufleet_gpus"] == [({}, 2)]
    finally:
        backend.close()


def test_live_snapshot_with_impossible_values_keeps_the_last_good_one(tmp_path: Path) -> None:
    path = tmp_path / "snapshot.json"
    snap = _snapshot()
    write_snapshot(path, snap)
    src = LiveSource(path, min_check_s=0)
    good = src.sample(0).power_mw
    data = json.loads(path.read_text())
    data["samples"][0]["gpm"] = 5
    path.write_text(json.dumps(data))
    assert src.sample(0).power_mw == good
    assert src.last_error is not None and "samples[0].gpm: expected an object" in src.last_error


# ------------------------------------------------------------------ job mapping directory


def _success(collector: JobsCollector) -> float:
    reg = AgentCollector([collector])
    for fam in reg.collect():
        if fam.name == "gpufleet_scrape_collector_success":
            return float(fam.samples[0].value)
    raise AssertionError("no success series")


def test_mapping_dir_that_is_a_file_is_a_collector_failure(tmp_path: Path) -> None:
    f = tmp_path / "not-a-dir"
    f.write_text("0\n")
    assert _success(JobsCollector(str(f))) == 0
    assert _success(JobsCollector(str(tmp_path / "missing"))) == 1  # no scheduler here: no data, success


def test_unreadable_mapping_dir_is_a_collector_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "jobs"
    d.mkdir()
    real = os.listdir

    def denied(path: str) -> list[str]:
        if str(path) == str(d):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "listdir", denied)  # as root, chmod 000 would not stop the read
    collector = JobsCollector(str(d))
    assert _success(collector) == 0
    with pytest.raises(OSError, match="Permission denied"):
        list(collector.collect())


@pytest.mark.parametrize("data", [
    b"slurm-1\x00evil\n", b"slurm-1\n\x1b[31mred\n", b"\xff\xfeslurm\n", b"job\x7f\n", "a\u2028b\n".encode(),
    b"x" * 300 + b"\n",
])
def test_job_files_with_garbage_are_skipped_and_counted(tmp_path: Path, data: bytes) -> None:
    d = tmp_path / "jobs"
    d.mkdir()
    (d / "0").write_text("slurm-1\n")
    (d / "1").write_bytes(data)
    fams = {f.name: f for f in JobsCollector(str(d)).collect()}
    jobs = {(s.labels["gpu"], s.labels["job_id"]) for s in fams["gpufleet_gpu_job_info"].samples}
    assert jobs == {("0", "slurm-1")}
    assert fams["gpufleet_gpu_job_mapping_skipped_files"].samples[0].value == 1


# ------------------------------------------------------------------ detector recordings

_SERIES = 'gpufleet_gpu_power_watts{gpu="0",instance="n:9445"}'


def _recording(path: Path, body: str) -> Path:
    path.write_text(f"# TYPE gpufleet_gpu_power_watts gauge\n{body}")
    return path


@pytest.mark.parametrize(("body", "needle"), [
    (f"{_SERIES} 1 1\n{_SERIES} 2 2\n", ":3: truncated (no '# EOF' line at the end)"),
    (f"{_SERIES} 1 1\n{_SERIES} 2 2\n{_SERIES} 3\n# EOF\n", ":4: sample without a timestamp"),
    (f"{_SERIES} 1 1\n{_SERIES} x 2\n# EOF\n", ":3: not valid OpenMetrics"),
    (f"{_SERIES} 1 1\n{_SERIES} 2 nan\n# EOF\n", ":3: timestamp 'nan' is not a finite number"),
    (f"{_SERIES} 1 1\n" + 'gpufleet_gpu_power_watts{gpu="0} 2 2\n# EOF\n', ":3: not valid OpenMetrics"),
    (f"{_SERIES} 1 1\n# EOF\n{_SERIES} 2 2\n", ":4: data after the '# EOF' line"),
    (f"{_SERIES} 1 1\n# EOF\nother 1\n", ":4: data after the '# EOF' line"),
    (f"{_SERIES} 1 1\n}}{{ garbage\n# EOF\n", ":3: not valid OpenMetrics: not a comment or a sample"),
])
def test_bad_recording_names_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str, needle: str,
) -> None:
    path = _recording(tmp_path / "rec.om", body)
    assert detector_main(["replay", str(path)]) == 2
    one_line_error(capsys.readouterr().err, f"{path}{needle}")


def test_non_utf8_recording_names_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "rec.om"
    path.write_bytes(f"# TYPE gpufleet_gpu_power_watts gauge\n{_SERIES} 1 1\n".encode() + b"\xff\xfe 2 2\n# EOF\n")
    assert detector_main(["replay", str(path)]) == 2
    one_line_error(capsys.readouterr().err, f"{path}:3: not UTF-8")


def test_non_utf8_detector_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "detector.toml"
    cfg.write_bytes(b"[detector]\nprofile = '\xff'\n")
    rec = _recording(tmp_path / "rec.om", f"{_SERIES} 1 1\n# EOF\n")
    assert detector_main(["replay", str(rec), "--config", str(cfg)]) == 2
    one_line_error(capsys.readouterr().err, str(cfg), "not UTF-8")


@pytest.mark.parametrize("kind", ["truncated", "garbage", "binary"])
def test_detector_replay_end_to_end(tmp_path: Path, kind: str) -> None:
    path = tmp_path / f"{kind}.om"
    good = "".join(f"{_SERIES} {i} {1_700_000_000 + 15 * i}\n" for i in range(200))
    if kind == "truncated":
        _recording(path, good[: len(good) // 2 + 7])
    elif kind == "garbage":
        _recording(path, good + "}}}{{{ not openmetrics at all\n# EOF\n")
    else:
        path.write_bytes(os.urandom(4096) + b"\x80")
    r = subprocess.run([str(BIN / "gpufleet-detector"), "replay", str(path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    one_line_error(r.stderr, str(path))
