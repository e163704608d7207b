"""A simulated node in MIG mode, served by the fake NVML as a live agent would serve it: MIG devices of a mix of
profiles, each with its own workload, and the parent GPU's own readings unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import scrape

from gpufleet.agent.collectors.mig import MigCollector
from gpufleet.agent.collectors.usage import GpuUsage
from gpufleet.agent.nvml.backend import NvmlBackend
from gpufleet.agent.nvml.model import write_snapshot
from gpufleet.sim.fake.library import FakeNvml
from gpufleet.sim.fake.live_source import LiveSource
from gpufleet.sim.simulator import Simulator

LAYOUT = "3g.40gb+2g.20gb+1g.10gb*2"


def test_a_mig_node_has_a_mix_of_profiles_and_workloads(tmp_path: Path) -> None:
    sim = Simulator("demo", seed=1, start=0.0)
    sim.set_mig(0, LAYOUT)
    with pytest.raises(ValueError, match="slices"):
        sim.set_mig(1, "7g.80gb+1g.10gb")
    path = tmp_path / "snapshot.json"
    sim.step(30.0)
    plain = sim.node_snapshot(1)
    assert all(g.mig_mode_current is None for g in plain.gpus)
    write_snapshot(path, sim.node_snapshot(0))
    src = LiveSource(str(path), min_check_s=0.0)
    with FakeNvml(src):
        backend = NvmlBackend()
        assert backend.start()
        try:
            usage = GpuUsage(backend, str(tmp_path), max_age=0.0)
            scrape(MigCollector(usage))
            sim.step(30.0)
            snap = sim.node_snapshot(0)
            write_snapshot(path, snap)
            got = scrape(MigCollector(usage))
        finally:
            backend.close()
    profiles = sorted(dict(k[1])["profile"] for k in got if k[0] == "gpufleet_mig_device_info" and ("gpu", "0") in k[1])
    assert profiles == ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]
    active = {dict(k[1])["gpu_instance"]: v for k, v in got.items()
              if k[0] == "gpufleet_mig_sm_active_ratio" and ("gpu", "0") in k[1]}
    assert len(active) == 4 and len(set(active.values())) == 4  # each slice its own workload
    assert all(0.0 <= v <= 1.0 for v in active.values())
    whole = sim.gpu_sample(int(sim.fleet.node_gpus(0)[0]))  # the parent's own readings are unchanged
    assert (snap.samples[0].power_mw, snap.samples[0].temperature_gpu_c) == (whole.power_mw, whole.temperature_gpu_c)
    assert snap.gpus[0].mig_mode_current == 1
