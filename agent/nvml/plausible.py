"""Is a device-model value well-formed and physically possible?

Two checks on the structures of :mod:`gpufleet.agent.nvml.model`, for everything
that enters the agent from outside (a trace, a live snapshot, the driver):

* :func:`check` — the types match the dataclass annotations (``"gpm": 5`` is not
  a GpmCounters) and every reading lies within :data:`BOUNDS`; raises
  ``ValueError`` naming the field (``samples[2].power_mw``). Used where a
  whole file is rejected (trace and snapshot loading).
* :data:`BOUNDS` — generous physical limits in NVML's units. A reading outside
  them is not a measurement (a 1e30 mW power draw, a clock of 0xFFFFFFFF MHz, a
  negative counter); the NVML reader drops such a reading and counts it instead
  of exporting it.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from typing import Any, Union

#: Field -> (lowest, highest) plausible value, NVML units. Any other integer reading must be in [0, 2**64).
BOUNDS: dict[str, tuple[float, float]] = {
    "utilization_gpu_pct": (0, 100),
    "utilization_memory_pct": (0, 100),
    "clock_sm_mhz": (0, 10_000),  # 10 GHz
    "clock_memory_mhz": (0, 10_000),
    "clock_graphics_mhz": (0, 10_000),
    "power_mw": (0, 10_000_000),  # 10 kW per GPU
    "power_limit_mw": (0, 10_000_000),
    "temperature_gpu_c": (-50, 200),
    "temperature_memory_c": (-50, 200),
    "fan_speed_pct": (0, 255),  # NVML: "may exceed 100% in certain cases"
    "pstate": (0, 15),
    "pcie_gen": (0, 16),
    "pcie_width": (0, 64),
    "memory_used_bytes": (0, 2**50),  # 1 PiB
    "memory_reserved_bytes": (0, 2**50),
    "memory_total_bytes": (0, 2**50),
    "pcie_tx_kbps": (0, 2**32),
    "pcie_rx_kbps": (0, 2**32),
    # GpuInventory
    "power_limit_default_mw": (0, 10_000_000),
    "power_limit_min_mw": (0, 10_000_000),
    "power_limit_max_mw": (0, 10_000_000),
    "temp_slowdown_c": (-50, 200),
    "temp_shutdown_c": (-50, 200),
    "temp_gpu_max_c": (-50, 200),
    "temp_memory_max_c": (-50, 200),
    "max_clock_sm_mhz": (0, 10_000),
    "max_clock_memory_mhz": (0, 10_000),
    "max_clock_graphics_mhz": (0, 10_000),
    "pcie_max_gen": (0, 16),
    "pcie_max_width": (0, 64),
    "nvlink_count": (0, 64),
    "fan_count": (0, 64),
    "index": (0, 65_535),
    "gpu": (0, 65_535),  # XidEvent.gpu
    # GPM metrics between two samples (nvml.reader.GpmRates): percent and MiB/s
    "sm_active_pct": (0, 101),
    "sm_occupancy_pct": (0, 101),
    "tensor_active_pct": (0, 101),
    "dram_active_pct": (0, 101),
    "nvlink_tx_mibps": (0, 2**32),
    "nvlink_rx_mibps": (0, 2**32),
    "pcie_tx_mibps": (0, 2**32),
    "pcie_rx_mibps": (0, 2**32),
}
#: Every other integer: an unsigned 64-bit NVML value.
UINT64 = (0, 2**64 - 1)
#: Floats (timestamps, GPM activity integrals) must be finite; these may not be negative.
NON_NEGATIVE_FLOATS = frozenset({
    "sm_active_s", "sm_occupancy_s", "tensor_active_s", "dram_active_s",
})


Checker = Callable[[Any, str], None]
_COMPILED: dict[type, list[tuple[str, Checker]]] = {}


def check(obj: Any, where: str = "") -> None:
    """Raise ValueError naming the first field of dataclass ``obj`` whose type or value is impossible."""
    checkers = _COMPILED.get(type(obj))
    if checkers is None:
        hints = typing.get_type_hints(type(obj))
        checkers = _COMPILED[type(obj)] = [(f.name, _compile(hints[f.name], f.name))
                                           for f in dataclasses.fields(obj)]
    prefix = f"{where}." if where else ""
    for name, fn in checkers:
        fn(getattr(obj, name), prefix + name)


def _compile(hint: Any, name: str) -> Checker:
    """A function checking a value against type ``hint`` (a model field's annotation) and BOUNDS[name]."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = typing.get_args(hint)
        inner = _compile(next(a for a in args if a is not type(None)), name)
        if type(None) not in args:  # pragma: no cover - the model's unions are all optional
            return inner

        def optional(v: Any, where: str) -> None:
            if v is not None:
                inner(v, where)
        return optional
    if hint is bool:
        def boolean(v: Any, where: str) -> None:
            if v is not True and v is not False:
                raise ValueError(f"{where}: expected true or false, got {_short(v)}")
        return boolean
    if hint is int:
        lo, hi = BOUNDS.get(name, UINT64)

        def integer(v: Any, where: str) -> None:
            if type(v) is not int and (not isinstance(v, int) or isinstance(v, bool)):
                raise ValueError(f"{where}: expected an integer, got {_short(v)}")
            if not lo <= v <= hi:
                raise ValueError(f"{where}: {_short(v)} is not a plausible reading (expected {lo:g}..{hi:g})")
        return integer
    if hint is float:
        non_negative = name in NON_NEGATIVE_FLOATS

        def number(v: Any, where: str) -> None:
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"{where}: expected a finite number, got {_short(v)}")
            if non_negative and v < 0:
                raise ValueError(f"{where}: {v!r} is not a plausible reading (it cannot be negative)")
        return number
    if hint is str:
        def string(v: Any, where: str) -> None:
            if not isinstance(v, str):
                raise ValueError(f"{where}: expected a string, got {_short(v)}")
        return string
    if origin is list:
        item = _compile(typing.get_args(hint)[0], name)

        def listing(v: Any, where: str) -> None:
            if not isinstance(v, list):
                raise ValueError(f"{where}: expected a list, got {_short(v)}")
            for i, x in enumerate(v):
                item(x, f"{where}[{i}]")
        return listing
    if origin is tuple:
        items = [_compile(a, name) for a in typing.get_args(hint)]

        def pair(v: Any, where: str) -> None:
            if not isinstance(v, (tuple, list)) or len(v) != len(items):
                raise ValueError(f"{where}: expected {len(items)} items, got {_short(v)}")
            for i, (x, fn) in enumerate(zip(v, items, strict=True)):
                fn(x, f"{where}[{i}]")
        return pair
    if origin is dict:
        value = _compile(typing.get_args(hint)[1], name)

        def mapping(v: Any, where: str) -> None:
            if not isinstance(v, dict):
                raise ValueError(f"{where}: expected an object, got {_short(v)}")
            for k, x in v.items():
                if not isinstance(k, str):
                    raise ValueError(f"{where}: expected string keys, got {_short(k)}")
                value(x, f"{where}.{k}")
        return mapping
    if dataclasses.is_dataclass(hint):
        cls = hint

        def nested(v: Any, where: str) -> None:
            if not isinstance(v, cls):  # type: ignore[arg-type]
                raise ValueError(f"{where}: expected an object, got {_short(v)}")
            check(v, where)
        return nested
    raise TypeError(f"{name}: cannot check a value of type {hint!r}")  # pragma: no cover - a new model type


def _short(v: Any) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and not -(10**30) < v < 10**30:
        return f"{'-' if v < 0 else ''}{float(abs(v)) if abs(v) < 10**300 else math.inf:g}"
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."
