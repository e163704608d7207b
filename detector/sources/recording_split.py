"""Reading one large recording in two processes: this one parses its first part, a forked worker the rest.

A well-formed recording can be cut where a family's metadata starts (:func:`~.recording_fast.family_cut`): each
part then parses on its own (:func:`~.recording_fast.parse_part`) and the parts join into the file's series
(:func:`~.recording_fast.join`), which also checks what only the whole file shows (a series in both parts, the
metadata as a whole). Where to cut comes from what reading costs a byte (:data:`PARSE_NS`, :data:`INFLATE_NS`),
so that both processes finish together: a plain file near its middle, less the work this process does beside
(replay imports scikit-learn meanwhile: :class:`Beside`); a gzip file is decompressed here up to the cut, and the
worker, forked with the decompressor's state, decompresses and parses the rest. The worker sends its part back as
a few large arrays. Anything unusual returns None (the strict reader then reads the whole file and names the
line); a worker that fails leaves its part to this process; a gzip file that cannot be streamed (several
members, a damaged one) is read as :func:`~.recording_io.file_bytes` reads it.
"""

from __future__ import annotations

import multiprocessing
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import cast

import numpy as np

from gpufleet.detector.sources.recording_fast import Buffer, Part, RawSeries, family_cut, join, parse_part
from gpufleet.detector.sources.recording_io import compression, file_bytes

FloatArray = np.ndarray
IntArray = np.ndarray

#: Files from this size on are read in two processes when asked (below it, the fork costs more than it saves).
SPLIT_BYTES = 16 << 20

#: What reading costs a byte of text (measured on the bench recordings; only their ratio matters): decompressing
#: gzip, and decoding and parsing. The part each process reads is chosen so that both finish together.
INFLATE_NS = 1.1
PARSE_NS = 3.2

#: Compressed bytes decompressed at a time.
_STEP = 1 << 20
#: How far back a line's start is looked for where a decompressed piece begins.
_LINE = 1 << 16


@dataclass(frozen=True)
class Beside:
    """Work for this process while the worker parses (replay imports scikit-learn), and what it costs, as the
    bytes of text parsing costs as much: this process's part of the file is that much smaller."""

    work: Callable[[], object]
    cost_bytes: int


def read_fast(path: str | Path, wanted: set[str] | None, parallel: bool,
              beside: Beside | None = None) -> RawSeries | None:
    """The file's series by the fast reader (None: anything unusual, for the strict reader); in two processes
    when ``parallel``, a worker can be forked and the file is large (or there is work to do beside). ``beside``
    runs once in this process, whichever way the file is read."""
    parallel = parallel and _can_fork()
    if parallel and compression(path) == "gzip":
        streamed = _read_gzip_split(path, wanted, beside)
        if streamed is not _NOT_STREAMED:
            return cast("RawSeries | None", streamed)
    with file_bytes(path) as data:
        if parallel and (beside is not None or len(data) >= SPLIT_BYTES):
            # this process's part: half of what is left after the work beside
            near = (len(data) - (beside.cost_bytes if beside else 0)) // 2
            cut = family_cut(data, near) if near > 0 else 0
            if cut or beside is not None:
                return _read_split(data, cut, b"", None, wanted, beside)
        if beside is not None:
            beside.work()
        return _whole(data, wanted)


def _whole(data: Buffer, wanted: set[str] | None) -> RawSeries | None:
    """A whole file's text parsed in this process."""
    part = _parsed(data, 0, len(data), wanted, final=True)
    return join([part]) if part is not None else None


class _Gzip:
    """A gzip file's text decompressed piece by piece (a single member; anything else is not streamed)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        self.inflate = zlib.decompressobj(wbits=31)  # gzip header and trailer (CRC, length) checked by zlib

    def size(self) -> int:
        """The text's size as the trailer gives it (modulo 4 GiB)."""
        return int.from_bytes(self.data[-4:], "little") if len(self.data) >= 18 else 0

    def more(self, n: int) -> bytes | None:
        """The text of the next ``n`` compressed bytes (b"" at the end); None: not one clean member."""
        try:
            out = self.inflate.decompress(self.data[self.pos:self.pos + n])
        except zlib.error:
            return None
        self.pos += n
        if self.inflate.eof and (self.inflate.unused_data or self.pos < len(self.data)):
            return None  # another member (or trailing bytes) after the first
        if self.pos >= len(self.data) and not self.inflate.eof:
            return None  # truncated
        return out

    def rest(self) -> list[bytes] | None:
        """The remaining text, in pieces (None: not one clean member)."""
        pieces = []
        while self.pos < len(self.data):
            piece = self.more(_STEP)
            if piece is None:
                return None
            pieces.append(piece)
        return pieces


