"""The XID collector: a thread listening to NVML's XID critical-error events.

``start()`` runs a listener thread: it creates an NVML event set, registers
every GPU for ``nvmlEventTypeXidCriticalError`` (a GPU that does not support
events is skipped, the others still listen), and waits on the set with a short
timeout so ``close()`` stops it within a second. When the set breaks (GPU lost,
driver reloaded, NVML re-initialized) the thread logs, backs off and builds a
new one; it never dies. Scrapes export what it counted:
``gpufleet_gpu_xid_errors_total{gpu,xid}`` and
``gpufleet_gpu_xid_last_seen_timestamp_seconds{gpu,xid}``.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import pynvml
from prometheus_client.core import Metric

from gpufleet.agent.nvml.backend import LOST_CODES, NvmlBackend, error_name
from gpufleet.agent.nvml.model import XidEvent
from gpufleet.vocab import catalog

log = logging.getLogger(__name__)

XID_EVENT = pynvml.nvmlEventTypeXidCriticalError
_COUNT = catalog.spec("gpufleet_gpu_xid_errors_total")
_LAST = catalog.spec("gpufleet_gpu_xid_last_seen_timestamp_seconds")
_MAX_BACKOFF = 30.0
#: Seconds before retrying registration of GPUs that failed to register with an error.
_RETRY_PARTIAL = 60.0


def _address(handle: Any) -> int | None:
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return None


class XidCollector:
    name = "xid"

    def __init__(self, backend: NvmlBackend, *, wait_ms: int = 500,
                 on_event: Callable[[XidEvent], None] | None = None,
                 backoff: tuple[float, float] = (0.5, _MAX_BACKOFF), retry_s: float = _RETRY_PARTIAL) -> None:
        self.backend = backend
        self.wait_ms = wait_ms
        self.backoff = backoff
        self.retry_s = retry_s
        self.on_event = on_event
        self._lock = threading.Lock()
        self._counts: dict[tuple[int, int], int] = {}
        self._last: dict[tuple[int, int], float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: GPU indexes currently registered (for tests and /health).
        self.registered: tuple[int, ...] = ()

    # ------------------------------------------------------------------ collector

    def describe(self) -> Iterable[Metric]:
        return [_COUNT.family(), _LAST.family()]

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            counts = sorted(self._counts.items())
            last = dict(self._last)
        if not counts:
            return []
        count: Any = _COUNT.family()
        seen: Any = _LAST.family()
        for (gpu, xid), n in counts:
            labels = [str(gpu), str(xid)]
            count.add_metric(labels, n)
            seen.add_metric(labels, last[(gpu, xid)])
        return [count, seen]

    def record(self, gpu: int, xid: int, timestamp: float | None = None) -> None:
        """Count one XID event (called by the listener thread)."""
        ts = time.time() if timestamp is None else timestamp
        key = (gpu, xid)
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1
            self._last[key] = ts
        log.warning("XID %d on GPU %d", xid, gpu)
        if self.on_event is not None:
            self.on_event(XidEvent(gpu=gpu, xid=xid, timestamp=ts))

    # ------------------------------------------------------------------ thread

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gpufleet-xid", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        first, cap = self.backoff
        backoff = first
        while not self._stop.is_set():
            try:
                healthy = self._listen_once()
            except Exception:  # never die: log and retry
                log.exception("XID listener failed; retrying")
                healthy = False
            if self._stop.is_set():
                break
            backoff = first if healthy else min(backoff * 2, cap)
            self._stop.wait(backoff)

    def _listen_once(self) -> bool:
        """Build an event set, wait on it until it breaks or we stop. True if it worked for a while."""
        b = self.backend
        if not b.up:  # initialized on the NVML lanes (it may hang there), never from this thread
            return False
        generation = b.generation
        try:
            event_set = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as e:
            b.count_error("nvmlEventSetCreate", e.value)
            log.warning("XID listener: nvmlEventSetCreate: %s", error_name(e.value))
            return False
        try:
            by_address, partial = self._register(event_set)
            self.registered = tuple(sorted(by_address.values()))
            if not by_address:
                if not partial:  # no GPU supports events: nothing to listen to; look again later
                    self._stop.wait(self.retry_s)
                return False
            retry_at = time.monotonic() + self.retry_s if partial else float("inf")
            return self._wait_loop(event_set, by_address, generation, retry_at)
        finally:
            self.registered = ()
            try:
                pynvml.nvmlEventSetFree(event_set)
            except pynvml.NVMLError as e:
                log.debug("nvmlEventSetFree: %s", e)

    def _register(self, event_set: Any) -> tuple[dict[int, int], bool]:
        """Register every GPU; returns (handle address -> GPU index, whether some GPU failed with an error)."""
        b = self.backend
        by_address: dict[int, int] = {}
        partial = False
        for dev in list(b.devices):
            if dev.handle is None:
                partial = True
                continue
            function = "nvmlDeviceGetSupportedEventTypes"
            try:
                supported = pynvml.nvmlDeviceGetSupportedEventTypes(dev.handle)
                if not supported & XID_EVENT:
                    continue
                function = "nvmlDeviceRegisterEvents"
                pynvml.nvmlDeviceRegisterEvents(dev.handle, XID_EVENT, event_set)
            except pynvml.NVMLError as e:
                if e.value == pynvml.NVML_ERROR_NOT_SUPPORTED:
                    continue
                b.count_error(function, e.value)
                log.warning("XID listener: GPU %d not registered (%s: %s)", dev.index, function, error_name(e.value))
                partial = True
                continue
            addr = _address(dev.handle)
            if addr is not None:
                by_address[addr] = dev.index
        return by_address, partial

    def _wait_loop(self, event_set: Any, by_address: dict[int, int], generation: int, retry_at: float) -> bool:
        b = self.backend
        while not self._stop.is_set():
            if b.generation != generation or not b.up:
                log.info("XID listener: NVML re-initialized; rebuilding the event set")
                return True
            if time.monotonic() >= retry_at:
                return True  # rebuild to retry the GPUs that failed to register
            try:
                data = pynvml.nvmlEventSetWait_v2(event_set, self.wait_ms)
            except pynvml.NVMLError as e:
                if e.value == pynvml.NVML_ERROR_TIMEOUT:
                    continue
                b.count_error("nvmlEventSetWait_v2", e.value)
                log.warning("XID listener: nvmlEventSetWait_v2: %s%s", error_name(e.value),
                            " (a GPU is lost)" if e.value in LOST_CODES else "")
                return False
            if not data.eventType & XID_EVENT:
                continue
            addr = _address(data.device)
            gpu = by_address.get(addr) if addr is not None else None
            if gpu is None:
                log.warning("XID %d from an unknown device handle", data.eventData)
                continue
            self.record(gpu, int(data.eventData))
        return True
