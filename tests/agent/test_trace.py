"""Trace format: write -> read -> replay, corrupt input, counters across loops."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path

import pynvml
import pytest

from gpufleet.agent.nvml.model import XidEvent
from gpufleet.agent.nvml.trace import Trace, TraceError, TraceWriter, read_trace
from gpufleet.sim.fake.library import FakeNvml
from gpufleet.sim.fake.sim_source import SimSource
from gpufleet.sim.fake.spec import source_from_spec
from gpufleet.sim.fake.trace_source import TraceSource

T0 = 1_763_780_000.0
IB_DATA = "mlx5_0/ports/1/counters/port_xmit_data"
IB_STATE = "mlx5_0/ports/1/state"


def _record(path: Path, n: int = 5, gpus: int = 3) -> tuple[SimSource, list[float]]:
    """Record ``n`` lines of a simulated host, 2 s apart, with XIDs and IB files."""
    now = [T0]
    sim = SimSource(gpus, seed=7, clock=lambda: now[0])
    times = []
    with TraceWriter(path, hostname="node-7", interval_s=2.0, driver=sim.driver(), gpus=sim.inventory()) as w:
        for k in range(n):
            now[0] = T0 + 2.0 * k
            times.append(now[0])
            xid = [XidEvent(gpu=1, xid=48, timestamp=now[0] - 0.5)] if k == 2 else []
            ib = {IB_DATA: f"{1000 * (k + 1)}\n", IB_STATE: "4: ACTIVE\n"}
            w.write(now[0], [sim.sample(i) for i in range(gpus)], xid, ib)
    return sim, times


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_write_read_round_trip(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    sim, times = _record(path)
    if name.endswith(".gz"):
        with gzip.open(path) as f:
            assert f.read(20).startswith(b'{"format"')
    tr = read_trace(path)
    assert (tr.hostname, tr.interval_s, tr.driver) == ("node-7", 2.0, sim.driver())
    assert tr.gpus == sim.inventory()
    assert [r.t for r in tr.records] == times
    # samples come back equal to what the simulator produced at those times
    again = SimSource(3, seed=7, clock=lambda: T0)
    for r in tr.records:
        again._clock = lambda r=r: r.t  # type: ignore[misc]
        assert r.samples == [again.sample(i) for i in range(3)]
    assert [len(r.xid) for r in tr.records] == [0, 0, 1, 0, 0]
    assert tr.records[2].xid[0] == XidEvent(gpu=1, xid=48, timestamp=times[2] - 0.5)
    # IB is delta-encoded: the unchanged state file is written once
    assert tr.records[0].ib == {IB_DATA: "1000\n", IB_STATE: "4: ACTIVE\n"}
    assert tr.records[1].ib == {IB_DATA: "2000\n"}


def test_header_and_lines_are_documented_json(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    _record(path, n=2)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0]["format"] == "gpufleet-trace" and lines[0]["version"] == 1
    assert set(lines[0]) == {"format", "version", "hostname", "interval_s", "driver", "gpus"}
    assert set(lines[1]) == {"t", "samples", "xid", "ib"}


def _replay(tmp_path: Path, n: int = 5) -> tuple[TraceSource, list[float], Trace]:
    path = tmp_path / "t.jsonl.gz"
    _record(path, n=n)
    wall = [5000.0]
    src = TraceSource(path, clock=lambda: wall[0], background=False)
    return src, wall, src.trace


def test_replay_maps_wall_clock_and_loops_without_counter_resets(tmp_path: Path) -> None:
    src, wall, tr = _replay(tmp_path)
    try:
        assert src.inventory() == tr.gpus  # first read: replay starts at wall 5000
        period = 5 * 2.0
        seen_energy: list[int] = []
        for step in range(0, 31):  # three loops, 1 s steps
            wall[0] = 5000.0 + step
            k = (step % 10) // 2
            s = src.sample(1)
            rec = tr.records[k].samples[1]
            assert s.power_mw == rec.power_mw and s.utilization_gpu_pct == rec.utilization_gpu_pct
            loops = step // 10
            assert s.timestamp == pytest.approx(5000.0 + loops * period + 2.0 * k)
            assert s.energy_mj is not None
            seen_energy.append(s.energy_mj)
            assert s.gpm is not None and rec.gpm is not None
            if loops == 0:
                assert s.energy_mj == rec.energy_mj
                assert s.gpm.sm_active_s == rec.gpm.sm_active_s
        assert all(b >= a for a, b in itertools.pairwise(seen_energy))
        first, last = tr.records[0].samples[1].energy_mj, tr.records[-1].samples[1].energy_mj
        assert first is not None and last is not None
        # after one loop, the counter continues one average step above the last line
        wall[0] = 5000.0 + period
        assert src.sample(1).energy_mj == last + (last - first) // 4
    finally:
        src.close()


def test_replay_delivers_xid_once_per_loop(tmp_path: Path) -> None:
    src, wall, _ = _replay(tmp_path)
    try:
        src.inventory()
        wall[0] = 5003.0
        assert src.poll_xid() == []
        wall[0] = 5004.5
        (ev,) = src.poll_xid()
        assert (ev.gpu, ev.xid) == (1, 48) and ev.timestamp == pytest.approx(5004.0 - 0.5)
        assert src.poll_xid() == []
        wall[0] = 5025.0  # two loops later: the event of loop 1 and of loop 2
        assert [e.timestamp for e in src.poll_xid()] == pytest.approx([5013.5, 5023.5])
    finally:
        src.close()


def test_replay_writes_ib_sysfs(tmp_path: Path) -> None:
    src, wall, _ = _replay(tmp_path)
    try:
        assert src.sysfs_root is not None
        base = Path(src.sysfs_root) / "class" / "infiniband"
        assert (base / IB_DATA).read_text() == "1000\n"
        assert (base / IB_STATE).read_text() == "4: ACTIVE\n"
        wall[0] = 5006.0
        src.refresh_sysfs()
        assert (base / IB_DATA).read_text() == "4000\n"
        wall[0] = 5010.0  # next loop: counters continue (5000 + one average step 1000), state unchanged
        src.refresh_sysfs()
        assert (base / IB_DATA).read_text() == "6000\n"
        root = src.sysfs_root
    finally:
        src.close()
    assert not Path(root).exists()


def test_pinned_replay_and_fake_nvml_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    _record(path)
    tr = read_trace(path)
    src = source_from_spec(f"trace:{path}@3")
    try:
        with FakeNvml(src):
            pynvml.nvmlInit()
            try:
                for i, want in enumerate(tr.records[3].samples):
                    d = pynvml.nvmlDeviceGetHandleByIndex(i)
                    assert pynvml.nvmlDeviceGetUUID(d) == tr.gpus[i].uuid
                    assert pynvml.nvmlDeviceGetPowerUsage(d) == want.power_mw
                    assert pynvml.nvmlDeviceGetTotalEnergyConsumption(d) == want.energy_mj
                    assert pynvml.nvmlDeviceGetClockInfo(d, pynvml.NVML_CLOCK_SM) == want.clock_sm_mhz
                    assert want.nvlink is not None
                    fv = pynvml.nvmlDeviceGetFieldValues(d, [(pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 5)])
                    assert fv[0].value.ullVal == want.nvlink[5].tx_kib
            finally:
                pynvml.nvmlShutdown()
    finally:
        src.close()  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="cannot pin"):
        source_from_spec(f"trace:{path}@99")


def _header_line() -> str:
    return json.dumps({"format": "gpufleet-trace", "version": 1, "hostname": "h", "interval_s": 1.0,
                       "driver": {}, "gpus": [{"index": 0, "uuid": "GPU-x"}]})


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([], "empty file"),
        (['{"format": "other"}'], "not a gpufleet trace"),
        ([_header_line().replace('"version": 1', '"version": 9')], "unsupported trace version 9"),
        ([_header_line(), '{"t": 1, "samples": [{}]}', '{"t": 2, "samples": [{}'], ":3: not valid JSON"),
        ([_header_line(), '{"t": 1, "samples": [{}, {}]}'], ":2: bad sample line"),
        ([_header_line(), '{"t": 2, "samples": [{}]}', '{"t": 1, "samples": [{}]}'], ":3: time 1.0 does not increase"),
        ([_header_line(), '{"samples": [{}]}'], ":2: bad sample line"),
        ([_header_line().replace('"uuid": "GPU-x"', '"serial": "1"')], ":1: bad header"),
        ([_header_line(), '{"t": 1, "samples": [{}], "ib": {"../../etc/x": "1"}}'], "leaves class/infiniband"),
    ],
)
def test_corrupt_traces_name_the_line(tmp_path: Path, lines: list[str], message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(x + "\n" for x in lines))
    with pytest.raises(TraceError, match=message):
        read_trace(path)


def test_truncated_gzip_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl.gz"
    _record(path, n=20)
    data = path.read_bytes()
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match=r"cut\.jsonl\.gz:\d+: .*corrupt or truncated"):
        read_trace(cut)
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="trace:"):
        source_from_spec(f"trace:{tmp_path / 'missing.jsonl'}")


def test_writer_rejects_bad_input(tmp_path: Path) -> None:
    sim = SimSource(2, clock=lambda: T0)
    with pytest.raises(ValueError, match="interval_s"):
        TraceWriter(tmp_path / "a.jsonl", hostname="h", interval_s=0, driver=sim.driver(), gpus=sim.inventory())
    with TraceWriter(tmp_path / "b.jsonl", hostname="h", interval_s=1, driver=sim.driver(),
                     gpus=sim.inventory()) as w:
        w.write(T0, [sim.sample(0), sim.sample(1)])
        with pytest.raises(ValueError, match="increase"):
            w.write(T0, [sim.sample(0), sim.sample(1)])
        with pytest.raises(ValueError, match="1 samples"):
            w.write(T0 + 1, [sim.sample(0)])
