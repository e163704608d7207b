"""What NVML would report about a GPU model that ``nvidia-smi -q -x`` does not print.

One place for product knowledge: the architecture ids NVML defines
(``NVML_DEVICE_ARCH_*``, by name from pynvml), the CUDA compute capability of
each architecture and of the products where it differs within one, and the
number of NVLinks each product has (``nvidia-smi -q`` lists none).

Unknown stays unknown: an architecture nvidia-smi names that NVML does not
define is :data:`ARCH_UNKNOWN` (what NVML itself answers), an unknown compute
capability is ``None`` (the fake NVML answers NOT_SUPPORTED), and a product not
in the NVLink table has no NVLinks (PCIe boards; NVLink bridges do not show in
a capture).
"""

from __future__ import annotations

import re

import pynvml


def _arch(name: str, value: int) -> int:
    # By name from pynvml; the value is NVML's, for bindings older than the architecture.
    return int(getattr(pynvml, f"NVML_DEVICE_ARCH_{name}", value))


ARCH_KEPLER = _arch("KEPLER", 2)
ARCH_MAXWELL = _arch("MAXWELL", 3)
ARCH_PASCAL = _arch("PASCAL", 4)
ARCH_VOLTA = _arch("VOLTA", 5)
ARCH_TURING = _arch("TURING", 6)
ARCH_AMPERE = _arch("AMPERE", 7)
ARCH_ADA = _arch("ADA", 8)
ARCH_HOPPER = _arch("HOPPER", 9)
ARCH_BLACKWELL = _arch("BLACKWELL", 10)
ARCH_DLA = _arch("DLA", 11)
ARCH_DLA2 = _arch("DLA2", 12)
ARCH_RUBIN = _arch("RUBIN", 13)
ARCH_NPU3 = _arch("NPU3", 15)
ARCH_UNKNOWN = _arch("UNKNOWN", 0xFFFFFFFF)

#: NVML architecture id -> the ``architecture`` label value. UNKNOWN has none (no label).
ARCHITECTURES: dict[int, str] = {
    ARCH_KEPLER: "kepler",
    ARCH_MAXWELL: "maxwell",
    ARCH_PASCAL: "pascal",
    ARCH_VOLTA: "volta",
    ARCH_TURING: "turing",
    ARCH_AMPERE: "ampere",
    ARCH_ADA: "ada",
    ARCH_HOPPER: "hopper",
    ARCH_BLACKWELL: "blackwell",
    ARCH_DLA: "dla",
    ARCH_DLA2: "dla2",
    ARCH_RUBIN: "rubin",
    ARCH_NPU3: "npu3",
}

#: nvidia-smi's ``<product_architecture>`` (lower case) -> NVML id, where it is not the label itself.
_SMI_NAMES = {"ada lovelace": ARCH_ADA}

#: Architectures whose data-center GPUs have GPU Performance Monitoring (nvmlGpmQueryDeviceSupport).
GPM_ARCHITECTURES = frozenset({ARCH_HOPPER, ARCH_BLACKWELL, ARCH_RUBIN})

#: Architectures whose NVLink GPUs report an NVLink fabric (nvmlDeviceGetGpuFabricInfo, nvidia-smi's
#: ``<fabric><state>``): where such a GPU's capture says N/A there, its NVLinks are not usable by NVML.
FABRIC_ARCHITECTURES = frozenset({ARCH_HOPPER, ARCH_BLACKWELL, ARCH_RUBIN})

#: The memory (HBM) temperature limit in Celsius: NVML_TEMPERATURE_THRESHOLD_MEM_MAX where the memory
#: T.Limit margin is 0. Seen as 95 both where nvidia-smi prints it absolutely (A100, driver 570) and from
#: the real H200's NVML (driver 580, whose nvidia-smi prints only ``gpu_temp_max_mem_tlimit_threshold`` 0 C).
MEMORY_TLIMIT_C = 95

