"""Load a GPU host's static inventory (and its readings at capture time) from ``nvidia-smi -q -x``.

The XML is what ``nvidia-smi -q -x`` prints: ``<nvidia_smi_log>`` with
``<driver_version>``, ``<cuda_version>`` and one ``<gpu id="...">`` per device in
NVML index order. Values carry units ("700.00 W", "1980 MHz", "87 C", "81559 MiB",
"16x") and "N/A" where the GPU or driver does not report them; "N/A" (or a
missing element) becomes ``None``, never zero.

Temperature thresholds: older drivers print absolute thresholds
(``gpu_temp_max_threshold`` = shutdown, ``gpu_temp_slow_threshold``,
``gpu_temp_max_gpu_threshold``, ``gpu_temp_max_mem_threshold``). Newer drivers
print them relative to T.Limit (``gpu_temp_*_tlimit_threshold``: the T.Limit
margin at which the action triggers) next to the current margin
``gpu_temp_tlimit``; the absolute GPU thresholds are then
``gpu_temp + gpu_temp_tlimit - threshold``. Each threshold is read in the form
the capture gives it (absolute first). The memory threshold
(``gpu_temp_max_mem_tlimit_threshold``) has no T.Limit reading to anchor it: it
is anchored at the HBM limit NVML reports (:data:`hardware.MEMORY_TLIMIT_C`,
95 C: what a real H200 with driver 580 answered where its capture printed 0 C);
"N/A" there (GDDR boards) stays ``None``.

MIG mode, the process list and NVLink presence: :mod:`.smi_state`.
"""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from gpufleet.agent.nvml import hardware
from gpufleet.agent.nvml.model import DriverInfo, GpuInventory, GpuSample
from gpufleet.sim.fake import smi_fabric, smi_state
from gpufleet.sim.fake.smi_text import text as _text
from gpufleet.vocab.nvml import CLOCK_EVENT_BITS

_NUMBER = re.compile(r"^\s*([-+]?\d+(?:\.\d+)?)\s*([A-Za-z/%]*)\s*$")
_BYTES = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
# nvidia-smi's clocks_event_reasons element suffix -> CLOCK_EVENT_BITS key
_REASONS = {
    "gpu_idle": "gpu_idle",
    "applications_clocks_setting": "applications_clocks_setting",
    "sw_power_cap": "sw_power_cap",
    "hw_slowdown": "hw_slowdown",
    "sync_boost": "sync_boost",
    "sw_thermal_slowdown": "sw_thermal_slowdown",
    "hw_thermal_slowdown": "hw_thermal_slowdown",
    "hw_power_brake_slowdown": "hw_power_brake_slowdown",
    "display_clocks_setting": "display_clock_setting",
}
_REASON_COUNTERS = {
    "sw_power_cap": "sw_power_cap",
    "sync_boost": "sync_boost",
    "sw_therm_slowdown": "sw_thermal_slowdown",
    "hw_therm_slowdown": "hw_thermal_slowdown",
    "hw_power_brake": "hw_power_brake_slowdown",
}


class SmiXmlError(ValueError):
    """The document is not usable ``nvidia-smi -q -x`` output."""


@dataclass
class SmiHost:
    driver: DriverInfo
    gpus: list[GpuInventory]
    #: the readings at capture time (one per GPU, same order); timestamp 0
    samples: list[GpuSample]



def _number(el: ET.Element, path: str) -> tuple[float, str] | None:
    t = _text(el, path)
    if t is None:
        return None
    m = _NUMBER.match(t)
    if m is None:
        return None
    return float(m.group(1)), m.group(2)


def _int(el: ET.Element, path: str) -> int | None:
    n = _number(el, path)
    return None if n is None else round(n[0])


def _mw(el: ET.Element, path: str) -> int | None:
    n = _number(el, path)
    if n is None:
        return None
    return round(n[0] * 1000) if n[1] == "W" else round(n[0])


def _bytes(el: ET.Element, path: str) -> int | None:
    n = _number(el, path)
    if n is None or n[1] not in _BYTES:
        return None
    return round(n[0] * _BYTES[n[1]])


def _yes(el: ET.Element, path: str) -> bool | None:
    t = _text(el, path)
    return None if t is None else t.lower() in ("yes", "enabled", "active")


def _power(gpu: ET.Element, name: str) -> int | None:
    # Drivers >= 535 nest power in gpu_power_readings; older ones in power_readings.
    for section in ("gpu_power_readings", "power_readings"):
        v = _mw(gpu, f"{section}/{name}")
        if v is not None:
            return v
    return None