_NOT_STREAMED = object()


def _read_gzip_split(path: str | Path, wanted: set[str] | None, beside: Beside | None) -> RawSeries | object | None:
    """:func:`read_fast` for a gzip file in two processes; _NOT_STREAMED when it is small or not one clean
    member (then it is read whole, and a damaged file's error raised there)."""
    with open(path, "rb") as f:
        gz = _Gzip(f.read())
    size = gz.size()
    if size < SPLIT_BYTES and beside is None:
        return _NOT_STREAMED
    # Decompressing this process's part delays the worker's start, so both finish together when this part is
    # (size * (inflate + parse) - beside) / (inflate + 2 * parse) long.
    cost = beside.cost_bytes * PARSE_NS if beside else 0.0
    target = int((size * (INFLATE_NS + PARSE_NS) - cost) / (INFLATE_NS + 2 * PARSE_NS))
    if target <= 0:  # the worker decompresses and parses it all
        return _read_split(b"", 0, b"", gz, wanted, beside)
    pieces: list[bytes] = []  # (inflating piece by piece into a list is faster than into one growing buffer)
    produced = 0
    cut = 0
    while not cut:
        piece = gz.more(_STEP)
        if piece is None:
            return _NOT_STREAMED
        if not piece and gz.pos >= len(gz.data):  # no family starts past the target: the whole text is here
            if beside is not None:
                beside.work()
            return _whole(b"".join(pieces), wanted)
        if produced + len(piece) > target:  # look in this piece and the end of the last one (a line's start)
            before = pieces[-1][-_LINE:] if pieces else b""
            at = family_cut(before + piece, max(0, target - produced + len(before)))
            if at:
                cut = produced - len(before) + at
        pieces.append(piece)
        produced += len(piece)
    head = b"".join(pieces)
    return _read_split(head, cut, head[cut:], gz, wanted, beside)


def _read_split(data: Buffer, cut: int, tail: bytes, gz: _Gzip | None, wanted: set[str] | None,
                beside: Beside | None = None) -> RawSeries | None:
    """Parse ``data[:cut]`` here (after the work beside, if any) and the rest in a forked worker: ``data[cut:]``,
    or for a gzip file ``tail`` (decompressed past the cut) and what ``gz`` has not decompressed yet. The
    worker's part comes back packed; if the worker fails, its part is read here."""
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    worker = ctx.Process(target=_part_worker, args=(send, data, cut, tail, gz, wanted), daemon=True)
    try:
        worker.start()
        started = True
    except OSError:  # no process to be had (limits): both parts here
        receive.close()
        started = False
    send.close()
    try:
        if beside is not None:
            beside.work()
        # (nothing before the cut: the worker reads it all)
        first = _parsed(data, 0, cut, wanted, final=False) if cut else ({}, [])
        if first is None:  # the strict reader reads the whole file: the worker's part is not needed
            if started:
                worker.kill()
            return None
        second: Part | None = None
        if started:
            try:
                answer: tuple[str, object] = receive.recv()
            except (EOFError, OSError):
                answer = ("lost", None)
            if answer[0] == "packed":
                second = _unpack_part(cast(_PackedPart, answer[1]))
            elif answer[0] == "unusual":
                return None
        if second is None:  # no worker, or it failed: its part here
            second = _second_part(data, cut, tail, gz, wanted)
    finally:
        receive.close()
        if started:
            worker.join()
    return join([first, second]) if second is not None else None


