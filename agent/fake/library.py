"""A pure-Python stand-in for libnvidia-ml that answers pynvml's C calls from a DeviceSource.

pynvml resolves every entry point with ``getattr(pynvml.nvmlLib, "nvmlXxx")`` and
calls it with ctypes objects (``byref(...)`` out-parameters, ``c_char`` buffers
with a length, versioned structs, opaque ``c_nvmlDevice_t`` pointers). Installing
a :class:`FakeNvml` replaces ``pynvml.nvmlLib`` with an object that has exactly
the entry points implemented here, so the agent's real pynvml calls run unchanged
on a machine without a GPU:

    with FakeNvml(source) as fake:
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        pynvml.nvmlDeviceGetPowerUsage(h)      # source.sample(0).power_mw

Behaviour mirrors NVML where it matters to a monitoring agent:

* calls before ``nvmlInit`` (or after the last ``nvmlShutdown``) return
  ``NVML_ERROR_UNINITIALIZED``; init is reference counted;
* ``driver_loaded = False`` makes ``nvmlInit`` fail with ``DRIVER_NOT_LOADED``;
* a ``None`` field in the source's data means ``NVML_ERROR_NOT_SUPPORTED``;
* ``nvmlDeviceGetFieldValues`` answers the link-scoped NVLink fields (GET_STATE,
  ERROR_DL_REPLAY / _RECOVERY / _CRC, scopeId = link) from the same NvLinkSample as
  nvmlDeviceGetNvLinkState / nvmlDeviceGetNvLinkErrorCounter (data CRC is per-call only);
* a sample with ``lost=True`` makes every call for that device return
  ``NVML_ERROR_GPU_IS_LOST`` (handles can still be obtained, as an agent that
  started before the GPU fell off the bus already holds them);
* entry points not implemented are absent, so pynvml raises
  ``NVMLError_FunctionNotFound`` instead of silently succeeding;
* :meth:`FakeNvml.inject_error` makes chosen calls (by C entry point or pynvml
  wrapper name, device, or field id inside ``nvmlDeviceGetFieldValues``) fail
  with any NVML return code.

Device handles are fake pointer values that are never dereferenced;
``nvmlDeviceGetIndex`` maps one back to its index.
"""

from __future__ import annotations

import ctypes
import itertools
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any

import pynvml

from gpufleet.agent.nvml.hardware import ARCH_UNKNOWN
from gpufleet.agent.nvml.model import DeviceSource, GpmCounters, GpuInventory, GpuSample, XidEvent

SUCCESS: int = pynvml.NVML_SUCCESS
UNINITIALIZED: int = pynvml.NVML_ERROR_UNINITIALIZED
INVALID_ARGUMENT: int = pynvml.NVML_ERROR_INVALID_ARGUMENT
NOT_SUPPORTED: int = pynvml.NVML_ERROR_NOT_SUPPORTED
NOT_FOUND: int = pynvml.NVML_ERROR_NOT_FOUND
INSUFFICIENT_SIZE: int = pynvml.NVML_ERROR_INSUFFICIENT_SIZE
DRIVER_NOT_LOADED: int = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
TIMEOUT: int = pynvml.NVML_ERROR_TIMEOUT
GPU_IS_LOST: int = pynvml.NVML_ERROR_GPU_IS_LOST
ARGUMENT_VERSION_MISMATCH: int = pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
UNKNOWN: int = pynvml.NVML_ERROR_UNKNOWN

_ERROR_STRINGS: dict[int, str] = {
    SUCCESS: "Success",
    UNINITIALIZED: "Uninitialized",
    INVALID_ARGUMENT: "Invalid Argument",
    NOT_SUPPORTED: "Not Supported",
    pynvml.NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    pynvml.NVML_ERROR_ALREADY_INITIALIZED: "Already Initialized",
    NOT_FOUND: "Not Found",
    INSUFFICIENT_SIZE: "Insufficient Size",
    DRIVER_NOT_LOADED: "Driver Not Loaded",
    TIMEOUT: "Timeout",
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    GPU_IS_LOST: "GPU is lost",
    pynvml.NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
    ARGUMENT_VERSION_MISMATCH: "Argument version mismatch",
    UNKNOWN: "Unknown Error",
}

# PCI ids of an H100 SXM5 80GB (the only board the built-in sources model).
_PCI_DEVICE_ID = 0x233010DE
_PCI_SUBSYSTEM_ID = 0x16C110DE

_FIELD_CLOCK_EVENT: dict[int, str] = {
    pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP: "sw_power_cap",
    pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST: "sync_boost",
    pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN: "sw_thermal_slowdown",
    pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN: "hw_thermal_slowdown",
    pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN: "hw_power_brake_slowdown",
}

_FI_NVLINK_TX: int = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
_FI_NVLINK_RX: int = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
_FI_MEMORY_TEMP: int = pynvml.NVML_FI_DEV_MEMORY_TEMP
_FI_NVLINK_LINK_COUNT: int = pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT
_ULL: int = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
_UI: int = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
#: Link-scoped NVLink fields (scopeId = link), as DCGM reads them on Hopper: field id -> NvLinkSample attribute.
_FI_NVLINK_SCOPED: dict[int, str] = {
    pynvml.NVML_FI_DEV_NVLINK_GET_STATE: "up",
    pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY: "replay",
    pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY: "recovery",
    pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_CRC: "crc_flit",
}

_NVLINK_ERROR_COUNTER: dict[int, str] = {
    pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: "crc_flit",
    pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA: "crc_data",
    pynvml.NVML_NVLINK_ERROR_DL_REPLAY: "replay",
    pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: "recovery",
}

