"""Hardware the agent was not built on: real `nvidia-smi -q -x` captures of other GPU models.

Each capture (tests/fixtures/nvidia-smi, see tests/fixtures/NOTICE.md) is parsed, checked against
what the file and the product say, and served as a simulated host (``--nvml.fake=sim:PATH``)
to the real agent, whose exposition must name the architecture, have one NVLink series per
link the product has, no memory temperature on GDDR boards, and pass ``promtool check metrics``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

import pynvml
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from support import BIN, FIXTURES, need_binary

from gpufleet.agent.collectors.gpu import GpuCollector
from gpufleet.agent.collectors.topology import nic_gpu_mapping
from gpufleet.agent.nvml import hardware
from gpufleet.agent.nvml.backend import NvmlBackend
from gpufleet.sim.fake.library import FakeNvml
from gpufleet.sim.fake.sim_source import SimSource
from gpufleet.sim.fake.smi_xml import SmiHost, load_smi_xml, parse_smi_xml
from gpufleet.sim.fake.spec import source_from_spec

SMI = FIXTURES / "nvidia-smi"
T0 = 1_700_000_000.0
MIB = 2**20


@dataclass(frozen=True)
class Board:
    file: str
    gpus: int
    name: str
    arch: int
    label: str
    cc: tuple[int, int]
    nvlinks: int
    memory_mib: int
    power_mw: tuple[int, int, int]  # default, min, max limit
    hbm: bool  # has a memory temperature sensor


BOARDS = [
    Board("a100-sxm4-1gpu.xml", 1, "NVIDIA A100-SXM4-40GB", hardware.ARCH_AMPERE, "ampere", (8, 0), 12, 40960,
          (400_000, 100_000, 400_000), True),
    Board("l40s-1gpu.xml", 1, "NVIDIA L40S", hardware.ARCH_ADA, "ada", (8, 9), 0, 46068,
          (350_000, 100_000, 350_000), False),
    Board("t4-1gpu.xml", 1, "Tesla T4", hardware.ARCH_TURING, "turing", (7, 5), 0, 15360,
          (70_000, 60_000, 70_000), False),
    Board("b200-8gpu.xml", 8, "NVIDIA B200", hardware.ARCH_BLACKWELL, "blackwell", (10, 0), 18, 183359,
          (1_000_000, 200_000, 1_000_000), True),
    Board("gb200-4gpu.xml", 4, "NVIDIA GB200", hardware.ARCH_BLACKWELL, "blackwell", (10, 0), 18, 189471,
          (1_200_000, 200_000, 1_200_000), True),
    Board("gb300-4gpu.xml", 4, "NVIDIA GB300", hardware.ARCH_BLACKWELL, "blackwell", (10, 3), 18, 284208,
          (1_400_000, 200_000, 1_400_000), True),
    Board("h100-8gpu-idle.xml", 8, "NVIDIA H100 80GB HBM3", hardware.ARCH_HOPPER, "hopper", (9, 0), 18, 81559,
          (700_000, 200_000, 700_000), True),
]
IDS = [b.file.removesuffix(".xml") for b in BOARDS]


def _tags(text: str, tag: str) -> list[str]:
    return [m.strip() for m in re.findall(rf"<{tag}>([^<]*)</{tag}>", text)]


@pytest.mark.parametrize("board", BOARDS, ids=IDS)
def test_capture_parses_to_what_the_board_is(board: Board) -> None:
    path = SMI / board.file
    text = path.read_text()
    host = load_smi_xml(path)
    assert len(host.gpus) == board.gpus
    assert [g.pci_bus_id for g in host.gpus] == [
        re.sub(r"^([0-9A-F]+):", lambda m: f"{int(m.group(1), 16):08X}:", b.upper()) for b in _tags(text, "pci_bus_id")
    ]
    mem_temps = _tags(text, "memory_temp")
    for g, s, mem_temp in zip(host.gpus, host.samples, mem_temps, strict=True):
        assert g.name == board.name
        assert g.architecture == board.arch and g.architecture != 0
        assert g.cuda_compute_capability == board.cc
        assert g.nvlink_count == board.nvlinks
        assert g.memory_total_bytes == board.memory_mib * MIB
        assert (g.power_limit_default_mw, g.power_limit_min_mw, g.power_limit_max_mw) == board.power_mw
        assert g.gpm_supported == (board.arch in (hardware.ARCH_HOPPER, hardware.ARCH_BLACKWELL))
        # The capture's own memory temperature: a reading on HBM, N/A on GDDR.
        assert (mem_temp != "N/A") == board.hbm
        assert (s.temperature_memory_c is not None) == board.hbm


@pytest.mark.parametrize("board", BOARDS, ids=IDS)
def test_simulated_job_stays_within_the_board(board: Board) -> None:
    """Over a whole job cycle (training, stalls, a checkpoint) every reading is one the board can give."""
    now = [T0]
    sim = SimSource(1, capture=SMI / board.file, seed=5, clock=lambda: now[0])
    inv = sim.inventory()[0]
    assert inv.max_clock_sm_mhz is not None and inv.temp_slowdown_c is not None
    capped = 0
    for step in range(800):
        now[0] = T0 + 2.0 * step
        s = sim.sample(0)
        assert s.power_mw is not None and 0 < s.power_mw <= board.power_mw[2]
        assert s.clock_sm_mhz is not None and 0 < s.clock_sm_mhz <= inv.max_clock_sm_mhz
        assert s.clocks_event_reasons is not None
        assert bool(s.clocks_event_reasons & 0x4) == (s.clock_sm_mhz < inv.max_clock_sm_mhz)
        capped += s.clock_sm_mhz < inv.max_clock_sm_mhz
        assert s.temperature_gpu_c is not None and 20 < s.temperature_gpu_c < inv.temp_slowdown_c
        assert (s.temperature_memory_c is not None) == board.hbm
        assert s.memory_used_bytes is not None and 0 < s.memory_used_bytes < inv.memory_total_bytes
        assert len(s.nvlink or []) == board.nvlinks
    assert capped < 800  # the checkpoint phase draws less than any board's limit


def _once(spec: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    return subprocess.run([str(BIN / "gpufleet-agent"), "once", f"--nvml.fake={spec}", "--no-collector.host", *extra],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("board", BOARDS, ids=IDS)
def test_agent_exports_the_board(board: Board) -> None:
    r = _once(f"sim:{SMI / board.file}")
    assert r.returncode == 0, r.stderr
    text = r.stdout
    info = re.findall(r"^gpufleet_gpu_info\{(.*)\} 1\.0$", text, flags=re.M)
    assert len(info) == board.gpus
    assert all(f'architecture="{board.label}"' in labels for labels in info), info[0]
    assert 'architecture="0"' not in text
    assert f"gpufleet_gpus {float(board.gpus)}" in text
    mem = re.findall(r'^gpufleet_gpu_temperature_celsius\{gpu="\d+",sensor="memory"\}', text, flags=re.M)
    assert len(mem) == (board.gpus if board.hbm else 0)  # never a made-up HBM temperature
    up = re.findall(r"^gpufleet_gpu_nvlink_up\{", text, flags=re.M)
    assert len(up) == board.gpus * board.nvlinks
    # The simulated job's readings stay within the board's own limits.
    for m in re.finditer(r'^gpufleet_gpu_memory_used_bytes\{gpu="\d+"\} (\S+)$', text, flags=re.M):
        assert 0 < float(m.group(1)) < board.memory_mib * MIB
    for m in re.finditer(r'^gpufleet_gpu_power_watts\{gpu="\d+"\} (\S+)$', text, flags=re.M):
        assert 0 < float(m.group(1)) * 1000 <= board.power_mw[2]
    # Every GPU got its NIC in the simulated PCI tree (one mlx5 port behind each GPU's switch).
    assert len(re.findall(r"^gpufleet_nic_gpu_info\{", text, flags=re.M)) == min(board.gpus, 8)
    check = subprocess.run([need_binary("promtool"), "check", "metrics"], input=text.encode(),
                           capture_output=True, timeout=60)
    problems = (check.stdout + check.stderr).decode()
    assert check.returncode == 0 and not problems.strip(), problems


def _assert_tree(sim: SimSource) -> None:
    """Every GPU (up to 8) has its own NIC, and the topology collector maps NIC i to GPU i alone."""
    assert sim.sysfs_root is not None
    gpus = sim.inventory()[:8]
    nics = sorted(p.name for p in Path(sim.sysfs_root, "class", "infiniband").iterdir())
    assert nics == sorted(f"mlx5_{g.index}" for g in gpus)
    mapping = nic_gpu_mapping(sim.sysfs_root, {str(g.index): g.pci_bus_id for g in gpus}, nics)
    assert sorted((m.device, m.gpu) for m in mapping) == sorted((f"mlx5_{g.index}", str(g.index)) for g in gpus)
    addresses = [m.pci_bus_id for m in mapping] + [g.pci_bus_id for g in gpus]
    assert len(set(addresses)) == len(addresses)


@pytest.mark.parametrize("spec", ["b200-8gpu.xml", "gb300-4gpu.xml", "gb300-4gpu.xml:12", "t4-1gpu.xml:8"])
def test_sysfs_tree_for_any_bus_layout_of_real_captures(spec: str) -> None:
    # B200: GPUs on adjacent buses (8F/90, 96/97...); GB300: four PCI domains, all on bus 06;
    # T4: bus 00; repeated to 8 or 12 GPUs, the copies go to new domains.
    src = source_from_spec(f"sim:{SMI / spec}")
    assert isinstance(src, SimSource)
    try:
        ids = [g.pci_bus_id for g in src.inventory()]
        assert len(set(ids)) == len(ids)
        _assert_tree(src)
    finally:
        src.close()


def _synthetic(bus_ids: list[str]) -> SmiHost:
    """SYNTHETIC inventory: the T4 capture's GPU repeated at the given PCI bus ids (layouts no public capture has)."""
    t4 = load_smi_xml(SMI / "t4-1gpu.xml")
    gpus = [replace(t4.gpus[0], index=i, uuid=f"GPU-synthetic-{i}", pci_bus_id=b) for i, b in enumerate(bus_ids)]
    return SmiHost(driver=t4.driver, gpus=gpus, samples=[t4.samples[0]] * len(gpus))


