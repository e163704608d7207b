"""The fabric collector (issue 21): a Blackwell GPU's NVLink domain, rack placement and health, through the real
pynvml wrappers on the fake NVML; no series where the driver lacks a reading (never a 0)."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest
from support import FIXTURES, Series, key, scrape
from test_gpu_collector import FakeHost

from gpufleet.agent.collectors.fabric import FabricCollector
from gpufleet.agent.nvml import reader as gpu_reader
from gpufleet.agent.nvml.backend import NvmlBackend
from gpufleet.agent.nvml.fabric_model import FabricSample, PlatformInfo
from gpufleet.sim.fake.library import FakeNvml
from gpufleet.sim.fake.smi_xml import load_smi_xml
from gpufleet.sim.fake.spec import fake_backend
from gpufleet.vocab import catalog
from gpufleet.vocab import fabric as fb

CAPTURES = FIXTURES / "nvidia-smi"
CLUSTER = "00000001-0000-0000-0000-000000000001"


def _scrape_spec(spec: str) -> Series:
    backend = fake_backend(spec)
    try:
        assert backend.start(), backend.init_error
        return scrape(FabricCollector(backend))
    finally:
        backend.close()


def names(series: Series) -> set[str]:
    return {n for n, _ in series}


@pytest.mark.parametrize(("capture", "clique", "trays"), [("gb200-4gpu.xml", "2", {"4"}),
                                                          ("gb300-4gpu.xml", "32766", {"15"})])
def test_a_gb200_gb300_host_names_its_domain_rack_and_tray(capture: str, clique: str, trays: set[str]) -> None:
    s = _scrape_spec(f"sim:{CAPTURES / capture}")
    info = [dict(lbl) for n, lbl in s if n == "gpufleet_gpu_fabric_info"]
    assert len(info) == 4 and {i["cluster_uuid"] for i in info} == {CLUSTER} and {i["clique_id"] for i in info} == {clique}
    plat = [dict(lbl) for n, lbl in s if n == "gpufleet_gpu_platform_info"]
    assert len(plat) == 4 and {p["chassis_serial"] for p in plat} == {"1820000000001"}
    assert {p["tray"] for p in plat} == trays and all(p["slot"] and p["module_id"] for p in plat)
    links = [dict(lbl) for n, lbl in s if n == "gpufleet_gpu_nvlink_link_events_total"]
    assert len(links) == 4 * 18 * len(fb.NVLINK5_EVENTS)  # Blackwell: NVLink 5 per-link counters, 18 links a GPU
    for g in "0123":
        assert s[key("gpufleet_gpu_fabric_overall_health", gpu=g)] == fb.SUMMARY_HEALTHY
        assert s[key("gpufleet_gpu_fabric_state", gpu=g)] == fb.FABRIC_STATE_COMPLETED
        assert s[key("gpufleet_gpu_fabric_health", gpu=g, condition="bandwidth_degraded")] == 0
        assert s[key("gpufleet_gpu_c2c_enabled", gpu=g)] == 1
        assert s[key("gpufleet_gpu_repair_pending", gpu=g, kind="tpc")] == 0
        assert 0 < s[key("gpufleet_gpu_thermal_margin_celsius", gpu=g)] < 100
    # GB200's capture prints incorrect_configuration N/A: that condition has no series; GB300's prints None: 0.
    incorrect = [lbl for n, lbl in s if n == "gpufleet_gpu_fabric_health" and ("condition", "incorrect_configuration") in lbl]
    assert len(incorrect) == (0 if capture.startswith("gb200") else 4)


def test_an_h100_host_has_no_rack_and_no_fabric_health() -> None:
    """The packaged H100 capture: fabric registered (NVSwitch, no multi-node domain), health N/A, no C2C."""
    s = _scrape_spec("sim:2")
    got = names(s)
    assert "gpufleet_gpu_platform_info" not in got and "gpufleet_gpu_nvlink_link_events_total" not in got
    assert "gpufleet_gpu_fabric_health" not in got and "gpufleet_gpu_fabric_overall_health" not in got
    assert s[key("gpufleet_gpu_c2c_enabled", gpu="0")] == 0  # the capture says Disabled: a reading, not N/A


@pytest.fixture
def host() -> Iterator[tuple[FakeHost, FakeNvml, NvmlBackend]]:
    src = FakeHost(n=2)
    for inv in src.inv:
        inv.platform = PlatformInfo(chassis_serial="RACK-7", slot_number=9, tray_index=inv.index + 3, host_id=1,
                                    module_id=inv.index + 1)
    for s in src.samples:
        s.fabric = FabricSample(cluster_uuid=CLUSTER, clique_id=5, health_mask=fb.HEALTHY_MASK,
                                health_summary=fb.SUMMARY_HEALTHY)
        s.margin_temperature_c, s.c2c_enabled, s.nvlink_bw_mode = 21, True, 0
        s.repair_channel_pending, s.repair_tpc_pending = False, True
    fake = FakeNvml(src).install()
    backend = NvmlBackend()
    assert backend.start(), backend.init_error
    try:
        yield src, fake, backend
    finally:
        backend.close()
        fake.uninstall()


def test_every_reading_is_exported_in_its_units(host: tuple[FakeHost, FakeNvml, NvmlBackend]) -> None:
    src, _, backend = host
    src.samples[1].fabric = FabricSample(
        cluster_uuid=CLUSTER, clique_id=5, state=2, status=0, health_summary=fb.SUMMARY_LIMITED_CAPACITY,
        health_mask=fb.encode({"bandwidth_degraded": True, "route_recovery_in_progress": True,
                               "route_unhealthy": False, "access_timeout_recovery": False,
                               "incorrect_configuration": True}))
    src.samples[1].nvlink_bw_mode = 3
    s = scrape(FabricCollector(backend))
    assert s[key("gpufleet_gpu_platform_info", gpu="1", chassis_serial="RACK-7", slot="9", tray="4", host_id="1",
                 module_id="2")] == 1
    assert s[key("gpufleet_gpu_fabric_info", gpu="0", cluster_uuid=CLUSTER, clique_id="5")] == 1
    assert s[key("gpufleet_gpu_fabric_state", gpu="1")] == 2
    health = {dict(lbl)["condition"]: v for (n, lbl), v in s.items()
              if n == "gpufleet_gpu_fabric_health" and ("gpu", "1") in lbl}
    assert health == {"bandwidth_degraded": 1, "route_recovery_in_progress": 1, "route_unhealthy": 0,
                      "access_timeout_recovery": 0, "incorrect_configuration": 1}
    assert s[key("gpufleet_gpu_fabric_overall_health", gpu="1")] == fb.SUMMARY_LIMITED_CAPACITY
    assert s[key("gpufleet_gpu_thermal_margin_celsius", gpu="0")] == 21
    assert s[key("gpufleet_gpu_repair_pending", gpu="0", kind="tpc")] == 1
    assert s[key("gpufleet_gpu_repair_pending", gpu="0", kind="channel")] == 0
    assert s[key("gpufleet_gpu_nvlink_bandwidth_mode", gpu="0", mode="full")] == 1
    assert s[key("gpufleet_gpu_nvlink_bandwidth_mode", gpu="1", mode="half")] == 1
    assert names(s) == {spec.name for spec in catalog.by_group("fabric")} - {"gpufleet_gpu_nvlink_link_events_total"}


def test_none_is_not_supported_and_has_no_series(host: tuple[FakeHost, FakeNvml, NvmlBackend]) -> None:
    src, _, backend = host
    s0 = src.samples[0]
    s0.fabric = s0.margin_temperature_c = s0.c2c_enabled = s0.nvlink_bw_mode = s0.repair_tpc_pending = None
    src.inv[0].platform = None
    s = scrape(FabricCollector(backend))
    assert not [k for k in s if ("gpu", "0") in k[1]]
    assert len([k for k in s if ("gpu", "1") in k[1]]) == 15  # 10 families, 5 health conditions, 2 repair kinds
    assert "gpufleet_gpu_nvlink_link_events_total" not in names(s)  # pre-Blackwell links: NOT_SUPPORTED
    assert backend.errors() == {}


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_NOT_SUPPORTED])
def test_a_driver_without_the_call_gives_no_series_and_is_not_asked_again(
        host: tuple[FakeHost, FakeNvml, NvmlBackend], code: int) -> None:
    _, fake, backend = host
    fake.inject_error(code, function="nvmlDeviceGetGpuFabricInfoV")
    fake.inject_error(code, function="nvmlDeviceGetMarginTemperature", gpu=1)
    c = FabricCollector(backend)
    s = scrape(c)
    assert not {"gpufleet_gpu_fabric_info", "gpufleet_gpu_fabric_health", "gpufleet_gpu_fabric_state"} & names(s)
    assert key("gpufleet_gpu_thermal_margin_celsius", gpu="0") in s
    assert key("gpufleet_gpu_thermal_margin_celsius", gpu="1") not in s
    assert backend.errors() == {}  # an absent reading is no error
    fake.clear_errors()
    assert "gpufleet_gpu_fabric_info" not in names(scrape(c))  # remembered: not called again


def test_an_error_is_counted_and_spares_the_other_readings(host: tuple[FakeHost, FakeNvml, NvmlBackend]) -> None:
    _, fake, backend = host
    fake.inject_error(pynvml.NVML_ERROR_UNKNOWN, function="nvmlDeviceGetGpuFabricInfoV", gpu=0)
    c = FabricCollector(backend)
    s = scrape(c)
    assert key("gpufleet_gpu_fabric_state", gpu="0") not in s and key("gpufleet_gpu_fabric_state", gpu="1") in s
    assert key("gpufleet_gpu_thermal_margin_celsius", gpu="0") in s
    assert backend.errors() == {("nvmlDeviceGetGpuFabricInfoV", "UNKNOWN"): 1}
    fake.clear_errors()
    assert key("gpufleet_gpu_fabric_state", gpu="0") in scrape(c)  # retried on the next scrape


def test_a_lost_gpu_has_no_fabric_series(host: tuple[FakeHost, FakeNvml, NvmlBackend]) -> None:
    src, _, backend = host
    src.samples[1].lost = True
    s = scrape(FabricCollector(backend))
    assert not [k for k in s if ("gpu", "1") in k[1]] and key("gpufleet_gpu_c2c_enabled", gpu="0") in s


def test_the_fake_checks_struct_versions(host: tuple[FakeHost, FakeNvml, NvmlBackend]) -> None:
    """The real wrappers take the caller's versioned struct: an old one is ARGUMENT_VERSION_MISMATCH, v2 fabric info
    (no health summary) is answered."""
    _, _, backend = host
    h = backend.devices[0].handle
    assert h is not None
    with pytest.raises(pynvml.NVMLError) as e:
        pynvml.nvmlDeviceGetPlatformInfo(h, ctypes.byref(pynvml.c_nvmlPlatformInfo_v1_t()))
    assert e.value.value == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    v2 = pynvml.c_nvmlGpuFabricInfo_v2_t()
    pynvml.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(v2))
    assert v2.cliqueId == 5 and v2.healthMask == fb.HEALTHY_MASK
    assert pynvml.nvmlDeviceGetC2cModeInfoV(h).isC2cEnabled == 1
    assert pynvml.nvmlDeviceGetRepairStatus(h) == [0, 1]
    assert pynvml.nvmlDeviceGetMarginTemperature(h) == 21


def test_nvlink5_per_link_counters_are_read_per_link_on_the_slow_interval(
        host: tuple[FakeHost, FakeNvml, NvmlBackend], monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU 0 (4 NVLinks) has Blackwell's per-link counters, GPU 1 (a PCIe card) none: no series for it."""
    src, fake, backend = host
    now = [1000.0]
    monkeypatch.setattr(gpu_reader, "slow_clock", lambda: now[0])
    for k, link in enumerate(src.samples[0].nvlink or []):
        link.counters = {e: 10 * k + i for i, e in enumerate(fb.NVLINK5_EVENTS)}
    c = FabricCollector(backend, slow_interval=30.0)
    s = scrape(c)
    got = {(dict(lbl)["gpu"], dict(lbl)["link"], dict(lbl)["event"]): v for (n, lbl), v in s.items()
           if n == "gpufleet_gpu_nvlink_link_events_total"}
    assert len(got) == 4 * len(fb.NVLINK5_EVENTS) and {g for g, _, _ in got} == {"0"}
    assert got[("0", "3", "recovery_failed")] == 33 and got[("0", "0", "symbol_errors")] == 0
    links = src.samples[0].nvlink or []
    links[2].counters = {**(links[2].counters or {}), "effective_errors": 500}
    now[0] += 10  # within the slow interval: the last read is served
    assert scrape(c)[key("gpufleet_gpu_nvlink_link_events_total", gpu="0", link="2", event="effective_errors")] == 21
    now[0] += 30
    assert scrape(c)[key("gpufleet_gpu_nvlink_link_events_total", gpu="0", link="2", event="effective_errors")] == 500
    fake.inject_error(pynvml.NVML_ERROR_UNKNOWN, function="nvmlDeviceGetFieldValues", field=221)
    now[0] += 30
    s = scrape(c)
    assert key("gpufleet_gpu_nvlink_link_events_total", gpu="0", link="1", event="symbol_errors") not in s
    assert key("gpufleet_gpu_nvlink_link_events_total", gpu="0", link="1", event="effective_errors") in s
    assert backend.errors() == {("nvmlDeviceGetFieldValues", "UNKNOWN"): 4}


