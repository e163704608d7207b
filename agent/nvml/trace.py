"""The gpufleet trace format: recorded GPU (and InfiniBand) readings of one host, for replay.

A trace is UTF-8 JSON Lines, optionally gzip-compressed (the file name ends in
``.gz``). ``gpufleet-agent record`` writes one on a real host; an agent started
with ``--nvml.fake=trace:PATH`` replays it through the fake NVML.

Line 1, the header::

    {"format": "gpufleet-trace", "version": 1,
     "hostname": "gpu-node-17",          # where it was recorded
     "interval_s": 1.0,                  # nominal time between sample lines (> 0)
     "driver": DriverInfo,               # {"driver_version", "nvml_version", "cuda_driver_version"}
     "gpus": [GpuInventory, ...]}        # static facts, in NVML index order

Every further line is one sample time::

    {"t": 1763780000.25,                 # unix seconds; strictly increasing from line to line
     "samples": [GpuSample, ...],        # one per GPU of the header, same order
     "xid": [XidEvent, ...],             # XID events seen since the previous line (may be [])
     "ib": {"mlx5_0/ports/1/counters/port_xmit_data": "123456\\n", ...}}   # optional

``DriverInfo``, ``GpuInventory``, ``GpuSample`` and ``XidEvent`` are the JSON
objects of the dataclasses in :mod:`gpufleet.agent.nvml.model`, with NVML's units
(MHz, mW, mJ, percent, KiB, KB/s, ns) and ``null`` for "not supported". Unknown
keys are ignored, missing keys take the dataclass defaults, so newer writers stay
readable. ``samples[i].timestamp`` is the reading time of GPU ``i``.

``ib`` holds files of a host's ``/sys/class/infiniband`` tree, keyed by their
path relative to ``class/infiniband`` and holding the file's text. It is
*delta-encoded*: a line lists only the files whose content changed since the
previous line (the first line that has ``ib`` lists them all); a file keeps its
last content until a later line changes it. A line without ``ib`` changes
nothing.

Replay (:class:`gpufleet.sim.fake.trace_source.TraceSource`) maps wall-clock time onto trace time and loops:
one loop lasts ``t_last - t_first + interval_s``; in each new loop the
cumulative counters (energy, clock-event time, NVLink/PCIe/GPM integrals, error
counters, numeric IB counters) continue from where the previous loop ended
instead of jumping back, so a replayed counter never resets.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from gpufleet.agent.nvml import plausible
from gpufleet.agent.nvml.model import (
    DriverInfo,
    GpuInventory,
    GpuSample,
    XidEvent,
    driver_from_dict,
    inventory_from_dict,
    sample_from_dict,
    to_dict,
    xid_from_dict,
)

FORMAT = "gpufleet-trace"
VERSION = 1


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


@dataclass
class TraceRecord:
    t: float
    samples: list[GpuSample]
    xid: list[XidEvent] = field(default_factory=list)
    #: changed IB files (delta, see the module docstring); None when the line has no "ib"
    ib: dict[str, str] | None = None


@dataclass
class Trace:
    hostname: str
    interval_s: float
    driver: DriverInfo
    gpus: list[GpuInventory]
    records: list[TraceRecord]


def _open_text(path: Path, mode: str) -> IO[str]:
    gz = path.name.endswith(".gz")
    if mode == "w":
        return gzip.open(path, "wt", encoding="utf-8", newline="\n") if gz else open(path, "w", encoding="utf-8")
    return gzip.open(path, "rt", encoding="utf-8", newline="\n") if gz else open(path, encoding="utf-8")


class TraceWriter:
    """Write a trace line by line (gzip when the path ends in ``.gz``); usable as a context manager.

    ``ib`` passed to :meth:`write` is the *full* current set of IB files; the
    writer stores only what changed since the previous line.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        hostname: str,
        interval_s: float,
        driver: DriverInfo,
        gpus: Sequence[GpuInventory],
    ) -> None:
        if not interval_s > 0 or not math.isfinite(interval_s):
            raise ValueError(f"interval_s must be a positive number, got {interval_s!r}")
        if not gpus:
            raise ValueError("a trace needs at least one GPU")
        self.path = Path(path)
        self._gpus = len(gpus)
        self._last_t: float | None = None
        self._ib: dict[str, str] = {}
        self._f = _open_text(self.path, "w")
        header = {
            "format": FORMAT,
            "version": VERSION,
            "hostname": hostname,
            "interval_s": float(interval_s),
            "driver": to_dict(driver),
            "gpus": [to_dict(g) for g in gpus],
        }
        self._line(header)

    def _line(self, obj: Mapping[str, Any]) -> None:
        self._f.write(json.dumps(obj, separators=(",", ":"), allow_nan=False) + "\n")
        self._f.flush()

    def write(
        self,
        t: float,
        samples: Sequence[GpuSample],
        xid: Iterable[XidEvent] = (),
        ib: Mapping[str, str] | None = None,
    ) -> None:
        if len(samples) != self._gpus:
            raise ValueError(f"{len(samples)} samples for a trace of {self._gpus} GPUs")
        if self._last_t is not None and not t > self._last_t:
            raise ValueError(f"trace times must increase: {t} after {self._last_t}")
        self._last_t = t
        line: dict[str, Any] = {
            "t": t,
            "samples": [to_dict(s) for s in samples],
            "xid": [to_dict(x) for x in xid],
        }
        if ib is not None:
            changed = {k: v for k, v in ib.items() if self._ib.get(k) != v}
            self._ib.update(changed)
            line["ib"] = changed
        self._line(line)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    lineno = 0
    try:
        with _open_text(path, "r") as f:
            for lineno, text in enumerate(f, start=1):
                yield lineno, text
    except (OSError, EOFError, UnicodeDecodeError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        where = f"{path}:{lineno + 1}" if lineno else str(path)
        raise TraceError(f"{where}: cannot read ({e}); the file is corrupt or truncated") from e


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Read a whole trace; raises :class:`TraceError` naming the line of the first problem."""
    p = Path(path)
    header: Trace | None = None
    last_t = -math.inf
    ib_files: set[str] = set()
    ib_dirs: set[str] = set()
    for lineno, text in _lines(p):
        if not text.strip():
            continue
        where = f"{p}:{lineno}"
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not valid JSON ({e.msg}); the file is corrupt or truncated") from e
        except (ValueError, RecursionError) as e:  # an integer of thousands of digits, nesting too deep
            raise TraceError(f"{where}: not a usable JSON line ({type(e).__name__}: {str(e)[:80]})") from e
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object")
        try:
            if header is None:
                header = _header(obj, where)
                continue
            rec = _record(obj, len(header.gpus))
        except TraceError:
            raise
        except (KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError) as e:
            what = "header" if header is None else "sample line"
            detail = f"missing key {e}" if isinstance(e, KeyError) else str(e)
            raise TraceError(f"{where}: bad {what}: {detail}") from e
        if not rec.t > last_t:
            raise TraceError(f"{where}: time {rec.t} does not increase (previous {last_t})")
        last_t = rec.t
        for k in rec.ib or ():
            if k not in ib_files:
                parts = k.split("/")
                parents = {"/".join(parts[:i]) for i in range(1, len(parts))}
                if k in ib_dirs or parents & ib_files:
                    raise TraceError(f"{where}: IB path {k[:80]!r} is both a file and a directory")
                ib_files.add(k)
                ib_dirs |= parents
        header.records.append(rec)
    if header is None:
        raise TraceError(f"{p}: empty file, not a gpufleet trace")
    return header


def _header(obj: dict[str, Any], where: str) -> Trace:
    if obj.get("format") != FORMAT:
        raise TraceError(f"{where}: not a gpufleet trace (header 'format' is {obj.get('format')!r})")
    if obj.get("version") != VERSION:
        raise TraceError(f"{where}: unsupported trace version {obj.get('version')!r} (this reader knows {VERSION})")
    interval = _number(obj["interval_s"], "interval_s")
    if not interval > 0 or not math.isfinite(interval):
        raise TraceError(f"{where}: interval_s must be positive")
    gpus = [inventory_from_dict(g) for g in _objects(obj["gpus"], "gpus")]
    if not gpus:
        raise TraceError(f"{where}: the header lists no GPUs")
    if not isinstance(obj["driver"], dict):
        raise ValueError("driver: expected an object")
    driver = driver_from_dict(obj["driver"])
    for i, inv in enumerate(gpus):
        plausible.check(inv, f"gpus[{i}]")
    plausible.check(driver, "driver")
    return Trace(
        hostname=str(obj.get("hostname", "")),
        interval_s=interval,
        driver=driver,
        gpus=gpus,
        records=[],
    )


def _number(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{what}: expected a number, got {type(v).__name__}")
    return float(v)


def _objects(v: Any, what: str) -> list[dict[str, Any]]:
    """``v`` if it is a list of JSON objects, else ValueError."""
    if not isinstance(v, list) or not all(isinstance(x, dict) for x in v):
        raise ValueError(f"{what}: expected a list of objects")
    return v


def _ib_path_ok(k: str) -> bool:
    """A relative path below class/infiniband: no empty, '.' or '..' parts, no NUL."""
    parts = k.split("/")
    return bool(k) and "\0" not in k and all(p not in ("", ".", "..") for p in parts)


def _record(obj: dict[str, Any], ngpus: int) -> TraceRecord:
    t = _number(obj["t"], "t")
    if not math.isfinite(t):
        raise ValueError("t is not finite")
    samples = [sample_from_dict(s) for s in _objects(obj["samples"], "samples")]
    if len(samples) != ngpus:
        raise ValueError(f"{len(samples)} samples, the header lists {ngpus} GPUs")
    for i, s in enumerate(samples):
        plausible.check(s, f"samples[{i}]")
    xid = [xid_from_dict(x) for x in _objects(obj.get("xid") or [], "xid")]
    for i, x in enumerate(xid):
        plausible.check(x, f"xid[{i}]")
        if x.gpu >= ngpus:
            raise ValueError(f"xid[{i}].gpu: no GPU {x.gpu} (the header lists {ngpus})")
    ib = obj.get("ib")
    if ib is not None and not (isinstance(ib, dict) and all(isinstance(v, str) for v in ib.values())):
        raise ValueError("'ib' must map paths to file contents (strings)")
    for k in ib or {}:
        if not _ib_path_ok(k):
            raise ValueError(f"IB path {k[:80]!r} leaves class/infiniband (not a relative path of named parts)")
    return TraceRecord(t=t, samples=samples, xid=xid, ib=ib)