@pytest.mark.parametrize(
    "bus_ids",
    [
        # several GPUs on one bus (a VM's root bus), and the first and last bus numbers
        ["00000000:00:1B.0", "00000000:00:1C.0", "00000000:00:1D.0", "00000000:00:1E.0", "00000000:FF:00.0"],
        # eight adjacent buses, and a domain past 0xFFFF (a VMD domain) next to domain 0
        [f"00000000:{b:02X}:00.0" for b in range(0x10, 0x16)] + ["00010000:01:00.0", "00010000:02:00.0"],
    ],
    ids=["one-bus-and-edges", "adjacent-and-vmd-domain"],
)
def test_sysfs_tree_for_synthetic_bus_layouts(bus_ids: list[str]) -> None:
    sim = SimSource(capture=_synthetic(bus_ids), clock=lambda: T0, sysfs=True)
    try:
        _assert_tree(sim)
    finally:
        sim.close()


def test_gddr_boards_answer_not_supported_for_memory_temperature() -> None:
    sim = SimSource(capture=SMI / "t4-1gpu.xml", clock=lambda: T0 + 100)
    assert sim.sample(0).temperature_memory_c is None
    with FakeNvml(sim):
        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            (fv,) = pynvml.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_MEMORY_TEMP])
            assert fv.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
            assert pynvml.nvmlDeviceGetArchitecture(h) == pynvml.NVML_DEVICE_ARCH_TURING
            assert tuple(pynvml.nvmlDeviceGetCudaComputeCapability(h)) == (7, 5)
        finally:
            pynvml.nvmlShutdown()


