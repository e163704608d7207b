"""Build fake sysfs trees for tests: an 8x H100 host's PCI hierarchy, GPU functions and InfiniBand devices.

The tree is written by the agent's one fake-sysfs writer (:mod:`gpufleet.sim.fake.sysfs`), in
the kernel's layout: every PCI function is a directory nested under ``devices/pci<domain>:<bus>/``
below its bridges; ``bus/pci/devices/<addr>`` is a relative symlink ``../../../devices/...``; an
InfiniBand device lives in ``<pci function>/infiniband/<name>/``, ``class/infiniband/<name>`` links
there (``../../devices/...``) and its ``device`` link points back to the function
(``../../../<addr>``). ``absolute=True`` writes absolute ``/sys/...`` targets instead (as some
container runtimes and bind mounts do).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gpufleet.sim.fake import sysfs


def add_pci_function(root: Path, chain: list[str], *, absolute: bool = False) -> Path:
    """Create ``devices/<chain...>`` (chain = host bridge, bridges..., function) and its bus/pci link."""
    return sysfs.add_pci_function(root, chain, files={"vendor": "0x10de"}, absolute=absolute)


def add_ib_device(root: Path, name: str, chain: list[str], *, absolute: bool = False,
                  link_layer: str = "InfiniBand") -> Path:
    """An InfiniBand device on the PCI function at ``chain`` (created if needed), with one active port."""
    fn = root.joinpath("devices", *chain)
    if not fn.exists():
        add_pci_function(root, chain, absolute=absolute)
    dev = sysfs.add_ib_device(root, name, fn, absolute=absolute,
                              files={"hca_type": "MT4129", "fw_ver": "28.41.1000", "board_id": "MT_0000000838"})
    sysfs.add_port(dev, 1, files={"rate": "400 Gb/sec (4X NDR)", "state": "4: ACTIVE", "phys_state": "5: LinkUp",
                                  "link_layer": link_layer},
                   counters={"port_xmit_data": 1000, "port_rcv_data": 2000}, hw_counters={"lifespan": 10})
    return dev


def nvml_bus_id(addr: str) -> str:
    """sysfs ``"0000:9c:00.0"`` -> NVML ``"00000000:9C:00.0"``."""
    domain, rest = addr.split(":", 1)
    return f"{int(domain, 16):08X}:{rest.upper()}"


@dataclass
class Node:
    root: Path
    gpus: dict[str, str] = field(default_factory=dict)  # gpu index -> NVML bus id
    nics: dict[str, str] = field(default_factory=dict)  # NIC name -> sysfs PCI address

    def gpu_bus_ids(self) -> dict[str, str]:
        return dict(self.gpus)


def _sw(root_bus: str, *bridges: str) -> list[str]:
    return [f"pci0000:{root_bus}", *(f"0000:{b}" for b in bridges)]


#: An 8x H100 HGX-like host: four PCIe switches behind four host bridges. GPU and NIC
#: placement (chains are host bridge, root port, switch ports..., function):
#:   switch A: GPU0, GPU1, mlx5_0          switch B: GPU2, GPU3, mlx5_1; mlx5_2 on another root port
#:   switch C: two second-level switches, each with one GPU and one NIC (GPU4+mlx5_4, GPU5+mlx5_5)
#:   switch D: GPU6, GPU7 and a dual-port card mlx5_6/mlx5_7 (functions .0 and .1)
#:   mlx5_bond_0 (RoCE, management) on pci0000:00 where there is no GPU.
H100_GPUS: dict[str, list[str]] = {
    "0": _sw("15", "15:01.0", "16:00.0", "17:00.0", "18:00.0"),
    "1": _sw("15", "15:01.0", "16:00.0", "17:01.0", "19:00.0"),
    "2": _sw("37", "37:01.0", "38:00.0", "39:00.0", "3a:00.0"),
    "3": _sw("37", "37:01.0", "38:00.0", "39:01.0", "3b:00.0"),
    "4": _sw("97", "97:01.0", "98:00.0", "99:00.0", "9a:00.0", "9b:00.0", "9c:00.0"),
    "5": _sw("97", "97:01.0", "98:00.0", "99:01.0", "a0:00.0", "a1:00.0", "a2:00.0"),
    "6": _sw("b7", "b7:01.0", "b8:00.0", "b9:00.0", "ba:00.0"),
    "7": _sw("b7", "b7:01.0", "b8:00.0", "b9:01.0", "bb:00.0"),
}
H100_NICS: dict[str, list[str]] = {
    "mlx5_0": _sw("15", "15:01.0", "16:00.0", "17:02.0", "1a:00.0"),
    "mlx5_1": _sw("37", "37:01.0", "38:00.0", "39:02.0", "3c:00.0"),
    "mlx5_2": _sw("37", "37:02.0", "3e:00.0"),
    "mlx5_4": _sw("97", "97:01.0", "98:00.0", "99:00.0", "9a:00.0", "9b:01.0", "9d:00.0"),
    "mlx5_5": _sw("97", "97:01.0", "98:00.0", "99:01.0", "a0:00.0", "a1:01.0", "a3:00.0"),
    "mlx5_6": _sw("b7", "b7:01.0", "b8:00.0", "b9:02.0", "bc:00.0"),
    "mlx5_7": _sw("b7", "b7:01.0", "b8:00.0", "b9:02.0", "bc:00.1"),
    "mlx5_bond_0": _sw("00", "00:1c.0", "01:00.0"),
}


def build_h100_node(root: Path, *, absolute: bool = False) -> Node:
    """Write the :data:`H100_GPUS` / :data:`H100_NICS` host under ``root`` (the fake ``/sys``)."""
    node = Node(root)
    for gpu, chain in H100_GPUS.items():
        add_pci_function(root, chain, absolute=absolute)
        node.gpus[gpu] = nvml_bus_id(chain[-1])
    for nic, chain in H100_NICS.items():
        layer = "Ethernet" if "bond" in nic else "InfiniBand"
        add_ib_device(root, nic, chain, absolute=absolute, link_layer=layer)
        node.nics[nic] = chain[-1]
    return node
