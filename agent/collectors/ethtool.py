"""Ethtool collector: RoCE/Ethernet driver statistics (``ethtool -S``) of the NICs that carry GPU traffic.

Which NICs: by default the network interfaces of the RDMA devices
(``<sysfs>/class/infiniband/<dev>/device/net/<ifname>``: a RoCE port's netdev, or an IB port's
IPoIB netdev), found again at most every :data:`DISCOVER_SECONDS`; ``--collector.ethtool.interfaces``
names them instead. Each scrape reads every statistic of each interface as ``(name, value)`` pairs
and keeps the allowlist of :mod:`~gpufleet.agent.collectors.ethtool_stats` (PFC pause frames and
duration, pause storms, discards, physical-layer errors); ``--collector.ethtool.all-stats`` keeps
everything else as ``gpufleet_nic_ethtool_stat``. Each interface read that belongs to an RDMA device
is tied to it once, as ``gpufleet_nic_netdev_info{device, port, interface}`` (the port from the netdev's
``dev_port``, 0-based, or the device's only port), so the interface-keyed series join the
``gpufleet_ib_port_*`` ones (the detector maps PFC pause onto the NIC that way) without a device label on
every series.

Live reads use the kernel's ``SIOCETHTOOL`` ioctl (``ETHTOOL_GSSET_INFO``, ``ETHTOOL_GSTRINGS``,
``ETHTOOL_GSTATS``, what ``ethtool -S`` itself does) through pyroute2, on an ``AF_INET`` datagram
socket, without a subprocess. Those three commands need no capability (the kernel's
``dev_ethtool`` lets anyone run them), so the hardened unit needs none: only ``AF_INET`` in
``RestrictAddressFamilies`` and the host's network namespace (no ``PrivateNetwork=``). The names
are fetched once per interface and again whenever the driver's count changes (checked on every
read, as ethtool does). An interface that vanished or a driver without statistics gives no
series; any other failure is counted in ``gpufleet_nic_ethtool_read_errors_total``.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, cast

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.samples import Sample

from gpufleet.agent.collectors.ethtool_stats import Kind, Malformed, Stat, base_value, parse_ethtool_s, plan
from gpufleet.agent.collectors.series import FrozenLabels, SeriesCache, StickySample
from gpufleet.vocab import catalog

log = logging.getLogger(__name__)

_FAMILIES: dict[Kind, catalog.MetricSpec] = {
    "pause_frames": catalog.spec("gpufleet_nic_pause_frames_total"),
    "pause_seconds": catalog.spec("gpufleet_nic_pause_duration_seconds_total"),
    "storm": catalog.spec("gpufleet_nic_pause_storm_events_total"),
    "discards": catalog.spec("gpufleet_nic_discards_total"),
    "phy_errors": catalog.spec("gpufleet_nic_phy_errors_total"),
    "other": catalog.spec("gpufleet_nic_ethtool_stat"),
}
_ERRORS = catalog.spec("gpufleet_nic_ethtool_read_errors_total")
_NETDEV = catalog.spec("gpufleet_nic_netdev_info")
#: Seconds between looks for the RDMA devices' network interfaces.
DISCOVER_SECONDS = 60.0
_IB_CLASS = os.path.join("class", "infiniband")


class _Slot:
    """One statistic's series of one interface: its family, label set, the last value read and its sample."""

    __slots__ = ("kind", "labels", "raw", "sample", "stat")

    def __init__(self, ifname: str, stat: Stat) -> None:
        spec = _FAMILIES[stat.kind]
        self.kind = stat.kind
        self.stat = stat
        self.labels = FrozenLabels(spec.name, zip(spec.labels, (ifname, *stat.labels), strict=True))
        self.raw: int | None = None
        self.sample: Sample | None = None


class Gone(Exception):
    """The interface does not exist (any more) or its driver has no statistics: no series, no error."""


class ReadError(Exception):
    """The statistics could not be read: counted and logged."""


class StatsReader(Protocol):
    """Reads one interface's statistics: ``(names, values)``, position by position (``ethtool -S`` order); the
    names list is the same object while the driver's set is unchanged. Raises :class:`Gone` or :class:`ReadError`."""

    def read(self, interface: str) -> tuple[Sequence[str], Sequence[int]]: ...

    def close(self) -> None: ...


