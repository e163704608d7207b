"""NCCL collector: per-rank collective time and bus bandwidth from the profiler plugin's trace dumps."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from support import FIXTURES, key, scrape

from gpufleet.agent import settings
from gpufleet.agent.collectors import nccl
from gpufleet.agent.collectors.nccl import NcclCollector
from gpufleet.agent.collectors.nccl_trace import bus_factor, parse_trace

COMM = 673864846479792718


def trace(rank: int, durations_us: list[float], *, count: int = 1 << 24, pid: int = 4000, name: str = "AllReduce",
          datatype: str = "ncclBfloat16") -> str:
    """A dump as the example plugin writes it (print_event.cc's COLL header and trailer), with proxy noise."""
    lines = ["["]
    ts = 1000.0
    for i, d in enumerate(durations_us):
        lines.append(f'{{"name": "Group", "cat": "GROUP", "ph": "b", "id": {i}, "pid": {pid}, "tid": 1, "ts": {ts:f}, '
                     f'"args": {{"groupId": {i}}}}},')
        lines.append(f'{{"name": "{name}", "cat": "COLL", "ph": "b", "id": {i}, "pid": {pid}, "tid": 1, "ts": {ts:f}, '
                     f'"args": {{"SeqNum": {i}, "CommHash": {COMM}, "Rank": {rank}, "Count": {count}, '
                     f'"Datatype": "{datatype}", "Algorithm": "RING", "Protocol": "SIMPLE", "nChannels": 16}}}},')
        lines.append(f'{{"name": "ScheduleSend", "cat": "PROXY", "ph": "b", "id": {i}, "pid": {pid}, "tid": 1, '
                     f'"ts": {ts + 1:f}, "args": {{"Channel": 0, "Peer": 1, "Steps": 8, "ChunkSize": 524288, '
                     f'"transSize": 4194304}}}},')
        lines.append(f'{{"name": "{name}", "cat": "COLL", "ph": "e", "id": {i}, "pid": {pid}, "tid": 1, '
                     f'"ts": {ts + d:f}}},')
        lines.append(f'{{"name": "Group", "cat": "GROUP", "ph": "e", "id": {i}, "pid": {pid}, "tid": 1, '
                     f'"ts": {ts + d + 1:f}}},')
        ts += d + 500.0
    lines.append("{}]")
    return "\n".join(lines) + "\n"


def test_nccl_documented_example() -> None:
    """The trace in NCCL's ext-profiler/example README: one AllReduce of 32768 float32 on rank 1, 7.97 ms."""
    s = parse_trace((FIXTURES / "nccl" / "readme-example-allreduce.txt").read_text())
    assert list(s.collectives) == [("AllReduce", COMM)] and s.malformed_lines == 0
    ar = s.collectives[("AllReduce", COMM)]
    assert ar.count == 1 and s.top_rank == {COMM: 1}
    assert ar.seconds == pytest.approx((772209.317383 - 764237.294922) / 1e6)
    assert ar.payload == 32768 * 4
    # rank 1 seen -> a communicator of at least 2: AllReduce bus factor 2(n-1)/n = 1 (it had 8: 1.75)
    assert bus_factor("AllReduce", 2) == 1.0 and bus_factor("AllReduce", 8) == 1.75


def test_rank_whose_peers_wait(tmp_path: Path) -> None:
    """Four ranks of one job; rank 2 arrives late, so its peers sit in every collective and it does not."""
    for rank in range(4):
        d = [2_000.0] * 5 if rank == 2 else [30_000.0] * 5
        (tmp_path / f"4711.gpu{rank}-node07-{100 + rank}.txt").write_text(trace(rank, d, pid=100 + rank))
    (tmp_path / "unrelated.txt").write_text("not a trace")
    got = scrape(NcclCollector(str(tmp_path)))
    for rank in range(4):
        lbl = {"gpu": str(rank), "job_id": "4711", "collective": "AllReduce"}
        assert got[key("gpufleet_nccl_collectives_total", **lbl)] == 5
        want = 5 * (0.002 if rank == 2 else 0.03)
        assert got[key("gpufleet_nccl_collective_seconds_total", **lbl)] == pytest.approx(want)
        bus = 5 * (1 << 24) * 2 * 2 * 3 / 4  # bf16 payload x 2(n-1)/n, n = 4
        assert got[key("gpufleet_nccl_collective_bus_bytes_total", **lbl)] == pytest.approx(bus)
        assert got[key("gpufleet_nccl_collective_bus_bandwidth_bytes_per_second", **lbl)] == pytest.approx(bus / want)
    assert not any(k[0] == "gpufleet_nccl_read_errors_total" for k in got)


def test_job_from_mapping_rewrites_and_retention(tmp_path: Path) -> None:
    mapping = {"3": ["slurm-99"]}
    c = NcclCollector(str(tmp_path), lambda: mapping)
    f = tmp_path / "gpu3-node07-55.txt"
    f.write_text(trace(3, [1000.0]))
    lbl = {"gpu": "3", "job_id": "slurm-99", "collective": "AllReduce"}
    assert scrape(c)[key("gpufleet_nccl_collectives_total", **lbl)] == 1
    mapping.clear()  # the job ended; the file keeps its job
    f.write_text(trace(3, [1000.0, 1000.0]) + "{\"cat\": \"COLL\", cut off\n")
    os.utime(f, ns=(1, 10**18))
    got = scrape(c)
    assert got[key("gpufleet_nccl_collectives_total", **lbl)] == 2
    assert got[key("gpufleet_nccl_read_errors_total", reason="malformed_line")] == 1
    assert scrape(c)[key("gpufleet_nccl_read_errors_total", reason="malformed_line")] == 1  # not counted again
    f.unlink()
    assert not any(k[0] == "gpufleet_nccl_collectives_total" for k in scrape(c))


def test_partial_file_and_limits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dump still being written counts its finished collectives; an oversized one is an error, once."""
    text = trace(0, [1000.0, 1000.0, 1000.0])
    cut = text[: text.rindex('"cat": "COLL", "ph": "e"')]  # the last collective's end is not written yet
    (tmp_path / "gpu0-n-1.txt").write_text(cut)
    c = NcclCollector(str(tmp_path))
    assert scrape(c)[key("gpufleet_nccl_collectives_total", gpu="0", job_id="", collective="AllReduce")] == 2
    monkeypatch.setattr(nccl, "MAX_FILE_BYTES", 100)
    (tmp_path / "gpu1-n-2.txt").write_text(text)
    for _ in range(2):
        got = scrape(c)
        assert got[key("gpufleet_nccl_read_errors_total", reason="too_large")] == 1
        assert not any(k[0] == "gpufleet_nccl_collectives_total" and ("gpu", "1") in k[1] for k in got)


def test_no_directory_no_series(tmp_path: Path) -> None:
    assert scrape(NcclCollector("")) == {}
    assert scrape(NcclCollector(str(tmp_path / "absent"))) == {}
    (tmp_path / "a-file").write_text("")
    c = NcclCollector(str(tmp_path / "a-file"))
    scrape(c)
    assert scrape(c) == {key("gpufleet_nccl_read_errors_total", reason="directory"): 2}
    shutil.copy(FIXTURES / "nccl" / "readme-example-allreduce.txt", tmp_path / "job.gpu1-host-4157654.txt")
    got = scrape(NcclCollector(str(tmp_path)))
    assert got[key("gpufleet_nccl_collectives_total", gpu="1", job_id="job", collective="AllReduce")] == 1


def test_flag() -> None:
    cfg = settings.resolve(["--collector.nccl.directory", "/var/lib/gpufleet/nccl"], env={}).config
    assert cfg.nccl_directory == "/var/lib/gpufleet/nccl"
