"""PCIe collector: AER error counters and link state of every GPU and NIC and the ports above them.

The devices: every GPU (NVML bus ids) and every InfiniBand/RoCE NIC (``class/infiniband``), each
resolved to its real directory under ``devices/pci<domain>:<bus>/...`` inside ``--path.sysfs``
(as :mod:`gpufleet.agent.collectors.topology` does), plus every PCI function on the way up: the
PCIe switch ports (role ``switch``) and the port right below the host bridge (``root_port``).
The list is computed once and reused until the set of GPUs or NICs changes.

Each device's small sysfs files are read again at most every ``interval`` seconds
(``--collector.pcie.interval``, default 60 s: AER counters and link state change rarely, and an alert
on them looks at minutes; 0 reads them on every scrape) and the families of the last read are
served in between (see the kernel's ``Documentation/PCI/pcieaer-howto.rst``, "AER statistics"):

* ``aer_dev_correctable``, ``aer_dev_nonfatal``, ``aer_dev_fatal``: one ``<ErrorName> <count>`` line
  per error type and a ``TOTAL_ERR_COR`` / ``TOTAL_ERR_NONFATAL`` / ``TOTAL_ERR_FATAL`` line. The
  ``TOTAL_*`` line (error *reports*: the kernel adds one per report, and one report may set several
  type bits) is ``gpufleet_pcie_aer_reports_total{device,kind}``, always present, the series to alert
  on. The per-type lines are ``gpufleet_pcie_aer_errors_total{device,kind,error}``, a separate family
  so that no sum mixes the two, and only for the types whose count is not 0: the kernel lists all
  26 uncorrectable types twice, which would be 40-odd series per device on a healthy host;
* ``aer_rootport_total_err_cor|nonfatal|fatal`` (root ports only): reports received from below,
  ``gpufleet_pcie_aer_root_port_errors_total{device,kind}``;
* ``current_link_speed``/``max_link_speed`` (``"32.0 GT/s PCIe"``, older kernels ``"8 GT/s"``,
  ``"Unknown"`` while the link is down) and ``current_link_width``/``max_link_width``, on the
  upstream ports only (the endpoints and the switch upstream ports): the downstream port above
  reports the same link's current state, so each link is exported once. Every PCI function below a
  root port is, in turn, a downstream-facing port (root port, switch downstream port) or an
  upstream port (switch upstream port, endpoint), which is how they are told apart. The maxima
  (capabilities) are read once, when the devices are discovered.

A device without AER (or a kernel without ``CONFIG_PCIEAER``) has no ``aer_*`` files: no series.
A file that exists but cannot be read, or a value that does not parse, is counted in
``gpufleet_pcie_read_errors_total{file}`` and logged once; the other files are still exported.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple, cast

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpufleet.agent.collectors.series import SeriesCache
from gpufleet.agent.collectors.topology import (
    PCI_ADDR_RE,
    PCI_ROOT_RE,
    gpu_index_key,
    ib_device_names,
    resolve_in_root,
    sysfs_pci_address,
)
from gpufleet.vocab import catalog

log = logging.getLogger(__name__)

_INFO = catalog.spec("gpufleet_pcie_device_info")
_REPORTS = catalog.spec("gpufleet_pcie_aer_reports_total")
_AER = catalog.spec("gpufleet_pcie_aer_errors_total")
_ROOT = catalog.spec("gpufleet_pcie_aer_root_port_errors_total")
_SPEED = catalog.spec("gpufleet_pcie_link_speed_transfers_per_second")
_WIDTH = catalog.spec("gpufleet_pcie_link_width")
_ERRORS = catalog.spec("gpufleet_pcie_read_errors_total")
_SPECS = (_INFO, _REPORTS, _AER, _ROOT, _SPEED, _WIDTH, _ERRORS)

AER_FILES = (("correctable", "aer_dev_correctable"), ("nonfatal", "aer_dev_nonfatal"), ("fatal", "aer_dev_fatal"))
ROOT_PORT_FILES = (("correctable", "aer_rootport_total_err_cor"), ("nonfatal", "aer_rootport_total_err_nonfatal"),
                   ("fatal", "aer_rootport_total_err_fatal"))
LINK_FILES = (("current", "current_link_speed", "current_link_width"), ("max", "max_link_speed", "max_link_width"))
ALL_FILES = (*(f for _, f in AER_FILES), *(f for _, f in ROOT_PORT_FILES), *(f for _, *fs in LINK_FILES for f in fs))
_SPEED_RE = re.compile(r"^(\d+(?:\.\d+)?) GT/s(?: PCIe)?$")
_NAME = r"[A-Za-z][A-Za-z0-9_]{0,63}"
#: A non-blank line that is not "<name> <count>".
_AER_BAD_RE = re.compile(rf"^(?!{_NAME}[ \t]+\d+[ \t]*$)[ \t]*\S.*$", re.M)
_AER_NONZERO_RE = re.compile(rf"^({_NAME})[ \t]+0*([1-9]\d*)[ \t]*$", re.M)
_AER_TOTAL_RE = re.compile(r"^TOTAL_ERR_[A-Z]+[ \t]+(\d+)[ \t]*$", re.M)
_MAX_FILE_BYTES = 4096  # the kernel's sysfs page: an attribute is never larger


class PcieDevice(NamedTuple):
    address: str  # PCI function address, sysfs form (0000:18:00.0)
    path: str  # its real directory, absolute (sysfs root joined with the resolved components)
    role: str  # gpu, nic, switch or root_port
    upstream: bool  # an upstream port (endpoint, switch upstream port): the link state is exported here
    gpus: tuple[str, ...]  # GPU indices at or below it
    nics: tuple[str, ...]  # NIC names at or below it


class Unreadable(Exception):
    """A file that exists but cannot be read or parsed."""


def read_attr(path: str) -> str | None:
    """A sysfs attribute's text without the trailing newline; None if the file does not exist.

    Raises :class:`Unreadable` for any other failure (permission, I/O error, not UTF-8)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise Unreadable(e.strerror or str(e)) from e
    try:
        data = os.read(fd, _MAX_FILE_BYTES)
    except OSError as e:
        raise Unreadable(e.strerror or str(e)) from e
    finally:
        os.close(fd)
    try:
        return data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise Unreadable("not ASCII text") from None