class IoctlReader:
    """The live reader: pyroute2's ``SIOCETHTOOL`` wrapper, one socket, names cached per interface."""

    def __init__(self) -> None:
        from pyroute2.ethtool.ioctl import ETH_SS_STATS, IoctlEthtool

        self._set = int(ETH_SS_STATS)
        self._io = IoctlEthtool()
        self._names: dict[str, list[str]] = {}

    def read(self, interface: str) -> tuple[Sequence[str], Sequence[int]]:
        from pyroute2.ethtool.ioctl import (
            ETHTOOL_GSTATS,
            NoSuchDevice,
            NotSupportedError,
            generate_EthtoolGStats,
        )

        io = self._io
        try:
            io.change_ifname(interface)
            count = int(io.get_stringset_length(self._set))
            names = self._names.get(interface)
            if names is None or len(names) != count:
                names = [str(n) for n in io.get_stringset(set_id=self._set)]
                self._names[interface] = names
            # ETHTOOL_GSTATS (what pyroute2's get_statistics does, without building a (name, value) tuple per
            # statistic: the collector picks its few by position). The kernel writes as many values as the driver
            # has *now*, whatever the buffer's size, so the buffer has room for the set to grow meanwhile (a
            # channel count change); a count that differs from the names' is an error and the names are re-read.
            gstats = generate_EthtoolGStats(2 * len(names) + 64)(cmd=ETHTOOL_GSTATS)
            io.ifreq.gstats = ctypes.cast(ctypes.byref(gstats), ctypes.POINTER(None))
            io.ioctl()
            if int(gstats.size) != len(names):  # struct ethtool_stats.n_stats: the driver's count now
                raise ValueError(f"{gstats.size} values for {len(names)} names")
        except NoSuchDevice as e:
            self._names.pop(interface, None)
            raise Gone(f"{interface}: no such interface") from e
        except NotSupportedError as e:
            self._names.pop(interface, None)
            raise Gone(f"{interface}: the driver has no statistics") from e
        except OSError as e:
            self._names.pop(interface, None)
            if e.errno in (errno.ENODEV, errno.ENXIO):
                raise Gone(f"{interface}: no such interface") from e
            if e.errno == errno.EOPNOTSUPP:
                raise Gone(f"{interface}: the driver has no statistics") from e
            raise ReadError(e.strerror or str(e)) from e
        except ValueError as e:  # the count changed between the calls
            self._names.pop(interface, None)
            raise ReadError(f"statistics changed while reading: {e}") from e
        return names, cast(Sequence[int], gstats.data[: len(names)])

    def close(self) -> None:
        self._io.close()


class TextReader:
    """Reads recorded ``ethtool -S`` outputs, ``<directory>/<interface>`` (tests; a host's outputs saved for a look)."""

    MAX_BYTES = 4 << 20

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def read(self, interface: str) -> tuple[Sequence[str], Sequence[int]]:
        path = os.path.join(self.directory, interface)
        try:
            with open(path, "rb") as f:
                data = f.read(self.MAX_BYTES + 1)
        except (FileNotFoundError, NotADirectoryError) as e:
            raise Gone(f"no {path}") from e
        except OSError as e:
            raise ReadError(f"{path}: {e.strerror or e}") from e
        if len(data) > self.MAX_BYTES:
            raise ReadError(f"{path}: larger than {self.MAX_BYTES} bytes")
        try:
            pairs = parse_ethtool_s(data.decode("utf-8"))
        except (UnicodeDecodeError, Malformed) as e:
            raise ReadError(f"{path}: {e}") from e
        return [n for n, _ in pairs], [v for _, v in pairs]

    def close(self) -> None:
        pass


def rdma_interfaces(sysfs: str) -> list[str]:
    """The network interfaces of the RDMA devices under ``<sysfs>/class/infiniband``, sorted, each once."""
    return sorted({ifname for _, _, ifname in rdma_netdevs(sysfs)})


def _port_of(dev_dir: str, ifname: str) -> str | None:
    """The RDMA port of a device's netdev: ``dev_port`` + 1 (the kernel numbers netdev ports from 0, RDMA
    ports from 1), else the device's only port; None when neither tells."""
    try:
        with open(os.path.join(dev_dir, "device", "net", ifname, "dev_port"), encoding="ascii") as f:
            text = f.read(32).strip()
        if text.isascii() and text.isdigit():
            return str(int(text) + 1)
    except (OSError, ValueError):
        pass
    try:
        ports = [p for p in os.listdir(os.path.join(dev_dir, "ports")) if p.isascii() and p.isdigit()]
    except OSError:
        return None
    return ports[0] if len(ports) == 1 else None


def rdma_netdevs(sysfs: str) -> list[tuple[str, str | None, str]]:
    """``(device, port, interface)`` of every network interface of the RDMA devices under
    ``<sysfs>/class/infiniband`` (port None when sysfs does not tell), sorted."""
    base = os.path.join(sysfs, _IB_CLASS)
    try:
        devices = os.listdir(base)
    except OSError:
        return []
    found: list[tuple[str, str | None, str]] = []
    for dev in devices:
        if dev.startswith("."):
            continue
        dev_dir = os.path.join(base, dev)
        try:
            nets = [n for n in os.listdir(os.path.join(dev_dir, "device", "net")) if not n.startswith(".")]
        except OSError:
            continue
        found.extend((dev, _port_of(dev_dir, n), n) for n in nets)
    return sorted(found, key=lambda x: (x[0], x[1] or "", x[2]))


