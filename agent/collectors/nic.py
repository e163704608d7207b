"""NIC collector: InfiniBand/RoCE ports from sysfs and Ethernet interfaces from psutil.

InfiniBand and RoCE devices live under ``<sysfs>/class/infiniband/<device>/``
(``hca_type``, ``fw_ver``, ``board_id``) with one directory per port in
``ports/<n>/``: ``rate`` ("400 Gb/sec (4X NDR)"), ``state`` ("4: ACTIVE"),
``phys_state`` ("5: LinkUp"), ``link_layer``, the PMA counters in ``counters/``
(``port_xmit_data`` and ``port_rcv_data`` count 4-byte words) and the driver's
``hw_counters/`` (mlx5: ECN/CNP, retransmits, sequence errors, ...).

Every scrape makes one pass over the tree; the port attributes and counter files
stay open between scrapes and are re-read with ``pread`` (:mod:`.sysfsfiles`). A
missing tree yields no InfiniBand series; a file that is missing, unreadable or
does not hold what it should drops that one series (logged at debug) and never
becomes a zero.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpufleet.agent.collectors.series import SeriesCache
from gpufleet.agent.collectors.sysfsfiles import SysfsFiles
from gpufleet.agent.vocab import catalog

log = logging.getLogger(__name__)

Family = GaugeMetricFamily | CounterMetricFamily

_INFO = "gpufleet_ib_port_info"
_RATE = "gpufleet_ib_port_rate_bytes_per_second"
_STATE = "gpufleet_ib_port_state_id"
_PHYS = "gpufleet_ib_port_physical_state_id"
_TX_BYTES = "gpufleet_ib_port_transmit_bytes_total"
_RX_BYTES = "gpufleet_ib_port_receive_bytes_total"
_TX_PKTS = "gpufleet_ib_port_transmit_packets_total"
_RX_PKTS = "gpufleet_ib_port_receive_packets_total"
_TX_WAIT = "gpufleet_ib_port_transmit_wait_total"
_ERRORS = "gpufleet_ib_port_errors_total"
_HW = "gpufleet_ib_hw_counters_total"
_NET_BYTES = "gpufleet_net_bytes_total"
_NET_PKTS = "gpufleet_net_packets_total"
_NET_ERRS = "gpufleet_net_errors_total"
_NET_DROPS = "gpufleet_net_drops_total"

#: counters/ file -> (metric, multiplier). The data counters count 4-byte words.
_PORT_COUNTERS: tuple[tuple[str, str, int], ...] = (
    ("port_xmit_data", _TX_BYTES, 4),
    ("port_rcv_data", _RX_BYTES, 4),
    ("port_xmit_packets", _TX_PKTS, 1),
    ("port_rcv_packets", _RX_PKTS, 1),
    ("port_xmit_wait", _TX_WAIT, 1),
)
_COUNTER_FILES = tuple(f for f, _, _ in _PORT_COUNTERS) + catalog.IB_PORT_ERRORS
#: Files in hw_counters/ that are not counters (lifespan: the driver's cache lifetime in ms).
_HW_NOT_COUNTERS = frozenset({"lifespan"})
_DEVICE_INFO = ("hca_type", "board_id", "fw_ver")
_PORT_ATTRS = ("link_layer", "rate", "state", "phys_state")
_READ_SIZE = 256
_O_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
_RATE_RE = re.compile(rb"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)b/sec\b")
_RATE_SCALE = {b"": 1.0, b"K": 1e3, b"M": 1e6, b"G": 1e9, b"T": 1e12}
_STATE_RE = re.compile(rb"^\s*(\d+)\s*:")

INFINIBAND_CLASS = os.path.join("class", "infiniband")


def read_raw(path: str, dir_fd: int | None = None) -> bytes | None:
    """The stripped contents of a small sysfs file, or None if it cannot be read.

    ``dir_fd`` opens ``path`` relative to an open directory (cheaper than a full path walk).
    """
    try:
        fd = os.open(path, _O_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        log.debug("cannot open %s: %s", path, e)
        return None
    try:
        return os.read(fd, _READ_SIZE).strip()
    except OSError as e:
        log.debug("cannot read %s: %s", path, e)
        return None
    finally:
        os.close(fd)


def open_dir(path: str, dir_fd: int | None = None) -> int | None:
    """A directory file descriptor (close it!), or None if ``path`` is not an openable directory."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY, dir_fd=dir_fd)
    except OSError:
        return None


def read_kept_counters(files: SysfsFiles, path: str, names: Iterable[str]) -> list[tuple[str, int]] | None:
    """``(name, value)`` for each file in ``names`` under directory ``path`` that holds a non-negative
    decimal integer, read through ``files`` (descriptors kept open across scrapes); the others are skipped and logged
    at debug. None if the directory is not there."""
    read = files.read(path, names)
    if read is None:
        return None
    out: list[tuple[str, int]] = []
    for name, raw in read:
        if isinstance(raw, OSError):
            log.debug("%s/%s: %s", path, name, raw.strerror)
        elif raw.isdigit():
            out.append((name, int(raw)))
        else:
            log.debug("%s/%s: not a counter: %r", path, name, raw[:40])
    return out


def parse_rate(raw: bytes | None) -> float | None:
    """``"400 Gb/sec (4X NDR)"`` -> bytes per second (5e10); None if unparsable."""
    if raw is None:
        return None
    m = _RATE_RE.match(raw)
    if m is None:
        return None
    return float(m.group(1)) * _RATE_SCALE[m.group(2)] / 8.0