def test_unknown_architecture_is_nvml_unknown_and_exported_without_a_label() -> None:
    text = (SMI / "l40s-1gpu.xml").read_text().replace("Ada Lovelace", "Feynman").replace("NVIDIA L40S", "NVIDIA X1")
    host = parse_smi_xml(text)
    g = host.gpus[0]
    assert g.architecture == hardware.ARCH_UNKNOWN and g.cuda_compute_capability is None
    assert not g.gpm_supported and g.nvlink_count == 0
    sim = SimSource(capture=host, clock=lambda: T0)
    fake = FakeNvml(sim).install()
    backend = NvmlBackend()
    try:
        assert backend.start(), backend.init_error
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetArchitecture(h) == pynvml.NVML_DEVICE_ARCH_UNKNOWN
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetCudaComputeCapability(h)
        reg = CollectorRegistry()
        reg.register(GpuCollector(backend))
        out = generate_latest(reg).decode()
        (info,) = re.findall(r"^gpufleet_gpu_info\{.*\} 1\.0$", out, flags=re.M)
        assert 'architecture=""' in info and 'name="NVIDIA X1"' in info
    finally:
        backend.close()
        fake.uninstall()


def test_legacy_zero_architecture_and_compute_capability_read_as_unknown() -> None:
    """Traces and snapshots written before ARCH_UNKNOWN stored 0 and (0, 0) for "unknown"."""
    sim = SimSource(capture=SMI / "t4-1gpu.xml", clock=lambda: T0)
    sim._inv[0] = replace(sim._inv[0], architecture=0, cuda_compute_capability=(0, 0))
    with FakeNvml(sim):
        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            assert pynvml.nvmlDeviceGetArchitecture(h) == pynvml.NVML_DEVICE_ARCH_UNKNOWN
            with pytest.raises(pynvml.NVMLError_NotSupported):
                pynvml.nvmlDeviceGetCudaComputeCapability(h)
        finally:
            pynvml.nvmlShutdown()


