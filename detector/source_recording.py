"""Features from OpenMetrics recordings, computed in memory with PromQL semantics.

Recordings are OpenMetrics text with timestamps (what ``promtool tsdb create-blocks-from openmetrics``
ingests), plain or compressed (:mod:`~gpufleet.detector.recording_io`: ``.gz``, and ``.zst`` where
``zstandard`` is installed). Only the metrics the profile asks for are kept, as one numpy time series per
label set: read by the fast block reader (:mod:`~gpufleet.detector.recording_fast`), or, for anything unusual,
by the strict line-by-line one (:mod:`~gpufleet.detector.recording_strict`), which names the line of an error.
Queries are evaluated by :mod:`~gpufleet.detector.window_ops` with Prometheus 2.x semantics.
"""

from __future__ import annotations

import multiprocessing
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import cast

import numpy as np

from gpufleet.detector.profiles import Query
from gpufleet.detector.recording_fast import RawSeries
from gpufleet.detector.recording_fast import load_fast as _load_fast
from gpufleet.detector.recording_io import RecordingError, read_text, text_lines
from gpufleet.detector.recording_strict import load_file as _load_file
from gpufleet.detector.source import Result, SeriesTable
from gpufleet.detector.window_ops import window_op, window_ops

__all__ = ["RawSeries", "RecordingError", "RecordingSource", "Series", "window_op", "window_ops"]

FloatArray = np.ndarray
IntArray = np.ndarray


@dataclass
class Series:
    labels: dict[str, str]
    ts: FloatArray
    values: FloatArray


