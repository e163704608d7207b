"""Write a fake sysfs tree as the kernel lays it out: PCI functions under their bridges, InfiniBand devices.

The one writer of fake sysfs trees (the simulated host of ``--nvml.fake=sim``, the fleet
simulator's nodes, the tests), in the layout of a real host (see the H100 capture in
``tests/fixtures``):

* every PCI function is a directory ``devices/pci<domain>:<bus>/<bridge>/.../<function>``
  below the bridges it sits behind, and ``bus/pci/devices/<addr>`` links to it;
* an InfiniBand device lives in ``<function>/infiniband/<name>/``, ``class/infiniband/<name>``
  links there and its ``device`` link points back to the function (``../../../<addr>``);
* a port is ``<device>/ports/<n>/`` with its attribute files, ``counters/`` and ``hw_counters/``.

Links are relative (``../../../devices/...``) or, with ``absolute=True``, ``/sys/...`` (as some
container runtimes and bind mounts show them). Every function is idempotent (an existing tree
is completed, not rebuilt). :class:`ValueWriter` rewrites the values that change (counters) and
only those, in place as sysfs does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpufleet.vocab.sysfs import IN_PLACE_MARKER

#: The files of an mlx5 port's counters/ directory.
IB_COUNTER_FILES = (
    "VL15_dropped", "excessive_buffer_overrun_errors", "link_downed", "link_error_recovery",
    "local_link_integrity_errors", "multicast_rcv_packets", "multicast_xmit_packets", "port_rcv_constraint_errors",
    "port_rcv_data", "port_rcv_errors", "port_rcv_packets", "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors", "port_xmit_constraint_errors", "port_xmit_data", "port_xmit_discards",
    "port_xmit_packets", "port_xmit_wait", "symbol_error", "unicast_rcv_packets", "unicast_xmit_packets",
)
#: The error names the kernel prints in aer_dev_correctable and in aer_dev_nonfatal/aer_dev_fatal, in its order.
AER_CORRECTABLE = ("RxErr", "BadTLP", "BadDLLP", "Rollover", "Timeout", "NonFatalErr", "CorrIntErr", "HeaderOF")
AER_UNCORRECTABLE = (
    "Undefined", "DLP", "SDES", "TLP", "FCP", "CmpltTO", "CmpltAbrt", "UnxCmplt", "RxOF", "MalfTLP", "ECRC",
    "UnsupReq", "ACSViol", "UncorrIntErr", "BlockedTLP", "AtomicOpBlocked", "TLPBlockedErr", "PoisonTLPBlocked",
)


def aer_files(correctable: Mapping[str, int] | None = None, nonfatal: Mapping[str, int] | None = None,
              fatal: Mapping[str, int] | None = None, *, root_port: bool = False) -> dict[str, str]:
    """The AER statistics attributes of an AER-capable function (``name -> text``, for :func:`write_files`):
    one ``<ErrorName> <count>`` line per error type and the ``TOTAL_ERR_*`` line; with ``root_port``
    also ``aer_rootport_total_err_*`` (here: the same totals)."""
    out: dict[str, str] = {}
    totals: dict[str, int] = {}
    for fname, total, names, counts in (
            ("aer_dev_correctable", "TOTAL_ERR_COR", AER_CORRECTABLE, correctable),
            ("aer_dev_nonfatal", "TOTAL_ERR_NONFATAL", AER_UNCORRECTABLE, nonfatal),
            ("aer_dev_fatal", "TOTAL_ERR_FATAL", AER_UNCORRECTABLE, fatal)):
        values = counts or {}
        totals[fname] = sum(values.values())
        out[fname] = "\n".join([*(f"{n} {values.get(n, 0)}" for n in names), f"{total} {totals[fname]}"])
    if root_port:
        out["aer_rootport_total_err_cor"] = str(totals["aer_dev_correctable"])
        out["aer_rootport_total_err_nonfatal"] = str(totals["aer_dev_nonfatal"])
        out["aer_rootport_total_err_fatal"] = str(totals["aer_dev_fatal"])
    return out


def link_files(speed: str = "32.0 GT/s PCIe", width: int = 16, *, max_speed: str | None = None,
               max_width: int | None = None) -> dict[str, str]:
    """A PCIe function's link attributes (``current_link_speed`` ...; the maxima default to the current)."""
    return {"current_link_speed": speed, "current_link_width": str(width),
            "max_link_speed": max_speed or speed, "max_link_width": str(max_width or width)}


def _link(root: Path, link: Path, dest: Path, absolute: bool) -> None:
    """Make ``link`` point at ``dest`` (both inside ``root``), relative or as ``/sys/...``; keep an existing one."""
    if link.is_symlink():
        return
    link.parent.mkdir(parents=True, exist_ok=True)
    if absolute:
        os.symlink("/sys/" + dest.relative_to(root).as_posix(), link)
    else:
        os.symlink(os.path.relpath(dest, link.parent), link)


