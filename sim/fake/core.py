"""The state every part of the fake NVML shares: its source, init count, injected errors, device lookup.

:class:`FakeCore` is the base of :class:`~gpufleet.sim.fake.library.FakeNvml`; the
entry-point modules (devices, readings, fields, GPM, events) are mixins on it and reach
a device through :meth:`FakeCore._dev`, which applies the injected errors and the
``lost`` flag the way NVML would. Device handles are fake pointer values that are never
dereferenced; ``nvmlDeviceGetIndex`` maps one back to its index.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpufleet.agent.nvml.model import DeviceSource, GpuInventory, GpuSample
from gpufleet.sim.fake.ctypes_io import GPU_IS_LOST, INVALID_ARGUMENT, address, set_out
from gpufleet.sim.fake.errors import Rule, device_code


@dataclass
class Dev:
    """A device as one call sees it: its index, inventory and current sample."""

    index: int
    inv: GpuInventory
    sample: GpuSample


class FakeCore:
    """Shared state of a fake libnvidia-ml backed by ``source``."""

    _instances = itertools.count(1)

    def __init__(self, source: DeviceSource) -> None:
        self.source = source
        self.driver_loaded = True
        #: the last exception a source raised inside a call (the call returned NVML_ERROR_UNKNOWN)
        self.last_exception: BaseException | None = None
        self._lock = threading.RLock()
        self._refcount = 0
        self._rules: list[Rule] = []
        base = 0x7F5A_0000_0000 + (next(self._instances) % 0xFFFF) * 0x1_0000_0000
        self._dev_base = base
        self._gpm_base = base + 0x1000_0000
        self._set_base = base + 0x2000_0000
        self._ids = itertools.count(1)
        self._devs: dict[int, Dev] = {}
        #: C entry point name -> its normalized name (filled by FakeNvml).
        self._normed: dict[str, str] = {}

    def handle_address(self, index: int) -> int:
        """The fake pointer value of device ``index``'s handle."""
        return self._dev_base + (index + 1) * 0x100

    def _new_address(self, base: int) -> int:
        """A fresh fake pointer value for an object allocated by the library (GPM sample, event set)."""
        return base + next(self._ids) * 0x40

    def _device_rule(self, name: str, index: int, *, wildcard: bool = True) -> int | None:
        if not self._rules:
            return None
        return device_code(self._rules, self._normed[name], index, wildcard=wildcard)

    def _dev(self, name: str, handle: Any) -> Dev | int:
        """The device behind ``handle`` with its current sample, or the error code the call returns."""
        addr = address(handle)
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
            d = self._devs[index] = Dev(index, inventory[index], sample)
        return d

    def _scalar_entry(self, name: str, get: Callable[[Dev], int | None]) -> Callable[[Any, Any], int]:
        """The C entry point ``name`` that writes ``get(device)`` into its single out-parameter."""

        def entry(handle: Any, out: Any) -> int:
            d = self._dev(name, handle)
            return d if isinstance(d, int) else set_out(out, get(d))

        return entry
