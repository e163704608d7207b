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
  with any NVML return code;
* :meth:`FakeNvml.inject_stall` makes chosen calls (by entry point, device) slow or hung,
  for a while or until cleared (:mod:`.stalls`).

The entry points live in one module per group, mixed into :class:`FakeNvml`:
:mod:`.devices` (enumeration, identity), :mod:`.readings`, :mod:`.fields`
(``nvmlDeviceGetFieldValues``), :mod:`.gpm`, :mod:`.events` (XID), :mod:`.mig` (MIG mode and MIG device
handles) and :mod:`.processes` (running processes, per-process utilization), :mod:`.fabric` (Blackwell NVLink
fabric, platform, thermal margin, repair, C2C, NVLink bandwidth mode); the shared state
and device lookup in :mod:`.core`, error injection in :mod:`.errors`, ctypes
conversions in :mod:`.ctypes_io`. This module installs the library into pynvml and
dispatches pynvml's calls to the entry points.
"""


from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

import pynvml

from gpufleet.agent.nvml.model import DeviceSource
from gpufleet.sim.fake.ctypes_io import (
    DRIVER_NOT_LOADED,
    ERROR_STRINGS,
    SUCCESS,
    UNINITIALIZED,
    UNKNOWN,
    address,
    as_int,
    norm,
    set_out,
    write_str,
)
from gpufleet.sim.fake.devices import SCALAR_ENTRY_POINTS, DeviceEntryPoints
from gpufleet.sim.fake.errors import make_rule, system_code
from gpufleet.sim.fake.events import EventEntryPoints
from gpufleet.sim.fake.fabric import FabricEntryPoints
from gpufleet.sim.fake.fields import FieldValueEntryPoints
from gpufleet.sim.fake.gpm import GpmEntryPoints
from gpufleet.sim.fake.processes import ProcessEntryPoints
from gpufleet.sim.fake.readings import ReadingEntryPoints
from gpufleet.sim.fake.stalls import StallRule, Stalls

#: Entry points that work without nvmlInit.
_NO_INIT = frozenset({"nvmlInit", "nvmlInit_v2", "nvmlInitWithFlags", "nvmlErrorString"})


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
        if fake.stalls:  # blocks outside the lock: the other devices keep answering
            fake.stalls.wait(self._normed, fake.stall_index(self._normed, args))
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
                    code = system_code(fake._rules, self._normed)
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
                    code = system_code(fake._rules, self._normed)
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




class FakeNvml(ProcessEntryPoints, DeviceEntryPoints, ReadingEntryPoints, FieldValueEntryPoints, GpmEntryPoints,
               EventEntryPoints, FabricEntryPoints):
    """A fake libnvidia-ml backed by ``source``; see the module docstring."""

    def __init__(self, source: DeviceSource) -> None:
        super().__init__(source)
        self._init_gpm()
        self._init_events()
        self._lib = _FakeLib(self)
        self._previous: Any = None
        self._installed = False
        #: The entry-point table: C name -> implementation (the ``_c_nvml*`` methods and the scalar table).
        self._impl: dict[str, Callable[..., Any]] = {
            name[3:]: getattr(self, name) for name in dir(type(self)) if name.startswith("_c_nvml")
        }
        self._impl.update({name: self._scalar_entry(name, get) for name, get in SCALAR_ENTRY_POINTS.items()})
        self._normed = {name: norm(name) for name in self._impl}
        #: Benchmarks: when True, every entry point adds its thread CPU time to ``cpu_seconds`` (the time a
        #: real host spends inside libnvidia-ml, which this fake and its source stand in for).
        self.cpu_accounting = False
        self.cpu_seconds = 0.0
        #: Slow and hung calls (:meth:`inject_stall`).
        self.stalls = Stalls()

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
            pynvml.nvmlLib = self._lib  # type: ignore[assignment]  # a stand-in for the CDLL, by design
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
        self.stalls.clear()  # calls still blocked in this fake return

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
        rule = make_rule(code, function, gpu, field, self._impl)
        with self._lock:
            self._rules.append(rule)

    def clear_errors(self) -> None:
        with self._lock:
            self._rules.clear()

    def inject_stall(self, *, function: str | None = None, gpu: int | None = None, delay: float | None = None,
                     duration: float | None = None) -> StallRule:
        """Make matching calls block before answering: ``delay`` seconds each (None: until
        :meth:`clear_stalls`), while the rule holds (``duration`` seconds, None: until cleared).
        ``function``: entry point or pynvml wrapper name, None for every call (but nvmlShutdown,
        nvmlErrorString and the event wait); ``gpu``: one device index (also matches
        nvmlDeviceGetHandleByIndex for that index), None for any and for node-wide calls."""
        return self.stalls.add(function=function, gpu=gpu, delay=delay, duration=duration, known=self._impl)

    def clear_stalls(self) -> None:
        """Remove every stall rule; calls blocked on them return now."""
        self.stalls.clear()

    def stall_index(self, normed: str, args: tuple[Any, ...]) -> int | None:
        """The device index a call is about (its handle, or the index asked for), None if none."""
        if not args:
            return None
        if normed == "nvmlDeviceGetHandleByIndex":
            try:
                return as_int(args[0])
            except (TypeError, ValueError):
                return None
        addr = address(args[0])
        off = None if addr is None else addr - self._dev_base
        if off is None or off <= 0 or off % 0x100:
            return None
        return off // 0x100 - 1

    def refresh_host(self) -> None:
        """Bring what the source simulates besides NVML (its fake sysfs tree) up to the source's time.

        The agent calls this before every hardware read and the recorder before reading the IB
        files, so NIC data never depend on NVML calls being made first. Its CPU time counts as the
        fake's (``cpu_accounting``), as the entry points' does."""
        refresh = getattr(self.source, "refresh_host", None)
        if not callable(refresh):
            return
        if not self.cpu_accounting:
            refresh()
            return
        t0 = time.thread_time()
        try:
            refresh()
        finally:
            self.cpu_seconds += time.thread_time() - t0

    # ------------------------------------------------------------------ init / system

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
        c = as_int(code)
        return ERROR_STRINGS.get(c, f"Unknown NVML error code {c}").encode()

    def _c_nvmlSystemGetDriverVersion(self, buf: Any, length: Any) -> int:
        return write_str(buf, length, self.source.driver().driver_version)

    def _c_nvmlSystemGetNVMLVersion(self, buf: Any, length: Any) -> int:
        return write_str(buf, length, self.source.driver().nvml_version)

    def _c_nvmlSystemGetCudaDriverVersion(self, out: Any) -> int:
        return set_out(out, self.source.driver().cuda_driver_version)

    def _c_nvmlSystemGetCudaDriverVersion_v2(self, out: Any) -> int:
        return set_out(out, self.source.driver().cuda_driver_version)