def parse_aer(text: str) -> tuple[list[tuple[str, int]], int | None, int]:
    """The ``(error name, count)`` lines of an ``aer_dev_*`` file whose count is not 0, its ``TOTAL_*``
    count (None if it has none) and the number of garbage lines; blank lines are ignored.

    Regular expressions over the whole text rather than a loop over its lines: the kernel prints
    every error type, mostly 0, and this runs for every device on every read."""
    body = text.rstrip("\n")
    if body.rpartition("\n")[2].startswith("TOTAL_ERR_") and body.count("\n") + 1 == (body + "\n").count(" 0\n"):
        return [], 0, 0  # the healthy case, nearly every file: every line, the total too, ends in " 0"
    m = _AER_TOTAL_RE.search(text)
    total = int(m.group(1)) if m else None
    bad = len(_AER_BAD_RE.findall(text))
    return [(name, int(n)) for name, n in _AER_NONZERO_RE.findall(text) if not name.startswith("TOTAL_")], total, bad


def parse_speed(text: str) -> float | None:
    """``"32.0 GT/s PCIe"`` -> 3.2e10 transfers per second; None for ``Unknown`` (link down).

    Raises ValueError for anything else."""
    if text.startswith("Unknown"):
        return None
    m = _SPEED_RE.match(text)
    if m is None:
        raise ValueError(f"not a link speed: {text[:40]!r}")
    return float(m.group(1)) * 1e9


def parse_width(text: str) -> int:
    """``"16"`` -> 16 lanes (some kernels print ``"x16"``); ValueError otherwise."""
    s = text.removeprefix("x")
    if not s.isdigit() or len(s) > 3:
        raise ValueError(f"not a link width: {text[:40]!r}")
    return int(s)