def test_the_vocabulary_matches_pynvml() -> None:
    for _, name, fid in fb.NVLINK5_COUNTERS:
        assert getattr(pynvml, name) == fid, name
    for h in fb.HEALTH_FIELDS:
        assert getattr(pynvml, f"NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_{h.suffix}") == h.shift, h.name
        assert getattr(pynvml, f"NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_{h.suffix}") == h.width, h.name
        if h.true_value > 0:
            assert getattr(pynvml, f"NVML_GPU_FABRIC_HEALTH_MASK_{h.suffix}_TRUE") == h.true_value
            assert getattr(pynvml, f"NVML_GPU_FABRIC_HEALTH_MASK_{h.suffix}_FALSE") == h.false_value
    assert pynvml.NVML_GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_NONE == 1
    for table in (fb.FABRIC_STATES, fb.HEALTH_SUMMARIES, fb.NVLINK_BW_MODES):
        for value, name, _ in table:
            assert getattr(pynvml, name) == value, name
    for h in fb.HEALTH_FIELDS:  # encode/condition round trip, and 0 (not reported) is None
        for v in (True, False, None):
            assert fb.condition(fb.encode({h.name: v}), h) is v


def test_the_smi_reader_maps_degraded_words_and_na() -> None:
    text = (CAPTURES / "gb200-4gpu.xml").read_text()
    first = text.index("<bandwidth>Full</bandwidth>")
    text = text[:first] + "<bandwidth>Degraded</bandwidth>" + text[first + len("<bandwidth>Full</bandwidth>"):]
    text = text.replace("<summary>Healthy</summary>", "<summary>Limited Capacity</summary>", 1)
    text = text.replace("<c2c_mode>Enabled</c2c_mode>", "<c2c_mode>N/A</c2c_mode>", 1)
    from gpufleet.sim.fake.smi_xml import parse_smi_xml

    host = parse_smi_xml(text)
    fab = host.samples[0].fabric
    assert fab is not None and fab.health_summary == fb.SUMMARY_LIMITED_CAPACITY
    assert fb.condition(fab.health_mask, fb.HEALTH_BY_NAME["bandwidth_degraded"]) is True
    assert fb.condition(fab.health_mask, fb.HEALTH_BY_NAME["incorrect_configuration"]) is None
    assert host.samples[0].c2c_enabled is None and host.samples[1].c2c_enabled is True
    assert load_smi_xml(CAPTURES / "t4-1gpu.xml").gpus[0].platform is None


