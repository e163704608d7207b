"""What ``nvidia-smi -q -x`` says about a GPU's MIG mode, its processes and whether NVML sees its NVLinks.

Made to match the first real GPU the agent ran on (an H200 passed alone into a VM, driver 580,
tests/gpu/results/h200-gvisor-580/): its NVML answered nvmlDeviceGetMigMode (Disabled/Disabled)
and the running-process list, and NOT_SUPPORTED for every NVLink call, while the capture's
product name alone made the fake serve 18 NVLinks.

* MIG mode: ``<mig_mode><current_mig>``/``<pending_mig>`` "Enabled"/"Disabled"; "N/A" (a GPU
  without MIG) or a missing element is ``None`` (NOT_SUPPORTED). The MIG devices of a capture taken
  in MIG mode are not read (the ``mig:`` spec models MIG layouts).
* Processes: ``<processes>`` holds one ``<process_info>`` per compute process (``pid``,
  ``used_memory`` "N MiB", in MIG mode ``gpu_instance_id``/``compute_instance_id``); an empty
  element is no process (NVML answered an empty list), "N/A" or no element at all is ``None``
  (NOT_SUPPORTED). The processes are those of the capture and do not change.
* NVLink presence: nvidia-smi ``-q`` prints no NVLink section, so the link count comes from the
  product table (:func:`gpufleet.agent.nvml.hardware.nvlink_count`). On the architectures that
  report an NVLink fabric (Hopper and newer), a GPU whose ``<fabric><state>`` is "N/A" is not in
  one: NVML answered NOT_SUPPORTED for its NVLinks (the H200 passed alone into a VM); its count is
  0. Where the state is a word (Not Started, In Progress, Completed: the HGX/DGX captures) or the
  element is absent (drivers before 535) the product table stands. Ampere and older report no
  fabric, so their "N/A" says nothing about NVLinks.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from gpufleet.agent.nvml import hardware
from gpufleet.agent.nvml.model import ProcessSample
from gpufleet.sim.fake.smi_text import NA
from gpufleet.sim.fake.smi_text import text as _text

_MODES = {"enabled": 1, "disabled": 0}
_MIB = re.compile(r"^\s*(\d+)\s*MiB\s*$")



def mig_mode(gpu: ET.Element) -> tuple[int | None, int | None]:
    """(current, pending) MIG mode: 1 enabled, 0 disabled, None not supported."""
    current = _MODES.get((_text(gpu, "mig_mode/current_mig") or "").lower())
    if current is None:
        return None, None
    pending = _MODES.get((_text(gpu, "mig_mode/pending_mig") or "").lower())
    return current, current if pending is None else pending


def _id(el: ET.Element, name: str) -> int | None:
    t = _text(el, name)
    return int(t) if t is not None and t.isdigit() else None


def processes(gpu: ET.Element) -> list[ProcessSample] | None:
    """The captured compute processes; None when the capture has no process list."""
    el = gpu.find("processes")
    if el is None or (el.text or "").strip() in NA[1:]:
        return None
    out: list[ProcessSample] = []
    for p in el.findall("process_info"):
        pid = _id(p, "pid")
        if pid is None:
            continue  # a process without a pid is no process NVML would list
        mem = _MIB.match(_text(p, "used_memory") or "")
        out.append(ProcessSample(pid=pid, used_memory_bytes=None if mem is None else int(mem.group(1)) * 2**20,
                                 gpu_instance_id=_id(p, "gpu_instance_id"),
                                 compute_instance_id=_id(p, "compute_instance_id")))
    return out


def nvlink_count(gpu: ET.Element, architecture: int, name: str) -> int:
    """The NVLinks NVML would answer for: the product's, but none outside a fabric (see the module docstring)."""
    count = hardware.nvlink_count(name)
    fabric = gpu.find("fabric")
    if count and architecture in hardware.FABRIC_ARCHITECTURES and fabric is not None and \
            _text(fabric, "state") is None:
        return 0
    return count
