"""A remote-write stream's window as columns: per metric, one row per series in two matrices (times, values).

The receiver's hot path only appends: a sample newer than its series' newest goes to the metric's *pending*
arrays (row, time, value), a few machine words, with no numpy call per sample. The matrices change only when
the store makes a view for a new evaluation instant (:meth:`MetricRows.flush`): the pending samples are
scattered into their rows at once (rows that took a late sample are re-sorted), so a view stays one consistent
picture of the window for the whole of one evaluation while samples keep arriving.

Series ``r`` is column ``r`` of the matrices (time-major: one step of every series is a contiguous row), its
samples from row 0 in time order, past the last (``cnt[r]``) NaN values and the largest time, so one query is a
few vectorized passes over the series it selects (:func:`~gpufleet.detector.sources.window_ops.window_rows`),
with every series at its own times (targets scraped at their own offsets need no grouping). Samples older than the
window are shifted out when the columns would otherwise grow (:meth:`MetricRows.trim`), and rows left empty
(series gone) are dropped when they are many (:meth:`MetricRows.compact`).

Times are held as they arrive, integer milliseconds, as 32-bit offsets from a per-metric base
(:attr:`MetricRows.base`): half the memory of a float second, and every comparison of a window's bounds made in
integers gives the float one's answer to the bit (:func:`~gpufleet.detector.sources.window_ops.window_bounds`).
When a sample would not fit (24.8 days from the base) what is older than the window is shifted out and the base
moves to the oldest time left; a flush whose times span more than that (a sender's clock years ahead) widens the
metric's times to 64 bits, narrowed again at the next trim once what is held fits.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping
from itertools import islice

import numpy as np

from gpufleet.detector.sources.profiles import Query
from gpufleet.detector.sources.recording import match_positions
from gpufleet.detector.sources.source import LabelKey, Result, SeriesTable
from gpufleet.detector.sources.window_ops import count_before, ms_seconds, window_bounds, window_rows

FloatArray = np.ndarray
IntArray = np.ndarray

_NARROW, _WIDE = np.int32, np.int64


class MetricRows:
    """One metric's series ("rows": columns of the time-major matrices): their label sets and ids, the flushed
    samples as matrices (step x series), the pending ones."""

    def __init__(self, retention: float) -> None:
        self.retention = retention
        #: Label key -> row, in row order.
        self.index: dict[LabelKey, int] = {}
        self.labels: list[dict[str, str]] = []
        self.ids = array("q")
        #: Per row: the newest sample time held (flushed or pending; -inf before the first).
        self.last = array("d")
        #: The sample times of ``t`` are milliseconds after this one (ms since the epoch).
        self.base = 0
        self.t: IntArray = np.full((0, 0), np.iinfo(_NARROW).max, dtype=_NARROW)
        self.v: FloatArray = np.full((0, 0), np.nan)
        self.cnt: IntArray = np.zeros(0, dtype=np.int64)
        self.p_row = array("q")
        self.p_t = array("d")
        self.p_v = array("d")
        #: (row, time) -> value of the pending samples, kept only once a late sample needs to look them up.
        self.p_map: dict[tuple[int, float], float] | None = None
        #: Rows that took a late sample since the last flush (re-sorted then).
        self.late: set[int] = set()
        #: Changes whenever a row is added or rows are dropped (ids and matching rows are cached until then).
        self.epoch = 0
        self._ids: tuple[int, IntArray] | None = None

    def add_row(self, key: LabelKey, sid: int, labels: dict[str, str]) -> int:
        r = len(self.ids)
        self.index[key] = r
        self.labels.append(labels)
        self.ids.append(sid)
        self.last.append(-math.inf)
        self.epoch += 1
        return r

    def held(self, r: int, t: float) -> float | None:
        """The value held for row ``r`` at time ``t`` (NaN is a value), or None when there is none."""
        pm = self.p_map
        if pm is None:
            pm = self.p_map = {(int(a), b): c for a, b, c in zip(self.p_row, self.p_t, self.p_v, strict=True)}
        got = pm.get((r, t))
        if got is not None:
            return got
        c = int(self.cnt[r]) if r < len(self.cnt) else 0
        off = round(t * 1000.0) - self.base
        info = np.iinfo(self.t.dtype)
        if c and info.min <= off < info.max:
            times = self.t[:c, r]
            i = int(np.searchsorted(times, off))
            if i < c and times[i] == off:
                return float(self.v[i, r])
        return None

    def times(self, r: int) -> FloatArray:
        """Row ``r``'s flushed sample times, in seconds."""
        return ms_seconds(self.t[: int(self.cnt[r]), r], self.base)

    def pending(self) -> int:
        return len(self.p_row)

    @property
    def samples(self) -> int:
        return int(self.cnt.sum()) + len(self.p_row)

    def series(self) -> int:
        """Rows holding a sample (flushed or pending)."""
        if not len(self.p_row):
            return int(np.count_nonzero(self.cnt))
        has = np.zeros(max(len(self.ids), len(self.cnt)), dtype=bool)
        has[: len(self.cnt)] = self.cnt > 0
        has[np.frombuffer(self.p_row, dtype=np.int64)] = True
        return int(np.count_nonzero(has))

    def settle(self, keep: float, trim: bool) -> None:
        """:meth:`flush`, and with ``trim`` also :meth:`trim` and :meth:`compact`."""
        self.flush(keep)
        if trim:
            self.trim(keep)
            self.compact()
            if self.t.dtype != _NARROW:  # widened for a clock far off: narrowed once what is held fits again
                self._refit(np.zeros(0, dtype=np.int64))

    def flush(self, keep: float) -> None:
        """Scatter the pending samples into the matrices (rows grown as needed; when the columns are full, the
        samples older than ``keep`` are shifted out first, and the columns grown only if that is not enough)."""
        n = len(self.ids)
        if n > self.t.shape[1]:
            self._resize(self.t.shape[0], max(n, 2 * self.t.shape[1], 16))
        if not len(self.p_row):
            self.p_map = None
            self.late.clear()
            return
        r = np.frombuffer(self.p_row, dtype=np.int64)
        tt = np.frombuffer(self.p_t, dtype=np.float64)
        vv = np.frombuffer(self.p_v, dtype=np.float64)
        self.p_row, self.p_t, self.p_v, self.p_map = array("q"), array("d"), array("d"), None
        if int(np.bincount(r, minlength=1).max()) == 1:  # a sample per series (evaluated every scrape): as it is
            start, length = np.arange(len(r)), np.ones(len(r), dtype=np.int64)
            rank = np.zeros(len(r), dtype=np.int64)
        else:  # grouped by series, each in arrival order (late ones are sorted below)
            order = np.argsort(r, kind="stable")
            r, tt, vv = r[order], tt[order], vv[order]
            start = np.flatnonzero(np.concatenate(([True], r[1:] != r[:-1])))
            length = np.diff(np.append(start, len(r)))
            rank = np.arange(len(r)) - np.repeat(start, length)
        ms = np.rint(tt * 1000.0).astype(np.int64)  # the samples' own integer timestamps (t = ms / 1000)
        if not self.cnt.any():  # nothing held: any base will do
            self.base = int(ms.min())
        col = self.cnt[r] + rank
        if int(col.max()) >= self.t.shape[0]:
            self.trim(keep)
            col = self.cnt[r] + rank
            need = int(col.max()) + 1
            if need > self.t.shape[0]:
                # room for half a window more than the window holds at the rate samples come (the columns are
                # trimmed when full): grown once, not at every new sample
                per_window = self._per_window(tt, length, need)
                steps = max(need, min(math.ceil(1.5 * per_window) + 2, max(3 * need, 64)),
                            self.t.shape[0] * 3 // 2, 4)
                self._resize(steps, self.t.shape[1])
        off = ms - self.base
        info = np.iinfo(self.t.dtype)
        if int(off.min()) < info.min or int(off.max()) >= info.max:
            self.trim(keep)  # what is older than the window goes first: the rest may fit from another base
            col = self.cnt[r] + rank
            self._refit(off)
            off = ms - self.base
        self.t[col, r] = off
        self.v[col, r] = vv
        self.cnt[r[start]] += length
        if self.late:
            lr = np.fromiter(self.late, dtype=np.int64, count=len(self.late))
            self.late.clear()
            by_time = np.argsort(self.t[:, lr], axis=0, kind="stable")  # past the last sample: sorts last
            self.t[:, lr] = np.take_along_axis(self.t[:, lr], by_time, axis=0)
            self.v[:, lr] = np.take_along_axis(self.v[:, lr], by_time, axis=0)

    def _refit(self, off: IntArray) -> None:
        """Make room for times ``off`` (ms after the base): the base moved to the oldest time held or coming when
        what is held and what comes fit 32 bits from there (narrowed again if they were 64), else the times
        widened to 64 bits."""
        past = np.iinfo(self.t.dtype).max
        real = self.t != past
        spans = [(int(off.min()), int(off.max()))] if len(off) else []
        if real.any():
            held = self.t[real]
            spans.append((int(held.min()), int(held.max())))
        lo, hi = min((a for a, _ in spans), default=0), max((b for _, b in spans), default=0)
        if hi - lo < np.iinfo(_NARROW).max:
            t = np.full(self.t.shape, np.iinfo(_NARROW).max, dtype=_NARROW)
            t[real] = self.t[real].astype(np.int64) - lo
        else:
            t = np.full(self.t.shape, np.iinfo(_WIDE).max, dtype=_WIDE)
            t[real] = self.t[real].astype(np.int64)
            lo = 0
        self.t, self.base = t, self.base + lo

    def _per_window(self, tt: FloatArray, length: IntArray, need: int) -> int:
        """About how many samples a series holds over the retention, at the rate they come: from the series
        holding the most, else from the pending samples of one series, else ``need``."""
        most = int(self.cnt.max()) if len(self.cnt) else 0
        if most >= 2:
            r = int(self.cnt.argmax())
            span = (int(self.t[most - 1, r]) - int(self.t[0, r])) / 1000.0
        else:
            most, span = int(length.max()), float(tt.max() - tt.min())
        return math.ceil((most - 1) * self.retention / span) + 1 if most > 1 and span > 0 else need

    def trim(self, keep: float) -> None:
        """Shift out the flushed samples older than ``keep``."""
        n = len(self.cnt)
        if not n or not self.t.shape[0]:
            return
        info = np.iinfo(self.t.dtype)
        drop = count_before(self.t, keep, self.base)
        rows = np.flatnonzero(drop)
        if not len(rows):
            return
        d = drop[rows]
        cap = self.t.shape[0]
        every = len(rows) == n
        # by how many samples a row shifts (all rows alike, or a few groups when the series come at a few
        # rates): a slice moved per group, no index matrix the size of the window
        shifts = np.unique(d)
        for k in shifts.tolist():
            sel: IntArray | slice = slice(None) if every and len(shifts) == 1 else rows[d == k]
            for m, gone in ((self.t, info.max), (self.v, np.nan)):
                if isinstance(sel, slice):
                    m[: cap - k] = m[k:]
                    m[cap - k:] = gone
                else:
                    m[: cap - k, sel] = m[k:, sel]
                    m[cap - k:, sel] = gone
        self.cnt[rows] -= d

    def compact(self) -> bool:
        """Drop the rows left without samples when they are many (flushed first); True when rows were dropped."""
        n = len(self.ids)
        if len(self.p_row) or n > len(self.cnt):
            return False
        alive = self.cnt[:n] > 0
        empty = n - int(np.count_nonzero(alive))
        if empty <= max(16, n // 4):
            return False
        kept = np.flatnonzero(alive)
        keys = list(self.index)
        self.index = {keys[i]: r for r, i in enumerate(kept.tolist())}
        self.labels = [self.labels[i] for i in kept]
        self.ids = array("q", np.frombuffer(self.ids, dtype=np.int64)[kept].tobytes())
        self.last = array("d", np.frombuffer(self.last, dtype=np.float64)[kept].tobytes())
        self._into(self.t.shape[0], max(len(kept), 16), self.t[:, kept], self.v[:, kept], self.cnt[kept])
        self.epoch += 1
        return True

    def _resize(self, steps: int, rows: int) -> None:
        s, r = min(steps, self.t.shape[0]), min(rows, self.t.shape[1])
        self._into(steps, rows, self.t[:s, :r], self.v[:s, :r], self.cnt[:r])

    def _into(self, steps: int, rows: int, t: FloatArray, v: FloatArray, cnt: IntArray) -> None:
        """New matrices of ``steps`` x ``rows`` (no sample) and counts, starting with ``t``, ``v`` and ``cnt``."""
        self.t = np.full((steps, rows), np.iinfo(self.t.dtype).max, dtype=self.t.dtype)
        self.v = np.full((steps, rows), np.nan)
        self.cnt = np.zeros(rows, dtype=np.int64)
        s, r = t.shape
        self.t[:s, :r], self.v[:s, :r], self.cnt[:r] = t, v, cnt

    def frozen(self) -> Frozen:
        """What a view reads of this metric (valid until the next flush)."""
        n = len(self.ids)
        if self._ids is None or self._ids[0] != self.epoch:
            self._ids = (self.epoch, np.frombuffer(self.ids, dtype=np.int64).copy())
        m = int(self.cnt[:n].max()) if n else 0
        return Frozen(self.t, self.v, n, m, self._ids[1], self.labels, self.epoch, self.base)


class Frozen:
    """One metric as a view reads it: the first ``m`` steps of the first ``n`` series of the matrices (times in
    ms after ``base``)."""

    __slots__ = ("base", "epoch", "ids", "labels", "m", "n", "t", "v")

    def __init__(self, t: IntArray, v: FloatArray, n: int, m: int, ids: IntArray, labels: list[dict[str, str]],
                 epoch: int, base: int) -> None:
        self.t, self.v, self.n, self.m, self.ids, self.labels, self.epoch = t, v, n, m, ids, labels, epoch
        self.base = base


class WindowView:
    """The window at one evaluation instant: answers queries with PromQL's range-function semantics."""

    def __init__(self, table: SeriesTable, metrics: Mapping[str, Frozen],
                 positions: dict[tuple[Query, int], IntArray]) -> None:
        self.table = table
        self.metrics = metrics
        self.query_errors = 0
        self._positions = positions
        self._answers: dict[tuple[Query, float, float], Result] = {}
        self._bounds: dict[tuple[str, float, float], tuple[IntArray, IntArray]] = {}

    def query(self, query: Query, t: float, window: float) -> Result:
        key = (query, float(t), float(window))
        got = self._answers.get(key)
        if got is None:
            got = self._answers[key] = self._evaluate(query, float(t), float(window))
        return got

    def _evaluate(self, query: Query, t: float, window: float) -> Result:
        f = self.metrics.get(query.metric)
        if f is None or not f.n:
            return Result.empty(self.table)
        pos: IntArray | None = self._matching(query, f)
        ids = f.ids
        if pos is not None and len(pos) == f.n:  # every series (positions are in order and distinct)
            pos = None
        elif pos is not None:
            ids = ids[pos]
        ts, vs = f.t[: f.m, : f.n], f.v[: f.m, : f.n]
        # where each series' window starts and ends: once per metric and instant, whatever the op and matchers
        bkey = (query.metric, t, window)
        bounds = self._bounds.get(bkey)
        if bounds is None:
            bounds = self._bounds[bkey] = window_bounds(ts, t, window, f.base)
        vals = window_rows(query.op, ts, vs, t, window, bounds, pos, f.base)
        if query.scale != 1.0:
            vals *= query.scale
        keep = ~np.isnan(vals)
        return Result(self.table, ids[keep], vals[keep])

    def _matching(self, query: Query, f: Frozen) -> IntArray:
        key = (query, f.epoch)
        got = self._positions.get(key)
        if got is None:
            if len(self._positions) > 4096:  # old epochs' entries
                self._positions.clear()
            got = self._positions[key] = np.array(match_positions(islice(f.labels, f.n), query.matchers),
                                                  dtype=np.intp)
        return got

