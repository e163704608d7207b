"""How the fake NVML talks ctypes: NVML's return codes, and reading arguments / writing out-parameters.

pynvml calls each entry point with ctypes objects: ``byref(...)`` out-parameters,
``c_char`` buffers with a length, opaque ``c_nvmlDevice_t`` pointers. These helpers
turn them into Python values and back, as libnvidia-ml would.
"""

from __future__ import annotations

import ctypes
import re
from typing import Any

import pynvml

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
NO_PERMISSION: int = pynvml.NVML_ERROR_NO_PERMISSION

#: nvmlErrorString's answers.
ERROR_STRINGS: dict[int, str] = {
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

#: pynvml wrapper names whose C entry point has a different base name.
_ALIASES = {"nvmlInit": "nvmlInitWithFlags", "nvmlInit_v2": "nvmlInitWithFlags"}


def norm(name: str) -> str:
    """An entry point's name without its version suffix ("nvmlDeviceGetPciInfo_v3" -> "nvmlDeviceGetPciInfo")."""
    name = _ALIASES.get(name, name)
    return re.sub(r"_v\d+$", "", name)


def as_int(x: Any) -> int:
    """The integer behind a ctypes scalar or a plain int."""
    return int(x.value) if hasattr(x, "value") else int(x)


def target(ref: Any) -> Any:
    """The object a ``byref(...)`` argument points at (or the object itself)."""
    return ref._obj if hasattr(ref, "_obj") else ref


def address(ptr: Any) -> int | None:
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


def set_pointer(ref: Any, value: int) -> None:
    """Store ``value`` in the pointer object ``ref`` points at."""
    obj = target(ref)
    ctypes.c_void_p.from_address(ctypes.addressof(obj)).value = value


def write_str(buf: Any, length: Any, text: str) -> int:
    """Copy ``text`` into a ``c_char`` buffer of ``length`` bytes (INSUFFICIENT_SIZE if it does not fit)."""
    data = text.encode()
    if len(data) + 1 > as_int(length):
        return INSUFFICIENT_SIZE
    buf.value = data
    return SUCCESS


def set_out(ref: Any, value: int | None) -> int:
    """Write ``value`` into a scalar out-parameter; None is NOT_SUPPORTED (nothing written)."""
    if value is None:
        return NOT_SUPPORTED
    target(ref).value = int(value)
    return SUCCESS