def test_sim_path_spec_forms(tmp_path: Path) -> None:
    t4 = SMI / "t4-1gpu.xml"
    for spec, n in ((f"sim:{t4}", 1), (f"sim:{t4}:3", 3), ("sim:2", 2)):
        src = source_from_spec(spec)
        assert isinstance(src, SimSource)
        try:
            assert len(src.inventory()) == n
        finally:
            src.close()
    # A file whose name itself ends in ":N" is that file, not N copies of another one.
    odd = tmp_path / "t4.xml:2"
    shutil.copy(t4, odd)
    src = source_from_spec(f"sim:{odd}")
    assert isinstance(src, SimSource)
    try:
        assert len(src.inventory()) == 1
    finally:
        src.close()


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("/nonexistent/host.xml", "cannot read /nonexistent/host.xml"),
        (str(FIXTURES / "NOTICE.md"), "not well-formed XML"),
        (f"{SMI / 't4-1gpu.xml'}:0", "1..4096"),
        (f"{SMI / 't4-1gpu.xml'}:5000", "1..4096"),
    ],
)
def test_bad_sim_paths_are_one_clear_line(arg: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        source_from_spec(f"sim:{arg}")
    assert "\n" not in str(e.value)


def test_cli_bad_capture_exits_2_with_one_line() -> None:
    r = _once("sim:/nonexistent/host.xml")
    assert r.returncode == 2
    errors = [ln for ln in r.stderr.splitlines() if not ln.startswith("ts=")]
    assert len(errors) == 1 and "cannot read /nonexistent/host.xml" in errors[0], r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
