"""Slow and hung calls for the fake NVML: rules that make chosen calls block before they answer.

A rule names a C entry point or pynvml wrapper (or none: every call, except ``nvmlShutdown``,
``nvmlErrorString`` and the XID event wait, which stall only when named), a device index or none,
how long each matching call blocks (``delay`` seconds: a slow call; None: hung until the rule is
cleared) and, optionally, for how long the rule itself holds (``duration`` seconds, then calls
answer normally again). A call blocks outside the fake's lock, so other devices keep answering,
as they do when one GPU's call wedges in the driver; clearing a rule releases the calls it holds.

``--nvml.fake`` specs take rules after a comma: ``sim:8,hang=nvmlDeviceGetPowerUsage@3`` (GPU 3's
power reads hang until cleared), ``slow=nvmlDeviceGetPowerUsage@3:2.5`` (each takes 2.5 s more),
``hang=*@3`` (every call of GPU 3), ``hang=*`` (every call: NVML stalled on the whole node),
``hang=nvmlInit`` (init never returns); ``hang=FN@GPU:SECONDS`` hangs for that long once, then
calls answer again (the rule's duration).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gpufleet.sim.fake.ctypes_io import norm

#: Calls a rule naming no function leaves alone (they stall only when named).
_NOT_WILDCARD = frozenset({"nvmlShutdown", "nvmlErrorString", "nvmlEventSetWait"})


@dataclass
class StallRule:
    function: str | None  # normalized entry point name, None: any
    gpu: int | None
    delay: float | None  # seconds each matching call blocks; None: until cleared
    until: float | None  # time.monotonic() after which the rule no longer applies; None: until cleared
    released: threading.Event = field(default_factory=threading.Event)

    def matches(self, normed: str, index: int | None, now: float) -> bool:
        if self.released.is_set() or (self.until is not None and now >= self.until):
            return False
        if self.function is None:
            if normed in _NOT_WILDCARD:
                return False
        elif self.function != normed:
            return False
        return self.gpu is None or self.gpu == index


class Stalls:
    """The stall rules of one fake library (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._rules: list[StallRule] = []
        #: Calls that blocked on a rule (tests, benchmarks), and those blocked now.
        self.blocked = 0
        self.blocking = 0

    def __bool__(self) -> bool:
        return bool(self._rules)

    def add(self, *, function: str | None = None, gpu: int | None = None, delay: float | None = None,
            duration: float | None = None, known: Iterable[str] = ()) -> StallRule:
        """Add a rule (``known``: the entry points the fake implements, to check ``function``)."""
        if function is not None:
            names = {norm(n) for n in known}
            if names and norm(function) not in names:
                raise ValueError(f"unknown NVML function {function!r}: the fake does not implement it")
            function = norm(function)
        for what, v in (("delay", delay), ("duration", duration)):
            if v is not None and not (v >= 0 and v < float("inf")):
                raise ValueError(f"stall {what} must be a non-negative number of seconds, got {v!r}")
        rule = StallRule(function, gpu, delay, None if duration is None else self._clock() + duration)
        with self._lock:
            self._rules.append(rule)
        return rule

    def clear(self) -> None:
        """Remove every rule and release the calls they hold."""
        with self._lock:
            rules, self._rules = self._rules, []
        for r in rules:
            r.released.set()

    def wait(self, normed: str, index: int | None) -> None:
        """Block as the first rule matching this call says (no-op when none does)."""
        now = self._clock()
        with self._lock:
            rule = next((r for r in self._rules if r.matches(normed, index, now)), None)
            if rule is None:
                return
            self.blocked += 1
            self.blocking += 1
        try:
            limit = rule.delay
            if rule.until is not None:
                left = max(0.0, rule.until - now)
                limit = left if limit is None else min(limit, left)
            rule.released.wait(limit)
        finally:
            with self._lock:
                self.blocking -= 1


_RULE = re.compile(r"(?P<kind>hang|slow)=(?P<fn>\*|nvml\w+)(?:@(?P<gpu>\d{1,4}|\*))?(?::(?P<secs>\d+(?:\.\d+)?))?")


def parse_rules(text: str) -> list[dict[str, object]]:
    """The stall rules of a spec's tail (``hang=FN@GPU[:S]``, ``slow=FN@GPU:S``, comma separated) as
    keyword arguments for :meth:`Stalls.add`; ValueError for a malformed one."""
    out: list[dict[str, object]] = []
    for part in text.split(","):
        part = part.strip()
        m = _RULE.fullmatch(part)
        if m is None:
            raise ValueError(f"bad stall rule {part!r}: expected hang=FUNCTION[@GPU][:SECONDS] or "
                             "slow=FUNCTION[@GPU]:SECONDS (FUNCTION an NVML entry point or *, GPU an index or *)")
        fn = None if m["fn"] == "*" else m["fn"]
        gpu = None if m["gpu"] in (None, "*") else int(m["gpu"])
        secs = None if m["secs"] is None else float(m["secs"])
        if m["kind"] == "slow":
            if secs is None:
                raise ValueError(f"bad stall rule {part!r}: slow= needs :SECONDS")
            out.append({"function": fn, "gpu": gpu, "delay": secs})
        else:  # hang: until cleared, or once for SECONDS (the rule's duration)
            out.append({"function": fn, "gpu": gpu, "delay": None, "duration": secs})
    return out


def split_spec(spec: str) -> tuple[str, str]:
    """``("sim:8", "hang=nvmlDeviceGetPowerUsage@3")`` from ``"sim:8,hang=nvmlDeviceGetPowerUsage@3"``."""
    m = re.search(r",\s*(?:hang|slow)=", spec)
    if m is None:
        return spec, ""
    return spec[:m.start()], spec[m.start() + 1:]