def _thresholds(gpu: ET.Element) -> tuple[int | None, int | None, int | None, int | None]:
    """(slowdown, shutdown, gpu max, memory max) in Celsius, each absolute where the capture prints it so,
    else from its T.Limit form (see the module docstring)."""
    t = "temperature/"
    temp, margin = _int(gpu, t + "gpu_temp"), _int(gpu, t + "gpu_temp_tlimit")
    anchor = None if temp is None or margin is None else temp + margin

    def read(absolute: str, relative: str, limit: int | None) -> int | None:
        v = _int(gpu, t + absolute)
        if v is not None:
            return v
        rel = _int(gpu, t + relative)
        return None if rel is None or limit is None else limit - rel

    return (read("gpu_temp_slow_threshold", "gpu_temp_slow_tlimit_threshold", anchor),
            read("gpu_temp_max_threshold", "gpu_temp_max_tlimit_threshold", anchor),
            read("gpu_temp_max_gpu_threshold", "gpu_temp_max_gpu_tlimit_threshold", anchor),
            read("gpu_temp_max_mem_threshold", "gpu_temp_max_mem_tlimit_threshold", hardware.MEMORY_TLIMIT_C))


def _bus_id(gpu: ET.Element) -> str:
    raw = _text(gpu, "pci/pci_bus_id") or gpu.get("id")
    if raw is None:
        raise SmiXmlError("a <gpu> has no PCI bus id")
    m = re.fullmatch(r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])", raw.strip())
    if m is None:
        raise SmiXmlError(f"bad PCI bus id {raw!r}")
    return f"{int(m.group(1) or '0', 16):08X}:{m.group(2).upper()}:{m.group(3).upper()}.{m.group(4)}"


def _inventory(index: int, gpu: ET.Element) -> GpuInventory:
    uuid = _text(gpu, "uuid")
    if uuid is None:
        raise SmiXmlError(f"GPU {index} has no <uuid>")
    # nvidia-smi -q prints neither the compute capability nor the NVLinks: product knowledge fills them in
    # (NVLinks only where the capture does not say the GPU is outside an NVLink fabric: smi_state).
    arch = hardware.architecture_id(_text(gpu, "product_architecture"))
    name = _text(gpu, "product_name") or "Unknown"
    slowdown, shutdown, gpu_max, mem_max = _thresholds(gpu)
    fans = gpu.findall("fan_speed")
    width = _number(gpu, "pci/pci_gpu_link_info/link_widths/max_link_width")
    minor = _int(gpu, "minor_number")
    total = _bytes(gpu, "fb_memory_usage/total")
    if total is None:
        raise SmiXmlError(f"GPU {index} has no <fb_memory_usage><total>")
    inv = GpuInventory(
        index=index,
        uuid=uuid,
        name=name,
        serial=_text(gpu, "serial"),
        pci_bus_id=_bus_id(gpu),
        vbios_version=_text(gpu, "vbios_version"),
        architecture=arch,
        cuda_compute_capability=hardware.compute_capability(arch, name),
        minor_number=index if minor is None else minor,
        memory_total_bytes=total,
        power_limit_default_mw=_power(gpu, "default_power_limit"),
        power_limit_min_mw=_power(gpu, "min_power_limit"),
        power_limit_max_mw=_power(gpu, "max_power_limit"),
        temp_slowdown_c=slowdown,
        temp_shutdown_c=shutdown,
        temp_gpu_max_c=gpu_max,
        temp_memory_max_c=mem_max,
        max_clock_sm_mhz=_int(gpu, "max_clocks/sm_clock"),
        max_clock_memory_mhz=_int(gpu, "max_clocks/mem_clock"),
        max_clock_graphics_mhz=_int(gpu, "max_clocks/graphics_clock"),
        pcie_max_gen=_int(gpu, "pci/pci_gpu_link_info/pcie_gen/max_link_gen"),
        pcie_max_width=None if width is None else round(width[0]),
        nvlink_count=smi_state.nvlink_count(gpu, arch, name),
        fan_count=sum(1 for f in fans if (f.text or "").strip() not in ("", "N/A")),
        ecc_supported=_text(gpu, "ecc_mode/current_ecc") is not None,
        gpm_supported=hardware.gpm_supported(arch, name),
        row_remap_supported=_text(gpu, "remapped_rows/remapped_row_corr") is not None,
        retired_pages_supported=_text(gpu, "retired_pages/multiple_single_bit_retirement/retired_count") is not None,
        platform=smi_fabric.platform(gpu),
    )
    inv.mig_mode_current, inv.mig_mode_pending = smi_state.mig_mode(gpu)
    return inv


