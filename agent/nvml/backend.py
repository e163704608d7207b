"""The agent's door to NVML: init with retry, device handles, static identity, error accounting.

Every NVML call the agent makes goes through :meth:`NvmlBackend.call` (or
:meth:`NvmlBackend.static` for facts read once), which turns pynvml's exceptions
into "no value":

* ``NVML_ERROR_NOT_SUPPORTED`` -> ``None`` and nothing else (the field has no series);
* any other NVML error -> ``None``, counted per (function, error name) for
  ``gpufleet_nvml_errors_total``;
* ``GPU_IS_LOST`` / ``GPU_NOT_FOUND`` -> counted, then :class:`GpuLost` is raised so
  the reader stops reading that GPU for this scrape (one lost GPU never stops
  the others).

Given a ``fake`` library (``--nvml.fake``: the composition root builds one with
:func:`gpufleet.sim.fake.spec.fake_backend`, found by entry point; this module never imports the fake),
the backend installs it into pynvml before ``nvmlInit``, so the very same pynvml
calls answer from the fake's device source.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, TypeVar

import pynvml

from gpufleet.agent.nvml.lanes import Lanes, waits_on_lanes
from gpufleet.agent.nvml.model import DeviceSource, GpuInventory

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Worker threads for NVML calls (one per GPU plus one for node-wide calls, up to this many).
NVML_WORKERS = 16
#: Seconds NVML's start, or a refresh that finds new GPUs, waits for their handles and identities, read in parallel
#: on each GPU's own lane: a GPU that hangs there is left unopened (its lane held by the call, named as stalled)
#: while the others are served, instead of holding up NVML's start for the whole node.
OPEN_TIMEOUT = 5.0

#: NVML return code -> short name ("GPU_IS_LOST"), for the ``error`` label.
ERROR_NAMES: dict[int, str] = {
    int(getattr(pynvml, n)): n.removeprefix("NVML_ERROR_") for n in dir(pynvml) if n.startswith("NVML_ERROR_")
}
#: Codes that mean the GPU is gone (fell off the bus) until it is reset.
LOST_CODES = frozenset({pynvml.NVML_ERROR_GPU_IS_LOST, getattr(pynvml, "NVML_ERROR_GPU_NOT_FOUND", 28)})
#: Codes that mean NVML itself is gone (driver unloaded, library replaced): re-init on a later scrape.
DOWN_CODES = frozenset({
    pynvml.NVML_ERROR_UNINITIALIZED,
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
})
#: Codes that, answering "does link N exist", mean it does not.
_NO_SUCH_LINK = frozenset({pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT})

_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
_MISSING: Any = object()


def error_name(code: int) -> str:
    return ERROR_NAMES.get(code, f"CODE_{code}")


class GpuLost(Exception):
    """The GPU answered GPU_IS_LOST (or kin): stop reading it for this scrape."""


@dataclass
class Device:
    """One GPU as the backend knows it: its handle and the facts read once."""

    index: int
    handle: pynvml.c_nvmlDevice_t | None = None
    #: Static facts by key (uuid, name, max clocks, thresholds...); a key is present once read or NOT_SUPPORTED.
    facts: dict[str, Any] = field(default_factory=dict)
    #: NVLink links that exist (probed once), fans (probed once), GPM support (probed once).
    nvlinks: tuple[int, ...] | None = None
    fans: int | None = None
    gpm_supported: bool | None = None
    lost: bool = False
    #: True once every static fact has been read (or found unsupported).
    identified: bool = False
    #: Per-device state of the reader (GPM samples); owned by :mod:`gpufleet.agent.nvml.reader`.
    reader_state: Any = None

    @property
    def label(self) -> str:
        return str(self.index)

    def fact(self, key: str) -> Any:
        return self.facts.get(key)


@dataclass(frozen=True)
class DriverVersions:
    driver_version: str
    nvml_version: str
    cuda_version: str
    cuda_driver_version: int | None


class FakeLibrary(Protocol):
    """A stand-in for libnvidia-ml that pynvml can be pointed at (the fake NVML of ``--nvml.fake``)."""

    @property
    def source(self) -> DeviceSource: ...

    def install(self) -> object: ...

    def uninstall(self) -> None: ...


class NvmlBackend:
    """NVML session shared by the GPU collector, the XID listener and the recorder.

    ``fake``: a fake library to install into pynvml on :meth:`start` (and to take out, closing
    its source, on :meth:`close`); None (the default) for the real libnvidia-ml.
    """

    def __init__(self, fake: FakeLibrary | None = None) -> None:
        self._fake = fake
        #: The fake library's device source (None for the real libnvidia-ml).
        self.source: DeviceSource | None = None if fake is None else fake.source
        self.up = False
        self.init_error = "not started"
        #: Incremented on every successful init; users holding NVML objects (event sets) re-create them on change.
        self.generation = 0
        self.devices: list[Device] = []
        self.driver: DriverVersions | None = None
        self._initialized = False
        self._fake_installed = False
        self._lock = threading.RLock()
        self._errors_lock = threading.Lock()
        self._errors: dict[tuple[str, str], int] = {}
        #: Total of every counted error (cheap "did anything fail since" check for the reader's caches).
        self.error_total = 0
        #: Where callers run NVML calls that may hang: one lane per GPU label, lanes.NODE for the rest.
        self.lanes = Lanes("gpufleet-nvml", NVML_WORKERS)
        self.open_timeout = OPEN_TIMEOUT

    @property
    def fake(self) -> FakeLibrary | None:
        """The fake library given to the constructor (``--nvml.fake``), else None."""
        return self._fake

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> bool:
        """Initialize NVML and enumerate the GPUs. Never raises; sets ``up`` and ``init_error``."""
        with self._lock:
            if self.up:
                return True
            if self._fake is not None and not self._fake_installed:
                self._fake.install()
                self._fake_installed = True
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError as e:
                self._count("nvmlInit", e.value)
                self._set_down(f"nvmlInit: {error_name(e.value)} ({e})")
                return False
            self._initialized = True
            try:
                self._enumerate()
            except pynvml.NVMLError as e:
                self._count("nvmlDeviceGetCount", e.value)
                self._shutdown_quietly()
                self._set_down(f"nvmlDeviceGetCount: {error_name(e.value)} ({e})")
                return False
            self.up = True
            self.init_error = ""
            self.generation += 1
            log.info("NVML up: %d GPU(s), driver %s", len(self.devices),
                     self.driver.driver_version if self.driver else "?")
            return True

    def refresh(self) -> bool:
        """Called at the start of a scrape: (re)initialize if needed and check NVML still answers.

        Returns True when NVML answers; False means "report nvml_up 0 and nothing else".
        """
        with self._lock:
            if not self.up:
                return self.start()
            try:
                count = pynvml.nvmlDeviceGetCount()
            except pynvml.NVMLError as e:
                self._count("nvmlDeviceGetCount", e.value)
                if e.value in DOWN_CODES:
                    self._drop_devices()  # handles and GPM samples die with the session
                    self._shutdown_quietly()
                    self._set_down(f"nvmlDeviceGetCount: {error_name(e.value)} ({e})")
                return False
            if count != len(self.devices):
                log.warning("GPU count changed from %d to %d: re-enumerating", len(self.devices), count)
                self._enumerate(count)
            self._open_all([dev for dev in self.devices if dev.handle is None])
            return True

    def close(self, timeout: float = 2.0) -> None:
        """Shut NVML down (and uninstall the fake library). When an init or refresh is blocked in a call
        that does not return, NVML is left as it is after ``timeout`` seconds (no nvmlShutdown)."""
        locked = self._lock.acquire(timeout=timeout)
        try:
            if locked:
                self._drop_devices()
                self._shutdown_quietly()
            else:
                log.warning("NVML is blocked in a call that has not returned: closing without nvmlShutdown")
            self._set_down("closed")
            self.lanes.close()
            if self._fake is not None and self._fake_installed:
                self._fake.uninstall()
                self._fake_installed = False
                closer = getattr(self.source, "close", None)
                if callable(closer):
                    closer()  # stops the source's threads, removes its temporary sysfs tree
        finally:
            if locked:
                self._lock.release()

    def __enter__(self) -> NvmlBackend:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ calls

    def call(self, fn: Callable[..., T], *args: Any) -> T | None:
        """``fn(*args)``; None when NOT_SUPPORTED or on error (counted); raises GpuLost for a lost GPU."""
        try:
            return fn(*args)
        except pynvml.NVMLError as e:
            self.failed(fn.__name__, e.value)
            return None

    def failed(self, function: str, code: int) -> None:
        """Account for ``function`` returning ``code``: count it (unless NOT_SUPPORTED); raise GpuLost if lost."""
        if code == _NOT_SUPPORTED:
            return
        self._count(function, code)
        if code in LOST_CODES:
            raise GpuLost(function)

    def static(self, dev: Device, key: str, fn: Callable[..., T], *args: Any) -> T | None:
        """A fact read once per device: cached on success or NOT_SUPPORTED, retried after an error."""
        value = dev.facts.get(key, _MISSING)
        if value is not _MISSING:
            return value  # type: ignore[no-any-return]
        try:
            value = fn(*args)
        except pynvml.NVMLError as e:
            code = e.value
            if code == _NOT_SUPPORTED:
                dev.facts[key] = None
                return None
            self._count(fn.__name__, code)
            if code in LOST_CODES:
                raise GpuLost(fn.__name__) from None
            return None
        dev.facts[key] = value
        return value

    def count_error(self, function: str, code: int) -> None:
        """Count an error NVML reported inside a struct (field values, GPM metrics)."""
        if code != _NOT_SUPPORTED:
            self._count(function, code)

    def errors(self) -> dict[tuple[str, str], int]:
        """A copy of the error counters: (function, error name) -> count."""
        with self._errors_lock:
            return dict(self._errors)

    def _count(self, function: str, code: int) -> None:
        key = (function, error_name(code))
        with self._errors_lock:
            self._errors[key] = self._errors.get(key, 0) + 1
            self.error_total += 1

    # ------------------------------------------------------------------ devices and identity

    def pci_bus_ids(self) -> dict[str, str]:
        """GPU index (string) -> NVML PCI bus id ("00000000:18:00.0"), for the topology collector; empty
        until NVML is up (this never calls NVML: initialization runs on the lanes, where it may hang)."""
        return {d.label: bus for d in self.devices if (bus := d.fact("pci_bus_id"))}

    def identify(self, dev: Device) -> None:
        """Read the device's static facts (each once; errored ones are retried on the next call)."""
        if dev.handle is None or dev.identified:
            return
        h = dev.handle
        st = self.static
        st(dev, "uuid", pynvml.nvmlDeviceGetUUID, h)
        st(dev, "name", pynvml.nvmlDeviceGetName, h)
        st(dev, "serial", pynvml.nvmlDeviceGetSerial, h)
        pci = st(dev, "pci", pynvml.nvmlDeviceGetPciInfo, h)
        if pci is not None and "pci_bus_id" not in dev.facts:
            dev.facts["pci_bus_id"] = _text(pci.busId) or _text(pci.busIdLegacy)
        st(dev, "vbios_version", pynvml.nvmlDeviceGetVbiosVersion, h)
        st(dev, "architecture", pynvml.nvmlDeviceGetArchitecture, h)
        st(dev, "minor_number", pynvml.nvmlDeviceGetMinorNumber, h)
        st(dev, "cuda_compute_capability", pynvml.nvmlDeviceGetCudaComputeCapability, h)
        for key, clock in (("max_clock_sm", pynvml.NVML_CLOCK_SM), ("max_clock_memory", pynvml.NVML_CLOCK_MEM),
                           ("max_clock_graphics", pynvml.NVML_CLOCK_GRAPHICS)):
            st(dev, key, pynvml.nvmlDeviceGetMaxClockInfo, h, clock)
        for key, thr in THRESHOLDS:
            st(dev, key, pynvml.nvmlDeviceGetTemperatureThreshold, h, thr)
        st(dev, "pcie_max_gen", pynvml.nvmlDeviceGetMaxPcieLinkGeneration, h)
        st(dev, "pcie_max_width", pynvml.nvmlDeviceGetMaxPcieLinkWidth, h)
        if dev.fans is None:
            fans = st(dev, "num_fans", pynvml.nvmlDeviceGetNumFans, h)
            if fans is not None or "num_fans" in dev.facts:
                dev.fans = int(fans or 0)
        if dev.nvlinks is None:
            dev.nvlinks = self._probe_nvlinks(dev, h)
        if dev.gpm_supported is None:
            support = st(dev, "gpm_support", pynvml.nvmlGpmQueryDeviceSupport, h)
            if "gpm_support" in dev.facts:
                dev.gpm_supported = bool(support is not None and support.isSupportedDevice)
        dev.identified = (
            all(k in dev.facts for k in _FACT_KEYS)
            and dev.fans is not None and dev.nvlinks is not None and dev.gpm_supported is not None
        )

    def inventory(self, dev: Device) -> GpuInventory:
        """The device's static facts as the model's :class:`GpuInventory` (for traces)."""
        f = dev.facts
        cc = f.get("cuda_compute_capability")
        mem = f.get("memory_total_bytes")
        return GpuInventory(
            index=dev.index,
            uuid=f.get("uuid") or "",
            name=f.get("name") or "",
            serial=f.get("serial"),
            pci_bus_id=f.get("pci_bus_id") or "",
            vbios_version=f.get("vbios_version"),
            architecture=int(f.get("architecture") or 0),
            cuda_compute_capability=(int(cc[0]), int(cc[1])) if cc else (0, 0),
            minor_number=int(f.get("minor_number") or 0),
            memory_total_bytes=int(mem or 0),
            power_limit_default_mw=None,
            power_limit_min_mw=None,
            power_limit_max_mw=None,
            temp_slowdown_c=f.get("temp_slowdown"),
            temp_shutdown_c=f.get("temp_shutdown"),
            temp_gpu_max_c=f.get("temp_gpu_max"),
            temp_memory_max_c=f.get("temp_memory_max"),
            max_clock_sm_mhz=f.get("max_clock_sm"),
            max_clock_memory_mhz=f.get("max_clock_memory"),
            max_clock_graphics_mhz=f.get("max_clock_graphics"),
            pcie_max_gen=f.get("pcie_max_gen"),
            pcie_max_width=f.get("pcie_max_width"),
            nvlink_count=len(dev.nvlinks or ()),
            fan_count=dev.fans or 0,
            gpm_supported=bool(dev.gpm_supported),
        )

    def _probe_nvlinks(self, dev: Device, h: pynvml.c_nvmlDevice_t) -> tuple[int, ...] | None:
        links: list[int] = []
        for link in range(int(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                pynvml.nvmlDeviceGetNvLinkState(h, link)
            except pynvml.NVMLError as e:
                if e.value in _NO_SUCH_LINK:
                    break
                self._count("nvmlDeviceGetNvLinkState", e.value)
                if e.value in LOST_CODES:
                    raise GpuLost("nvmlDeviceGetNvLinkState") from None
                return None  # unknown: probe again next time
            links.append(link)
        return tuple(links)

    def _open(self, dev: Device) -> None:
        try:
            dev.handle = pynvml.nvmlDeviceGetHandleByIndex(dev.index)
        except pynvml.NVMLError as e:
            self._count("nvmlDeviceGetHandleByIndex", e.value)
            dev.lost = dev.lost or e.value in LOST_CODES
            return
        try:
            self.identify(dev)
        except GpuLost:
            dev.lost = True

    @waits_on_lanes
    def _open_all(self, devices: list[Device]) -> None:
        """Open and identify ``devices`` in parallel, each on its own lane, waiting at most ``open_timeout``
        seconds in all: a GPU whose lane is still busy (a call from before that has not returned) is skipped,
        one that misses the bound is left unopened, named once in the log (see OPEN_TIMEOUT)."""
        if not devices:
            return
        deadline = time.monotonic() + self.open_timeout
        jobs = [(dev, self.lanes.submit(dev.label, "open", partial(self._open, dev))) for dev in devices]
        for dev, job in jobs:
            if job is None:
                continue
            if not job.wait(deadline):
                log.error("GPU %s: NVML has not answered its identification after %g s: serving the other GPUs; "
                          "it is opened once its calls return", dev.label, self.open_timeout)
            elif job.error is not None:
                log.error("GPU %s: identification failed: %s: %s", dev.label, type(job.error).__name__, job.error)

    def _enumerate(self, count: int | None = None) -> None:
        if count is None:
            count = pynvml.nvmlDeviceGetCount()
        old = {d.index: d for d in self.devices}
        devices = [old.pop(i) if i in old else Device(index=i) for i in range(count)]
        self._open_all([dev for dev in devices if dev.handle is None])
        for dev in old.values():
            closer = getattr(dev.reader_state, "close", None)
            if callable(closer):
                closer()
        self.devices = devices
        self.driver = self._driver_versions()

    def _driver_versions(self) -> DriverVersions:
        drv = self.call(pynvml.nvmlSystemGetDriverVersion) or ""
        nvml = self.call(pynvml.nvmlSystemGetNVMLVersion) or ""
        cuda = self.call(pynvml.nvmlSystemGetCudaDriverVersion)
        cuda_text = f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else ""
        return DriverVersions(str(drv), str(nvml), cuda_text, cuda)

    def _drop_devices(self) -> None:
        for dev in self.devices:
            closer = getattr(dev.reader_state, "close", None)
            if callable(closer):
                closer()
        self.devices = []

    def _set_down(self, reason: str) -> None:
        repeated = reason == self.init_error
        self.up = False
        self.init_error = reason
        if reason == "closed" or repeated:  # retried on every scrape: say it once
            log.debug("NVML down: %s", reason)
        else:
            log.warning("NVML down: %s (retrying on later scrapes)", reason)

    def _shutdown_quietly(self) -> None:
        if not self._initialized:
            return
        self._initialized = False
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as e:
            log.debug("nvmlShutdown: %s", e)


#: (fact key, NVML threshold) pairs read once per device.
THRESHOLDS: tuple[tuple[str, int], ...] = (
    ("temp_slowdown", pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
    ("temp_shutdown", pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),
    ("temp_gpu_max", pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX),
    ("temp_memory_max", pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX),
)


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value) if value else ""

_FACT_KEYS = (
    "uuid", "name", "serial", "pci", "vbios_version", "architecture", "minor_number", "cuda_compute_capability",
    "max_clock_sm", "max_clock_memory", "max_clock_graphics", "pcie_max_gen", "pcie_max_width",
    *(k for k, _ in THRESHOLDS),
)