def _chain(sysfs: str, link: str) -> list[str] | None:
    """Resolved components of ``link`` up to its PCI function, starting at the host bridge."""
    comps = resolve_in_root(sysfs, link)
    if not comps:
        return None
    end = next((i for i in range(len(comps) - 1, -1, -1) if PCI_ADDR_RE.match(comps[i])), None)
    if end is None:
        return None
    start = next((i for i in range(end, -1, -1) if PCI_ROOT_RE.match(comps[i])), None)
    if start is None:
        return None
    return comps[: end + 1]


def discover(sysfs: str, gpu_bus_ids: dict[str, str], nics: Iterable[str]) -> list[PcieDevice]:
    """Every GPU and NIC and each PCI function above it up to the root port, once each."""
    endpoints: list[tuple[str, str, list[str]]] = []  # (role, name, chain)
    for gpu, bus_id in gpu_bus_ids.items():
        addr = sysfs_pci_address(bus_id)
        chain = _chain(sysfs, f"bus/pci/devices/{addr}") if addr else None
        if chain is None:
            log.debug("GPU %s: no PCI device %s under %s", gpu, bus_id, sysfs)
            continue
        endpoints.append(("gpu", gpu, chain))
    for nic in nics:
        chain = _chain(sysfs, f"class/infiniband/{nic}/device")
        if chain is None:
            log.debug("NIC %s: no PCI device link under %s", nic, sysfs)
            continue
        endpoints.append(("nic", nic, chain))
    roles: dict[str, str] = {}
    upstream: dict[str, bool] = {}
    paths: dict[str, str] = {}
    below: dict[str, tuple[set[str], set[str]]] = {}
    for role, name, chain in endpoints:
        root_at = max(i for i, c in enumerate(chain) if PCI_ROOT_RE.match(c))
        functions = [i for i in range(root_at + 1, len(chain)) if PCI_ADDR_RE.match(chain[i])]
        for n, i in enumerate(functions):
            addr = chain[i]
            endpoint = i == len(chain) - 1
            kind = role if endpoint else "root_port" if n == 0 else "switch"
            if roles.get(addr) not in ("gpu", "nic"):  # an endpoint keeps its role
                roles[addr] = kind
            upstream[addr] = upstream.get(addr, False) or endpoint or n % 2 == 1
            paths.setdefault(addr, os.path.join(sysfs, *chain[: i + 1]))
            gpus, nics_below = below.setdefault(addr, (set(), set()))
            (gpus if role == "gpu" else nics_below).add(name)
    return [PcieDevice(a, paths[a], roles[a], upstream[a], tuple(sorted(below[a][0], key=gpu_index_key)), tuple(sorted(below[a][1])))
            for a in sorted(roles)]