def write_files(directory: Path, files: Mapping[str, str]) -> None:
    """Write each ``name -> text`` under ``directory`` as a sysfs attribute (the text plus a newline)."""
    for name, text in files.items():
        (directory / name).write_text(text + "\n")


def add_pci_function(root: Path, chain: Sequence[str], *, files: Mapping[str, str] | None = None,
                     absolute: bool = False) -> Path:
    """``devices/<chain...>`` (chain: host bridge ``pci<domain>:<bus>``, bridges..., the function's address),
    its attribute ``files`` (``vendor``, ``class``...) and its ``bus/pci/devices`` link; returns its directory."""
    fn = root.joinpath("devices", *chain)
    fn.mkdir(parents=True, exist_ok=True)
    write_files(fn, files or {})
    _link(root, root / "bus" / "pci" / "devices" / chain[-1], fn, absolute)
    return fn


def add_ib_device(root: Path, name: str, function: Path, *, files: Mapping[str, str] | None = None,
                  absolute: bool = False) -> Path:
    """InfiniBand device ``name`` on the PCI function directory ``function`` (see :func:`add_pci_function`),
    with its attribute ``files`` (``hca_type``, ``fw_ver``...), its ``device`` link and its
    ``class/infiniband`` entry; returns the device directory (add ports with :func:`add_port`)."""
    dev = function / "infiniband" / name
    dev.mkdir(parents=True, exist_ok=True)
    write_files(dev, files or {})
    if absolute:
        _link(root, dev / "device", function, absolute=True)
    elif not (dev / "device").is_symlink():  # the kernel's form: up out of infiniband/<name>/ and the function
        os.symlink(f"../../../{function.name}", dev / "device")
    _link(root, root / "class" / "infiniband" / name, dev, absolute)
    return dev


def add_netdev(root: Path, function: Path, ifname: str, *, files: Mapping[str, str] | None = None) -> Path:
    """Network interface ``ifname`` of the PCI function directory ``function``: ``<function>/net/<ifname>``
    with its attribute ``files`` and the ``class/net/<ifname>`` link; returns its directory."""
    d = function / "net" / ifname
    d.mkdir(parents=True, exist_ok=True)
    write_files(d, files or {})
    _link(root, root / "class" / "net" / ifname, d, False)
    return d


def add_port(device: Path, port: int = 1, *, files: Mapping[str, str] | None = None,
             counters: Mapping[str, int] | None = None, hw_counters: Mapping[str, int] | None = None) -> Path:
    """Port ``port`` of an InfiniBand device: its attribute ``files`` (``rate``, ``state``, ``phys_state``,
    ``link_layer``...), ``counters/`` and ``hw_counters/`` with the given values; returns the port directory."""
    port_dir = device / "ports" / str(port)
    for sub, values in (("counters", counters), ("hw_counters", hw_counters)):
        (port_dir / sub).mkdir(parents=True, exist_ok=True)
        write_files(port_dir / sub, {k: str(v) for k, v in (values or {}).items()})
    write_files(port_dir, files or {})
    return port_dir


class ValueWriter:
    """Keeps files under ``root`` at given values, writing only those whose value changed.

    Every value is written the way sysfs shows a new one: in place, over the old text at the same inode (one
    pwrite, and an ftruncate when the new text is shorter; no rename, no truncate to zero, so ext4 does not
    flush), so a reader's kept descriptor reads it. After its first update it leaves
    :data:`~gpufleet.vocab.sysfs.IN_PLACE_MARKER` at ``root``: the agent may then read the tree as it
    reads sysfs. A reader between the pwrite and the ftruncate of a shorter text sees the new text followed
    by a newline and the old text's tail (``"99\\n45\\n"``): not a number, so no series for that read, never
    a wrong value.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._written: dict[str, str | int] = {}
        self._marked = False

    def forget(self) -> None:
        """Write every value again on the next :meth:`update` (the tree was rebuilt)."""
        self._written.clear()

    def update(self, values: Mapping[str, str | int]) -> None:
        """Bring each file (path relative to ``root``) to its value (text without the newline, or an int)."""
        written = self._written
        for rel, value in values.items():
            old = written.get(rel)
            if old == value:
                continue
            data = f"{value}\n".encode()
            # the length of the text there: unknown (the tree's builder wrote it) until this writer wrote it
            _write_in_place(self.root / rel, data, None if old is None else len(f"{old}\n".encode()))
            written[rel] = value
        if not self._marked:
            (self.root / IN_PLACE_MARKER).touch()
            self._marked = True


def _write_in_place(path: Path, data: bytes, old_len: int | None) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        os.pwrite(fd, data, 0)
        if old_len is None or len(data) < old_len:
            os.ftruncate(fd, len(data))
    finally:
        os.close(fd)
