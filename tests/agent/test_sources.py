"""Device sources: the simulated H100 host, live snapshot files, and --nvml.fake specs."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import pynvml
import pytest

from gpufleet.agent.nvml.model import GpuSample, Snapshot, XidEvent, write_snapshot
from gpufleet.sim.fake.library import FakeNvml
from gpufleet.sim.fake.live_source import LiveSource, SourceUnavailable
from gpufleet.sim.fake.sim_source import SimSource
from gpufleet.sim.fake.smi_xml import builtin_host
from gpufleet.sim.fake.spec import source_from_spec

T0 = 1_700_000_000.0


def _counters(s: GpuSample) -> list[float]:
    assert s.gpm is not None and s.nvlink is not None and s.clocks_event_ns is not None
    return [
        s.energy_mj or 0, *s.clocks_event_ns.values(), *(ln.tx_kib or 0 for ln in s.nvlink),
        *(ln.rx_kib or 0 for ln in s.nvlink), s.gpm.sm_active_s, s.gpm.sm_occupancy_s, s.gpm.tensor_active_s,
        s.gpm.dram_active_s, s.gpm.nvlink_tx_bytes, s.gpm.nvlink_rx_bytes, s.gpm.pcie_tx_bytes, s.gpm.pcie_rx_bytes,
    ]


def test_sim_is_physically_consistent() -> None:
    now = [T0]
    sim = SimSource(8, seed=3, clock=lambda: now[0])
    inv = sim.inventory()
    dt = 0.5
    prev: list[GpuSample | None] = [None] * 8
    integral = [0.0] * 8
    start_energy = [sim.sample(i).energy_mj or 0 for i in range(8)]
    capped = 0
    # 1600 s covers training, data-loader stalls and one checkpoint
    for step in range(int(1600 / dt) + 1):
        now[0] = T0 + step * dt
        for i in range(8):
            s = sim.sample(i)
            g = inv[i]  # a name, so the `is not None` checks below narrow it
            assert s.power_mw is not None and s.power_limit_mw is not None
            assert 0 < s.power_mw <= s.power_limit_mw
            assert s.clock_sm_mhz is not None and g.max_clock_sm_mhz is not None
            assert 0 < s.clock_sm_mhz <= g.max_clock_sm_mhz
            assert s.clocks_event_reasons is not None
            power_capped = bool(s.clocks_event_reasons & 0x4)
            assert power_capped == (s.clock_sm_mhz < g.max_clock_sm_mhz)
            capped += power_capped
            assert s.utilization_gpu_pct is not None and 0 <= s.utilization_gpu_pct <= 100
            assert s.temperature_gpu_c is not None and g.temp_slowdown_c is not None
            assert 20 < s.temperature_gpu_c < g.temp_slowdown_c
            assert s.memory_used_bytes is not None and s.memory_used_bytes < g.memory_total_bytes
            p = prev[i]
            if p is not None:
                assert all(b >= a for a, b in zip(_counters(p), _counters(s), strict=True))
                assert p.power_mw is not None
                integral[i] += p.power_mw * dt  # mW * s = mJ
            prev[i] = s
    for i in range(8):
        last = prev[i]
        assert last is not None and last.energy_mj is not None
        assert last.energy_mj - start_energy[i] == pytest.approx(integral[i], rel=1e-4)
    # a realistic mix: the job sometimes hits the power cap, but not always
    assert 0.01 < capped / (8 * 3201) < 0.5


def test_sim_is_deterministic_and_varies_per_gpu_and_seed() -> None:
    def run(seed: int) -> list[tuple[int | None, ...]]:
        now = [T0]
        sim = SimSource(4, seed=seed, clock=lambda: now[0])
        out: list[tuple[int | None, ...]] = []
        for k in range(40):
            now[0] = T0 + 3 * k
            out.extend((sim.sample(i).power_mw, sim.sample(i).temperature_gpu_c) for i in range(4))
        return out

    a = run(1)
    assert a == run(1)
    assert a != run(2)
    now = [T0 + 100]
    sim = SimSource(8, seed=1, clock=lambda: now[0])
    now[0] += 300
    assert len({sim.sample(i).power_mw for i in range(8)}) > 1


def test_sim_clock_going_back_restarts_the_model() -> None:
    now = [T0]
    sim = SimSource(2, clock=lambda: now[0])
    now[0] = T0 + 50.5
    first = sim.sample(1)
    now[0] = T0 + 500
    sim.sample(1)
    now[0] = T0 + 50.5
    assert sim.sample(1) == first


def test_sim_more_than_8_gpus_are_unique() -> None:
    sim = SimSource(64, clock=lambda: T0)
    inv = sim.inventory()
    assert [g.index for g in inv] == list(range(64))
    assert len({g.uuid for g in inv}) == 64
    assert len({g.pci_bus_id for g in inv}) == 64
    assert len({g.minor_number for g in inv}) == 64
    assert inv[:8] == [replace(g) for g in builtin_host().gpus]
    assert SimSource(3, clock=lambda: T0).inventory() == builtin_host().gpus[:3]


def test_sim_through_the_fake_nvml_gpm_and_xid() -> None:
    now = [T0]
    sim = SimSource(2, clock=lambda: now[0])
    with FakeNvml(sim):
        pynvml.nvmlInit()
        try:
            d = pynvml.nvmlDeviceGetHandleByIndex(0)
            a, b = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
            now[0] = T0 + 100
            pynvml.nvmlGpmSampleGet(d, a)
            s1 = sim.sample(0)
            now[0] = T0 + 110
            pynvml.nvmlGpmSampleGet(d, b)
            s2 = sim.sample(0)
            mg = pynvml.c_nvmlGpmMetricsGet_t()
            mg.version, mg.numMetrics, mg.sample1, mg.sample2 = 1, 2, a, b
            mg.metrics[0].metricId = pynvml.NVML_GPM_METRIC_SM_UTIL
            mg.metrics[1].metricId = pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC
            out = pynvml.nvmlGpmMetricsGet(mg)
            assert s1.gpm is not None and s2.gpm is not None
            assert out.metrics[0].value == pytest.approx(10 * (s2.gpm.sm_active_s - s1.gpm.sm_active_s))
            assert 50 < out.metrics[0].value <= 100
            mib_s = (s2.gpm.nvlink_tx_bytes - s1.gpm.nvlink_tx_bytes) / 10 / 2**20
            assert out.metrics[1].value == pytest.approx(mib_s)
            es = pynvml.nvmlEventSetCreate()
            pynvml.nvmlDeviceRegisterEvents(pynvml.nvmlDeviceGetHandleByIndex(1), pynvml.nvmlEventTypeXidCriticalError, es)
            sim.inject_xid(1, 79)
            data = pynvml.nvmlEventSetWait_v2(es, 1000)
            assert data.eventData == 79
            sim.lost.add(1)
            with pytest.raises(pynvml.NVMLError_GpuIsLost):
                pynvml.nvmlDeviceGetPowerUsage(pynvml.nvmlDeviceGetHandleByIndex(1))
            assert pynvml.nvmlDeviceGetPowerUsage(d) > 0
        finally:
            pynvml.nvmlShutdown()


def _resolve(root: Path, link: Path) -> Path:
    target = (link.parent / os.readlink(link)).resolve()
    assert target.is_relative_to(root.resolve()), target
    return target


def test_sim_sysfs_tree() -> None:
    now = [T0]
    sim = SimSource(8, clock=lambda: now[0], sysfs=True)
    try:
        assert sim.sysfs_root is not None
        root = Path(sim.sysfs_root)
        ib = root / "class" / "infiniband"
        assert sorted(p.name for p in ib.iterdir()) == [f"mlx5_{i}" for i in range(8)]
        port = ib / "mlx5_0" / "ports" / "1"
        for f in ("np_ecn_marked_roce_packets", "np_cnp_sent", "rp_cnp_handled"):
            assert (port / "hw_counters" / f).read_text().strip().isdigit()
        assert (port / "rate").read_text().startswith("400 Gb/sec")
        before = int((port / "counters" / "port_xmit_data").read_text())
        now[0] = T0 + 60
        sim._sysfs.refresh()  # type: ignore[union-attr]
        after = int((port / "counters" / "port_xmit_data").read_text())
        assert after > before
        # NIC i sits behind the same PCIe switch as GPU i, and no other GPU
        for i, g in enumerate(sim.inventory()):
            addr = g.pci_bus_id[4:].lower()
            gpu_dev = _resolve(root, root / "bus" / "pci" / "devices" / addr)
            assert gpu_dev.name == addr and (gpu_dev / "vendor").read_text().strip() == "0x10de"
            nic_dev = _resolve(root, ib / f"mlx5_{i}" / "device")
            assert (nic_dev / "vendor").read_text().strip() == "0x15b3"
            assert nic_dev.parent.parent == gpu_dev.parent.parent  # the switch upstream port
            assert str(nic_dev.relative_to(root.resolve())).startswith("devices/pci0000:")
    finally:
        sim.close()
    assert not root.exists()


def test_sim_sysfs_is_refreshed_on_its_own_clock_and_only_changed_files() -> None:
    import threading

    now = [T0]
    sim = SimSource(2, clock=lambda: now[0], sysfs=True)
    try:
        assert not [t for t in threading.enumerate() if t.name == "sim-sysfs"]  # no writer thread
        assert sim.sysfs_root is not None
        port = Path(sim.sysfs_root) / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
        data, zero = port / "counters" / "port_xmit_data", port / "counters" / "symbol_error"
        start, zero_stat = int(data.read_text()), zero.stat()
        sim.refresh_host()
        now[0] = T0 + 30
        assert int(data.read_text()) == start  # time moved on, but nobody refreshed: nothing written
        now[0] = T0 + 30.5
        sim.sample(0)
        assert int(data.read_text()) == start  # NVML readings never touch the NIC files
        sim.refresh_host()
        grown = int(data.read_text())
        assert grown > start
        now[0] = T0 + 31.0  # within a second of the last rewrite: not again
        sim.refresh_host()
        assert int(data.read_text()) == grown
        now[0] = T0 + 32.0
        sim.refresh_host()
        assert int(data.read_text()) > grown
        after = zero.stat()  # a counter that stayed 0 was never rewritten
        assert (after.st_ino, after.st_mtime_ns) == (zero_stat.st_ino, zero_stat.st_mtime_ns)
        assert zero.read_text() == "0\n" and data.read_text().endswith("\n")
    finally:
        sim.close()


# ------------------------------------------------------------------ live snapshots


def _snapshot(n: int = 2, power: int = 400_000, xid: list[XidEvent] | None = None) -> Snapshot:
    host = builtin_host()
    samples = [replace(s, power_mw=power + i, timestamp=T0) for i, s in enumerate(host.samples[:n])]
    return Snapshot(driver=host.driver, gpus=host.gpus[:n], samples=samples, xid=xid or [])


def test_live_source_rereads_and_survives_bad_files(tmp_path: Path) -> None:
    path = tmp_path / "node.json"
    src = LiveSource(path, min_check_s=0)
    assert not src.usable and src.last_error is not None and "does not exist" in src.last_error
    with pytest.raises(SourceUnavailable, match="does not exist"):  # nothing to serve: never "0 GPUs"
        src.inventory()
    write_snapshot(path, _snapshot(power=400_000))
    assert len(src.inventory()) == 2 and src.last_error is None
    assert src.sample(1).power_mw == 400_001
    write_snapshot(path, _snapshot(power=500_000))
    assert src.sample(1).power_mw == 500_001
    path.write_text('{"format": "gpufleet-snapshot", "version": 1, "driver"')  # torn / corrupt
    assert src.sample(1).power_mw == 500_001  # last good state
    assert src.last_error is not None and "cannot use snapshot" in src.last_error
    path.write_text('{"format": "other"}')
    assert src.sample(0).power_mw == 500_000
    path.unlink()  # gone at runtime: the source fails (the agent reports NVML down), it does not serve stale data
    with pytest.raises(SourceUnavailable, match="does not exist"):
        src.sample(0)
    assert src.poll_xid() == []
    write_snapshot(path, _snapshot(power=600_000))
    assert src.sample(0).power_mw == 600_000 and src.last_error is None
    with pytest.raises(IndexError):
        src.sample(5)


def test_live_source_xid_once_and_through_fake(tmp_path: Path) -> None:
    path = tmp_path / "node.json"
    ev = XidEvent(gpu=1, xid=94, timestamp=T0 + 1)
    write_snapshot(path, _snapshot(xid=[ev]))
    src = source_from_spec(f"live:{path}")
    assert isinstance(src, LiveSource)
    src._min_check = 0
    assert src.poll_xid() == [ev]
    assert src.poll_xid() == []
    ev2 = XidEvent(gpu=0, xid=13, timestamp=T0 + 2)
    write_snapshot(path, _snapshot(xid=[ev, ev2]))
    assert src.poll_xid() == [ev2]
    with FakeNvml(src):
        pynvml.nvmlInit()
        try:
            assert pynvml.nvmlDeviceGetCount() == 2
            d = pynvml.nvmlDeviceGetHandleByIndex(1)
            assert pynvml.nvmlDeviceGetPowerUsage(d) == 400_001
            path.write_text("garbage")
            assert pynvml.nvmlDeviceGetPowerUsage(d) == 400_001
        finally:
            pynvml.nvmlShutdown()


# ------------------------------------------------------------------ specs


def test_spec_sim_variants() -> None:
    for spec, n in (("sim", 8), ("sim:1", 1), ("sim:12", 12)):
        src = source_from_spec(spec)
        assert isinstance(src, SimSource)
        try:
            assert len(src.inventory()) == n
            assert src.sysfs_root is not None and Path(src.sysfs_root, "class", "infiniband").is_dir()
        finally:
            src.close()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("sim:0", "1..4096"),
        ("sim:x", "sim:N"),
        ("sim:", "sim:N"),
        ("trace:", "trace:PATH"),
        ("live:", "live:PATH"),
        ("gpu", "expected sim, sim:N, trace:PATH or live:PATH"),
        ("", "expected sim"),
    ],
)
def test_bad_specs(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        source_from_spec(spec)



def test_nic_counters_advance_with_only_the_nic_collector() -> None:
    """A simulated host's IB counters move on by themselves: no NVML reading needed (--no-collector.gpu)."""
    from gpufleet.agent.app import Agent
    from gpufleet.agent.config import COLLECTORS, AgentConfig

    cfg = AgentConfig(nvml_fake="sim:2", collectors={c: c == "nic" for c in COLLECTORS})
    agent = Agent(cfg)
    source = agent.backend.source
    assert isinstance(source, SimSource)
    t0 = time.time()  # the simulator started when it was built
    now = [t0]
    source._clock = lambda: now[0]
    agent.start(listen_xid=False)
    try:
        assert [c.name for c in agent.collectors] == ["nic"]

        def xmit_bytes() -> float:
            text = agent.text().decode()
            line = next(ln for ln in text.splitlines()
                        if ln.startswith('gpufleet_ib_port_transmit_bytes_total{device="mlx5_0"'))
            return float(line.rsplit(" ", 1)[1])

        first = xmit_bytes()
        now[0] = t0 + 60
        second = xmit_bytes()
        now[0] = t0 + 120
        third = xmit_bytes()
        assert first < second < third
    finally:
        agent.close()
