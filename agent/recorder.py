"""``gpufleet-agent record``: record a host's raw NVML readings (and IB counters) into a trace.

The trace (format: :mod:`gpufleet.agent.nvml.trace`) holds what NVML returned, in
NVML's units, plus the XID events the listener saw and the InfiniBand files
under ``<sysfs>/class/infiniband``. Replay it anywhere with
``gpufleet-agent --nvml.fake=trace:PATH``: the agent then exports what it would
have exported on the recorded host.

The MIG mode (in the trace's inventory) and every line's compute processes are
recorded too (:mod:`gpufleet.agent.nvml.record_usage`).

GPM metrics are ratios between two samples on real hardware; the recorder
integrates them over the time between samples into the cumulative
:class:`~gpufleet.agent.nvml.model.GpmCounters`, so replay recomputes the same
ratios.

Usage::

    gpufleet-agent record --output node17.jsonl.gz --interval 1 --duration 600
    gpufleet-agent record --output x.jsonl --samples 30 --nvml.fake=sim

Options: ``--output PATH`` (``.jsonl`` or ``.jsonl.gz``, required), ``--interval
SECONDS`` (default 1), ``--duration SECONDS`` or ``--samples N`` (default: until
interrupted), ``--path.sysfs DIR`` (default ``/sys``; IB files are read from
``DIR/class/infiniband`` when it exists), ``--hostname NAME``, and the agent's
``--nvml.fake SPEC`` and ``--log.level LEVEL``, and ``--call-timeout SECONDS`` (default 10): how long
NVML's initialization and each line's reads may take (:mod:`gpufleet.agent.nvml.record_reads`: a GPU whose
reads hang is written as lost until they return; the others go on). Exit codes: 0 done (also when
interrupted after the header), 1 NVML unavailable, hung at initialization, or an I/O error, 2 bad usage.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from types import FrameType

from gpufleet.agent.app import build_backend
from gpufleet.agent.collectors.xid import XidCollector
from gpufleet.agent.nvml import fabric_reader
from gpufleet.agent.nvml.backend import Device, NvmlBackend
from gpufleet.agent.nvml.model import DriverInfo, GpmCounters, GpuInventory, GpuSample, XidEvent
from gpufleet.agent.nvml.reading import GpmRates, Reading, blank_sample
from gpufleet.agent.nvml.record_reads import CALL_TIMEOUT, GpuRead, LineReader
from gpufleet.agent.nvml.record_usage import UsageRecorder
from gpufleet.agent.nvml.trace import TraceWriter
from gpufleet.serving.argtypes import positive_float, positive_int
from gpufleet.serving.logs import LOG_FORMAT, LOG_LEVELS, log_level

log = logging.getLogger(__name__)

MIB = 1024 * 1024
#: IB files read per device and per port (besides everything in counters/ and hw_counters/).
IB_DEVICE_FILES = ("hca_type", "board_id", "fw_ver", "node_guid")
IB_PORT_FILES = ("state", "phys_state", "rate", "link_layer")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpufleet-agent record",
        description="Record raw NVML readings, XID events and InfiniBand counters into a replayable trace.",
    )
    p.add_argument("--output", "-o", required=True, metavar="PATH",
                   help="trace file to write: .jsonl, or .jsonl.gz for gzip")
    p.add_argument("--interval", type=positive_float, default=1.0, metavar="SECONDS",
                   help="seconds between samples (default: 1)")
    stop = p.add_mutually_exclusive_group()
    stop.add_argument("--duration", type=positive_float, metavar="SECONDS", help="record for this long")
    stop.add_argument("--samples", type=positive_int, metavar="N", help="record N sample lines")
    p.add_argument("--path.sysfs", dest="sysfs", default=None, metavar="DIR",
                   help="sysfs mount point; IB files come from DIR/class/infiniband (default: /sys, or the fake "
                        "source's tree with --nvml.fake)")
    p.add_argument("--nvml.fake", dest="nvml_fake", default="", metavar="SPEC",
                   help="record from a fake NVML source (sim, sim:N, trace:PATH, live:PATH) instead of the driver")
    p.add_argument("--hostname", default=socket.gethostname(), help="host name stored in the trace header")
    p.add_argument("--call-timeout", type=positive_float, default=CALL_TIMEOUT, metavar="SECONDS",
                   help="how long NVML's initialization and each line's reads of a GPU may take; a GPU whose "
                        f"reads have not returned is recorded as lost until they do (default: {CALL_TIMEOUT:g})")
    p.add_argument("--log.level", dest="log_level", default="info", choices=sorted(LOG_LEVELS))
    return p


# ---------------------------------------------------------------------- IB files


def read_ib_files(root: Path) -> dict[str, str]:
    """The IB files under ``root`` (a ``class/infiniband`` directory), keyed by path relative to it.

    Only the identity/state files and the counters are read (never the ``device`` link
    into the PCI tree); unreadable files are skipped.
    """
    out: dict[str, str] = {}
    try:
        devices = sorted(os.listdir(root))
    except OSError:
        return out
    for dev in devices:
        for name in IB_DEVICE_FILES:
            _read_into(out, root, f"{dev}/{name}")
        try:
            ports = sorted(os.listdir(root / dev / "ports"))
        except OSError:
            continue
        for port in ports:
            base = f"{dev}/ports/{port}"
            for name in IB_PORT_FILES:
                _read_into(out, root, f"{base}/{name}")
            for sub in ("counters", "hw_counters"):
                try:
                    names = sorted(os.listdir(root / base / sub))
                except OSError:
                    continue
                for name in names:
                    _read_into(out, root, f"{base}/{sub}/{name}")
    return out


def _read_into(out: dict[str, str], root: Path, rel: str) -> None:
    try:
        with open(root / rel, encoding="utf-8", errors="replace") as f:
            out[rel] = f.read()
    except OSError:
        pass  # absent, unreadable (EACCES/EINVAL on some counters) or a directory


# ---------------------------------------------------------------------- samples


class _Integrator:
    """Integrates GPM ratios (percent, MiB/s) between samples into cumulative GpmCounters per GPU."""

    def __init__(self, n: int) -> None:
        self.counters = [GpmCounters() for _ in range(n)]
        self.last_t: list[float | None] = [None] * n

    def add(self, i: int, rates: GpmRates | None, t: float) -> GpmCounters:
        c = self.counters[i]
        prev = self.last_t[i]
        self.last_t[i] = t
        if rates is not None and prev is not None and t > prev:
            dt = t - prev
            c.sm_active_s += (rates.sm_active_pct or 0.0) / 100 * dt
            c.sm_occupancy_s += (rates.sm_occupancy_pct or 0.0) / 100 * dt
            c.tensor_active_s += (rates.tensor_active_pct or 0.0) / 100 * dt
            c.dram_active_s += (rates.dram_active_pct or 0.0) / 100 * dt
            c.nvlink_tx_bytes += round((rates.nvlink_tx_mibps or 0.0) * MIB * dt)
            c.nvlink_rx_bytes += round((rates.nvlink_rx_mibps or 0.0) * MIB * dt)
            c.pcie_tx_bytes += round((rates.pcie_tx_mibps or 0.0) * MIB * dt)
            c.pcie_rx_bytes += round((rates.pcie_rx_mibps or 0.0) * MIB * dt)
        return replace(c)


def _to_sample(dev: Device, r: Reading, gpm: _Integrator, t: float) -> GpuSample:
    """The trace sample of one reading; GPM ratios are integrated over the time since the previous line
    (replay recomputes them over the same line times)."""
    if r.sample is None:
        s = blank_sample(t)
        s.lost = True  # lost or unreachable: replay answers GPU_IS_LOST
        gpm.last_t[dev.index] = None
        return s
    s = r.sample
    if s.nvlink:
        for ls, up in zip(s.nvlink, r.nvlink_up, strict=False):
            ls.up = bool(up)
    s.gpm = gpm.add(dev.index, r.gpm, t) if dev.gpm_supported else None
    return s


def _inventory(backend: NvmlBackend, dev: Device, first: GpuRead) -> GpuInventory:
    inv = backend.inventory(dev)
    inv.platform = (first.fabric or fabric_reader.FabricReading()).platform
    inv.mig_mode_current, inv.mig_mode_pending = first.mig_mode
    s = first.reading.sample
    if s is not None:
        inv.ecc_supported = s.ecc is not None
        inv.row_remap_supported = s.remapped_rows_correctable is not None
        inv.retired_pages_supported = s.retired_pages_single_bit is not None
    return inv


# ---------------------------------------------------------------------- main


def record_main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """Run ``gpufleet-agent record``; returns the process exit code."""
    ns = args if isinstance(args, argparse.Namespace) else build_parser().parse_args(
        list(sys.argv[1:] if args is None else args))
    logging.basicConfig(level=log_level(ns.log_level), format=LOG_FORMAT)
    out = Path(ns.output)
    if not (out.name.endswith(".jsonl") or out.name.endswith(".jsonl.gz")):
        print(f"gpufleet-agent record: --output {out}: the file name must end in .jsonl or .jsonl.gz",
              file=sys.stderr)
        return 2
    if not out.parent.is_dir():
        print(f"gpufleet-agent record: --output {out}: directory {out.parent} does not exist", file=sys.stderr)
        return 2
    try:
        backend = build_backend(ns.nvml_fake)
    except (ValueError, OSError) as e:
        print(f"gpufleet-agent record: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    restore = _install_signal_handlers(stop)
    try:
        return _record(ns, backend, out, stop)
    except KeyboardInterrupt:
        return 0
    finally:
        restore()
        backend.close()


def _record(ns: argparse.Namespace, backend: NvmlBackend, out: Path, stop: threading.Event) -> int:
    usage = UsageRecorder(backend)
    reader = LineReader(backend, usage, ns.call_timeout)
    started = reader.start()
    if started is None:
        print(f"gpufleet-agent record: NVML initialization has not returned after {ns.call_timeout:g} s "
              "(a hung driver or GPU): nothing recorded", file=sys.stderr)
        return 1
    if not started:
        print(f"gpufleet-agent record: NVML is not available: {backend.init_error}", file=sys.stderr)
        return 1
    sysfs = ns.sysfs or getattr(backend.source, "sysfs_root", None) or "/sys"
    ib_root = Path(sysfs) / "class" / "infiniband"
    refresh_host = getattr(backend.fake, "refresh_host", None)
    has_ib = ib_root.is_dir()
    events: list[XidEvent] = []
    lock = threading.Lock()

    def on_xid(e: XidEvent) -> None:
        with lock:
            events.append(e)

    xid = XidCollector(backend, on_event=on_xid)
    xid.start()
    try:
        devices = list(backend.devices)
        if not devices:
            print("gpufleet-agent record: NVML reports no GPUs", file=sys.stderr)
            return 1
        gpm = _Integrator(len(devices))
        read_t = time.time()
        reads = reader.read(devices, first=True)
        gpus = [_inventory(backend, d, g) for d, g in zip(devices, reads, strict=True)]
        assert backend.driver is not None
        driver = backend.driver
        info = DriverInfo(driver_version=driver.driver_version, nvml_version=driver.nvml_version,
                          cuda_driver_version=driver.cuda_driver_version or 0)
        limit = ns.samples
        deadline = time.monotonic() + ns.duration if ns.duration else None
        written = 0
        try:
            writer = TraceWriter(out, hostname=ns.hostname, interval_s=ns.interval, driver=info, gpus=gpus)
        except OSError as e:
            print(f"gpufleet-agent record: cannot write {out}: {e}", file=sys.stderr)
            return 1
        log.info("recording %d GPU(s) every %gs to %s%s", len(devices), ns.interval, out,
                 f" (IB from {ib_root})" if has_ib else "")
        with writer:
            start = time.monotonic()
            last_t = 0.0
            while True:
                t = max(read_t, last_t + 1e-6)
                samples = [_to_sample(d, g.reading, gpm, t) for d, g in zip(devices, reads, strict=True)]
                for g, sample in zip(reads, samples, strict=True):
                    if g.fabric is not None:
                        fabric_reader.apply(g.fabric, sample, g.reading.nvlink_links)
                    if g.reading.sample is not None:
                        sample.processes = g.processes
                with lock:
                    xids, events[:] = list(events), []
                if has_ib and refresh_host is not None:
                    refresh_host()  # a fake host's IB files move on by themselves (before they are read)
                writer.write(t, samples, xids, read_ib_files(ib_root) if has_ib else None)
                last_t = t
                written += 1
                if limit is not None and written >= limit:
                    break
                next_at = start + written * ns.interval
                if deadline is not None and next_at > deadline:
                    break
                if stop.wait(max(0.0, next_at - time.monotonic())):
                    break
                read_t = time.time()
                nxt = _read_all(reader, devices, stop)
                if nxt is None:
                    break
                reads = nxt
        log.info("wrote %d sample line(s) to %s", written, out)
        return 0
    finally:
        usage.close()
        xid.close()


def _read_all(reader: LineReader, devices: list[Device], stop: threading.Event) -> list[GpuRead] | None:
    """Read every GPU, each bounded (a hung one is written as lost); while NVML is down or does not answer,
    wait and retry (a trace never gets made-up lines)."""
    backend = reader.backend
    while not reader.refresh():
        log.warning("NVML not answering (%s); retrying", backend.init_error or "device count failed or hung")
        if stop.wait(1.0):
            return None
    if [d.index for d in backend.devices] != [d.index for d in devices]:
        log.warning("the GPU set changed during recording; keeping the original %d GPU(s)", len(devices))
    current = {d.index: d for d in backend.devices}
    return reader.read([current.get(d.index, d) for d in devices])


def _install_signal_handlers(stop: threading.Event) -> Callable[[], None]:
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for sig in previous:
        signal.signal(sig, handler)

    def restore() -> None:
        for sig, h in previous.items():
            signal.signal(sig, h)

    return restore


if __name__ == "__main__":
    raise SystemExit(record_main())
