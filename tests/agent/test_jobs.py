"""Jobs collector: dcgm-exporter style GPU -> job mapping directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpufleet.agent.collectors import jobs as jobs_mod
from gpufleet.agent.collectors.jobs import JobsCollector


def scrape(collector: JobsCollector) -> set[tuple[str, str]]:
    registry = CollectorRegistry()
    registry.register(collector)
    out = set()
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        if fam.name == "gpufleet_gpu_job_mapping_skipped_files":
            continue
        for s in fam.samples:
            assert s.name == "gpufleet_gpu_job_info"
            assert set(s.labels) == {"gpu", "job_id"}
            assert s.value == 1.0
            out.add((s.labels["gpu"], s.labels["job_id"]))
    return out


@pytest.fixture
def mapping_dir(tmp_path: Path) -> Path:
    d = tmp_path / "job-mapping"
    d.mkdir()
    (d / "0").write_text("slurm-1001\n\nslurm-1002\n")
    (d / "1").write_text("slurm-1001")  # no trailing newline
    (d / "2").write_text("  slurm-1001 \r\nslurm-1001\n")  # whitespace, CRLF, duplicate
    (d / "3").write_text("\n\n")  # idle GPU
    (d / "12").write_text("train/run-7\n")
    return d


def test_one_series_per_gpu_and_job(mapping_dir: Path) -> None:
    assert scrape(JobsCollector(str(mapping_dir))) == {
        ("0", "slurm-1001"), ("0", "slurm-1002"), ("1", "slurm-1001"), ("2", "slurm-1001"),
        ("12", "train/run-7"),
    }


def test_files_that_are_not_gpu_indices_are_ignored(mapping_dir: Path) -> None:
    for name in ("README", "07", "-1", "4.tmp", ".5", "٣"):
        (mapping_dir / name).write_text("bogus-job\n")
    assert not {job for _, job in scrape(JobsCollector(str(mapping_dir)))} & {"bogus-job"}


def test_unusable_files_are_skipped_and_others_kept(
    mapping_dir: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    (mapping_dir / "4").write_text("x" * (jobs_mod.MAX_FILE_BYTES + 1))  # oversized
    (mapping_dir / "5").mkdir()  # not a file
    os.mkfifo(mapping_dir / "6")  # a FIFO must not hang the scrape
    (mapping_dir / "7").symlink_to(mapping_dir / "missing")  # dangling link
    (mapping_dir / "8").write_text("y" * 100 + "\n")  # just under any limit: kept
    collector = JobsCollector(str(mapping_dir))
    with caplog.at_level("WARNING", logger="gpufleet.agent.collectors.jobs"):
        got = scrape(collector)
    gpus = {gpu for gpu, _ in got}
    assert gpus == {"0", "1", "2", "12", "8"}
    warned = caplog.text
    assert "larger than" in warned and "not a regular file" in warned and "cannot open" in warned
    caplog.clear()
    with caplog.at_level("WARNING", logger="gpufleet.agent.collectors.jobs"):
        assert scrape(collector) == got
    assert caplog.text == ""  # each problem is logged at warning level once, not every scrape


def test_mapping_follows_the_directory(mapping_dir: Path) -> None:
    collector = JobsCollector(str(mapping_dir))
    assert ("1", "slurm-1001") in scrape(collector)
    (mapping_dir / "1").write_text("")  # the epilog clears the file when the job ends
    (mapping_dir / "3").write_text("slurm-2000\n")
    got = scrape(collector)
    assert not [p for p in got if p[0] == "1"]
    assert ("3", "slurm-2000") in got


def skipped(collector: JobsCollector) -> float | None:
    for fam in collector.collect():
        if fam.name == "gpufleet_gpu_job_mapping_skipped_files":
            return float(fam.samples[0].value)
    return None


def test_missing_directory_gives_nothing_and_empty_directory_no_jobs(tmp_path: Path) -> None:
    assert list(JobsCollector(str(tmp_path / "missing")).collect()) == []  # no scheduler here: no data, success
    empty = tmp_path / "empty"
    empty.mkdir()
    assert [(m.name, m.samples[0].value) for m in JobsCollector(str(empty)).collect()] == [
        ("gpufleet_gpu_job_mapping_skipped_files", 0)]
    assert [m.name for m in JobsCollector(str(tmp_path / "missing")).describe()] == [
        "gpufleet_gpu_job_info", "gpufleet_gpu_job_mapping_skipped_files"]


def test_skipped_files_are_counted(mapping_dir: Path) -> None:
    assert skipped(JobsCollector(str(mapping_dir))) == 0
    (mapping_dir / "4").write_text("x" * (jobs_mod.MAX_FILE_BYTES + 1))
    (mapping_dir / "5").mkdir()
    (mapping_dir / "README").write_text("not a GPU index: ignored, not counted\n")
    assert skipped(JobsCollector(str(mapping_dir))) == 2
