"""Topology collector: map each InfiniBand/RoCE NIC to its nearest GPUs through the PCI tree.

In sysfs every PCI function is a directory under ``devices/pci<domain>:<bus>/``
nested below the bridges it sits behind (root port, PCIe switch ports), and
``bus/pci/devices/<addr>`` and ``class/infiniband/<dev>/device`` are symlinks to
those directories. A NIC's nearest GPUs are the GPUs whose PCI paths share the
deepest common ancestor with the NIC's path (ties: all of them); a NIC with no
PCI ancestor in common with any GPU gets no mapping.

Symlinks are resolved inside the given sysfs root (relative targets against the
link's directory, absolute ``/sys/...`` targets re-rooted), never against the
real ``/sys``, so a fake tree or a chroot'ed copy works. The mapping is computed
once and reused until the set of GPUs or NICs changes.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from collections.abc import Callable, Iterable
from typing import NamedTuple, cast

from prometheus_client.core import GaugeMetricFamily, Metric

from gpufleet.vocab import catalog

log = logging.getLogger(__name__)

_SPEC = catalog.spec("gpufleet_nic_gpu_info")
#: A PCI function address as sysfs writes it: domain:bus:device.function.
PCI_ADDR_RE = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
#: A PCI host bridge (root complex) directory: pci<domain>:<bus>.
PCI_ROOT_RE = re.compile(r"^pci[0-9a-f]{4,8}:[0-9a-f]{2}$")
_NVML_BUS_ID_RE = re.compile(r"^([0-9a-fA-F]{1,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
_MAX_LINKS = 40  # the kernel's own limit on symlinks followed in one lookup


class NicGpu(NamedTuple):
    device: str  # NIC (InfiniBand device name, e.g. mlx5_0)
    gpu: str  # GPU index
    pci_bus_id: str  # the NIC's PCI address (sysfs form)
    common_ancestor: str  # deepest PCI bridge/root shared by the NIC and the GPU


def sysfs_pci_address(nvml_bus_id: str) -> str | None:
    """NVML's ``"00000000:18:00.0"`` -> sysfs's ``"0000:18:00.0"`` (None if malformed)."""
    m = _NVML_BUS_ID_RE.match(nvml_bus_id.strip())
    if m is None:
        return None
    domain, bus, dev, fn = m.groups()
    return f"{int(domain, 16):04x}:{bus.lower()}:{dev.lower()}.{fn}"


def resolve_in_root(root: str, path: str) -> list[str] | None:
    """Resolve ``path`` (relative to ``root``) following symlinks *inside* ``root``.

    Returns the components of the real path relative to ``root``, or None if any
    component does not exist, a symlink loops, or the path cannot be read.
    ``..`` never climbs above ``root``; an absolute link target is taken
    relative to ``root`` after removing a leading ``/sys``.
    """
    pending = list(reversed(path.split("/")))
    done: list[str] = []
    links = 0
    while pending:
        comp = pending.pop()
        if comp in ("", "."):
            continue
        if comp == "..":
            if done:
                done.pop()
            continue
        here = os.path.join(root, *done, comp)
        try:
            target = os.readlink(here)
        except OSError as e:
            if e.errno == errno.EINVAL:  # exists and is not a symlink
                done.append(comp)
                continue
            return None  # missing (ENOENT), not a directory (ENOTDIR), unreadable
        links += 1
        if links > _MAX_LINKS:
            log.debug("too many symlinks resolving %s under %s", path, root)
            return None
        if target.startswith("/"):
            done = []
            if target == "/sys" or target.startswith("/sys/"):
                target = target[len("/sys"):]
        pending.extend(reversed(target.split("/")))
    return done


def _pci_chain(components: list[str] | None) -> list[str] | None:
    """The PCI path of a resolved device directory, ending at its PCI function, or None if it has none.

    A device that is a child of a PCI function (an mlx5 sub-function on the auxiliary bus, a virtio
    device) is placed at that function.
    """
    if not components:
        return None
    for i in range(len(components) - 1, -1, -1):
        if PCI_ADDR_RE.match(components[i]):
            return components[: i + 1]
    return None


def _common_pci_ancestor(a: list[str], b: list[str]) -> tuple[int, str] | None:
    """(depth, name) of the deepest PCI bridge or host bridge that is an ancestor of both paths."""
    depth = 0
    for x, y in zip(a[:-1], b[:-1], strict=False):
        if x != y:
            break
        depth += 1
    for i in range(depth - 1, -1, -1):
        name = a[i]
        if PCI_ADDR_RE.match(name) or PCI_ROOT_RE.match(name):
            return i + 1, name
    return None


def nic_gpu_mapping(sysfs_path: str, gpu_bus_ids: dict[str, str], nics: Iterable[str]) -> list[NicGpu]:
    """Map every NIC to its nearest GPUs (see the module docstring)."""
    gpus: dict[str, list[str]] = {}
    for gpu, bus_id in gpu_bus_ids.items():
        addr = sysfs_pci_address(bus_id)
        if addr is None:
            log.debug("GPU %s: unparsable PCI bus id %r", gpu, bus_id)
            continue
        chain = _pci_chain(resolve_in_root(sysfs_path, f"bus/pci/devices/{addr}"))
        if chain is None:
            log.debug("GPU %s: no PCI device %s under %s", gpu, addr, sysfs_path)
            continue
        gpus[gpu] = chain
    out: list[NicGpu] = []
    for nic in nics:
        chain = _pci_chain(resolve_in_root(sysfs_path, f"class/infiniband/{nic}/device"))
        if chain is None:
            log.debug("NIC %s: no PCI device link under %s", nic, sysfs_path)
            continue
        best: list[tuple[str, str]] = []
        best_depth = 0
        for gpu, gchain in gpus.items():
            common = _common_pci_ancestor(chain, gchain)
            if common is None:
                continue
            depth, name = common
            if depth > best_depth:
                best, best_depth = [(gpu, name)], depth
            elif depth == best_depth:
                best.append((gpu, name))
        out.extend(NicGpu(nic, gpu, chain[-1], name) for gpu, name in best)
    return sorted(out, key=lambda m: (m.device, gpu_index_key(m.gpu)))


def gpu_index_key(gpu: str) -> tuple[int, str]:
    """Sort key for ``gpu`` label values: numeric indices in order, anything else after them."""
    return (int(gpu), gpu) if gpu.isdigit() else (1 << 30, gpu)


def ib_device_names(sysfs_path: str) -> tuple[str, ...]:
    """The InfiniBand/RoCE devices under ``class/infiniband``, sorted (none when the class is absent)."""
    try:
        return tuple(sorted(os.listdir(os.path.join(sysfs_path, "class", "infiniband"))))
    except OSError:
        return ()


class TopologyCollector:
    """``gpufleet_nic_gpu_info``: each NIC's nearest GPUs by PCI topology."""

    name = "topology"

    def __init__(self, sysfs_path: str, gpu_bus_ids: Callable[[], dict[str, str]]) -> None:
        self.sysfs_path = sysfs_path
        self._gpu_bus_ids = gpu_bus_ids
        self._key: tuple[tuple[tuple[str, str], ...], tuple[str, ...]] | None = None
        self._mapping: list[NicGpu] = []

    def describe(self) -> Iterable[Metric]:
        return [_SPEC.family()]

    def mapping(self) -> list[NicGpu]:
        """The current mapping, recomputed only when the set of GPUs or NICs changed."""
        nics = ib_device_names(self.sysfs_path)
        gpus = self._gpu_bus_ids()
        key = (tuple(sorted(gpus.items())), nics)
        if key != self._key:
            self._mapping = nic_gpu_mapping(self.sysfs_path, gpus, nics) if nics and gpus else []
            self._key = key
            log.debug("NIC-GPU mapping: %s", self._mapping)
        return self._mapping

    def collect(self) -> Iterable[Metric]:
        mapping = self.mapping()
        if not mapping:
            return []
        fam = cast(GaugeMetricFamily, _SPEC.family())
        for m in mapping:
            fam.add_metric([m.device, m.gpu, m.pci_bus_id, m.common_ancestor], 1.0)
        return [fam]