class EthtoolCollector:
    """``gpufleet_nic_pause_*``, ``_discards_total``, ``_phy_errors_total`` (see the module docstring)."""

    name = "ethtool"

    def __init__(self, sysfs_path: str, reader: StatsReader | Callable[[], StatsReader] | None = None,
                 interfaces: Sequence[str] = (), all_stats: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.sysfs_path = sysfs_path
        self._reader_arg = reader
        self._reader: StatsReader | None = None
        self._fixed = tuple(interfaces)
        self.all_stats = all_stats
        self._clock = clock
        self._found: list[str] = []
        self._ports: dict[str, list[tuple[str, str]]] = {}  # interface -> its RDMA (device, port)s
        self._found_at = -float("inf")
        self._errors: dict[str, int] = {}
        self._warned: set[tuple[str, str]] = set()
        self._unavailable = False
        #: interface -> (the names its slots are for, (position, slot) of each statistic that feeds a series)
        self._plans: dict[str, tuple[Sequence[str], list[tuple[int, _Slot]]]] = {}
        specs = (*_FAMILIES.values(), _ERRORS, _NETDEV)
        self._put = SeriesCache(specs).put

    def describe(self) -> Iterable[Metric]:
        return [s.family() for s in (*_FAMILIES.values(), _ERRORS, _NETDEV)]

    def interfaces(self) -> list[str]:
        now = self._clock()
        if now - self._found_at >= DISCOVER_SECONDS:
            found = rdma_netdevs(self.sysfs_path)
            self._found = sorted({ifname for _, _, ifname in found})
            self._ports = {}
            for dev, port, ifname in found:
                if port is not None:
                    self._ports.setdefault(ifname, []).append((dev, port))
            self._found_at = now
        return list(self._fixed) if self._fixed else self._found

    def _get_reader(self) -> StatsReader | None:
        if self._reader is None and not self._unavailable:
            arg = self._reader_arg
            try:
                if arg is None:
                    self._reader = IoctlReader()
                elif callable(arg) and not hasattr(arg, "read"):
                    self._reader = arg()
                else:
                    self._reader = cast(StatsReader, arg)
            except (ImportError, OSError) as e:
                self._unavailable = True
                log.warning("ethtool statistics unavailable: %s", e)
        return self._reader

    def collect(self) -> Iterable[Metric]:
        ifnames = self.interfaces()
        reader = self._get_reader() if ifnames else None
        if reader is None:
            return []
        put = self._put
        fams = {k: s.family() for k, s in _FAMILIES.items()}
        lists = {k: f.samples for k, f in fams.items()}
        netdev = _NETDEV.family()
        for ifname in ifnames:
            try:
                names, values = reader.read(ifname)
            except Gone as e:
                log.debug("ethtool %s: %s", ifname, e)
                continue
            except ReadError as e:
                self._errors[ifname] = self._errors.get(ifname, 0) + 1
                level = logging.DEBUG if (ifname, str(e)) in self._warned else logging.WARNING
                self._warned.add((ifname, str(e)))
                log.log(level, "ethtool statistics of %s: %s", ifname, e)
                continue
            cached = self._plans.get(ifname)
            if cached is None or (cached[0] is not names and cached[0] != names):
                cached = self._plans[ifname] = (names, [(i, _Slot(ifname, st))
                                                        for i, st in plan(names, self.all_stats)])
            if len(values) != len(names):
                self._errors[ifname] = self._errors.get(ifname, 0) + 1
                continue
            self._errors.setdefault(ifname, 0)
            for i, slot in cached[1]:
                # the slot's last sample while the value read is the same (same type: it prints the same)
                v = values[i]
                sample = slot.sample
                if sample is None or v != slot.raw or type(v) is not type(slot.raw):
                    slot.raw = v
                    sample = slot.sample = StickySample(slot.labels.name, slot.labels, base_value(slot.stat, v))
                lists[slot.kind].append(sample)
            for dev, port in self._ports.get(ifname, ()):
                put(netdev, [dev, port, ifname], 1.0)
        out: list[Metric] = [f for f in fams.values() if f.samples]
        if netdev.samples:
            out.append(netdev)
        if self._errors:
            errors = cast(CounterMetricFamily, _ERRORS.family())
            for ifname in sorted(self._errors):
                put(errors, [ifname], float(self._errors[ifname]))
            out.append(errors)
        return out

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