_MIB = float(2**20)

# GPM metric id -> (short name, unit, how to compute it from two GpmCounters and the interval).
_GpmFn = Callable[[GpmCounters, GpmCounters, float], float]


def _pct(attr: str) -> _GpmFn:
    def f(a: GpmCounters, b: GpmCounters, dt: float) -> float:
        return min(100.0, max(0.0, 100.0 * float(getattr(b, attr) - getattr(a, attr)) / dt))

    return f


def _mib_s(attr: str) -> _GpmFn:
    def f(a: GpmCounters, b: GpmCounters, dt: float) -> float:
        return max(0.0, float(getattr(b, attr) - getattr(a, attr)) / dt / _MIB)

    return f


_GPM_METRICS: dict[int, tuple[bytes, bytes, _GpmFn]] = {
    pynvml.NVML_GPM_METRIC_SM_UTIL: (b"SM_UTIL", b"%", _pct("sm_active_s")),
    pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: (b"SM_OCCUPANCY", b"%", _pct("sm_occupancy_s")),
    pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: (b"ANY_TENSOR_UTIL", b"%", _pct("tensor_active_s")),
    pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: (b"DRAM_BW_UTIL", b"%", _pct("dram_active_s")),
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: (b"NVLINK_TOTAL_TX_PER_SEC", b"MiB/s", _mib_s("nvlink_tx_bytes")),
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: (b"NVLINK_TOTAL_RX_PER_SEC", b"MiB/s", _mib_s("nvlink_rx_bytes")),
    pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: (b"PCIE_TX_PER_SEC", b"MiB/s", _mib_s("pcie_tx_bytes")),
    pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: (b"PCIE_RX_PER_SEC", b"MiB/s", _mib_s("pcie_rx_bytes")),
}

_SUPPORTED_EVENTS: int = pynvml.nvmlEventTypeXidCriticalError

#: Entry points that work without nvmlInit.
_NO_INIT = frozenset({"nvmlInit", "nvmlInit_v2", "nvmlInitWithFlags", "nvmlErrorString"})

#: pynvml wrapper names whose C entry point has a different base name.
_ALIASES = {"nvmlInit": "nvmlInitWithFlags", "nvmlInit_v2": "nvmlInitWithFlags"}

_POLL_STEP_S = 0.02


def _norm(name: str) -> str:
    name = _ALIASES.get(name, name)
    return re.sub(r"_v\d+$", "", name)


def _int(x: Any) -> int:
    """The integer behind a ctypes scalar or a plain int."""
    return int(x.value) if hasattr(x, "value") else int(x)


def _target(ref: Any) -> Any:
    """The object a ``byref(...)`` argument points at (or the object itself)."""
    return ref._obj if hasattr(ref, "_obj") else ref


