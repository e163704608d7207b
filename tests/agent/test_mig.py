"""MIG through the fake NVML: the real pynvml MIG wrappers, the MIG reader and the mig collector, series by series."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest
from support import BIN, FIXTURES, Series, need_binary, scrape
from test_gpu_collector import FakeHost

from gpufleet.agent.collectors.gpu import GpuCollector
from gpufleet.agent.collectors.mig import MigCollector
from gpufleet.agent.collectors.usage import GpuUsage
from gpufleet.agent.kubelet.devices import GpuIds, Holder, resolve
from gpufleet.agent.nvml.backend import NvmlBackend
from gpufleet.agent.nvml.mig import profile_from_name
from gpufleet.agent.nvml.model import GpmCounters, MigDeviceInventory, MigSample
from gpufleet.sim.fake.library import FakeNvml
from gpufleet.sim.fake.shared_source import parse_layout

GOLDEN = FIXTURES / "golden" / "agent-mig.prom"
UPDATE = os.environ.get("GPUFLEET_UPDATE_GOLDEN", "") not in ("", "0")


def mig_host() -> FakeHost:
    """GPU 0: H100 in MIG mode, 3g.40gb (gi 2) + 1g.10gb (gi 9) + 1g.10gb (gi 10), GPM;
    GPU 1: an A100 PCIe in MIG mode without GPM (one 7g.40gb); GPU 2: H100, MIG capable, disabled, pending on."""
    src = FakeHost()
    layout = [(2, "3g.40gb", 40, 3), (9, "1g.10gb", 10, 1), (10, "1g.10gb", 10, 1)]
    src.inv[0].mig_mode_current = src.inv[0].mig_mode_pending = 1
    src.inv[0].mig_devices = [
        MigDeviceInventory(gpu_instance_id=gi, profile_name=p, uuid=f"MIG-0000000{gi}-aaaa-5bbb-8ccc-dddddddddddd",
                           memory_total_bytes=gb * 2**30, slice_count=n) for gi, p, gb, n in layout]
    src.samples[0].mig = [MigSample(memory_used_bytes=(k + 1) * 2**30, gpm=GpmCounters()) for k in range(3)]
    src.inv[1].mig_mode_current = src.inv[1].mig_mode_pending = 1
    src.inv[1].mig_devices = [MigDeviceInventory(gpu_instance_id=0, profile_name="7g.40gb", uuid="MIG-a100",
                                                 memory_total_bytes=40 * 2**30, slice_count=7)]
    src.samples[1].mig = [MigSample(memory_used_bytes=5 * 2**30, gpm=None)]
    src.inv[2].mig_mode_current, src.inv[2].mig_mode_pending = 0, 1
    return src


def advance(src: FakeHost, dt: float) -> None:
    src.advance(dt)
    for k, m in enumerate(src.samples[0].mig):
        assert m.gpm is not None
        busy = 0.2 * (k + 1)  # slice k: 20 %, 40 %, 60 % SM active
        m.gpm.sm_active_s += busy * dt
        m.gpm.sm_occupancy_s += busy / 2 * dt
        m.gpm.tensor_active_s += 0.1 * dt
        m.gpm.dram_active_s += 0.05 * dt


@pytest.fixture
def mig() -> Iterator[tuple[FakeHost, FakeNvml, NvmlBackend, GpuUsage]]:
    src = mig_host()
    fake = FakeNvml(src).install()
    backend = NvmlBackend()
    assert backend.start(), backend.init_error
    try:
        yield src, fake, backend, GpuUsage(backend, "/nonexistent-proc", max_age=0.0)
    finally:
        backend.close()
        fake.uninstall()


def mig_series(series: Series) -> Series:
    return {k: v for k, v in series.items() if "mig" in k[0]}


def test_mig_series_match_the_source(mig: tuple[FakeHost, FakeNvml, NvmlBackend, GpuUsage]) -> None:
    src, _, _, usage = mig
    c = MigCollector(usage)
    first = mig_series(scrape(c))
    advance(src, 10.0)
    got = mig_series(scrape(c))
    exp: Series = {}

    def put(name: str, v: float, **labels: str) -> None:
        exp[(name, frozenset(labels.items()))] = v

    for g, cur, pend in (("0", 1, 1), ("1", 1, 1), ("2", 0, 1)):
        put("gpufleet_gpu_mig_mode_enabled", cur, gpu=g, state="current")
        put("gpufleet_gpu_mig_mode_enabled", pend, gpu=g, state="pending")
    for i in (0, 1):
        for k, m in enumerate(src.inv[i].mig_devices):
            gi = str(m.gpu_instance_id)
            put("gpufleet_mig_device_info", 1, gpu=str(i), gpu_instance=gi, compute_instance="0",
                profile=m.profile_name, uuid=m.uuid)
            used = src.samples[i].mig[k].memory_used_bytes
            assert used is not None
            put("gpufleet_mig_memory_used_bytes", used, gpu=str(i), gpu_instance=gi)
            put("gpufleet_mig_memory_total_bytes", m.memory_total_bytes, gpu=str(i), gpu_instance=gi)
    for k, gi in enumerate(("2", "9", "10")):  # GPM only on the H100 (GPU 1 has none: no series, not 0)
        busy = 0.2 * (k + 1)
        put("gpufleet_mig_sm_active_ratio", busy, gpu="0", gpu_instance=gi)
        put("gpufleet_mig_sm_occupancy_ratio", busy / 2, gpu="0", gpu_instance=gi)
        put("gpufleet_mig_tensor_active_ratio", 0.1, gpu="0", gpu_instance=gi)
        put("gpufleet_mig_dram_active_ratio", 0.05, gpu="0", gpu_instance=gi)
    assert got.keys() == exp.keys()
    for key, v in exp.items():
        assert got[key] == pytest.approx(v, abs=1e-9), key
    # The first read has no interval yet: no GPM series at all, everything else already there.
    assert first.keys() == {k for k in exp if "active" not in k[0] and "occupancy" not in k[0]}


def test_parent_gpu_keeps_its_device_series(mig: tuple[FakeHost, FakeNvml, NvmlBackend, GpuUsage]) -> None:
    _, _, backend, usage = mig
    got = scrape(GpuCollector(backend), MigCollector(usage))
    for g in ("0", "1", "2"):
        assert ("gpufleet_gpu_power_watts", frozenset({("gpu", g)})) in got
        assert ("gpufleet_gpu_temperature_celsius", frozenset({("gpu", g), ("sensor", "gpu")})) in got
    assert not any(k[0] == "gpufleet_nvml_errors_total" for k in got), "a MIG call failed"


def test_no_mig_gpu_has_no_mig_series() -> None:
    src = FakeHost()  # mig_mode_current None: nvmlDeviceGetMigMode answers NOT_SUPPORTED
    with FakeNvml(src):
        backend = NvmlBackend()
        assert backend.start()
        try:
            got = scrape(MigCollector(GpuUsage(backend, "/nonexistent-proc", max_age=0.0)), GpuCollector(backend))
        finally:
            backend.close()
    assert mig_series(got) == {}
    assert not any(k[0] == "gpufleet_nvml_errors_total" for k in got)


def test_repartitioned_gpu_is_listed_again(mig: tuple[FakeHost, FakeNvml, NvmlBackend, GpuUsage]) -> None:
    src, _, _, usage = mig
    c = MigCollector(usage)
    scrape(c)
    src.inv[0].mig_devices = src.inv[0].mig_devices[:1]  # an administrator destroyed two GPU instances
    src.samples[0].mig = src.samples[0].mig[:1]
    scrape(c)  # the cached handles of the destroyed devices fail: listed again on the next read
    got = scrape(c)
    info = {dict(k[1])["gpu_instance"] for k in got if k[0] == "gpufleet_mig_device_info" and ("gpu", "0") in k[1]}
    assert info == {"2"}


def test_mig_gpm_errors_are_counted_not_zero(mig: tuple[FakeHost, FakeNvml, NvmlBackend, GpuUsage]) -> None:
    src, fake, backend, usage = mig
    c = MigCollector(usage)
    scrape(c)
    advance(src, 5.0)
    fake.inject_error(pynvml.NVML_ERROR_UNKNOWN, function="nvmlGpmMigSampleGet")
    got = scrape(c)
    assert not any("active" in k[0] for k in got)
    assert backend.errors()[("nvmlGpmMigSampleGet", "UNKNOWN")] >= 1


def test_profile_names() -> None:
    assert profile_from_name("NVIDIA H100 80GB HBM3 MIG 1g.10gb") == "1g.10gb"
    assert profile_from_name("NVIDIA A100-SXM4-40GB MIG 3g.20gb") == "3g.20gb"
    assert profile_from_name("NVIDIA H100 80GB HBM3 MIG 1g.10gb+me") == "1g.10gb+me"
    assert profile_from_name("NVIDIA H100 80GB HBM3") == ""
    assert parse_layout("3g.40gb+2g.20gb+1g.10gb*2") == ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
    for bad in ("1g.10gb*8", "9g.90gb", "7g.80gb+1g.10gb", "1g.10gb*x"):
        with pytest.raises(ValueError):
            parse_layout(bad)


def test_pod_resources_mig_uuid_resolves_to_the_parent_gpu() -> None:
    ids = GpuIds.of([("0", "GPU-aaaa", 0), ("1", "GPU-bbbb", 1)])
    holder = Holder("ml", "p", "c", "nvidia.com/mig-1g.10gb", "MIG-4a2b9c1d-0000-5e6f-8a9b-0123456789ab")
    assert resolve(holder, ids).gpu == ""  # without NVML's MIG devices: unknown
    ids = GpuIds(ids.by_uuid, ids.by_minor, ids.uuid_of, {"mig-4a2b9c1d-0000-5e6f-8a9b-0123456789ab": "1"})
    assert resolve(holder, ids) == ("1", "GPU-bbbb", "MIG-4a2b9c1d-0000-5e6f-8a9b-0123456789ab")


# ---------------------------------------------------------------------- the whole agent on a MIG host

MIG_SPEC = "mig:2:3g.40gb+2g.20gb+1g.10gb*2"
_FAMILIES = re.compile(r"^(# (HELP|TYPE) )?gpufleet_(gpu_mig|mig_|gpu_processes|gpu_owner_|gpu_job_info|gpu_process)")


def agent_once(tmp_path: Path, *extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    r = subprocess.run(
        [str(BIN / "gpufleet-agent"), "once", f"--nvml.fake={MIG_SPEC}", "--no-collector.host",
         "--no-collector.pods", f"--collector.jobs.mapping-dir={tmp_path / 'none'}",
         f"--path.cgroupfs={tmp_path / 'none'}", *extra],
        capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_mig_host_exposition_passes_promtool_and_matches_golden(tmp_path: Path) -> None:
    text = agent_once(tmp_path)
    check = subprocess.run([need_binary("promtool"), "check", "metrics"], input=text, capture_output=True,
                           text=True, timeout=60)
    # promtool lints counters without _total in HELP/TYPE names (prometheus-client's form); anything else fails
    problems = [ln for ln in (check.stdout + check.stderr).splitlines()
                if ln.strip() and "counter metrics should have \"_total\" suffix" not in ln]
    assert not problems, problems
    mine = "".join(ln + "\n" for ln in text.splitlines() if _FAMILIES.match(ln))
    if UPDATE:
        GOLDEN.write_text(mine)
    assert GOLDEN.exists(), "no golden file: run with GPUFLEET_UPDATE_GOLDEN=1"
    assert mine == GOLDEN.read_text()
    assert 'gpufleet_mig_device_info{compute_instance="0",gpu="1",gpu_instance="2",profile="3g.40gb"' in mine


def test_failed_mig_memory_is_counted_without_series_and_the_slices_listed_again(
        mig: tuple[FakeHost, FakeNvml, NvmlBackend, GpuUsage]) -> None:
    src, fake, backend, usage = mig
    c = MigCollector(usage)
    assert any(k[0] == "gpufleet_mig_memory_used_bytes" for k in scrape(c))
    listed = usage._mig["0"].devices
    advance(src, 5.0)
    fake.inject_error(pynvml.NVML_ERROR_UNKNOWN, function="nvmlDeviceGetMemoryInfo")
    got = scrape(c)
    assert not any(k[0].startswith("gpufleet_mig_memory") for k in got)  # no value, never a 0
    assert any(k[0] == "gpufleet_mig_device_info" for k in got)  # the slices are still known
    assert backend.errors()[("nvmlDeviceGetMemoryInfo", "UNKNOWN")] >= 1
    assert usage._mig["0"].devices is None  # a MIG handle that failed: enumerated again on the next read
    fake.clear_errors()
    advance(src, 5.0)
    got = scrape(c)
    assert usage._mig["0"].devices is not None and usage._mig["0"].devices is not listed
    assert got[("gpufleet_mig_memory_total_bytes", frozenset({("gpu", "0"), ("gpu_instance", "2")}))] > 0


def test_unsupported_mig_memory_has_no_series_and_no_error(mig: tuple[FakeHost, FakeNvml, NvmlBackend, GpuUsage]) -> None:
    src, _, backend, usage = mig
    src.samples[0].mig[1].memory_used_bytes = None  # the driver answers NOT_SUPPORTED for this MIG device
    got = scrape(MigCollector(usage))
    used = {dict(k[1])["gpu_instance"] for k in got if k[0] == "gpufleet_mig_memory_used_bytes" and ("gpu", "0") in k[1]}
    assert used == {"2", "10"}
    assert backend.errors() == {}


def test_mig_parent_has_no_device_utilization_and_is_not_asked_every_scrape(
        mig: tuple[FakeHost, FakeNvml, NvmlBackend, GpuUsage], monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML: "On MIG-enabled GPUs, querying device utilization rates is not currently supported" (the driver
    answers NOT_SUPPORTED): no utilization series for a GPU in MIG mode (never a made-up value), no error
    counted, and the answer is remembered rather than asked for again on every scrape."""
    from gpufleet.agent.nvml import reader

    _, _, backend, _ = mig
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetUtilizationRates(pynvml.nvmlDeviceGetHandleByIndex(0))
    assert pynvml.nvmlDeviceGetUtilizationRates(pynvml.nvmlDeviceGetHandleByIndex(2)).gpu >= 0  # MIG disabled

    asked: list[int] = []
    real = pynvml.nvmlDeviceGetUtilizationRates

    def counting(h: pynvml.c_nvmlDevice_t) -> object:
        asked.append(pynvml.nvmlDeviceGetIndex(h))
        return real(h)

    now = [1000.0]
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUtilizationRates", counting)
    monkeypatch.setattr(reader, "slow_clock", lambda: now[0])
    c = GpuCollector(backend)
    for _ in range(3):
        got = scrape(c)
        util = {dict(k[1])["gpu"] for k in got if k[0] in ("gpufleet_gpu_utilization_ratio",
                                                          "gpufleet_gpu_memory_utilization_ratio")}
        assert util == {"2"}
        now[0] += 15
    assert sorted(asked) == [0, 1, 2, 2, 2]
    assert not any(k[0] == "gpufleet_nvml_errors_total" for k in got)
    now[0] += reader.UTILIZATION_RETRY_SECONDS  # MIG mode may have been turned off (a GPU reset): ask again
    scrape(c)
    assert sorted(asked) == [0, 0, 1, 1, 2, 2, 2, 2]