def parse_state(raw: bytes | None) -> int | None:
    """``"4: ACTIVE"`` -> 4; None if unparsable."""
    if raw is None:
        return None
    m = _STATE_RE.match(raw)
    return int(m.group(1)) if m else None


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _text(raw: bytes | None) -> str:
    return raw.decode("utf-8", "replace") if raw is not None else ""


class NicCollector:
    """InfiniBand/RoCE ports under ``<sysfs_path>/class/infiniband`` plus psutil's per-NIC counters."""

    name = "nic"

    def __init__(self, sysfs_path: str = "/sys") -> None:
        self.sysfs_path = sysfs_path
        self.ib_root = os.path.join(sysfs_path, INFINIBAND_CLASS)
        self._specs = {s.name: s for s in catalog.by_group("nic")}
        self._info_cache: dict[str, tuple[int, list[str]]] = {}
        #: Label sets built once; unchanged values (most error counters) keep their sample.
        self._put = SeriesCache(self._specs.values()).put
        #: Counter files re-read with pread on descriptors kept open (sysfsfiles).
        self._files = SysfsFiles()

    def close(self) -> None:
        self._files.close()

    def describe(self) -> Iterable[Metric]:
        return [s.family() for s in self._specs.values()]

    def collect(self) -> Iterable[Metric]:
        fams = {name: s.family() for name, s in self._specs.items()}
        self._collect_ib(fams)
        self._files.sweep()
        self._collect_net(fams)
        return [f for f in fams.values() if f.samples]

    # ------------------------------------------------------------------ InfiniBand / RoCE
    def _device_info(self, device: str, dfd: int) -> list[str]:
        """hca_type, board_id, fw_ver: read once per device instance (a driver reload or firmware
        reset re-creates the sysfs directory, with a new inode, and they are read again)."""
        try:
            ino = os.fstat(dfd).st_ino
        except OSError:
            ino = -1
        cached = self._info_cache.get(device)
        if cached is not None and cached[0] == ino:
            return cached[1]
        info = [_text(read_raw(attr, dfd)) for attr in _DEVICE_INFO]
        if all(info) and ino != -1:  # a device still being set up is read again next time
            self._info_cache[device] = (ino, info)
        return info

    def _collect_ib(self, fams: dict[str, Family]) -> None:
        for device in _listdir(self.ib_root):
            dfd = open_dir(os.path.join(self.ib_root, device))
            if dfd is None:
                continue
            try:
                info = self._device_info(device, dfd)
                pfd = open_dir("ports", dfd)
                if pfd is None:
                    continue
                try:
                    for port in sorted(os.listdir(pfd)):
                        fd = open_dir(port, pfd)
                        if fd is not None:
                            try:
                                self._collect_port(fams, device, port, fd, info)
                            finally:
                                os.close(fd)
                finally:
                    os.close(pfd)
            finally:
                os.close(dfd)

    def _collect_port(self, fams: dict[str, Family], device: str, port: str, pfd: int, info: list[str]) -> None:
        where = f"{self.ib_root}/{device}/ports/{port}"
        put = self._put
        labels = (device, port)
        hca_type, board_id, fw_ver = info
        attrs = {n: v for n, v in self._files.read(where, _PORT_ATTRS) or () if isinstance(v, bytes)}
        link_layer = _text(attrs.get("link_layer"))
        put(fams[_INFO], (device, port, link_layer, hca_type, board_id, fw_ver), 1.0)

        raw = attrs.get("rate")
        rate = parse_rate(raw)
        if rate is not None:
            put(fams[_RATE], labels, rate)
        elif raw is not None:
            log.debug("%s/rate: not a port rate: %r", where, raw[:40])
        for fname, metric in (("state", _STATE), ("phys_state", _PHYS)):
            raw = attrs.get(fname)
            value = parse_state(raw)
            if value is not None:
                put(fams[metric], labels, float(value))
            elif raw is not None:
                log.debug("%s/%s: not a port state: %r", where, fname, raw[:40])

        if (counted := read_kept_counters(self._files, where + "/counters", _COUNTER_FILES)) is not None:
            found = dict(counted)
            for fname, metric, mult in _PORT_COUNTERS:
                count = found.get(fname)
                if count is not None:
                    put(fams[metric], labels, float(count * mult))
            errors = fams[_ERRORS]
            for fname in catalog.IB_PORT_ERRORS:
                count = found.get(fname)
                if count is not None:
                    put(errors, (device, port, fname), float(count))

        listed = self._files.listdir(hpath := where + "/hw_counters")
        if listed is not None:
            names = [n for n in listed if n not in _HW_NOT_COUNTERS and n[:1] != "."]
            hw = read_kept_counters(self._files, hpath, names) or []
            hw_fam = fams[_HW]
            for fname, count in hw:
                put(hw_fam, (device, port, fname), float(count))

    # ------------------------------------------------------------------ Ethernet (psutil)
    def _collect_net(self, fams: dict[str, Family]) -> None:
        try:
            counters = psutil.net_io_counters(pernic=True)
        except (OSError, RuntimeError) as e:
            log.warning("psutil.net_io_counters failed: %s", e)
            return
        for iface in sorted(counters):
            if iface == "lo":
                continue
            c = counters[iface]
            for metric, tx, rx in (
                (_NET_BYTES, c.bytes_sent, c.bytes_recv),
                (_NET_PKTS, c.packets_sent, c.packets_recv),
                (_NET_ERRS, c.errout, c.errin),
                (_NET_DROPS, c.dropout, c.dropin),
            ):
                self._put(fams[metric], (iface, "transmit"), float(tx))
                self._put(fams[metric], (iface, "receive"), float(rx))

