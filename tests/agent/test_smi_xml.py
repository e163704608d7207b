"""Loading an inventory from `nvidia-smi -q -x` output."""

from __future__ import annotations

import re
from pathlib import Path

import pynvml
import pytest
from support import FIXTURES, REPO

from gpufleet.agent.nvml import hardware
from gpufleet.sim.fake.smi_xml import SmiXmlError, builtin_host, load_smi_xml, parse_smi_xml

XML = FIXTURES / "nvidia-smi" / "h100-8gpu-idle.xml"


def _gpu_blocks(text: str) -> list[str]:
    return re.findall(r"<gpu id=.*?</gpu>", text, flags=re.S)


def _tag(block: str, tag: str) -> str:
    m = re.search(rf"<{tag}>([^<]*)</{tag}>", block)
    assert m is not None, tag
    return m.group(1).strip()


def test_fixture_inventory_matches_the_file() -> None:
    text = XML.read_text()
    host = load_smi_xml(XML)
    blocks = _gpu_blocks(text)
    assert len(host.gpus) == len(blocks) == 8
    assert host.driver.driver_version == "580.105.08"
    assert host.driver.cuda_driver_version == 13000
    for i, (g, block) in enumerate(zip(host.gpus, blocks, strict=True)):
        assert g.index == i
        assert g.uuid == _tag(block, "uuid")
        assert g.serial == _tag(block, "serial")
        assert g.pci_bus_id == _tag(block, "pci_bus_id")
        assert g.minor_number == int(_tag(block, "minor_number"))
        assert g.vbios_version == _tag(block, "vbios_version")
        assert g.name == "NVIDIA H100 80GB HBM3"
        assert g.architecture == 9
        assert g.cuda_compute_capability == (9, 0)
    g0 = host.gpus[0]
    assert g0.uuid == "GPU-00000000-0000-0000-0000-000000000000"
    assert [g.pci_bus_id for g in host.gpus] == [
        "00000000:53:00.0", "00000000:64:00.0", "00000000:75:00.0", "00000000:86:00.0",
        "00000000:97:00.0", "00000000:A8:00.0", "00000000:B9:00.0", "00000000:CA:00.0",
    ]
    assert g0.memory_total_bytes == 81559 * 2**20
    assert (g0.power_limit_default_mw, g0.power_limit_min_mw, g0.power_limit_max_mw) == (700000, 200000, 700000)
    assert (g0.max_clock_sm_mhz, g0.max_clock_memory_mhz, g0.max_clock_graphics_mhz) == (1980, 2619, 1980)
    assert (g0.pcie_max_gen, g0.pcie_max_width) == (5, 16)
    assert g0.fan_count == 0  # fan_speed N/A on SXM
    assert g0.ecc_supported and g0.row_remap_supported and not g0.retired_pages_supported
    # T.Limit-relative thresholds: GPU 0 reads 29 C with a 58 C margin -> anchor 87 C
    assert (g0.temp_gpu_max_c, g0.temp_slowdown_c, g0.temp_shutdown_c) == (87, 89, 95)
    # memory: T.Limit margin 0 C at the HBM limit NVML reports (95 C on a real H200, driver 580)
    assert g0.temp_memory_max_c == 95
    s0 = host.samples[0]
    assert (s0.power_mw, s0.temperature_gpu_c, s0.temperature_memory_c) == (68920, 29, 37)
    assert s0.pcie_replay_counter == 150
    assert s0.memory_reserved_bytes == 480 * 2**20
    assert s0.clocks_event_ns is not None and s0.clocks_event_ns["sw_power_cap"] == 7015662857 * 1000
    assert s0.retired_pages_single_bit is None


def test_builtin_copy_is_the_fixture() -> None:
    packaged = REPO / "sim" / "fake" / "data" / "h100-8gpu-idle.xml"
    assert packaged.read_bytes() == XML.read_bytes()
    assert "k8s-test-infra" in (packaged.parent / "NOTICE.md").read_text()
    assert [g.uuid for g in builtin_host().gpus] == [g.uuid for g in load_smi_xml(XML).gpus]


