"""Error injection for the fake NVML: rules that make chosen calls return an NVML error code.

A rule names a C entry point or pynvml wrapper (normalized, see :func:`ctypes_io.norm`) or
none (every call that takes a device), a device index or none, and optionally a field id
inside ``nvmlDeviceGetFieldValues`` (then only that field carries the code).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpufleet.sim.fake.ctypes_io import SUCCESS, norm


@dataclass
class Rule:
    code: int
    function: str | None
    gpu: int | None
    field: int | None


def make_rule(code: int, function: str | None, gpu: int | None, field: int | None,
              known: Iterable[str]) -> Rule:
    """A checked rule (``known``: the entry points the fake implements); ValueError for a bad one."""
    if function is not None:
        if norm(function) not in {norm(n) for n in known}:
            raise ValueError(f"unknown NVML function {function!r}: the fake does not implement it")
        function = norm(function)
    if field is not None and function not in (None, "nvmlDeviceGetFieldValues"):
        raise ValueError("a field error applies to nvmlDeviceGetFieldValues only")
    if code == SUCCESS:
        raise ValueError("inject a non-zero NVML return code")
    return Rule(int(code), function, gpu, field)


def system_code(rules: list[Rule], normed: str) -> int | None:
    """The code of a rule naming this call (normalized name) and no device, else None."""
    for r in rules:
        if r.function == normed and r.gpu is None and r.field is None:
            return r.code
    return None


def device_code(rules: list[Rule], normed: str, index: int, *, wildcard: bool = True) -> int | None:
    """The code of a rule for this call on device ``index`` (``wildcard``: rules naming no call count)."""
    for r in rules:
        if r.field is not None:
            continue
        if r.gpu is not None and r.gpu != index:
            continue
        if r.function == normed or (r.function is None and wildcard):
            return r.code
    return None


def field_rules(rules: list[Rule], index: int) -> list[Rule]:
    """The field rules that apply to device ``index``."""
    return [r for r in rules if r.field is not None and r.gpu in (None, index)]