def _second_part(data: Buffer, cut: int, tail: bytes, gz: _Gzip | None, wanted: set[str] | None) -> Part | None:
    """The part after the cut (in the worker, or here when the worker failed)."""
    if gz is None:
        return _parsed(data, cut, len(data), wanted, final=True)
    rest = gz.rest()
    if rest is None:
        return None  # a damaged end: the strict reader reads the file and raises its error
    whole = b"".join([tail, *rest])
    return _parsed(whole, 0, len(whole), wanted, final=True)


def _part_worker(send: Connection, data: Buffer, cut: int, tail: bytes, gz: _Gzip | None,
                 wanted: set[str] | None) -> None:
    """In :func:`_read_split`'s worker: parse the part after the cut, send it packed (or "unusual")."""
    answer: tuple[str, object]
    try:
        part = _second_part(data, cut, tail, gz, wanted)
        answer = ("unusual", None) if part is None else ("packed", _pack_part(part))
    except Exception as e:  # anything else: the parent reads the part itself and meets it there
        answer = ("failed", repr(e))
    try:
        send.send(answer)
    finally:
        send.close()


def _parsed(data: Buffer, start: int, end: int, wanted: set[str] | None, final: bool) -> Part | None:
    """``data[start:end]`` decoded in place (not copied first) and parsed (:func:`parse_part`); None when it is not
    UTF-8 or anything is unusual (the strict reader then says where)."""
    try:
        with memoryview(data) as whole, whole[start:end] as piece:
            text = str(piece, "utf-8")
    except UnicodeDecodeError:
        return None
    return parse_part(text, wanted, final) if text else None


def _can_fork() -> bool:
    """Whether a worker process can be forked here (fork exists; a daemon, e.g. a pool's worker, may not)."""
    try:
        multiprocessing.get_context("fork")
    except ValueError:
        return False
    return not multiprocessing.current_process().daemon


#: A :data:`Part` as the worker sends it: names, each name's label sets, which of the distinct timestamp arrays
#: each series has, the arrays' lengths, the distinct timestamps and all values each as one, and the metadata.
_PackedPart = tuple[list[str], list[list[tuple[tuple[str, str], ...]]], IntArray, IntArray, FloatArray, FloatArray,
                    list[str]]


def _pack_part(part: Part) -> _PackedPart:
    """A part as a few large arrays (pickled as a few buffers, not ~20,000 small arrays: about half the CPU for
    10,000 series). Series that share one timestamp array (the reader gives series of one scrape the same one)
    share it after unpacking. Each series of a part is one chunk (the reader rejects a series seen twice)."""
    raw, meta = part
    names = list(raw)
    keys = [list(raw[name]) for name in names]
    every = [chunks for name in names for chunks in raw[name].values()]
    which: dict[int, int] = {}
    distinct: list[FloatArray] = []
    ts_of = np.empty(len(every), dtype=np.int64)
    for k, (ts, _) in enumerate(every):
        j = which.get(id(ts[0]))
        if j is None:
            j = which[id(ts[0])] = len(distinct)
            distinct.append(np.asarray(ts[0], dtype=np.float64))
        ts_of[k] = j
    ts_len = np.array([len(a) for a in distinct], dtype=np.int64)
    stamps = np.concatenate(distinct) if distinct else np.zeros(0)
    values = np.concatenate([np.asarray(vs[0], dtype=np.float64) for _, vs in every]) if every else np.zeros(0)
    return names, keys, ts_of, ts_len, stamps, values, meta


def _unpack_part(packed: _PackedPart) -> Part:
    """What :func:`_pack_part` packed: the same part, its arrays views of the large ones."""
    names, keys, ts_of, ts_len, stamps, values, meta = packed
    stamps.flags.writeable = False  # shared between series
    columns = [stamps[a:b] for a, b in _bounds(ts_len)]
    spans = iter(zip(ts_of.tolist(), _bounds(ts_len[ts_of]), strict=True))
    raw: RawSeries = {}
    for name, name_keys in zip(names, keys, strict=True):
        by_labels = raw[name] = {}
        for key in name_keys:
            j, (lo, hi) = next(spans)
            by_labels[key] = ([columns[j]], [values[lo:hi]])
    return raw, meta


def _bounds(lengths: IntArray) -> list[tuple[int, int]]:
    """(start, end) of each of consecutive pieces of these lengths."""
    ends = np.cumsum(lengths).tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True)) if ends else []