MINIMAL = """<?xml version="1.0" ?>
<nvidia_smi_log><driver_version>535.104.05</driver_version><cuda_version>12.2</cuda_version>
<gpu id="00000000:07:00.0"><product_name>NVIDIA A100-SXM4-80GB</product_name>
<product_architecture>Ampere</product_architecture><uuid>GPU-abc</uuid><serial>N/A</serial>
<minor_number>3</minor_number><vbios_version>N/A</vbios_version>
<fb_memory_usage><total>81920 MiB</total></fb_memory_usage>
<fan_speed>35 %</fan_speed>
<power_readings><power_draw>250.50 W</power_draw><default_power_limit>400.00 W</default_power_limit>
<min_power_limit>N/A</min_power_limit><max_power_limit>400.00 W</max_power_limit></power_readings>
<temperature><gpu_temp>40 C</gpu_temp><gpu_temp_max_threshold>92 C</gpu_temp_max_threshold>
<gpu_temp_slow_threshold>89 C</gpu_temp_slow_threshold><gpu_temp_max_gpu_threshold>87 C</gpu_temp_max_gpu_threshold>
<gpu_temp_max_mem_threshold>95 C</gpu_temp_max_mem_threshold></temperature>
<max_clocks><sm_clock>1410 MHz</sm_clock><mem_clock>N/A</mem_clock></max_clocks>
</gpu></nvidia_smi_log>"""


def test_older_layout_absolute_thresholds_and_na() -> None:
    host = parse_smi_xml(MINIMAL)
    g = host.gpus[0]
    assert host.driver.cuda_driver_version == 12020
    assert g.pci_bus_id == "00000000:07:00.0"
    assert (g.uuid, g.serial, g.vbios_version, g.minor_number) == ("GPU-abc", None, None, 3)
    assert g.architecture == 7 and not g.gpm_supported
    assert (g.temp_shutdown_c, g.temp_slowdown_c, g.temp_gpu_max_c, g.temp_memory_max_c) == (92, 89, 87, 95)
    assert (g.power_limit_default_mw, g.power_limit_min_mw) == (400000, None)
    assert (g.max_clock_sm_mhz, g.max_clock_memory_mhz) == (1410, None)
    assert g.fan_count == 1
    assert host.samples[0].power_mw == 250500
    assert host.samples[0].fan_speed_pct == [35]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<nvidia_smi_log><driver_version>1</driver_version>", "not well-formed"),
        ("<other/>", "expected <nvidia_smi_log>"),
        ("<nvidia_smi_log><driver_version>1</driver_version></nvidia_smi_log>", "no <gpu>"),
        ("<nvidia_smi_log><gpu id='00000000:07:00.0'><uuid>GPU-a</uuid></gpu></nvidia_smi_log>", "driver_version"),
        (MINIMAL.replace("<uuid>GPU-abc</uuid>", ""), "no <uuid>"),
        (MINIMAL.replace('id="00000000:07:00.0"', 'id="zz"'), "bad PCI bus id"),
    ],
)
def test_bad_documents_are_rejected_clearly(text: str, message: str) -> None:
    with pytest.raises(SmiXmlError, match=message):
        parse_smi_xml(text)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SmiXmlError, match="cannot read"):
        load_smi_xml(tmp_path / "nope.xml")


# ------------------------------------------------------------------ product knowledge (hardware.py)


def test_every_nvml_architecture_is_known_by_name() -> None:
    defined = {k: v for k, v in vars(pynvml).items() if k.startswith("NVML_DEVICE_ARCH_")}
    assert "NVML_DEVICE_ARCH_BLACKWELL" in defined
    for const, value in defined.items():
        if const == "NVML_DEVICE_ARCH_UNKNOWN":
            assert value == hardware.ARCH_UNKNOWN and value not in hardware.ARCHITECTURES
            assert hardware.architecture_label(value) == ""
            continue
        label = const.removeprefix("NVML_DEVICE_ARCH_").lower()
        assert hardware.ARCHITECTURES.get(value) == label, const
        assert hardware.architecture_id(label.title()) == value
    assert 0 not in hardware.ARCHITECTURES and hardware.architecture_label(0) == ""


@pytest.mark.parametrize(
    ("smi", "arch"),
    [("Ada Lovelace", "ADA"), ("Hopper", "HOPPER"), ("Blackwell", "BLACKWELL"), ("Turing", "TURING"),
     ("Ampere", "AMPERE"), ("Volta", "VOLTA"), ("Pascal", "PASCAL"), ("Maxwell", "MAXWELL"), ("Kepler", "KEPLER"),
     ("Feynman", "UNKNOWN"), (None, "UNKNOWN")],
)
def test_nvidia_smi_architecture_names(smi: str | None, arch: str) -> None:
    assert hardware.architecture_id(smi) == getattr(pynvml, f"NVML_DEVICE_ARCH_{arch}")