class RecordingSource:
    """All series of the wanted metrics from one or more recording files."""

    def __init__(self, series: dict[str, list[Series]], table: SeriesTable | None = None) -> None:
        """``table``: the series table to intern the label sets into (a source that rebuilds views shares one)."""
        self.series = series
        self.table = table if table is not None else SeriesTable()
        self._ids = {name: np.array([self.table.intern(s.labels) for s in ss], dtype=np.int64)
                     for name, ss in series.items()}
        self._cache: dict[tuple[Query, float], tuple[dict[float, int], IntArray, FloatArray, np.ndarray]] = {}
        self.query_errors = 0
        self.samples = sum(len(s.ts) for ss in series.values() for s in ss)

    @classmethod
    def load(cls, paths: Sequence[str | Path], metrics: Iterable[str] | None = None) -> RecordingSource:
        return cls(_load_series(paths, set(metrics) if metrics is not None else None))

    @classmethod
    def load_beside(cls, paths: Sequence[str | Path], metrics: Iterable[str] | None,
                    work: Callable[[], object]) -> RecordingSource:
        """Like :meth:`load`, with the file read in a forked worker process while ``work()`` runs here.

        Replay uses this to overlap the parse with a costly import on a machine with a second core. The worker
        sends the parsed series back through a pipe; a file error is raised here with the same message. Where
        fork is not available, in a daemonic process (a multiprocessing pool's worker may not have children), or
        when the worker dies without an answer, the file is read in this process.
        """
        wanted = set(metrics) if metrics is not None else None
        try:
            ctx = multiprocessing.get_context("fork")
        except ValueError:
            ctx = None
        if ctx is None or multiprocessing.current_process().daemon:  # no fork; a daemon may not have children
            work()
            return cls(_load_series(paths, wanted))
        receive, send = ctx.Pipe(duplex=False)
        worker = ctx.Process(target=_load_worker, args=(send, list(paths), wanted), daemon=True)
        try:
            worker.start()
        except OSError:  # no process to be had (limits): read here
            receive.close()
            send.close()
            work()
            return cls(_load_series(paths, wanted))
        send.close()
        try:
            work()
            try:
                answer: tuple[str, object] = receive.recv()
            except (EOFError, OSError):
                answer = ("lost", None)
        finally:
            receive.close()
            worker.join()
        kind, payload = answer
        if kind == "packed":
            return cls(_unpack(cast(_Packed, payload)))  # what _load_series returned in the worker
        if kind == "series":
            return cls(cast(dict[str, list[Series]], payload))
        if kind == "error":
            raise RecordingError(str(payload))
        return cls(_load_series(paths, wanted))  # the worker failed otherwise: the error (if any) is raised here

    def time_range(self) -> tuple[float, float]:
        lo, hi = np.inf, -np.inf
        for ss in self.series.values():
            for s in ss:
                if len(s.ts):
                    lo, hi = min(lo, float(s.ts[0])), max(hi, float(s.ts[-1]))
        if lo > hi:
            raise RecordingError("the recording holds no samples of the profile's metrics")
        return lo, hi

    def metric_names(self) -> set[str]:
        return set(self.series)

    def precompute(self, query: Query, times: Sequence[float], window: float) -> None:
        """Evaluate ``query`` at every time of ``times`` at once (vectorized over time)."""
        t = np.asarray(times, dtype=np.float64)
        matching = self._matching_positions(query)
        ids = self._ids[query.metric][matching] if matching else np.zeros(0, dtype=np.int64)
        every = self.series.get(query.metric, [])
        # time-major (one row per evaluation time), so one time's answer is a contiguous row
        mat = np.empty((len(t), len(matching)))
        # Series that share their timestamps (scraped together; the reader shares one array) are evaluated
        # together, as rows of one matrix, in chunks of bounded size.
        shared: dict[int, list[int]] = {}
        for j, k in enumerate(matching):
            shared.setdefault(id(every[k].ts), []).append(j)
        for cols in shared.values():
            ts = every[matching[cols[0]]].ts
            rows = max(1, _CHUNK // max(len(ts), 1))
            for c in range(0, len(cols), rows):
                part = cols[c:c + rows]
                vs = np.stack([every[matching[j]].values for j in part])
                mat[:, part] = window_ops(query.op, ts, vs, t, window).T
        if query.scale != 1.0:
            mat *= query.scale
        mat.flags.writeable = False  # rows are handed out as the answers' values
        # per time: the answer's ids and values, the row itself where it has no gap (most rows: no copy)
        gaps = np.zeros(len(t), dtype=bool)
        if mat.size:
            np.any(np.isnan(mat), axis=1, out=gaps)
        self._cache[(query, window)] = ({float(x): i for i, x in enumerate(t)}, ids, mat, gaps)

    def query(self, query: Query, t: float, window: float) -> Result:
        cached = self._cache.get((query, window))
        if cached is None or float(t) not in cached[0]:
            self.precompute(query, [t], window)
            cached = self._cache[(query, window)]
        idx = cached[0][float(t)]
        ids, row = cached[1], cached[2][idx]
        if not cached[3][idx]:
            return Result(self.table, ids, row)
        keep = ~np.isnan(row)
        return Result(self.table, ids[keep], row[keep])

    def _matching(self, query: Query) -> list[Series]:
        """The series the query's matchers select."""
        every = self.series.get(query.metric, [])
        return [every[k] for k in self._matching_positions(query)]

    def _matching_positions(self, query: Query) -> list[int]:
        """Positions (in ``series[query.metric]``) of the series the query's matchers select."""
        res = [(k, op, re.compile(v) if op == "=~" else v) for k, op, v in query.matchers]
        out = []
        for pos, s in enumerate(self.series.get(query.metric, [])):
            ok = True
            for k, op, v in res:
                got = s.labels.get(k, "")
                if (op == "=" and got != v) or (op == "=~" and not v.fullmatch(got)):  # type: ignore[union-attr]
                    ok = False
                    break
            if ok:
                out.append(pos)
        return out



def _load_series(paths: Sequence[str | Path], wanted: set[str] | None) -> dict[str, list[Series]]:
    """Every series of the ``wanted`` sample names (all when None) in ``paths``, each sorted by time."""
    raw: RawSeries = {}
    for path in paths:
        try:
            text = read_text(path)
            fast = _load_fast(text, wanted) if text else None
            del text
            if fast is not None and not raw:
                raw = fast
                continue
            if fast is not None:
                for name, by_labels in fast.items():
                    into = raw.setdefault(name, {})
                    for key, (ts, vs) in by_labels.items():
                        have = into.setdefault(key, ([], []))
                        have[0].extend(ts)
                        have[1].extend(vs)
                continue
            _load_file(text_lines(path), wanted, raw, str(path))  # anything unusual: the strict line-by-line reader
        except OSError as e:
            raise RecordingError(f"cannot read {path}: {e.strerror or e}") from e
    series: dict[str, list[Series]] = {}
    for name, by_labels in raw.items():
        out = series.setdefault(name, [])
        for key, (ts_chunks, vs_chunks) in by_labels.items():
            t_arr = ts_chunks[0] if len(ts_chunks) == 1 else np.concatenate(ts_chunks)
            v_arr = vs_chunks[0] if len(vs_chunks) == 1 else np.concatenate(vs_chunks)
            if len(t_arr) > 1 and not (t_arr[1:] >= t_arr[:-1]).all():
                order = np.argsort(t_arr, kind="stable")
                t_arr, v_arr = t_arr[order], v_arr[order]
            out.append(Series(dict(key), t_arr, v_arr))
    return series


def _load_worker(send: Connection, paths: list[str | Path], wanted: set[str] | None) -> None:
    """In the worker process of :meth:`RecordingSource.load_beside`: parse, send the series or the error."""
    answer: tuple[str, object]
    try:
        series = _load_series(paths, wanted)
        packed = _pack(series)
        answer = ("series", series) if packed is None else ("packed", packed)
    except RecordingError as e:
        answer = ("error", str(e))
    except Exception as e:  # anything else: the parent reads the file itself and raises it there
        answer = ("failed", repr(e))
    try:
        send.send(answer)
    finally:
        send.close()


#: The series as :func:`_pack` sends them: the names and their series counts, every series' labels, which of the
#: distinct timestamp arrays it has and its values' length; the distinct timestamp arrays and all values, each as one.
_Packed = tuple[list[str], list[int], list[dict[str, str]], IntArray, IntArray, FloatArray, FloatArray]


def _pack(series: dict[str, list[Series]]) -> _Packed | None:
    """The series as a few large arrays (pickled as two buffers, not ~20,000 small arrays: about half the CPU
    for 10,000 series); None when the arrays are not all float64 (then they are sent as they are). Series that
    share one timestamp array (the reader gives series of one scrape the same one) share it after unpacking."""
    every = [s for ss in series.values() for s in ss]
    if any(s.ts.dtype != np.float64 or s.values.dtype != np.float64 for s in every):
        return None
    which: dict[int, int] = {}
    distinct: list[FloatArray] = []
    ts_of = np.empty(len(every), dtype=np.int64)
    for k, s in enumerate(every):
        j = which.get(id(s.ts))
        if j is None:
            j = which[id(s.ts)] = len(distinct)
            distinct.append(s.ts)
        ts_of[k] = j
    ts_len = np.array([len(a) for a in distinct], dtype=np.int64)
    ts = np.concatenate(distinct) if distinct else np.zeros(0)
    vs = np.concatenate([s.values for s in every]) if every else np.zeros(0)
    return list(series), [len(ss) for ss in series.values()], [s.labels for s in every], ts_of, ts_len, ts, vs


def _unpack(packed: _Packed) -> dict[str, list[Series]]:
    """What :func:`_pack` packed: the same series, their arrays views of the two large ones."""
    names, counts, labels, ts_of, ts_len, ts, vs = packed
    stamps = [ts[a:b] for a, b in _bounds(ts_len)]
    every = [Series(lb, stamps[j], vs[a:b])
             for lb, j, (a, b) in zip(labels, ts_of.tolist(), _bounds(ts_len[ts_of]), strict=True)]
    out: dict[str, list[Series]] = {}
    k = 0
    for name, count in zip(names, counts, strict=True):
        out[name] = every[k:k + count]
        k += count
    return out


def _bounds(lengths: IntArray) -> list[tuple[int, int]]:
    """(start, end) of each of consecutive pieces of these lengths."""
    ends = np.cumsum(lengths).tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True)) if ends else []


#: Values (samples x series) evaluated at once by :meth:`RecordingSource.precompute`.
_CHUNK = 1 << 22