#: Compute capability of an architecture whose products all share one (or whose exceptions
#: are listed in _PRODUCTS); architectures left out have no single answer.
_ARCH_COMPUTE_CAPABILITY: dict[int, tuple[int, int]] = {
    ARCH_MAXWELL: (5, 2),  # M4, M6, M40, M60, GTX 9xx; M10 / GTX 750 are 5.0
    ARCH_PASCAL: (6, 1),  # P4, P6, P40, GTX 10xx, Quadro P; P100 is 6.0
    ARCH_VOLTA: (7, 0),
    ARCH_TURING: (7, 5),
    ARCH_AMPERE: (8, 6),  # A2, A10, A16, A40, RTX A-series, RTX 30xx; GA100 parts are 8.0
    ARCH_ADA: (8, 9),
    ARCH_HOPPER: (9, 0),
}

_Cc = tuple[int, int] | None

#: (product-name pattern, compute capability or None to use the architecture's, NVLink count),
#: first match wins. Names as nvidia-smi prints them (``<product_name>``).
_PRODUCTS: list[tuple[re.Pattern[str], _Cc, int]] = [
    (re.compile(p, re.I), cc, links)
    for p, cc, links in (
        # Kepler has no single compute capability.
        (r"\bK80\b", (3, 7), 0),
        (r"\bK(20X?|40)[cmsx]?\b|\bK6000\b|GTX TITAN\b(?! X)|GTX 78", (3, 5), 0),
        (r"\bK10\b|GRID K[12]\b|GTX 6[0-9]{2}", (3, 0), 0),
        (r"\bM10\b|GTX 75", (5, 0), 0),
        (r"\bP100-SXM2", (6, 0), 4),
        (r"\bP100\b", (6, 0), 0),
        (r"\bV100S?-SXM[23]", None, 6),
        (r"\bA800-SXM4", (8, 0), 8),
        (r"\bA100-SXM4", (8, 0), 12),
        (r"\bA(100|800|30)\b", (8, 0), 0),  # PCIe boards
        (r"\bH800\b(?!.*(PCIe|NVL))", None, 8),
        (r"\bG?H(100|200|20)\b(?!.*(PCIe|NVL))", None, 18),  # SXM5 / Grace Hopper
        (r"\bG?B300\b", (10, 3), 18),
        (r"\bG?B(100|200)\b", (10, 0), 18),
        (r"\bGB10\b", (12, 1), 0),  # DGX Spark
        (r"\bRTX\b.*\bBlackwell\b|\bRTX 50[0-9]{2}\b", (12, 0), 0),
    )
]


def architecture_id(smi_name: str | None) -> int:
    """NVML's id for nvidia-smi's ``<product_architecture>`` text; ARCH_UNKNOWN if unknown."""
    if smi_name is None:
        return ARCH_UNKNOWN
    key = " ".join(smi_name.split()).lower()
    if key in _SMI_NAMES:
        return _SMI_NAMES[key]
    for arch, label in ARCHITECTURES.items():
        if label == key:
            return arch
    return ARCH_UNKNOWN


def architecture_label(arch: int | None) -> str:
    """The ``architecture`` label value: the name, or "" for unknown (0 included: no NVML id is 0)."""
    return "" if arch is None else ARCHITECTURES.get(arch, "")


def _product(name: str) -> tuple[_Cc, int] | None:
    for pattern, cc, links in _PRODUCTS:
        if pattern.search(name):
            return cc, links
    return None


def compute_capability(arch: int, name: str) -> tuple[int, int] | None:
    """CUDA compute capability of product ``name`` of architecture ``arch``; None when not known."""
    hit = _product(name)
    if hit is not None and hit[0] is not None:
        return hit[0]
    return _ARCH_COMPUTE_CAPABILITY.get(arch)


def gpm_supported(arch: int, name: str) -> bool:
    """GPM is for "fully supported" (data-center) GPUs of Hopper and newer, not GeForce boards."""
    return arch in GPM_ARCHITECTURES and "geforce" not in name.lower()


def nvlink_count(name: str) -> int:
    """The NVLinks product ``name`` has (0 for PCIe boards and products not in the table)."""
    hit = _product(name)
    return 0 if hit is None else hit[1]