@pytest.mark.parametrize(
    ("name", "arch", "cc", "links"),
    [
        ("Tesla K80", "KEPLER", (3, 7), 0),
        ("Tesla K40m", "KEPLER", (3, 5), 0),
        ("Tesla M60", "MAXWELL", (5, 2), 0),
        ("Tesla P100-SXM2-16GB", "PASCAL", (6, 0), 4),
        ("Tesla P40", "PASCAL", (6, 1), 0),
        ("Tesla V100-SXM2-32GB", "VOLTA", (7, 0), 6),
        ("Tesla V100-PCIE-16GB", "VOLTA", (7, 0), 0),
        ("Tesla T4", "TURING", (7, 5), 0),
        ("NVIDIA A100-SXM4-80GB", "AMPERE", (8, 0), 12),
        ("NVIDIA A100 80GB PCIe", "AMPERE", (8, 0), 0),
        ("NVIDIA A30", "AMPERE", (8, 0), 0),
        ("NVIDIA A10G", "AMPERE", (8, 6), 0),
        ("NVIDIA A40", "AMPERE", (8, 6), 0),
        ("NVIDIA RTX A6000", "AMPERE", (8, 6), 0),
        ("NVIDIA L40S", "ADA", (8, 9), 0),
        ("NVIDIA L4", "ADA", (8, 9), 0),
        ("NVIDIA H100 80GB HBM3", "HOPPER", (9, 0), 18),
        ("NVIDIA H100 PCIe", "HOPPER", (9, 0), 0),
        ("NVIDIA H100 NVL", "HOPPER", (9, 0), 0),
        ("NVIDIA H200", "HOPPER", (9, 0), 18),
        ("NVIDIA H200 NVL", "HOPPER", (9, 0), 0),
        ("NVIDIA H800", "HOPPER", (9, 0), 8),
        ("NVIDIA GH200 480GB", "HOPPER", (9, 0), 18),
        ("NVIDIA B200", "BLACKWELL", (10, 0), 18),
        ("NVIDIA GB200", "BLACKWELL", (10, 0), 18),
        ("NVIDIA GB300", "BLACKWELL", (10, 3), 18),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "BLACKWELL", (12, 0), 0),
        ("NVIDIA GeForce RTX 5090", "BLACKWELL", (12, 0), 0),
        ("NVIDIA Blackwell X9", "BLACKWELL", None, 0),  # a part not in the table: no compute capability
        ("NVIDIA Rubin X", "RUBIN", None, 0),
    ],
)
def test_compute_capability_and_nvlinks_per_product(
    name: str, arch: str, cc: tuple[int, int] | None, links: int
) -> None:
    arch_id = getattr(pynvml, f"NVML_DEVICE_ARCH_{arch}")
    assert hardware.compute_capability(arch_id, name) == cc
    assert hardware.nvlink_count(name) == links
    assert hardware.gpm_supported(arch_id, name) == (arch in ("HOPPER", "BLACKWELL", "RUBIN") and "GeForce" not in name)


def test_unknown_architecture_is_not_zero_and_has_no_compute_capability() -> None:
    g = parse_smi_xml(MINIMAL.replace("Ampere", "Feynman").replace("A100-SXM4-80GB", "X1")).gpus[0]
    assert g.architecture == hardware.ARCH_UNKNOWN != 0
    assert g.cuda_compute_capability is None and not g.gpm_supported and g.nvlink_count == 0
    # The A100 SXM4 of the same document has its 12 NVLinks and compute capability 8.0.
    a100 = parse_smi_xml(MINIMAL).gpus[0]
    assert (a100.nvlink_count, a100.cuda_compute_capability) == (12, (8, 0))


def test_two_gpus_at_one_pci_address_are_rejected() -> None:
    gpu = re.search(r"<gpu id=.*</gpu>", MINIMAL, flags=re.S)
    assert gpu is not None
    twice = MINIMAL.replace(gpu.group(0), gpu.group(0) + gpu.group(0).replace("GPU-abc", "GPU-def"))
    with pytest.raises(SmiXmlError, match=re.escape("two GPUs with PCI bus id 00000000:07:00.0")):
        parse_smi_xml(twice)
