"""``--nvml.fake=live:PATH``: serve a snapshot file (:class:`~gpufleet.agent.nvml.model.Snapshot`) that
another process (the fleet simulator) rewrites, re-read whenever it changes."""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from gpufleet.agent.nvml import plausible
from gpufleet.agent.nvml.model import DriverInfo, GpuInventory, GpuSample, Snapshot, XidEvent


class SourceUnavailable(RuntimeError):
    """The source has nothing to serve (its file is gone); the fake NVML answers its calls with an error."""


class LiveSource:
    """Serve the Snapshot file at ``path``, re-read whenever its mtime/size/inode changes.

    A corrupt file (torn write, bad JSON, impossible readings: see :mod:`.plausible`) keeps the last
    good state and sets ``last_error``; a good read clears it. While the file is missing or unreadable,
    or before the first good read, every call raises :class:`SourceUnavailable` (through the fake NVML:
    an NVML error, so the agent reports ``gpufleet_nvml_up 0``, never a host with 0 GPUs).
    ``source_from_spec("live:PATH")`` refuses a file that is not usable at start.
    XID events in the snapshot are delivered once each (by gpu, xid, timestamp).
    """

    def __init__(self, path: str | os.PathLike[str], *, min_check_s: float = 0.05,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self.last_error: str | None = None
        self.sysfs_root: str | None = None
        self._min_check = min_check_s
        self._clock = clock
        self._checked = -math.inf
        self._stamp: tuple[int, int, int] | None = None
        self._snap: Snapshot | None = None
        self._gone = False  # the file is missing or unreadable: nothing to serve
        self._seen: set[tuple[int, int, float]] = set()
        self._lock = threading.RLock()
        self._refresh()

    @property
    def usable(self) -> bool:
        """Is there a snapshot to serve (the file is readable and was good at least once)?"""
        return self._snap is not None and not self._gone

    def _refresh(self) -> Snapshot | None:
        with self._lock:
            now = self._clock()
            if now - self._checked < self._min_check:
                return self._snap
            self._checked = now
            try:
                st = self.path.stat()
                stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
                if stamp == self._stamp and self.last_error is None:
                    return self._snap
                text = self.path.read_text(encoding="utf-8")
            except FileNotFoundError:
                self.last_error = f"{self.path}: snapshot file does not exist"
                self._gone = True
                return self._snap
            except (OSError, ValueError) as e:  # ValueError: not UTF-8
                self.last_error = f"{self.path}: cannot read snapshot: {getattr(e, 'strerror', None) or e}"
                self._gone = True
                return self._snap
            self._gone = False
            try:
                snap = _parse_snapshot(text)
            except (ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError) as e:
                self.last_error = f"{self.path}: cannot use snapshot: {e}"
                return self._snap
            self._stamp, self._snap, self.last_error = stamp, snap, None
            return snap

    def _current(self) -> Snapshot:
        snap = self._refresh()
        if snap is None or self._gone:
            raise SourceUnavailable(self.last_error or f"{self.path}: no snapshot")
        return snap

    def driver(self) -> DriverInfo:
        return self._current().driver

    def inventory(self) -> list[GpuInventory]:
        return self._current().gpus

    def sample(self, index: int) -> GpuSample:
        snap = self._current()
        if not 0 <= index < len(snap.samples):
            raise IndexError(f"no GPU {index} in {self.path}")
        return snap.samples[index]

    def poll_xid(self) -> list[XidEvent]:
        snap = self._refresh()
        if snap is None or self._gone:
            return []
        with self._lock:
            out = []
            keys = set()
            for x in snap.xid:
                key = (x.gpu, x.xid, x.timestamp)
                keys.add(key)
                if key not in self._seen:
                    out.append(x)
            # Remember only what the file still lists, so the set stays small.
            self._seen = keys
            return out


def _parse_snapshot(text: str) -> Snapshot:
    """A snapshot whose every value has the right type and is a possible reading; ValueError otherwise."""
    snap = Snapshot.from_json(text)
    if len(snap.samples) != len(snap.gpus):
        raise ValueError(f"{len(snap.samples)} samples for {len(snap.gpus)} GPUs")
    plausible.check(snap.driver, "driver")
    for name, items in (("gpus", snap.gpus), ("samples", snap.samples), ("xid", snap.xid)):
        for i, item in enumerate(items):
            plausible.check(item, f"{name}[{i}]")
    for i, x in enumerate(snap.xid):
        if x.gpu >= len(snap.gpus):
            raise ValueError(f"xid[{i}].gpu: no GPU {x.gpu} (the snapshot lists {len(snap.gpus)})")
    return snap
