"""The fake NVML's events: XID critical errors delivered through event sets.

Event sets collect the source's XID events for the devices registered on them.
``nvmlEventSetWait_v2`` waits on sources that signal new events (``add_xid_listener``)
and polls the others every 20 ms, releasing the fake's lock while it waits.
"""

from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pynvml

from gpufleet.agent.nvml.model import XidEvent
from gpufleet.sim.fake.core import FakeCore
from gpufleet.sim.fake.ctypes_io import (
    INVALID_ARGUMENT,
    NOT_SUPPORTED,
    SUCCESS,
    TIMEOUT,
    UNINITIALIZED,
    address,
    as_int,
    set_pointer,
    target,
)

#: The event types the fake supports.
SUPPORTED_EVENTS: int = pynvml.nvmlEventTypeXidCriticalError
_POLL_STEP_S = 0.02


@dataclass
class _EventSet:
    devices: set[int] = field(default_factory=set)
    queue: list[XidEvent] = field(default_factory=list)


class EventEntryPoints(FakeCore):
    """Event sets and XID delivery (see the module docstring)."""

    def _init_events(self) -> None:
        self._sets: dict[int, _EventSet] = {}
        #: Signalled when the source has new XID events (sources with ``add_xid_listener``) or on shutdown.
        self._xid_cond = threading.Condition(self._lock)
        self._xid_pushed = False
        listen = getattr(self.source, "add_xid_listener", None)
        self._xid_push = callable(listen)
        if callable(listen):
            listen(self._on_xid)

    def _c_nvmlEventSetCreate(self, out: Any) -> int:
        addr = self._new_address(self._set_base)
        self._sets[addr] = _EventSet()
        set_pointer(out, addr)
        return SUCCESS

    def _c_nvmlEventSetFree(self, event_set: Any) -> int:
        addr = address(event_set)
        if addr not in self._sets:
            return INVALID_ARGUMENT
        del self._sets[addr]
        return SUCCESS

    def _c_nvmlDeviceRegisterEvents(self, handle: Any, types: Any, event_set: Any) -> int:
        d = self._dev("nvmlDeviceRegisterEvents", handle)
        if isinstance(d, int):
            return d
        es = self._sets.get(address(event_set) or 0)
        if es is None:
            return INVALID_ARGUMENT
        t = as_int(types)
        if t == 0 or t & ~SUPPORTED_EVENTS:
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
        addr = address(event_set) or 0
        deadline = time.monotonic() + max(0, as_int(timeout_ms)) / 1000.0
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
                    out = target(data)
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