def _sample(gpu: ET.Element) -> GpuSample:
    reasons = 0
    for suffix, key in _REASONS.items():
        if _yes(gpu, f"clocks_event_reasons/clocks_event_reason_{suffix}"):
            reasons |= CLOCK_EVENT_BITS[key]
    counters: dict[str, int] = {}
    for suffix, key in _REASON_COUNTERS.items():
        n = _number(gpu, f"clocks_event_reasons_counters/clocks_event_reasons_counters_{suffix}")
        if n is not None:
            counters[key] = round(n[0] * (1000 if n[1] == "us" else 1))
    pstate = _text(gpu, "performance_state")
    fan = _int(gpu, "fan_speed")
    ecc: dict[str, int] = {}
    for counter in ("volatile", "aggregate"):
        corr = _int(gpu, f"ecc_errors/{counter}/dram_correctable")
        unc = _int(gpu, f"ecc_errors/{counter}/dram_uncorrectable")
        if corr is not None:
            ecc[f"{counter}_corrected"] = corr
        if unc is not None:
            ecc[f"{counter}_uncorrected"] = unc
    return GpuSample(
        timestamp=0.0,
        utilization_gpu_pct=_int(gpu, "utilization/gpu_util"),
        utilization_memory_pct=_int(gpu, "utilization/memory_util"),
        clock_sm_mhz=_int(gpu, "clocks/sm_clock"),
        clock_memory_mhz=_int(gpu, "clocks/mem_clock"),
        clock_graphics_mhz=_int(gpu, "clocks/graphics_clock"),
        power_mw=_power(gpu, "instant_power_draw") or _power(gpu, "power_draw"),
        power_limit_mw=_power(gpu, "current_power_limit") or _power(gpu, "enforced_power_limit"),
        energy_mj=None,
        temperature_gpu_c=_int(gpu, "temperature/gpu_temp"),
        temperature_memory_c=_int(gpu, "temperature/memory_temp"),
        fan_speed_pct=None if fan is None else [fan],
        memory_used_bytes=_bytes(gpu, "fb_memory_usage/used"),
        memory_reserved_bytes=_bytes(gpu, "fb_memory_usage/reserved"),
        pstate=int(pstate[1:]) if pstate and re.fullmatch(r"P\d+", pstate) else None,
        clocks_event_reasons=reasons,
        clocks_event_ns=counters or None,
        ecc=ecc or None,
        remapped_rows_correctable=_int(gpu, "remapped_rows/remapped_row_corr"),
        remapped_rows_uncorrectable=_int(gpu, "remapped_rows/remapped_row_unc"),
        row_remap_pending=_yes(gpu, "remapped_rows/remapped_row_pending"),
        row_remap_failure=_yes(gpu, "remapped_rows/remapped_row_failure"),
        retired_pages_single_bit=_int(gpu, "retired_pages/multiple_single_bit_retirement/retired_count"),
        retired_pages_double_bit=_int(gpu, "retired_pages/double_bit_retirement/retired_count"),
        retired_pages_pending=_yes(gpu, "retired_pages/pending_retirement"),
        pcie_gen=_int(gpu, "pci/pci_gpu_link_info/pcie_gen/current_link_gen"),
        pcie_width=_int(gpu, "pci/pci_gpu_link_info/link_widths/current_link_width"),
        pcie_replay_counter=_int(gpu, "pci/replay_counter"),
        pcie_tx_kbps=_int(gpu, "pci/tx_util"),
        pcie_rx_kbps=_int(gpu, "pci/rx_util"),
        nvlink=None,
        gpm=None,
        processes=smi_state.processes(gpu),
        **smi_fabric.sample_fields(gpu),
    )


def parse_smi_xml(text: str | bytes) -> SmiHost:
    """Parse ``nvidia-smi -q -x`` output; raises :class:`SmiXmlError` on anything unusable."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as e:
        raise SmiXmlError(f"not well-formed XML: {e}") from e
    if root.tag != "nvidia_smi_log":
        raise SmiXmlError(f"root element is <{root.tag}>, expected <nvidia_smi_log>")
    driver_version = _text(root, "driver_version")
    if driver_version is None:
        raise SmiXmlError("no <driver_version>")
    cuda = _text(root, "cuda_version")
    cuda_int = 0
    if cuda is not None and re.fullmatch(r"\d+\.\d+", cuda):
        major, minor = (int(x) for x in cuda.split("."))
        cuda_int = 1000 * major + 10 * minor
    driver = DriverInfo(
        driver_version=driver_version,
        nvml_version=f"{cuda_int // 1000}.{driver_version}" if cuda_int else driver_version,
        cuda_driver_version=cuda_int,
    )
    gpus_el = root.findall("gpu")
    if not gpus_el:
        raise SmiXmlError("no <gpu> elements")
    gpus = [_inventory(i, g) for i, g in enumerate(gpus_el)]
    seen: set[str] = set()
    for g in gpus:
        for key in (g.uuid, g.pci_bus_id):
            if key in seen:
                raise SmiXmlError(f"two GPUs with {'uuid' if key == g.uuid else 'PCI bus id'} {key}")
            seen.add(key)
    return SmiHost(driver=driver, gpus=gpus, samples=[_sample(g) for g in gpus_el])


def load_smi_xml(path: str | os.PathLike[str]) -> SmiHost:
    """Read and parse an ``nvidia-smi -q -x`` file."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise SmiXmlError(f"cannot read {path}: {e.strerror or e}") from e
    try:
        return parse_smi_xml(data)
    except SmiXmlError as e:
        raise SmiXmlError(f"{path}: {e}") from e


def builtin_host() -> SmiHost:
    """The packaged 8x H100 80GB HBM3 inventory (sim/fake/data/h100-8gpu-idle.xml)."""
    return load_smi_xml(Path(__file__).with_name("data") / "h100-8gpu-idle.xml")
