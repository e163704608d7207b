"""``gpufleet-agent record`` and replay: a trace gives back, through the agent, the values it recorded."""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from support import FIXTURES, running, scrape
from test_gpu_collector import FakeHost, assert_series_equal, expected_series, pick, value

from gpufleet.agent.collectors.gpu import GpuCollector
from gpufleet.agent.nvml.backend import OPEN_TIMEOUT, NvmlBackend
from gpufleet.agent.nvml.model import GpuSample, XidEvent
from gpufleet.agent.nvml.trace import read_trace
from gpufleet.agent.recorder import build_parser, read_ib_files, record_main
from gpufleet.sim.fake.library import FakeNvml
from gpufleet.sim.fake.spec import fake_backend
from gpufleet.sim.fake.trace_source import TraceSource

TRACE = FIXTURES / "traces" / "h100x8-sim.jsonl.gz"
IB_FIXTURE = FIXTURES / "sysfs-infiniband-h100"


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# ---------------------------------------------------------------------- the committed trace


def test_committed_trace_is_small_and_complete() -> None:
    assert TRACE.stat().st_size < 400_000, "keep the committed trace small"
    trace = read_trace(TRACE)
    assert len(trace.gpus) == 8
    assert 25 <= len(trace.records) <= 40
    assert len({g.uuid for g in trace.gpus}) == 8
    assert all(g.gpm_supported and g.nvlink_count == 18 for g in trace.gpus)
    # GPM integrals grow (the recorder integrated the ratios NVML reported between samples)
    first, last = trace.records[1].samples[0].gpm, trace.records[-1].samples[0].gpm
    assert first is not None and last is not None
    assert last.sm_active_s > first.sm_active_s
    assert any(r.ib for r in trace.records), "IB files of the simulated host were recorded"


@pytest.mark.parametrize("line", [0, 17])
def test_replayed_exposition_equals_the_trace_values(line: int) -> None:
    trace = read_trace(TRACE)
    backend = fake_backend(f"trace:{TRACE}@{line}")
    try:
        assert backend.start(), backend.init_error
        got = scrape(GpuCollector(backend))  # one scrape: no GPM interval yet
        rec = trace.records[line]
        src = SimpleNamespace(inv=trace.gpus, samples=rec.samples, driver=lambda: trace.driver)
        assert_series_equal(got, expected_series(src))
        assert backend.errors() == {}
        assert backend.pci_bus_ids() == {str(g.index): g.pci_bus_id for g in trace.gpus}
    finally:
        backend.close()


def test_replayed_gpm_equals_the_trace_integrals() -> None:
    trace = read_trace(TRACE)
    t0 = trace.records[0].t
    clock = Clock(time.time())
    start = clock.t
    source = TraceSource(trace, clock=clock)
    with FakeNvml(source):
        backend = NvmlBackend()
        try:
            assert backend.start()
            collector = GpuCollector(backend)
            a, b = 3, 9
            clock.t = start + (trace.records[a].t - t0)
            scrape(collector)
            clock.t = start + (trace.records[b].t - t0)
            got = scrape(collector)
            for gpu in range(8):
                sa, sb = trace.records[a].samples[gpu], trace.records[b].samples[gpu]
                assert sa.gpm is not None and sb.gpm is not None
                dt = trace.records[b].t - trace.records[a].t  # replay stamps samples with their line's time
                g = str(gpu)
                assert value(got, "gpufleet_gpu_sm_active_ratio", gpu=g) == pytest.approx(
                    (sb.gpm.sm_active_s - sa.gpm.sm_active_s) / dt, rel=1e-6)
                assert value(got, "gpufleet_gpu_tensor_active_ratio", gpu=g) == pytest.approx(
                    (sb.gpm.tensor_active_s - sa.gpm.tensor_active_s) / dt, rel=1e-6)
                assert value(got, "gpufleet_gpu_nvlink_throughput_bytes_per_second", gpu=g, direction="tx") == \
                    pytest.approx((sb.gpm.nvlink_tx_bytes - sa.gpm.nvlink_tx_bytes) / dt, rel=1e-6)
                assert value(got, "gpufleet_gpu_pcie_throughput_bytes_per_second", gpu=g, direction="rx") == \
                    pytest.approx((sb.gpm.pcie_rx_bytes - sa.gpm.pcie_rx_bytes) / dt, rel=1e-6)
                assert 0 < value(got, "gpufleet_gpu_sm_active_ratio", gpu=g) <= 1
        finally:
            backend.close()
            source.close()


# ---------------------------------------------------------------------- record -> replay round trip


class RampHost(FakeHost):
    """FakeHost whose counters follow the wall clock: GPM activity 60 % SM, 30 % tensor, 2 GiB/s NVLink TX."""

    def __init__(self) -> None:
        super().__init__()
        self.t0 = time.time()
        self.base = [copy.deepcopy(s.gpm) for s in self.samples]

    def sample(self, index: int) -> GpuSample:
        s = self.samples[index]
        now = time.time()
        dt = now - self.t0
        s.timestamp = now
        s.energy_mj = 9_876_543_210 + int(512_345 * dt)
        base = self.base[index]
        if base is not None and s.gpm is not None:
            s.gpm.sm_active_s = base.sm_active_s + 0.6 * dt
            s.gpm.tensor_active_s = base.tensor_active_s + 0.3 * dt
            s.gpm.nvlink_tx_bytes = base.nvlink_tx_bytes + int(2 * 2**30 * dt)
        return s