def _addr(ptr: Any) -> int | None:
    """The address held by an opaque handle (a ctypes pointer, c_void_p or int)."""
    if ptr is None:
        return None
    if isinstance(ptr, int):
        return ptr
    if isinstance(ptr, ctypes.c_void_p):
        return ptr.value
    if hasattr(ptr, "contents"):  # a ctypes pointer: its target's address is the handle value
        try:
            return ctypes.addressof(ptr.contents)
        except ValueError:  # NULL
            return None
    try:
        return ctypes.cast(ptr, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None


def _set_pointer(ref: Any, value: int) -> None:
    """Store ``value`` in the pointer object ``ref`` points at."""
    obj = _target(ref)
    ctypes.c_void_p.from_address(ctypes.addressof(obj)).value = value


def _write_str(buf: Any, length: Any, text: str) -> int:
    data = text.encode()
    if len(data) + 1 > _int(length):
        return INSUFFICIENT_SIZE
    buf.value = data
    return SUCCESS


def _set(ref: Any, value: int | None) -> int:
    if value is None:
        return NOT_SUPPORTED
    _target(ref).value = int(value)
    return SUCCESS


@dataclass
class _Rule:
    code: int
    function: str | None
    gpu: int | None
    field: int | None


@dataclass
class _Dev:
    index: int
    inv: GpuInventory
    sample: GpuSample


@dataclass
class _GpmSample:
    index: int | None = None
    timestamp: float = 0.0
    counters: GpmCounters | None = None


@dataclass
class _EventSet:
    devices: set[int] = field(default_factory=set)
    queue: list[XidEvent] = field(default_factory=list)


#: Entry points that read one value of the device into their single out-parameter: C name -> the value
#: (None = NOT_SUPPORTED, as for every entry point).
_SCALAR_ENTRY_POINTS: dict[str, Callable[[_Dev], Any]] = {
    "nvmlDeviceGetIndex": lambda d: d.index,
    # 0 is no NVML id: older traces and snapshots wrote it for "unknown", which NVML answers as ARCH_UNKNOWN.
    "nvmlDeviceGetArchitecture": lambda d: d.inv.architecture or ARCH_UNKNOWN,
    "nvmlDeviceGetMinorNumber": lambda d: d.inv.minor_number,
    "nvmlDeviceGetPowerUsage": lambda d: d.sample.power_mw,
    "nvmlDeviceGetEnforcedPowerLimit": lambda d: d.sample.power_limit_mw,
    "nvmlDeviceGetPowerManagementDefaultLimit": lambda d: d.inv.power_limit_default_mw,
    "nvmlDeviceGetTotalEnergyConsumption": lambda d: d.sample.energy_mj,
    "nvmlDeviceGetNumFans": lambda d: d.inv.fan_count,
    "nvmlDeviceGetPerformanceState": lambda d: d.sample.pstate,
    "nvmlDeviceGetCurrentClocksEventReasons": lambda d: d.sample.clocks_event_reasons,
    "nvmlDeviceGetCurrentClocksThrottleReasons": lambda d: d.sample.clocks_event_reasons,
    "nvmlDeviceGetCurrPcieLinkGeneration": lambda d: d.sample.pcie_gen,
    "nvmlDeviceGetCurrPcieLinkWidth": lambda d: d.sample.pcie_width,
    "nvmlDeviceGetMaxPcieLinkGeneration": lambda d: d.inv.pcie_max_gen,
    "nvmlDeviceGetMaxPcieLinkWidth": lambda d: d.inv.pcie_max_width,
    "nvmlDeviceGetPcieReplayCounter": lambda d: d.sample.pcie_replay_counter,
    "nvmlDeviceGetSupportedEventTypes": lambda d: _SUPPORTED_EVENTS,
}


class _Entry:
    """One exported "C function": callable, and accepts ``restype``/``argtypes`` like a ctypes function.

    The implementation, its normalized name and whether it needs ``nvmlInit`` are bound once
    (pynvml caches the entry point), so a call costs one lock and one Python call.
    """

    def __init__(self, fake: FakeNvml, name: str) -> None:
        self.__name__ = name
        self._fake = fake
        self._impl = fake._impl[name]
        self._normed = fake._normed[name]
        self._needs_init = name not in _NO_INIT
        self.restype: Any = ctypes.c_int
        self.argtypes: Any = None

    def __call__(self, *args: Any) -> Any:
        fake = self._fake
        if fake.cpu_accounting:
            t0 = time.thread_time()
            try:
                return self._dispatch(fake, args)
            finally:
                fake.cpu_seconds += time.thread_time() - t0
        return self._dispatch(fake, args)

    def _dispatch(self, fake: FakeNvml, args: tuple[Any, ...]) -> Any:
        with fake._lock:
            try:
                if self._needs_init and fake._refcount == 0:
                    return UNINITIALIZED
                if fake._rules:
                    code = fake._system_rule(self._normed)
                    if code is not None:
                        return code
                return self._impl(*args)
            except Exception as e:  # a broken source must not take the agent down
                fake.last_exception = e
                return UNKNOWN


class _UnlockedEntry(_Entry):
    """nvmlErrorString (no init, no rules) and nvmlEventSetWait_v2 (blocks: takes the lock itself)."""

    def _dispatch(self, fake: FakeNvml, args: tuple[Any, ...]) -> Any:
        try:
            if self.__name__ == "nvmlErrorString":
                return self._impl(*args)
            if fake._refcount == 0:
                return UNINITIALIZED
            if fake._rules:
                with fake._lock:
                    code = fake._system_rule(self._normed)
                if code is not None:
                    return code
            return self._impl(*args)
        except Exception as e:
            fake.last_exception = e
            return UNKNOWN


_UNLOCKED = frozenset({"nvmlErrorString", "nvmlEventSetWait_v2"})


class _FakeLib:
    """What ``pynvml.nvmlLib`` becomes: attribute lookup yields the implemented entry points only."""

    def __init__(self, fake: FakeNvml) -> None:
        self._fake = fake
        self._entries: dict[str, _Entry] = {}

    def __getattr__(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is not None:
            return entry
        if name.startswith("_") or name not in self._fake._impl:
            raise AttributeError(name)
        entry = (_UnlockedEntry if name in _UNLOCKED else _Entry)(self._fake, name)
        self._entries[name] = entry
        return entry


class FakeNvml:
    """A fake libnvidia-ml backed by ``source``; see the module docstring."""

    _instances = itertools.count(1)

    def __init__(self, source: DeviceSource) -> None:
        self.source = source
        self.driver_loaded = True
        #: the last exception a source raised inside a call (the call returned NVML_ERROR_UNKNOWN)
        self.last_exception: BaseException | None = None
        self._lock = threading.RLock()
        self._refcount = 0
        self._rules: list[_Rule] = []
        base = 0x7F5A_0000_0000 + (next(self._instances) % 0xFFFF) * 0x1_0000_0000
        self._dev_base = base
        self._gpm_base = base + 0x1000_0000
        self._set_base = base + 0x2000_0000
        self._gpm: dict[int, _GpmSample] = {}
        self._sets: dict[int, _EventSet] = {}
        self._ids = itertools.count(1)
        self._lib = _FakeLib(self)
        self._previous: Any = None
        self._installed = False
        self._impl: dict[str, Callable[..., int]] = {
            name[3:]: getattr(self, name) for name in dir(type(self)) if name.startswith("_c_nvml")
        }
        self._impl.update({name: self._scalar_entry(name, get) for name, get in _SCALAR_ENTRY_POINTS.items()})
        self._normed = {name: _norm(name) for name in self._impl}
        #: Benchmarks: when True, every entry point adds its thread CPU time to ``cpu_seconds`` (the time a
        #: real host spends inside libnvidia-ml, which this fake and its source stand in for).
        self.cpu_accounting = False
        self.cpu_seconds = 0.0
        self._devs: dict[int, _Dev] = {}
        #: Signalled when the source has new XID events (sources with ``add_xid_listener``) or on shutdown.
        self._xid_cond = threading.Condition(self._lock)
        self._xid_pushed = False
        listen = getattr(source, "add_xid_listener", None)
        self._xid_push = callable(listen)
        if callable(listen):
            listen(self._on_xid)

    # ------------------------------------------------------------------ public API

    def entry_points(self) -> frozenset[str]:
        """The C entry point names this fake exports."""
        return frozenset(self._impl)

    def install(self) -> FakeNvml:
        """Make pynvml call this fake (remembers the library pynvml had before)."""
        with pynvml.libLoadLock:
            if self._installed:
                raise RuntimeError("this FakeNvml is already installed")
            self._previous = pynvml.nvmlLib
            pynvml.nvmlLib = self._lib
            pynvml._nvmlGetFunctionPointer_cache.clear()
            self._installed = True
        return self

    def uninstall(self) -> None:
        """Give pynvml back the library it had before :meth:`install`."""
        with pynvml.libLoadLock:
            if not self._installed:
                return
            pynvml.nvmlLib = self._previous
            pynvml._nvmlGetFunctionPointer_cache.clear()
            self._previous = None
            self._installed = False

    def __enter__(self) -> FakeNvml:
        return self.install()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.uninstall()

    def inject_error(
        self, code: int, *, function: str | None = None, gpu: int | None = None, field: int | None = None
    ) -> None:
        """Make matching calls return ``code``.

        ``function`` is a C entry point ("nvmlDeviceGetPciInfo_v3") or pynvml wrapper name
        ("nvmlDeviceGetPciInfo"); ``None`` means every call that takes a device (except
        nvmlDeviceGetHandleByIndex, which fails only when named). ``gpu`` limits the rule to
        one device index. ``field`` makes only that field id inside nvmlDeviceGetFieldValues
        carry ``code`` in its nvmlReturn while the call and the other fields succeed.
        """
        if function is not None:
            known = {_norm(n) for n in self._impl}
            if _norm(function) not in known:
                raise ValueError(f"unknown NVML function {function!r}: the fake does not implement it")
            function = _norm(function)
        if field is not None and function not in (None, "nvmlDeviceGetFieldValues"):
            raise ValueError("a field error applies to nvmlDeviceGetFieldValues only")
        if code == SUCCESS:
            raise ValueError("inject a non-zero NVML return code")
        with self._lock:
            self._rules.append(_Rule(int(code), function, gpu, field))

    def clear_errors(self) -> None:
        with self._lock:
            self._rules.clear()

    def handle_address(self, index: int) -> int:
        """The fake pointer value of device ``index``'s handle."""
        return self._dev_base + (index + 1) * 0x100

    # ------------------------------------------------------------------ dispatch

    def _system_rule(self, n: str) -> int | None:
        """A rule naming this call (normalized name ``n``) and no device (device calls: :meth:`_dev`)."""
        for r in self._rules:
            if r.function == n and r.gpu is None and r.field is None:
                return r.code
        return None

    def _device_rule(self, name: str, index: int, *, wildcard: bool = True) -> int | None:
        if not self._rules:
            return None
        n = self._normed[name]
        for r in self._rules:
            if r.field is not None:
                continue
            if r.gpu is not None and r.gpu != index:
                continue
            if r.function == n or (r.function is None and wildcard):
                return r.code
        return None

    def _dev(self, name: str, handle: Any) -> _Dev | int:
        """The device behind ``handle`` with its current sample, or the error code the call returns."""
        addr = _addr(handle)
        if addr is None:
            return INVALID_ARGUMENT
        off = addr - self._dev_base
        inventory = self.source.inventory()
        if off <= 0 or off % 0x100 or off // 0x100 > len(inventory):
            return INVALID_ARGUMENT
        index = off // 0x100 - 1
        if self._rules:
            code = self._device_rule(name, index)
            if code is not None:
                return code
        sample = self.source.sample(index)
        if sample.lost:
            return GPU_IS_LOST
        d = self._devs.get(index)
        if d is None or d.sample is not sample or d.inv is not inventory[index]:
            d = self._devs[index] = _Dev(index, inventory[index], sample)
        return d

    # ------------------------------------------------------------------ init / system

    def _scalar_entry(self, name: str, get: Callable[[_Dev], Any]) -> Callable[[Any, Any], int]:
        """The C entry point ``name`` that writes ``get(device)`` into its out-parameter."""

        def entry(handle: Any, out: Any) -> int:
            d = self._dev(name, handle)
            return d if isinstance(d, int) else _set(out, get(d))

        return entry

    def _c_nvmlInitWithFlags(self, flags: Any = 0) -> int:
        if not self.driver_loaded:
            return DRIVER_NOT_LOADED
        self._refcount += 1
        return SUCCESS

    def _c_nvmlInit_v2(self) -> int:
        return self._c_nvmlInitWithFlags(0)

    def _c_nvmlInit(self) -> int:
        return self._c_nvmlInitWithFlags(0)

    def _c_nvmlShutdown(self) -> int:
        self._refcount -= 1
        if self._refcount == 0:
            self._gpm.clear()
            self._sets.clear()
            self._devs.clear()
            self._xid_cond.notify_all()  # blocked waits return UNINITIALIZED now
        return SUCCESS

    def _c_nvmlErrorString(self, code: Any) -> bytes:
        c = _int(code)
        return _ERROR_STRINGS.get(c, f"Unknown NVML error code {c}").encode()

    def _c_nvmlSystemGetDriverVersion(self, buf: Any, length: Any) -> int:
        return _write_str(buf, length, self.source.driver().driver_version)

    def _c_nvmlSystemGetNVMLVersion(self, buf: Any, length: Any) -> int:
        return _write_str(buf, length, self.source.driver().nvml_version)

    def _c_nvmlSystemGetCudaDriverVersion(self, out: Any) -> int:
        return _set(out, self.source.driver().cuda_driver_version)

    def _c_nvmlSystemGetCudaDriverVersion_v2(self, out: Any) -> int:
        return _set(out, self.source.driver().cuda_driver_version)

    # ------------------------------------------------------------------ identity

    def _c_nvmlDeviceGetCount_v2(self, out: Any) -> int:
        return _set(out, len(self.source.inventory()))

    def _c_nvmlDeviceGetHandleByIndex_v2(self, index: Any, out: Any) -> int:
        i = _int(index)
        if not 0 <= i < len(self.source.inventory()):
            return INVALID_ARGUMENT
        code = self._device_rule("nvmlDeviceGetHandleByIndex_v2", i, wildcard=False)
        if code is not None:
            return code
        _set_pointer(out, self.handle_address(i))
        return SUCCESS

    def _c_nvmlDeviceGetUUID(self, handle: Any, buf: Any, length: Any) -> int:
        d = self._dev("nvmlDeviceGetUUID", handle)
        return d if isinstance(d, int) else _write_str(buf, length, d.inv.uuid)

    def _c_nvmlDeviceGetName(self, handle: Any, buf: Any, length: Any) -> int:
        d = self._dev("nvmlDeviceGetName", handle)
        return d if isinstance(d, int) else _write_str(buf, length, d.inv.name)

    def _c_nvmlDeviceGetSerial(self, handle: Any, buf: Any, length: Any) -> int:
        d = self._dev("nvmlDeviceGetSerial", handle)
        if isinstance(d, int):
            return d
        return NOT_SUPPORTED if d.inv.serial is None else _write_str(buf, length, d.inv.serial)

    def _c_nvmlDeviceGetVbiosVersion(self, handle: Any, buf: Any, length: Any) -> int:
        d = self._dev("nvmlDeviceGetVbiosVersion", handle)
        if isinstance(d, int):
            return d
        v = d.inv.vbios_version
        return NOT_SUPPORTED if v is None else _write_str(buf, length, v)

    def _c_nvmlDeviceGetPciInfo_v3(self, handle: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetPciInfo_v3", handle)
        if isinstance(d, int):
            return d
        m = re.fullmatch(r"([0-9a-fA-F]+):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])", d.inv.pci_bus_id)
        if m is None:
            return UNKNOWN
        domain, bus, dev = (int(m.group(i), 16) for i in (1, 2, 3))
        info = _target(out)
        info.busId = f"{domain:08X}:{bus:02X}:{dev:02X}.{m.group(4)}".encode()
        info.busIdLegacy = f"{domain:04X}:{bus:02X}:{dev:02X}.{m.group(4)}".encode()
        info.domain, info.bus, info.device = domain, bus, dev
        info.pciDeviceId = _PCI_DEVICE_ID
        info.pciSubSystemId = _PCI_SUBSYSTEM_ID
        return SUCCESS

    def _c_nvmlDeviceGetCudaComputeCapability(self, handle: Any, major: Any, minor: Any) -> int:
        d = self._dev("nvmlDeviceGetCudaComputeCapability", handle)
        if isinstance(d, int):
            return d
        cc = d.inv.cuda_compute_capability
        if cc is None or cc == (0, 0):  # not known (older traces wrote (0, 0) for it)
            return NOT_SUPPORTED
        _set(major, cc[0])
        return _set(minor, cc[1])

    # ------------------------------------------------------------------ readings

    def _c_nvmlDeviceGetUtilizationRates(self, handle: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetUtilizationRates", handle)
        if isinstance(d, int):
            return d
        s = d.sample
        if s.utilization_gpu_pct is None or s.utilization_memory_pct is None:
            return NOT_SUPPORTED
        u = _target(out)
        u.gpu, u.memory = s.utilization_gpu_pct, s.utilization_memory_pct
        return SUCCESS

    def _c_nvmlDeviceGetClockInfo(self, handle: Any, clock: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetClockInfo", handle)
        if isinstance(d, int):
            return d
        c, s = _int(clock), d.sample
        values = {
            pynvml.NVML_CLOCK_GRAPHICS: s.clock_graphics_mhz,
            pynvml.NVML_CLOCK_SM: s.clock_sm_mhz,
            pynvml.NVML_CLOCK_MEM: s.clock_memory_mhz,
            pynvml.NVML_CLOCK_VIDEO: None,
        }
        return _set(out, values[c]) if c in values else INVALID_ARGUMENT

    def _c_nvmlDeviceGetMaxClockInfo(self, handle: Any, clock: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetMaxClockInfo", handle)
        if isinstance(d, int):
            return d
        c, inv = _int(clock), d.inv
        values = {
            pynvml.NVML_CLOCK_GRAPHICS: inv.max_clock_graphics_mhz,
            pynvml.NVML_CLOCK_SM: inv.max_clock_sm_mhz,
            pynvml.NVML_CLOCK_MEM: inv.max_clock_memory_mhz,
            pynvml.NVML_CLOCK_VIDEO: None,
        }
        return _set(out, values[c]) if c in values else INVALID_ARGUMENT

    def _c_nvmlDeviceGetPowerManagementLimitConstraints(self, handle: Any, lo: Any, hi: Any) -> int:
        d = self._dev("nvmlDeviceGetPowerManagementLimitConstraints", handle)
        if isinstance(d, int):
            return d
        if d.inv.power_limit_min_mw is None or d.inv.power_limit_max_mw is None:
            return NOT_SUPPORTED
        _set(lo, d.inv.power_limit_min_mw)
        return _set(hi, d.inv.power_limit_max_mw)

    def _c_nvmlDeviceGetTemperature(self, handle: Any, sensor: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetTemperature", handle)
        if isinstance(d, int):
            return d
        if _int(sensor) != pynvml.NVML_TEMPERATURE_GPU:
            return INVALID_ARGUMENT
        return _set(out, d.sample.temperature_gpu_c)

    def _c_nvmlDeviceGetTemperatureThreshold(self, handle: Any, threshold: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetTemperatureThreshold", handle)
        if isinstance(d, int):
            return d
        t, inv = _int(threshold), d.inv
        values = {
            pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: inv.temp_shutdown_c,
            pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: inv.temp_slowdown_c,
            pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX: inv.temp_memory_max_c,
            pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX: inv.temp_gpu_max_c,
        }
        if t in values:
            return _set(out, values[t])
        return NOT_SUPPORTED if 0 <= t < pynvml.NVML_TEMPERATURE_THRESHOLD_COUNT else INVALID_ARGUMENT

    def _c_nvmlDeviceGetFanSpeed_v2(self, handle: Any, fan: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetFanSpeed_v2", handle)
        if isinstance(d, int):
            return d
        f = _int(fan)
        if d.inv.fan_count == 0:
            return NOT_SUPPORTED
        if not 0 <= f < d.inv.fan_count:
            return INVALID_ARGUMENT
        speeds = d.sample.fan_speed_pct
        if speeds is None or f >= len(speeds):
            return NOT_SUPPORTED
        return _set(out, speeds[f])

    def _memory(self, d: _Dev) -> tuple[int, int, int, int] | None:
        s = d.sample
        if s.memory_used_bytes is None or s.memory_reserved_bytes is None:
            return None
        total = d.inv.memory_total_bytes
        free = max(0, total - s.memory_reserved_bytes - s.memory_used_bytes)
        return total, s.memory_reserved_bytes, s.memory_used_bytes, free

    def _c_nvmlDeviceGetMemoryInfo_v2(self, handle: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetMemoryInfo_v2", handle)
        if isinstance(d, int):
            return d
        m = _target(out)
        if m.version != pynvml.nvmlMemory_v2:
            return ARGUMENT_VERSION_MISMATCH
        mem = self._memory(d)
        if mem is None:
            return NOT_SUPPORTED
        m.total, m.reserved, m.used, m.free = mem
        return SUCCESS

    def _c_nvmlDeviceGetMemoryInfo(self, handle: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetMemoryInfo", handle)
        if isinstance(d, int):
            return d
        mem = self._memory(d)
        if mem is None:
            return NOT_SUPPORTED
        total, reserved, used, free = mem
        m = _target(out)
        m.total, m.used, m.free = total, used + reserved, free  # v1 counts reserved memory as used
        return SUCCESS

    # ------------------------------------------------------------------ field values

    def _field(self, d: _Dev, fid: int, scope: int) -> tuple[int, int, int | None]:
        """(nvmlReturn, valueType, value) of one field id."""
        s = d.sample
        if fid in (_FI_NVLINK_TX, _FI_NVLINK_RX):  # most of the request: one TX and one RX per link
            count = d.inv.nvlink_count
            if count == 0:
                return NOT_SUPPORTED, _ULL, None
            if not 0 <= scope < count:
                return INVALID_ARGUMENT, _ULL, None
            links = s.nvlink
            if links is None or scope >= len(links):
                return NOT_SUPPORTED, _ULL, None
            v = links[scope].tx_kib if fid == _FI_NVLINK_TX else links[scope].rx_kib
            return (NOT_SUPPORTED, _ULL, None) if v is None else (SUCCESS, _ULL, v)
        attr = _FI_NVLINK_SCOPED.get(fid)
        if attr is not None:  # the slow tier: link state and error counters, one entry per link
            count = d.inv.nvlink_count
            if count == 0:
                return NOT_SUPPORTED, _ULL, None
            if not 0 <= scope < count:
                return INVALID_ARGUMENT, _ULL, None
            links = s.nvlink
            if links is None or scope >= len(links):
                return NOT_SUPPORTED, _ULL, None
            if attr == "up":
                up = pynvml.NVML_FEATURE_ENABLED if links[scope].up else pynvml.NVML_FEATURE_DISABLED
                return SUCCESS, _UI, up
            v = getattr(links[scope], attr)
            return (NOT_SUPPORTED, _ULL, None) if v is None else (SUCCESS, _ULL, v)
        if fid == _FI_MEMORY_TEMP:
            t = s.temperature_memory_c
            return (NOT_SUPPORTED, _UI, None) if t is None else (SUCCESS, _UI, t)
        reason = _FIELD_CLOCK_EVENT.get(fid)
        if reason is not None:
            ns = s.clocks_event_ns
            if ns is None or reason not in ns:
                return NOT_SUPPORTED, _ULL, None
            return SUCCESS, _ULL, ns[reason]
        if fid == _FI_NVLINK_LINK_COUNT:
            return (NOT_SUPPORTED, _UI, None) if d.inv.nvlink_count == 0 else (SUCCESS, _UI, d.inv.nvlink_count)
        return NOT_SUPPORTED, _ULL, None

    def _c_nvmlDeviceGetFieldValues(self, handle: Any, count: Any, values: Any) -> int:
        d = self._dev("nvmlDeviceGetFieldValues", handle)
        if isinstance(d, int):
            return d
        arr = _target(values)
        n = _int(count)
        if n < 0 or n > len(arr):
            return INVALID_ARGUMENT
        ts = int(d.sample.timestamp * 1e6)
        rules = [r for r in self._rules if r.field is not None and r.gpu in (None, d.index)]
        field = self._field
        for i in range(n):
            fv = arr[i]
            fid = fv.fieldId
            ret, vtype, value = field(d, fid, fv.scopeId)
            for r in rules:
                if r.field == fid:
                    ret, value = r.code, None
                    break
            fv.timestamp, fv.latencyUsec, fv.valueType, fv.nvmlReturn = ts, 0, vtype, ret
            if ret == SUCCESS and value is not None:
                if vtype == _UI:
                    fv.value.ullVal = 0
                    fv.value.uiVal = int(value)
                else:
                    fv.value.ullVal = int(value)
            else:
                fv.value.ullVal = 0
        return SUCCESS

    # ------------------------------------------------------------------ memory health

    def _c_nvmlDeviceGetEccMode(self, handle: Any, current: Any, pending: Any) -> int:
        d = self._dev("nvmlDeviceGetEccMode", handle)
        if isinstance(d, int):
            return d
        if not d.inv.ecc_supported:
            return NOT_SUPPORTED
        _set(current, pynvml.NVML_FEATURE_ENABLED)
        return _set(pending, pynvml.NVML_FEATURE_ENABLED)

    def _c_nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: Any, counter_type: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetTotalEccErrors", handle)
        if isinstance(d, int):
            return d
        kinds = {pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED: "corrected", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED: "uncorrected"}
        counters = {pynvml.NVML_VOLATILE_ECC: "volatile", pynvml.NVML_AGGREGATE_ECC: "aggregate"}
        e, c = _int(error_type), _int(counter_type)
        if e not in kinds or c not in counters:
            return INVALID_ARGUMENT
        if not d.inv.ecc_supported or d.sample.ecc is None:
            return NOT_SUPPORTED
        return _set(out, d.sample.ecc.get(f"{counters[c]}_{kinds[e]}", 0))

    def _c_nvmlDeviceGetRemappedRows(self, handle: Any, corr: Any, unc: Any, pending: Any, failure: Any) -> int:
        d = self._dev("nvmlDeviceGetRemappedRows", handle)
        if isinstance(d, int):
            return d
        s = d.sample
        values = (s.remapped_rows_correctable, s.remapped_rows_uncorrectable, s.row_remap_pending, s.row_remap_failure)
        if not d.inv.row_remap_supported or any(v is None for v in values):
            return NOT_SUPPORTED
        for ref, v in zip((corr, unc, pending, failure), values, strict=True):
            _set(ref, int(v or 0))
        return SUCCESS

    def _c_nvmlDeviceGetRetiredPages(self, handle: Any, cause: Any, count: Any, addresses: Any) -> int:
        d = self._dev("nvmlDeviceGetRetiredPages", handle)
        if isinstance(d, int):
            return d
        c = _int(cause)
        by_cause = {
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: d.sample.retired_pages_single_bit,
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: d.sample.retired_pages_double_bit,
        }
        if c not in by_cause:
            return INVALID_ARGUMENT
        n = by_cause[c]
        if not d.inv.retired_pages_supported or n is None:
            return NOT_SUPPORTED
        cnt = _target(count)
        room = int(cnt.value)
        cnt.value = n
        if addresses is None or room < n:
            return INSUFFICIENT_SIZE if n > room else SUCCESS
        # The model carries counts only: the page addresses are synthetic (distinct, page aligned).
        for i in range(n):
            addresses[i] = (c + 1) * 0x1_0000_0000 + i * 0x1000
        return SUCCESS

    def _c_nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetRetiredPagesPendingStatus", handle)
        if isinstance(d, int):
            return d
        p = d.sample.retired_pages_pending
        if not d.inv.retired_pages_supported or p is None:
            return NOT_SUPPORTED
        return _set(out, int(p))

    # ------------------------------------------------------------------ PCIe / NVLink

    def _c_nvmlDeviceGetPcieThroughput(self, handle: Any, counter: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetPcieThroughput", handle)
        if isinstance(d, int):
            return d
        c = _int(counter)
        if c == pynvml.NVML_PCIE_UTIL_TX_BYTES:
            return _set(out, d.sample.pcie_tx_kbps)
        if c == pynvml.NVML_PCIE_UTIL_RX_BYTES:
            return _set(out, d.sample.pcie_rx_kbps)
        return INVALID_ARGUMENT

    def _link(self, d: _Dev, link: Any) -> Any:
        """The NvLinkSample for ``link`` or an error code."""
        n = _int(link)
        if d.inv.nvlink_count == 0:
            return NOT_SUPPORTED
        if not 0 <= n < d.inv.nvlink_count:
            return INVALID_ARGUMENT
        links = d.sample.nvlink
        if links is None or n >= len(links):
            return NOT_SUPPORTED
        return links[n]

    def _c_nvmlDeviceGetNvLinkState(self, handle: Any, link: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetNvLinkState", handle)
        if isinstance(d, int):
            return d
        ln = self._link(d, link)
        if isinstance(ln, int):
            return ln
        return _set(out, pynvml.NVML_FEATURE_ENABLED if ln.up else pynvml.NVML_FEATURE_DISABLED)

    def _c_nvmlDeviceGetNvLinkErrorCounter(self, handle: Any, link: Any, counter: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetNvLinkErrorCounter", handle)
        if isinstance(d, int):
            return d
        ln = self._link(d, link)
        if isinstance(ln, int):
            return ln
        c = _int(counter)
        if c not in _NVLINK_ERROR_COUNTER:
            return NOT_SUPPORTED if c == pynvml.NVML_NVLINK_ERROR_DL_ECC_DATA else INVALID_ARGUMENT
        value: int | None = getattr(ln, _NVLINK_ERROR_COUNTER[c])
        return _set(out, value)

    # ------------------------------------------------------------------ GPM

    def _c_nvmlGpmQueryDeviceSupport(self, handle: Any, out: Any) -> int:
        d = self._dev("nvmlGpmQueryDeviceSupport", handle)
        if isinstance(d, int):
            return d
        support = _target(out)
        if support.version != pynvml.NVML_GPM_SUPPORT_VERSION:
            return ARGUMENT_VERSION_MISMATCH
        support.isSupportedDevice = int(d.inv.gpm_supported)
        return SUCCESS

    def _c_nvmlGpmSampleAlloc(self, out: Any) -> int:
        addr = self._gpm_base + next(self._ids) * 0x40
        self._gpm[addr] = _GpmSample()
        _set_pointer(out, addr)
        return SUCCESS

    def _c_nvmlGpmSampleFree(self, sample: Any) -> int:
        addr = _addr(sample)
        if addr not in self._gpm:
            return INVALID_ARGUMENT
        del self._gpm[addr]
        return SUCCESS

    def _c_nvmlGpmSampleGet(self, handle: Any, sample: Any) -> int:
        d = self._dev("nvmlGpmSampleGet", handle)
        if isinstance(d, int):
            return d
        slot = self._gpm.get(_addr(sample) or 0)
        if slot is None:
            return INVALID_ARGUMENT
        if not d.inv.gpm_supported or d.sample.gpm is None:
            return NOT_SUPPORTED
        slot.index, slot.timestamp, slot.counters = d.index, d.sample.timestamp, replace(d.sample.gpm)
        return SUCCESS

    def _c_nvmlGpmMetricsGet(self, ref: Any) -> int:
        mg = _target(ref)
        if mg.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            return ARGUMENT_VERSION_MISMATCH
        a, b = self._gpm.get(_addr(mg.sample1) or 0), self._gpm.get(_addr(mg.sample2) or 0)
        n = int(mg.numMetrics)
        if a is None or b is None or a.counters is None or b.counters is None or a.index != b.index:
            return INVALID_ARGUMENT
        if not 0 < n <= pynvml.NVML_GPM_METRIC_MAX:
            return INVALID_ARGUMENT
        assert a.index is not None
        d = self._dev("nvmlGpmMetricsGet", ctypes.c_void_p(self.handle_address(a.index)))
        if isinstance(d, int):
            return d
        dt = b.timestamp - a.timestamp
        for i in range(n):
            m = mg.metrics[i]
            m.value = 0.0
            spec = _GPM_METRICS.get(int(m.metricId))
            if spec is None:
                m.nvmlReturn = NOT_SUPPORTED
                continue
            m.metricInfo.shortName, m.metricInfo.longName, m.metricInfo.unit = spec[0], spec[0], spec[1]
            if dt <= 0:
                m.nvmlReturn = INVALID_ARGUMENT
                continue
            m.value = spec[2](a.counters, b.counters, dt)
            m.nvmlReturn = SUCCESS
        # Two samples without time between them cannot give a rate (the second must be later).
        return INVALID_ARGUMENT if dt <= 0 else SUCCESS

    # ------------------------------------------------------------------ events (XID)

    def _c_nvmlEventSetCreate(self, out: Any) -> int:
        addr = self._set_base + next(self._ids) * 0x40
        self._sets[addr] = _EventSet()
        _set_pointer(out, addr)
        return SUCCESS

    def _c_nvmlEventSetFree(self, event_set: Any) -> int:
        addr = _addr(event_set)
        if addr not in self._sets:
            return INVALID_ARGUMENT
        del self._sets[addr]
        return SUCCESS

    def _c_nvmlDeviceRegisterEvents(self, handle: Any, types: Any, event_set: Any) -> int:
        d = self._dev("nvmlDeviceRegisterEvents", handle)
        if isinstance(d, int):
            return d
        es = self._sets.get(_addr(event_set) or 0)
        if es is None:
            return INVALID_ARGUMENT
        t = _int(types)
        if t == 0 or t & ~_SUPPORTED_EVENTS:
            return NOT_SUPPORTED
        es.devices.add(d.index)
        return SUCCESS

    def _pump_events(self) -> None:
        """Move new XID events from the source to every event set registered for their device."""
        for ev in self.source.poll_xid():
            for es in self._sets.values():
                if ev.gpu in es.devices:
                    es.queue.append(ev)

    def _on_xid(self) -> None:
        """The source's XID listener: wake the waiters (called by the source's thread)."""
        with self._xid_cond:
            self._xid_pushed = True
            self._xid_cond.notify_all()

    def _c_nvmlEventSetWait_v2(self, event_set: Any, data: Any, timeout_ms: Any) -> int:
        """Sources that signal new events (``add_xid_listener``) are waited on, others polled every 20 ms."""
        addr = _addr(event_set) or 0
        deadline = time.monotonic() + max(0, _int(timeout_ms)) / 1000.0
        pump = True
        while True:
            with self._xid_cond:
                if self._refcount == 0:
                    return UNINITIALIZED
                es = self._sets.get(addr)
                if es is None:
                    return INVALID_ARGUMENT
                if not es.queue and (pump or self._xid_pushed or not self._xid_push):
                    self._xid_pushed = False
                    self._pump_events()
                pump = False
                if es.queue:
                    ev = es.queue.pop(0)
                    out = _target(data)
                    out.device = ctypes.cast(ctypes.c_void_p(self.handle_address(ev.gpu)), pynvml.c_nvmlDevice_t)
                    out.eventType = pynvml.nvmlEventTypeXidCriticalError
                    out.eventData = ev.xid
                    out.gpuInstanceId = 0xFFFFFFFF
                    out.computeInstanceId = 0xFFFFFFFF
                    return SUCCESS
                left = deadline - time.monotonic()
                if left <= 0:
                    return TIMEOUT
                if self._xid_push:
                    if not self._xid_pushed:
                        self._xid_cond.wait(left)  # releases the fake's lock while waiting
                    continue
            time.sleep(min(_POLL_STEP_S, left))
