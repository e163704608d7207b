"""Replay a recorded trace (:mod:`gpufleet.agent.nvml.trace`) as a device source: ``--nvml.fake=trace:PATH``.

Wall-clock time maps onto trace time and the replay loops: one loop lasts
``t_last - t_first + interval_s``; in each new loop the cumulative counters (energy,
clock-event time, NVLink/PCIe/GPM integrals, error counters, numeric IB counters)
continue from where the previous loop ended instead of jumping back, so a replayed
counter never resets. The trace's IB files are served as a temporary sysfs tree.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpufleet.agent.nvml.model import (
    DriverInfo,
    GpmCounters,
    GpuInventory,
    GpuSample,
    NvLinkSample,
    XidEvent,
)
from gpufleet.agent.nvml.trace import Trace, TraceError, read_trace
from gpufleet.serving.files import write_atomic


def _add(a: int | None, b: int | None, k: int) -> int | None:
    """a + k * b (None stays None)."""
    return None if a is None or b is None else a + k * b


def _step(first: int | None, last: int | None, n: int) -> int | None:
    """How much a counter grows per loop: its whole rise plus one average step to wrap around."""
    if first is None or last is None:
        return None
    rise = last - first
    return rise + (rise // (n - 1) if n > 1 else 0)


def _counter_delta(first: GpuSample, last: GpuSample, n: int) -> GpuSample:
    """A GpuSample whose counter fields hold the per-loop growth (others unused)."""
    d = GpuSample()
    d.energy_mj = _step(first.energy_mj, last.energy_mj, n)
    d.pcie_replay_counter = _step(first.pcie_replay_counter, last.pcie_replay_counter, n)
    if first.clocks_event_ns is not None and last.clocks_event_ns is not None:
        d.clocks_event_ns = {
            k: _step(v, last.clocks_event_ns.get(k), n) or 0 for k, v in first.clocks_event_ns.items()
        }
    if first.ecc is not None and last.ecc is not None:
        d.ecc = {k: _step(v, last.ecc.get(k), n) or 0 for k, v in first.ecc.items()}
    if first.nvlink is not None and last.nvlink is not None:
        d.nvlink = [
            NvLinkSample(
                tx_kib=_step(a.tx_kib, b.tx_kib, n),
                rx_kib=_step(a.rx_kib, b.rx_kib, n),
                crc_flit=_step(a.crc_flit, b.crc_flit, n),
                crc_data=_step(a.crc_data, b.crc_data, n),
                replay=_step(a.replay, b.replay, n),
                recovery=_step(a.recovery, b.recovery, n),
            )
            for a, b in zip(first.nvlink, last.nvlink, strict=False)
        ]
    if first.gpm is not None and last.gpm is not None:
        g: dict[str, Any] = {}
        for name in GpmCounters.__dataclass_fields__:
            a, b = getattr(first.gpm, name), getattr(last.gpm, name)
            rise = b - a
            g[name] = rise + (rise / (n - 1) if n > 1 else 0)
            if isinstance(a, int):
                g[name] = int(g[name])
        d.gpm = GpmCounters(**g)
    return d


def _shift(s: GpuSample, d: GpuSample, k: int, timestamp: float) -> GpuSample:
    """``s`` moved ``k`` loops forward: counters grown by ``k`` times the per-loop delta ``d``."""
    out = replace(s, timestamp=timestamp)
    if k == 0:
        return out
    out.energy_mj = _add(s.energy_mj, d.energy_mj, k)
    out.pcie_replay_counter = _add(s.pcie_replay_counter, d.pcie_replay_counter, k)
    if s.clocks_event_ns is not None and d.clocks_event_ns is not None:
        out.clocks_event_ns = {key: v + k * d.clocks_event_ns.get(key, 0) for key, v in s.clocks_event_ns.items()}
    if s.ecc is not None and d.ecc is not None:
        out.ecc = {key: v + k * d.ecc.get(key, 0) for key, v in s.ecc.items()}
    if s.nvlink is not None and d.nvlink is not None:
        links = []
        for i, ln in enumerate(s.nvlink):
            dl = d.nvlink[i] if i < len(d.nvlink) else NvLinkSample()
            links.append(
                replace(
                    ln,
                    tx_kib=_add(ln.tx_kib, dl.tx_kib, k),
                    rx_kib=_add(ln.rx_kib, dl.rx_kib, k),
                    crc_flit=_add(ln.crc_flit, dl.crc_flit, k),
                    crc_data=_add(ln.crc_data, dl.crc_data, k),
                    replay=_add(ln.replay, dl.replay, k),
                    recovery=_add(ln.recovery, dl.recovery, k),
                )
            )
        out.nvlink = links
    if s.gpm is not None and d.gpm is not None:
        out.gpm = GpmCounters(
            **{n: getattr(s.gpm, n) + k * getattr(d.gpm, n) for n in GpmCounters.__dataclass_fields__}
        )
    return out


def _is_counter_file(rel: str) -> bool:
    parts = rel.split("/")
    return len(parts) >= 2 and parts[-2] in ("counters", "hw_counters")


class TraceSource:
    """A DeviceSource replaying a trace in a loop, with ``clock`` (unix seconds) as "now".

    Replay starts at the first line at the first read (driver(), inventory(),
    sample() or poll_xid()); ``pin=N`` instead freezes replay at sample line N
    (0-based), which gives deterministic reads for tests. When the trace
    carries IB files, ``sysfs_root`` is a temporary directory holding
    ``class/infiniband/...`` as of the current replay time, refreshed by a
    background thread every ``min(interval_s, 1)`` seconds (``background=False``:
    only when :meth:`refresh_sysfs` is called); :meth:`close` stops the thread
    and removes the directory.
    """

    def __init__(
        self,
        trace: Trace | str | os.PathLike[str],
        *,
        clock: Callable[[], float] = time.time,
        background: bool = True,
        pin: int | None = None,
    ) -> None:
        self.trace = trace if isinstance(trace, Trace) else read_trace(trace)
        if not self.trace.records:
            raise TraceError("the trace has a header but no sample lines")
        if pin is not None and not 0 <= pin < len(self.trace.records):
            raise ValueError(f"cannot pin sample line {pin}: the trace has {len(self.trace.records)}")
        self._pin = pin
        self._clock = clock
        self._lock = threading.RLock()
        recs = self.trace.records
        self._t0 = recs[0].t
        self._times = [r.t - self._t0 for r in recs]
        self._period = self._times[-1] + self.trace.interval_s
        self._start: float | None = None  # set by the first read
        n = len(recs)
        self._deltas = [_counter_delta(a, b, n) for a, b in zip(recs[0].samples, recs[-1].samples, strict=True)]
        self._xid_pos: tuple[int, int] = (0, -1)  # (loop, last record index delivered)
        # IB: full state at the first and last record, to continue counters across loops.
        self._has_ib = any(r.ib is not None for r in recs)
        self._ib_state: dict[str, str] = {}
        self._ib_at = -1
        self._ib_first: dict[str, str] = {}
        self._ib_last: dict[str, str] = {}
        self._ib_written: dict[str, str] = {}
        self.sysfs_root: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._has_ib:
            self._ib_first = self._ib_full(0)
            self._ib_last = self._ib_full(n - 1)
            self.sysfs_root = tempfile.mkdtemp(prefix="gpufleet-trace-sysfs-")
            self._cleanup = weakref.finalize(self, shutil.rmtree, self.sysfs_root, True)
            try:
                self.refresh_sysfs()
            except (OSError, ValueError) as e:  # e.g. "a" and "a/b" both listed as files
                self._cleanup()
                raise TraceError(f"the trace's IB files cannot form a sysfs tree: {e}") from e
            if background:
                self._thread = threading.Thread(target=self._sysfs_loop, name="trace-sysfs", daemon=True)
                self._thread.start()

    # --------------------------------------------------------------- time mapping

    def _position(self) -> tuple[int, int, float]:
        """(loop number, record index, wall time when that loop started) for now."""
        now = self._clock()
        if self._start is None:
            self._start = now
        if self._pin is not None:
            return 0, self._pin, self._start - self._times[self._pin]
        elapsed = max(0.0, now - self._start)
        loop = int(elapsed // self._period)
        within = elapsed - loop * self._period
        lo, hi = 0, len(self._times) - 1
        while lo < hi:  # last record with time <= within
            mid = (lo + hi + 1) // 2
            if self._times[mid] <= within:
                lo = mid
            else:
                hi = mid - 1
        return loop, lo, self._start + loop * self._period

    # --------------------------------------------------------------- DeviceSource

    def driver(self) -> DriverInfo:
        self._begin()
        return self.trace.driver

    def inventory(self) -> list[GpuInventory]:
        self._begin()
        return self.trace.gpus

    def _begin(self) -> None:
        if self._start is None:
            with self._lock:
                self._position()

    def sample(self, index: int) -> GpuSample:
        with self._lock:
            loop, i, loop_start = self._position()
            rec = self.trace.records[i]
            return _shift(rec.samples[index], self._deltas[index], loop, loop_start + self._times[i])

    def poll_xid(self) -> list[XidEvent]:
        with self._lock:
            loop, i, loop_start = self._position()
            events: list[XidEvent] = []
            pl, pi = self._xid_pos
            recs = self.trace.records
            while (pl, pi) < (loop, i):
                pi += 1
                if pi == len(recs):
                    pl, pi = pl + 1, 0
                ls = loop_start + (pl - loop) * self._period
                for x in recs[pi].xid:
                    events.append(XidEvent(gpu=x.gpu, xid=x.xid, timestamp=ls + (x.timestamp - self._t0)))
            self._xid_pos = (loop, i)
            return events

    # --------------------------------------------------------------- IB sysfs

    def _ib_full(self, index: int) -> dict[str, str]:
        """The full IB file set as of record ``index`` (applies deltas forward from a cached point)."""
        if index < self._ib_at:
            self._ib_state, self._ib_at = {}, -1
        for j in range(self._ib_at + 1, index + 1):
            delta = self.trace.records[j].ib
            if delta:
                self._ib_state.update(delta)
        self._ib_at = index
        return dict(self._ib_state)

    def ib_files(self) -> dict[str, str]:
        """The IB files as of now (counters continued across loops)."""
        with self._lock:
            loop, i, _ = self._position()
            files = self._ib_full(i)
            if loop == 0:
                return files
            out = {}
            n = len(self.trace.records)
            for rel, text in files.items():
                if _is_counter_file(rel):
                    try:
                        v = int(text.strip())
                        a, b = int(self._ib_first[rel].strip()), int(self._ib_last[rel].strip())
                    except (KeyError, ValueError):
                        out[rel] = text
                        continue
                    step = _step(a, b, n) or 0
                    out[rel] = f"{v + loop * step}\n"
                else:
                    out[rel] = text
            return out

    def refresh_sysfs(self) -> None:
        root = self.sysfs_root
        if root is None:
            return
        base = Path(root) / "class" / "infiniband"
        for rel, text in self.ib_files().items():
            if self._ib_written.get(rel) == text:
                continue
            target = base / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(target, text, mode=0o644)
            self._ib_written[rel] = text

    def _sysfs_loop(self) -> None:
        step = min(self.trace.interval_s, 1.0)
        while not self._stop.wait(step):
            with contextlib.suppress(OSError, ValueError):
                self.refresh_sysfs()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self.sysfs_root is not None:
            self._cleanup()
            self.sysfs_root = None