class PcieCollector:
    """``gpufleet_pcie_*``: AER counters and link state (see the module docstring)."""

    name = "pcie"

    def __init__(self, sysfs_path: str, gpu_bus_ids: Callable[[], dict[str, str]], *, interval: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.sysfs_path = sysfs_path
        self._gpu_bus_ids = gpu_bus_ids
        self.interval = interval
        self._clock = clock
        self._read_at = -math.inf
        self._families: list[Metric] = []
        self._max_link: dict[str, tuple[float | None, int | None]] = {}  # address -> (max speed, max width)
        self._key: tuple[tuple[tuple[str, str], ...], tuple[str, ...]] | None = None
        self._devices: list[PcieDevice] = []
        self._read_errors: dict[str, int] = {}
        self._warned: set[tuple[str, str]] = set()
        self._put = SeriesCache(_SPECS).put  # unchanged values reuse their samples (and encoded lines)

    def describe(self) -> Iterable[Metric]:
        return [s.family() for s in _SPECS]

    def devices(self) -> list[PcieDevice]:
        """The devices, rediscovered only when the set of GPUs or NICs changed."""
        nics = ib_device_names(self.sysfs_path)
        gpus = self._gpu_bus_ids()
        key = (tuple(sorted(gpus.items())), nics)
        if key != self._key:
            self._devices = discover(self.sysfs_path, gpus, nics)
            self._key = key
            self._max_link = {d.address: (self._speed(d, "max_link_speed"), self._width(d, "max_link_width"))
                              for d in self._devices if d.upstream}
            log.debug("PCIe devices: %s", self._devices)
        return self._devices

    def _error(self, path: str, name: str, problem: str) -> None:
        self._read_errors[name] = self._read_errors.get(name, 0) + 1
        level = logging.DEBUG if (path, problem) in self._warned else logging.WARNING
        self._warned.add((path, problem))
        log.log(level, "PCIe attribute %s: %s", path, problem)

    def _read(self, dev: PcieDevice, name: str) -> str | None:
        path = f"{dev.path}/{name}"
        try:
            return read_attr(path)
        except Unreadable as e:
            self._error(path, name, str(e))
            return None

    def _speed(self, dev: PcieDevice, name: str) -> float | None:
        text = self._read(dev, name)
        if text is None:
            return None
        try:
            return parse_speed(text)
        except ValueError as e:
            self._error(os.path.join(dev.path, name), name, str(e))
            return None

    def _width(self, dev: PcieDevice, name: str) -> int | None:
        text = self._read(dev, name)
        if text is None:
            return None
        try:
            return parse_width(text)
        except ValueError as e:
            self._error(os.path.join(dev.path, name), name, str(e))
            return None

    def collect(self) -> Iterable[Metric]:
        now = self._clock()
        if now - self._read_at >= self.interval or self.interval <= 0:
            self._families = self._read_all()
            self._read_at = now
        return self._families

    def _read_all(self) -> list[Metric]:
        put = self._put
        devices = self.devices()
        info = cast(GaugeMetricFamily, _INFO.family())
        reports = cast(CounterMetricFamily, _REPORTS.family())
        aer = cast(CounterMetricFamily, _AER.family())
        root = cast(CounterMetricFamily, _ROOT.family())
        speed = cast(GaugeMetricFamily, _SPEED.family())
        width = cast(GaugeMetricFamily, _WIDTH.family())
        for dev in devices:
            d = dev.address
            put(info, [d, dev.role, ",".join(dev.gpus), ",".join(dev.nics)], 1.0)
            for kind, fname in AER_FILES:
                text = self._read(dev, fname)
                if text is None:
                    continue
                counts, total, bad = parse_aer(text)
                if bad:
                    self._error(os.path.join(dev.path, fname), fname, f"{bad} unparsable line(s)")
                if total is not None:
                    put(reports, [d, kind], float(total))
                for error, n in counts:
                    if n:
                        put(aer, [d, kind, error], float(n))
            if dev.role == "root_port":
                for kind, fname in ROOT_PORT_FILES:
                    text = self._read(dev, fname)
                    if text is None:
                        continue
                    if text.isdigit():
                        put(root, [d, kind], float(text))
                    else:
                        self._error(os.path.join(dev.path, fname), fname, f"not a count: {text[:40]!r}")
            if not dev.upstream:
                continue
            max_speed, max_width = self._max_link.get(d, (None, None))
            for which, s, w in (("current", self._speed(dev, "current_link_speed"),
                                 self._width(dev, "current_link_width")), ("max", max_speed, max_width)):
                if s is not None:
                    put(speed, [d, which], s)
                if w is not None:
                    put(width, [d, which], float(w))
        out: list[Metric] = [f for f in (info, reports, aer, root, speed, width) if f.samples]
        if devices or self._read_errors:  # every file name from the start, so that increase() sees the first error
            errors = cast(CounterMetricFamily, _ERRORS.family())
            for fname in sorted({*ALL_FILES, *self._read_errors}):
                put(errors, [fname], float(self._read_errors.get(fname, 0)))
            out.append(errors)
        return out