def test_a_recorded_trace_replays_the_rack_readings(tmp_path: Path) -> None:
    """gpufleet-agent record writes the fabric readings into the trace; trace:PATH serves them again."""
    from gpufleet.agent.recorder import record_main

    out = tmp_path / "gb200.jsonl"
    spec = f"sim:{CAPTURES / 'gb200-4gpu.xml'}"
    assert record_main(["--output", str(out), "--samples", "2", "--interval", "0.05", "--nvml.fake", spec]) == 0
    live, replayed = _scrape_spec(spec), _scrape_spec(f"trace:{out}@1")
    for family in ("gpufleet_gpu_fabric_info", "gpufleet_gpu_platform_info", "gpufleet_gpu_fabric_health",
                   "gpufleet_gpu_fabric_overall_health", "gpufleet_gpu_c2c_enabled", "gpufleet_gpu_repair_pending"):
        want = {k: v for k, v in live.items() if k[0] == family}
        assert want and {k: v for k, v in replayed.items() if k[0] == family} == want, family
    assert len([k for k in replayed if k[0] == "gpufleet_gpu_nvlink_link_events_total"]) == 4 * 18 * 9
    assert {k for k in replayed if k[0] == "gpufleet_gpu_thermal_margin_celsius"} == {
        k for k in live if k[0] == "gpufleet_gpu_thermal_margin_celsius"}