def test_record_then_replay_round_trip(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    (sysfs / "class").mkdir(parents=True)
    (sysfs / "class" / "infiniband").symlink_to(IB_FIXTURE)
    out = tmp_path / "rec.jsonl.gz"
    src = RampHost()
    src.xids.append(XidEvent(gpu=1, xid=79, timestamp=0))
    with FakeNvml(src):
        rc = record_main(["--output", str(out), "--samples", "4", "--interval", "0.25",
                          f"--path.sysfs={sysfs}", "--hostname", "test-host", "--log.level", "warn"])
    assert rc == 0
    with gzip.open(out, "rt") as f:
        assert json.loads(f.readline())["hostname"] == "test-host"
    trace = read_trace(out)
    assert len(trace.records) == 4
    assert [g.uuid for g in trace.gpus] == [g.uuid for g in src.inv]
    assert trace.gpus[1].fan_count == 2 and trace.gpus[1].retired_pages_supported
    assert not trace.gpus[0].retired_pages_supported and trace.gpus[0].nvlink_count == 4
    assert [(x.gpu, x.xid) for r in trace.records for x in r.xid] == [(1, 79)]
    # raw NVML values, NVML units
    s0 = trace.records[-1].samples[0]
    assert s0.power_mw == src.samples[0].power_mw and s0.pcie_tx_kbps == src.samples[0].pcie_tx_kbps
    assert s0.nvlink is not None and [ls.up for ls in s0.nvlink] == [True, True, True, False]
    assert trace.records[-1].samples[1].gpm is None, "no GPM on the PCIe card"
    # GPM: the recorder integrated the ratios; replay gives them back
    for a, b in zip(trace.records[1:], trace.records[2:], strict=False):
        ga, gb = a.samples[0].gpm, b.samples[0].gpm
        assert ga is not None and gb is not None
        dt = b.t - a.t
        assert (gb.sm_active_s - ga.sm_active_s) / dt == pytest.approx(0.6, rel=0.02)
        assert (gb.nvlink_tx_bytes - ga.nvlink_tx_bytes) / dt == pytest.approx(2 * 2**30, rel=0.02)
    # IB files, verbatim
    ib = trace.records[0].ib or {}
    key = "mlx5_0/ports/1/counters/port_xmit_data"
    assert ib[key] == (IB_FIXTURE / key).read_text()
    assert ib["mlx5_0/hca_type"] == (IB_FIXTURE / "mlx5_0" / "hca_type").read_text()
    assert not any(k.split("/")[1] == "device" for k in ib), "the PCI tree is not recorded"
    # replay through the agent
    backend = fake_backend(f"trace:{out}@3")
    try:
        assert backend.start()
        got = scrape(GpuCollector(backend))
        assert value(got, "gpufleet_gpu_power_watts", gpu="0") == src.samples[0].power_mw / 1000  # type: ignore[operator]
        assert value(got, "gpufleet_gpu_nvlink_up", gpu="0", link="3") == 0
        assert len(pick(got, "gpufleet_gpu_fan_speed_ratio", gpu="1")) == 2
        assert isinstance(backend.source, TraceSource)
        assert backend.source.sysfs_root, "IB files replay into a sysfs tree"
        replayed = read_ib_files(Path(backend.source.sysfs_root) / "class" / "infiniband")
        assert replayed[key] == (IB_FIXTURE / key).read_text()
    finally:
        backend.close()


def test_lost_gpu_is_recorded_as_lost(tmp_path: Path) -> None:
    src = FakeHost()
    src.samples[2].lost = True
    out = tmp_path / "lost.jsonl"
    with FakeNvml(src):
        assert record_main(["--output", str(out), "--samples", "2", "--interval", "0.05",
                            f"--path.sysfs={tmp_path}"]) == 0
    trace = read_trace(out)
    assert [s.lost for s in trace.records[-1].samples] == [False, False, True]
    backend = fake_backend(f"trace:{out}@1")
    try:
        assert backend.start()
        got = scrape(GpuCollector(backend))
        assert value(got, "gpufleet_gpu_up", gpu="2") == 0
        assert value(got, "gpufleet_gpu_up", gpu="0") == 1
    finally:
        backend.close()


# ---------------------------------------------------------------------- usage errors


def test_bad_usage_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert record_main(["--output", str(tmp_path / "x.csv"), "--samples", "1", "--nvml.fake=sim:1"]) == 2
    assert ".jsonl" in capsys.readouterr().err
    assert record_main(["--output", str(tmp_path / "x.jsonl"), "--nvml.fake=bogus"]) == 2
    assert "bogus" in capsys.readouterr().err
    assert record_main(["--output", str(tmp_path / "missing" / "x.jsonl"), "--nvml.fake=sim:1"]) == 2
    for argv in (["--samples", "1"], ["--output", "x.jsonl", "--samples", "0"],
                 ["--output", "x.jsonl", "--interval", "-1"], ["--output", "x.jsonl", "--samples", "2",
                                                               "--duration", "3"]):
        with pytest.raises(SystemExit) as e:
            record_main(argv)
        assert e.value.code == 2
    assert not list(tmp_path.iterdir())


def test_nvml_unavailable_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with FakeNvml(FakeHost()) as fake:
        fake.driver_loaded = False
        assert record_main(["--output", str(tmp_path / "x.jsonl"), "--samples", "1"]) == 1
    assert "DRIVER_NOT_LOADED" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()


def test_hung_nvml_init_ends_the_recording_within_its_bound(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.monotonic()
    assert record_main(["--output", str(tmp_path / "x.jsonl"), "--samples", "1", "--call-timeout", "0.5",
                        "--nvml.fake=sim:2,hang=nvmlInit", f"--path.sysfs={tmp_path}"]) == 1
    assert time.monotonic() - t0 < 5
    # (other tests' lingering threads may log into the captured stream too: the recorder's own line is one)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gpufleet-agent record:")]
    assert err == ["gpufleet-agent record: NVML initialization has not returned after 0.5 s (a hung driver or GPU): "
                   "nothing recorded"]
    assert not (tmp_path / "x.jsonl").exists()


# one call of GPU 2 hangs / every call of GPU 2 hangs (its identification at NVML's start too: the backend
# waits backend.OPEN_TIMEOUT for it, then starts with the other GPUs)
@pytest.mark.parametrize(("hang", "bound"), [("nvmlDeviceGetPowerUsage@2", 0.3),
                                             pytest.param("*@2", OPEN_TIMEOUT + 1, marks=pytest.mark.slow)])
def test_one_hung_gpu_is_recorded_as_lost_and_the_others_go_on(tmp_path: Path, hang: str, bound: float) -> None:
    out = tmp_path / "hung.jsonl"
    t0 = time.monotonic()
    assert record_main(["--output", str(out), "--samples", "3", "--interval", "0.1", "--call-timeout", str(bound),
                        f"--nvml.fake=sim:4,hang={hang}", f"--path.sysfs={tmp_path}"]) == 0
    # the first line waits for the hung GPU once; while its call hangs, its lane is busy and is not waited on
    assert time.monotonic() - t0 < bound + 6
    trace = read_trace(out)
    assert len(trace.records) == 3
    for rec in trace.records:
        assert [s.lost for s in rec.samples] == [False, False, True, False]
        assert all(s.power_mw for s in rec.samples if not s.lost)
    backend = fake_backend(f"trace:{out}@2")
    try:
        assert backend.start()
        got = scrape(GpuCollector(backend))
        assert value(got, "gpufleet_gpu_up", gpu="2") == 0 and value(got, "gpufleet_gpu_up", gpu="3") == 1
    finally:
        backend.close()


def test_a_gpu_whose_reads_come_back_is_recorded_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "back.jsonl"
    # GPU 1's power read hangs once for 0.8 s: the lines read meanwhile have it lost, the later ones do not
    assert record_main(["--output", str(out), "--samples", "6", "--interval", "0.3", "--call-timeout", "0.2",
                        "--nvml.fake=sim:2,hang=nvmlDeviceGetPowerUsage@1:0.8", f"--path.sysfs={tmp_path}"]) == 0
    lost = [rec.samples[1].lost for rec in read_trace(out).records]
    assert lost[0] and not lost[-1], lost
    assert all(not rec.samples[0].lost for rec in read_trace(out).records)
    text = caplog.text
    assert "GPU 1's NVML reads have not returned after 0.2 s" in text and "GPU 1 answers again" in text


def test_duration_bounds_the_recording(tmp_path: Path) -> None:
    out = tmp_path / "d.jsonl"
    ns = build_parser().parse_args(["--output", str(out), "--duration", "0.3", "--interval", "0.1",
                                    "--nvml.fake=sim:2", f"--path.sysfs={tmp_path}"])
    assert isinstance(ns, argparse.Namespace)
    t0 = time.monotonic()
    assert record_main(ns) == 0
    assert time.monotonic() - t0 < 5
    assert 3 <= len(read_trace(out).records) <= 4


def test_sigterm_ends_an_open_ended_recording_cleanly(tmp_path: Path) -> None:
    out = tmp_path / "open.jsonl"
    argv = [sys.executable, "-m", "gpufleet.agent.recorder", "--output", str(out), "--interval", "0.1",
            "--nvml.fake=sim:1", f"--path.sysfs={tmp_path}"]
    with running(argv) as proc:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if len(read_trace(out).records) >= 2:
                    break
            except (OSError, ValueError):
                pass  # not written yet
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    assert len(read_trace(out).records) >= 2
