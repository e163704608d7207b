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

What a scrape costs (the agent's own CPU per scrape has a budget): the devices' and ports' layout
(names, device identity, the ports' directories) is kept per device while the device directory is
the same one (its inode: a driver reload or firmware reset re-creates it) and, on a regular-file
tree, while ``ports/`` is unchanged (:func:`os.stat`); on sysfs the ports of a device never change
after it registered them (they are listed again only in its first :data:`~.sysfsfiles.RACY_SECONDS`).
A tree whose root holds :data:`~gpufleet.vocab.sysfs.IN_PLACE_MARKER` (the simulated host's: its
writer changes files in place, as sysfs does) is read as sysfs (:func:`read_as_sysfs`).
A scrape lists ``class/infiniband``, stats each device and reads the kept files; each file has
a slot with its series' label set, its last text and its last sample, so a file whose text did not
change costs a ``pread``, one comparison and an append.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

from gpufleet.agent.collectors.series import FrozenLabels, SeriesCache, StickySample
from gpufleet.agent.collectors.sysfsfiles import RACY_SECONDS, SysfsFiles, sysfs_devices
from gpufleet.vocab import catalog
from gpufleet.vocab.sysfs import IN_PLACE_MARKER

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
#: The families this collector fills (the rest of the "nic" group is the ethtool collector's), in the
#: catalog's order, which is the exposition's.
_PRODUCED = frozenset({_INFO, _RATE, _STATE, _PHYS, _TX_BYTES, _RX_BYTES, _TX_PKTS, _RX_PKTS, _TX_WAIT, _ERRORS,
                       _HW, _NET_BYTES, _NET_PKTS, _NET_ERRS, _NET_DROPS})
_RACY_NS = int(RACY_SECONDS * 1e9)
_FILLED = tuple(s for s in catalog.by_group("nic") if s.name in _PRODUCED)
#: family name -> its index among the scrape's families
_INDEX = {s.name: i for i, s in enumerate(_FILLED)}
#: A file's value into its family's samples, its label set's last sample again while the value is the same.
_emit = SeriesCache(_FILLED).emit


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


def _state_value(raw: bytes) -> float | None:
    value = parse_state(raw)
    return None if value is None else float(value)


def _counter(mult: int) -> Callable[[bytes], float | None]:
    """A non-negative decimal integer times ``mult`` (a counter file); None for anything else."""
    def parse(raw: bytes) -> float | None:
        return float(int(raw) * mult) if raw.isdigit() else None
    return parse


_COUNT = _counter(1)


def read_as_sysfs(sysfs_path: str) -> Callable[[str, int], bool]:
    """Whether a directory (its path, its ``st_dev``) is sysfs, or in the tree under ``sysfs_path`` when that holds
    the marker saying its writer writes as sysfs does (the simulated host's, ``vocab.sysfs``) on the same file
    system: such a tree is read without the checks of a tree of files replaced by rename."""
    root = sysfs_path.rstrip("/") + "/"
    marker = root + IN_PLACE_MARKER

    def is_sysfs(path: str, dev: int) -> bool:
        if dev in sysfs_devices():
            return True
        if not path.startswith(root):
            return False
        try:
            return os.stat(marker).st_dev == dev
        except OSError:
            return False
    return is_sysfs


def _text(raw: bytes | None) -> str:
    return raw.decode("utf-8", "replace") if raw is not None else ""


class _Slot:
    """One file's series: its family (index into the scrape's families), label set and parser, and the last
    text read (its sample is the label set's last one, reused while the text is the same)."""

    __slots__ = ("fam", "file", "labels", "parse", "raw", "what")

    def __init__(self, fam: int, labels: FrozenLabels, parse: Callable[[bytes], float | None], what: str,
                 file: str) -> None:
        self.fam = fam
        self.file = file
        self.labels = labels
        self.parse = parse
        self.what = what  # for the debug log of a file that does not parse
        self.raw: bytes | None = None  # set only while ``labels.last`` is the sample made of it


def _slot(metric: str, labels: Sequence[str], parse: Callable[[bytes], float | None], what: str,
          file: str = "") -> _Slot:
    i = _INDEX[metric]
    spec = _FILLED[i]
    return _Slot(i, FrozenLabels(spec.name, zip(spec.labels, labels, strict=True)), parse, what, file)


class _Port:
    """A port's directories and the slots of its files (kept while its device is the same one)."""

    __slots__ = (
        "attrs",
        "counters",
        "counters_path",
        "device",
        "hw_listing",
        "hw_names",
        "hw_path",
        "hw_slots",
        "info_key",
        "info_sample",
        "name",
        "path",
    )

    def __init__(self, device: str, name: str, path: str) -> None:
        self.device = device
        self.name = name
        self.path = path
        self.counters_path = path + "/counters"
        self.hw_path = path + "/hw_counters"
        labels = (device, name)
        self.attrs = [_slot(_RATE, labels, parse_rate, "not a port rate", "rate"),
                      _slot(_STATE, labels, _state_value, "not a port state", "state"),
                      _slot(_PHYS, labels, _state_value, "not a port state", "phys_state")]
        by_file = {f: _slot(metric, labels, _counter(mult), "not a counter", f) for f, metric, mult in _PORT_COUNTERS}
        for f in catalog.IB_PORT_ERRORS:
            by_file[f] = _slot(_ERRORS, (device, name, f), _COUNT, "not a counter", f)
        self.counters = [by_file[f] for f in _COUNTER_FILES]
        self.info_key: tuple[bytes | None, tuple[str, str, str]] | None = None
        self.info_sample: Sample | None = None
        self.hw_listing: list[str] | None = None
        self.hw_names: list[str] = []
        self.hw_slots: list[_Slot] = []

    def select_hw(self, listed: list[str]) -> list[str]:
        """The counters in a listing of hw_counters/ (the listing is the same object while unchanged)."""
        if listed is not self.hw_listing:
            names = [n for n in listed if n not in _HW_NOT_COUNTERS and n[:1] != "."]
            if names != self.hw_names:
                old = dict(zip(self.hw_names, self.hw_slots, strict=True))
                self.hw_slots = [old.get(n) or _slot(_HW, (self.device, self.name, n), _COUNT,
                                                              "not a counter", n) for n in names]
                self.hw_names = names
            self.hw_listing = listed
        return self.hw_names


class _Device:
    """A device directory as last seen: its identity, information files and ports."""

    __slots__ = ("info", "info_done", "key", "made", "ports", "ports_key", "relist", "sysfs")

    def __init__(self, key: tuple[int, int], sysfs: bool, made: float) -> None:
        self.key = key  # (st_dev, st_ino): a re-created device directory has a new inode
        self.sysfs = sysfs
        self.made = made
        self.info: tuple[str, str, str] = ("", "", "")
        self.info_done = False
        self.ports: list[_Port] = []
        self.ports_key: tuple[int, int, int] | None = None  # regular trees: ports/ when listed (trusted)
        self.relist = True


class NicCollector:
    """InfiniBand/RoCE ports under ``<sysfs_path>/class/infiniband`` plus psutil's per-NIC counters."""

    name = "nic"

    def __init__(self, sysfs_path: str = "/sys", files: SysfsFiles | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.sysfs_path = sysfs_path
        self.ib_root = os.path.join(sysfs_path, INFINIBAND_CLASS)
        self._specs = {s.name: s for s in catalog.by_group("nic")}
        self._devices: dict[str, _Device] = {}
        #: Label sets built once; unchanged values keep their sample (the Ethernet counters).
        self._put = SeriesCache(_FILLED).put
        #: Port attribute and counter files re-read with pread on descriptors kept open (sysfsfiles).
        self._files = files or SysfsFiles(clock=clock, is_sysfs=read_as_sysfs(sysfs_path))
        self._clock = clock
        #: interface -> (psutil's counters, the samples made of them) at the last scrape
        self._net_last: dict[str, tuple[tuple[int, ...], list[tuple[int, Sample]]]] = {}

    def close(self) -> None:
        self._files.close()

    def describe(self) -> Iterable[Metric]:
        return [s.family() for s in self._specs.values()]

    def collect(self) -> Iterable[Metric]:
        fams = [s.family() for s in _FILLED]
        self._collect_ib(fams)
        self._files.sweep()
        self._collect_net(fams)
        return [f for f in fams if f.samples]

    # ------------------------------------------------------------------ InfiniBand / RoCE
    def _collect_ib(self, fams: list[Family]) -> None:
        files = self._files
        try:
            names = sorted(os.listdir(self.ib_root))
        except OSError:
            names = []
        files.check(self.ib_root)  # the devices are then checked by name in it
        kept: dict[str, _Device] = {}
        lists = [f.samples for f in fams]
        for name in names:
            path = os.path.join(self.ib_root, name)
            dev = self._device(name, path, self._devices.get(name))
            if dev is None:
                continue
            kept[name] = dev
            for port in dev.ports:
                if not self._collect_port(lists, dev, port):
                    dev.relist = True  # the port's directory went: list the ports again next time
        self._devices = kept

    def _device(self, name: str, path: str, dev: _Device | None) -> _Device | None:
        """The device's entry (None if it is not a directory), made anew when its directory is another one (or
        at the rescan); its information files read until they are all there; its ports listed again when they
        may have changed."""
        files = self._files
        checked = files.check(path)
        if checked is None:
            return None
        (st_dev, st_ino, _), _, sysfs = checked
        if sysfs:  # check() looks at a sysfs directory only at the rescan: its identity is looked at here
            try:
                st = os.stat(path)
            except OSError:
                return None
            st_dev, st_ino = st.st_dev, st.st_ino
        now = self._clock()
        if dev is None or dev.key != (st_dev, st_ino) or now - dev.made >= files.rescan_seconds:
            if dev is not None:
                files.forget(path)  # the kept files of the old directory
            dev = _Device((st_dev, st_ino), sysfs, now)
        if not dev.info_done:
            # hca_type, board_id, fw_ver: read once per device instance; a device still being set up again
            info = tuple(_text(read_raw(os.path.join(path, attr))) for attr in _DEVICE_INFO)
            dev.info = (info[0], info[1], info[2])
            dev.info_done = all(info)
        ports = os.path.join(path, "ports")
        listed_at = files.check(ports)
        if listed_at is None:
            dev.ports, dev.ports_key = [], None
            return dev
        pkey, trusted, _ = listed_at
        if sysfs:
            # sysfs: a device's ports are made when it registers and stay while it exists (a removed device
            # answers ENODEV, a re-created one has a new inode): listed again only in its first moments
            if not dev.relist and dev.ports and now - dev.made >= RACY_SECONDS:
                return dev
        elif not dev.relist and pkey == dev.ports_key:
            return dev  # a regular-file tree: listed again whenever ports/ changed (or too recently to tell)
        dev.relist = False
        dev.ports_key = pkey if trusted else None
        try:
            listed = sorted(os.listdir(ports))
        except OSError:
            dev.ports = []
            return dev
        old = {p.name: p for p in dev.ports}
        dev.ports = [old.get(p) or _Port(name, p, f"{ports}/{p}") for p in listed
                     if os.path.isdir(os.path.join(ports, p))]
        return dev

    def _collect_port(self, lists: list[list[Sample]], dev: _Device, port: _Port) -> bool:
        """The port's series into ``lists`` (the scrape's families' samples); False if its directory is gone."""
        files = self._files
        attrs = files.values(port.path, _PORT_ATTRS)
        if attrs is None:
            return False
        link_layer = attrs[0]
        info_key = (link_layer if type(link_layer) is bytes else None, dev.info)
        if info_key != port.info_key or port.info_sample is None:
            hca_type, board_id, fw_ver = dev.info
            values = (port.device, port.name, _text(info_key[0]), hca_type, board_id, fw_ver)
            labels = _slot(_INFO, values, _COUNT, "").labels
            port.info_sample = StickySample(labels.name, labels, 1.0)
            port.info_key = info_key
        lists[_INDEX[_INFO]].append(port.info_sample)
        _fill(lists, port.attrs, attrs[1:], port.path)
        got = files.values(port.counters_path, _COUNTER_FILES)
        if got is not None:
            _fill(lists, port.counters, got, port.counters_path)
        hw = files.values_listed(port.hw_path, port.select_hw)
        if hw is not None:
            _fill(lists, port.hw_slots, hw[1], port.hw_path)
        return True

    # ------------------------------------------------------------------ Ethernet (psutil)
    def _collect_net(self, fams: list[Family]) -> None:
        try:
            counters = psutil.net_io_counters(pernic=True)
        except (OSError, RuntimeError) as e:
            log.warning("psutil.net_io_counters failed: %s", e)
            return
        index = _INDEX
        last, now = self._net_last, {}
        for iface in sorted(counters):
            if iface == "lo":
                continue
            c = counters[iface]
            seen = last.get(iface)
            if seen is not None and seen[0] == c:  # an idle interface: the same samples again
                now[iface] = seen
                for i, sample in seen[1]:
                    fams[i].samples.append(sample)
                continue
            made: list[tuple[int, Sample]] = []
            for metric, tx, rx in (
                (_NET_BYTES, c.bytes_sent, c.bytes_recv),
                (_NET_PKTS, c.packets_sent, c.packets_recv),
                (_NET_ERRS, c.errout, c.errin),
                (_NET_DROPS, c.dropout, c.dropin),
            ):
                i = index[metric]
                fam = fams[i]
                self._put(fam, (iface, "transmit"), float(tx))
                self._put(fam, (iface, "receive"), float(rx))
                made += ((i, fam.samples[-2]), (i, fam.samples[-1]))
            now[iface] = (c, made)
        self._net_last = now


def _fill(lists: list[list[Sample]], slots: list[_Slot], got: Sequence[bytes | OSError], where: str) -> None:
    """Each file's sample (the slot's last one while its text is the same) into its family's list."""
    for slot, raw in zip(slots, got, strict=True):
        if raw == slot.raw:  # set only beside a sample
            lists[slot.fam].append(slot.labels.last)  # type: ignore[arg-type]  # never None with raw set
            continue
        slot.raw = None
        if type(raw) is not bytes:
            log.debug("%s/%s: %s", where, slot.file, getattr(raw, "strerror", raw))
            continue
        value = slot.parse(raw)
        if value is None:
            log.debug("%s/%s: %s: %r", where, slot.file, slot.what, raw[:40])
            continue
        slot.raw = raw
        _emit(lists[slot.fam], slot.labels, value)
