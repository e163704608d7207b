"""Features from OpenMetrics recordings, computed in memory with PromQL semantics.

Recordings are OpenMetrics text with timestamps (what ``promtool tsdb
create-blocks-from openmetrics`` ingests), parsed with prometheus-client's
OpenMetrics parser. Only the metrics the profile asks for are kept, as one
numpy time series per label set.

Semantics match Prometheus 2.x range selectors: a window of ``w`` seconds at
time ``t`` holds the samples with ``t - w <= ts <= t``. ``avg``/``max``/``min``/
``last``/``count`` are the ``*_over_time`` functions; ``rate``/``increase``
use Prometheus' extrapolation and counter-reset handling; series with fewer
than two samples in the window give no rate.
"""

from __future__ import annotations

import math
import mmap
import multiprocessing
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import cast

import numpy as np
from prometheus_client.openmetrics.parser import text_fd_to_metric_families

from gpufleet.detector.profiles import Query
from gpufleet.detector.source import Result, SeriesTable

FloatArray = np.ndarray
IntArray = np.ndarray


class RecordingError(ValueError):
    """A recording could not be read; the message names the file and, where known, the line."""


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
        self._cache: dict[tuple[Query, float], tuple[dict[float, int], IntArray, FloatArray]] = {}
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
        if kind == "series":
            return cls(cast(dict[str, list[Series]], payload))  # what _load_series returned in the worker
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
        self._cache[(query, window)] = ({float(x): i for i, x in enumerate(t)}, ids, mat)

    def query(self, query: Query, t: float, window: float) -> Result:
        cached = self._cache.get((query, window))
        if cached is None or float(t) not in cached[0]:
            self.precompute(query, [t], window)
            cached = self._cache[(query, window)]
        idx = cached[0][float(t)]
        ids, mat = cached[1], cached[2]
        row = mat[idx]
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
            text = _read_text(path)
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
            with open(path, encoding="utf-8") as fd:  # anything unusual: the strict line-by-line reader
                _load_file(fd, wanted, raw, str(path))
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


def _read_text(path: str | Path) -> str:
    """The file's text; "" when it is not UTF-8 (the strict reader then says where). Decoded straight from a
    memory map where the file can be mapped (no intermediate copy of the bytes), else read."""
    with open(path, "rb") as f:
        try:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return str(mm, "utf-8")
        except UnicodeDecodeError:
            return ""
        except (ValueError, OSError):  # an empty file, or one that cannot be mapped (a pipe)
            data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return ""


def _load_worker(send: Connection, paths: list[str | Path], wanted: set[str] | None) -> None:
    """In the worker process of :meth:`RecordingSource.load_beside`: parse, send the series or the error."""
    answer: tuple[str, object]
    try:
        answer = ("series", _load_series(paths, wanted))
    except RecordingError as e:
        answer = ("error", str(e))
    except Exception as e:  # anything else: the parent reads the file itself and raises it there
        answer = ("failed", repr(e))
    try:
        send.send(answer)
    finally:
        send.close()

#: Per sample name and label set: chunks of timestamps and of values (lists or arrays), in file order.
RawSeries = dict[str, dict[tuple[tuple[str, str], ...], tuple[list[FloatArray], list[FloatArray]]]]


def _load_fast(text: str, wanted: set[str] | None) -> RawSeries | None:
    """Parse one well-formed recording quickly; None when anything is unusual (the strict reader then reports it).

    The OpenMetrics parser validates the metadata (``# TYPE``/``# HELP``/``# UNIT``, ``# EOF``); each series'
    ``name{labels}`` is checked here against the OpenMetrics grammar (names, quoting, escapes, duplicate
    labels) and against its family's type (a counter's samples are ``<family>_total``). The lines of a series
    are contiguous and repeat that text, so a series is one block: its end is found by binary search, and its
    ``value timestamp`` pairs are converted by numpy at once.
    """
    meta: list[str] = []
    raw: RawSeries = {}
    seen: set[str] = set()
    family, ftype = "", ""
    last_stamps: tuple[list[str], FloatArray] = ([], np.zeros(0))
    last_block = 0  # the length of the last series' block of lines
    n = len(text)
    p = 0
    eof = False
    while p < n:
        eol = text.find("\n", p)
        if eol < 0:
            return None  # a last line without a newline (or no '# EOF'): let the strict reader say what is wrong
        if eof:
            return None  # data after '# EOF'
        c = text[p]
        if c == "#" or eol == p:
            line = text[p:eol]
            meta.append(line + "\n")
            eof = line == "# EOF"
            parts = line.split(" ", 3)
            if len(parts) >= 3 and parts[1] in ("TYPE", "HELP", "UNIT"):
                if parts[2] != family:
                    family, ftype = parts[2], "unknown"
                if parts[1] == "TYPE" and len(parts) == 4:
                    ftype = parts[3]
            p = eol + 1
            continue
        if c not in _NAME_START:
            return None
        line = text[p:eol]
        brace = line.rfind("}")
        prefix = line[: brace + 1] if brace >= 0 else line[: line.find(" ")] if " " in line else ""
        if not prefix:
            return None
        lead = prefix + " "
        # The block ends at the first line not starting with this series' text: a binary search over offsets
        # (the line holding an offset starts with it before the end, not after), checked below. Blocks are
        # often as long as the one before: the search starts by bracketing the end around that length.
        lo, hi = eol + 1, n
        step = max(last_block >> 6, 64)
        probe = p + last_block - 1
        while lo <= probe < hi:
            if text.startswith(lead, text.rfind("\n", 0, probe) + 1):
                lo = probe + 1
                probe += step
            else:
                hi = probe
                probe -= step
            step *= 2
        while lo < hi:
            mid = (lo + hi) // 2
            if text.startswith(lead, text.rfind("\n", 0, mid) + 1):
                lo = mid + 1
            else:
                hi = mid
        if lo >= n:
            return None
        q = text.rfind("\n", 0, lo) + 1
        last_block = q - p
        brace_at = prefix.find("{")
        name = prefix[:brace_at] if brace_at >= 0 else prefix
        if wanted is not None and name not in wanted:
            p = q
            continue
        if prefix in seen:
            return None  # samples of one series not contiguous
        seen.add(prefix)
        labels = _series_labels(prefix, name)
        if labels is None or _SAMPLE_SUFFIX.get(ftype) is None or name != family + _SAMPLE_SUFFIX[ftype]:
            return None  # unusual labels, or a sample outside its family: the strict reader decides
        block = text[p:q]
        lines = block.count("\n")
        if block.count("\n" + lead) != lines - 1:
            return None  # another line within the block: the series is not contiguous
        if block.find("#", len(line)) >= 0:
            return None  # exemplars
        if _SPACE.search(prefix) is None:  # the usual case: each line is three fields
            parts = block.split()
            if len(parts) != 3 * lines:
                return None
            values, stamps = parts[1::3], parts[2::3]
        else:
            parts = block.replace(lead, "").split()
            if len(parts) != 2 * lines:
                return None
            values, stamps = parts[0::2], parts[1::2]
        try:
            vs = np.array(values, dtype=np.float64)
            # Series scraped together share their timestamps' text: convert each distinct column once.
            if stamps == last_stamps[0]:
                ts = last_stamps[1]
            else:
                ts = np.array(stamps, dtype=np.float64)
                if not np.isfinite(ts).all():
                    return None
                ts.flags.writeable = False  # shared between series
                last_stamps = (stamps, ts)
        except ValueError:
            return None
        have = raw.setdefault(name, {}).setdefault(tuple(sorted(labels.items())), ([], []))
        if have[0]:
            return None  # the same label set twice
        have[0].append(ts)
        have[1].append(vs)
        p = q
    if not eof:
        return None
    try:
        for _ in text_fd_to_metric_families(iter(meta)):  # type: ignore[no-untyped-call]
            pass
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    return raw


#: The sample name of a series, per family type, that the fast reader accepts (others go to the strict one).
_SAMPLE_SUFFIX = {"gauge": "", "unknown": "", "counter": "_total", "info": "_info", "stateset": ""}
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')
_ESCAPE = re.compile(r"\\(.)")


def _series_labels(prefix: str, name: str) -> dict[str, str] | None:
    """The labels of a series line's ``name{labels}`` text; None unless it is plainly valid OpenMetrics."""
    if not _METRIC_NAME.fullmatch(name):
        return None
    if len(prefix) == len(name):
        return {}
    body = prefix[len(name) + 1: -1]
    labels: dict[str, str] = {}
    pos = 0
    while pos < len(body):
        m = _LABEL.match(body, pos)
        if m is None:
            return None
        k, v = m.group(1), m.group(2)
        if k in labels:
            return None
        labels[k] = _ESCAPE.sub(lambda e: "\n" if e.group(1) == "n" else e.group(1), v) if "\\" in v else v
        pos = m.end()
        if pos < len(body):
            if body[pos] != ",":
                return None
            pos += 1
            if pos == len(body):
                return None  # a trailing comma
    return labels


_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def _load_file(fd: Iterable[str], wanted: set[str] | None, raw: RawSeries, path: str) -> None:
    """Parse one recording into ``raw``.

    The OpenMetrics parser reads every metadata line and the first sample line of every series, so names,
    label sets, types and grouping are validated by it. The further lines of a series repeat the same
    ``name{labels}`` text; for those only ``value timestamp`` remains, which is read with ``float``
    (anything else on such a line is an error). This is several times faster than parsing every label set.
    """
    meta: list[str] = []
    meta_lines: list[int] = []  # the file's line number of each meta entry
    order: list[str] = []
    order_lines: list[int] = []
    starts = tuple(wanted) if wanted is not None else ("",)
    points: dict[str, tuple[list[float], list[float]]] = {}
    prev = ""
    eof = False
    lineno = 0
    try:
        for line in fd:
            lineno += 1
            if eof:
                raise RecordingError(f"{path}:{lineno}: data after the '# EOF' line (invalid OpenMetrics)")
            if not line.startswith(starts):  # cheap rejection of unwanted metrics (exact check below)
                if line.startswith("#") or not line.strip():
                    meta.append(line)
                    meta_lines.append(lineno)
                    eof = line.rstrip("\r\n") == "# EOF"
                elif line[0] not in _NAME_START:
                    raise RecordingError(f"{path}:{lineno}: not valid OpenMetrics: not a comment or a sample: "
                                         f"{_clip(line.strip())}")
                continue
            if line.startswith("#"):
                meta.append(line)
                meta_lines.append(lineno)
                eof = line.rstrip("\r\n") == "# EOF"
                continue
            end = len(line)
            for sep in ("{", " "):
                j = line.find(sep)
                if 0 <= j < end:
                    end = j
            if wanted is not None and line[:end] not in wanted:
                continue
            brace = line.rfind("}")
            prefix = line[: brace + 1] if brace >= 0 else line[:end]
            if prefix == prev:
                rest = line[len(prefix):].split()
                if len(rest) != 2:
                    raise RecordingError(f"{path}:{lineno}: sample without a timestamp or with extra fields: "
                                         f"{_clip(line.strip())}")
                try:
                    t, v = float(rest[1]), float(rest[0])
                except ValueError:
                    raise RecordingError(f"{path}:{lineno}: not valid OpenMetrics: bad value or timestamp in "
                                         f"{_clip(line.strip())}") from None
                if not math.isfinite(t):
                    raise RecordingError(f"{path}:{lineno}: timestamp {rest[1][:40]!r} is not a finite number")
                ts, vs = points[prefix]
                ts.append(t)
                vs.append(v)
                continue
            if prefix in points:
                raise RecordingError(f"{path}:{lineno}: samples of {_clip(prefix)} are not contiguous "
                                     "(invalid OpenMetrics)")
            points[prefix] = ([], [])
            order.append(prefix)
            order_lines.append(lineno)
            meta.append(line)
            meta_lines.append(lineno)
            prev = prefix
    except UnicodeDecodeError as e:
        raise RecordingError(f"{path}:{_first_bad_utf8_line(path)}: not UTF-8 text ({e.reason}); "
                             "the file is corrupt") from None
    at = [0]  # the line the parser read last

    def fed() -> Iterator[str]:
        for i, text in enumerate(meta):
            at[0] = meta_lines[i]
            yield text
        at[0] = lineno

    try:
        families = text_fd_to_metric_families(fed())  # type: ignore[no-untyped-call]
        parsed = [s for family in families for s in family.samples]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        what = ("truncated (no '# EOF' line at the end)" if "Missing # EOF" in str(e)
                else f"not valid OpenMetrics: {_clip(str(e))}")
        raise RecordingError(f"{path}:{at[0]}: {what}") from None
    if len(parsed) != len(order):
        raise RecordingError(f"{path}: parser returned {len(parsed)} series for {len(order)} series lines")
    for sample, prefix, where in zip(parsed, order, order_lines, strict=True):
        if sample.name.endswith("_created") or (wanted is not None and sample.name not in wanted):
            continue
        if sample.timestamp is None:
            raise RecordingError(f"{path}:{where}: sample {sample.name} has no timestamp")
        if not math.isfinite(float(sample.timestamp)):
            raise RecordingError(f"{path}:{where}: sample {sample.name}: the timestamp is not a finite number")
        key = tuple(sorted(sample.labels.items()))
        more_t, more_v = points[prefix]
        t_chunks, v_chunks = raw.setdefault(sample.name, {}).setdefault(key, ([], []))
        t_chunks.append(np.array([float(sample.timestamp), *more_t], dtype=np.float64))
        v_chunks.append(np.array([float(sample.value), *more_v], dtype=np.float64))


_SPACE = re.compile(r"\s")
#: Characters that may start a metric name, so a sample line.
_NAME_START = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_:")


def _first_bad_utf8_line(path: str) -> int:
    """The number of the first line of ``path`` that is not UTF-8 (0 when it cannot be found)."""
    try:
        with open(path, "rb") as f:
            for n, raw in enumerate(f, start=1):
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError:
                    return n
    except OSError:
        pass
    return 0


def _clip(text: str, n: int = 120) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


#: Values (samples x series) evaluated at once by :meth:`RecordingSource.precompute`.
_CHUNK = 1 << 22


def window_op(op: str, ts: FloatArray, vs: FloatArray, t: FloatArray, window: float) -> FloatArray:
    """PromQL range function ``op`` over ``[t - window, t]`` for each t; NaN where it has no result."""
    out: FloatArray = window_ops(op, ts, vs[np.newaxis, :], t, window)[0]
    return out


def window_ops(op: str, ts: FloatArray, vs: FloatArray, t: FloatArray, window: float) -> FloatArray:
    """:func:`window_op` for several series sampled at the same times ``ts``: ``vs`` holds one series per row;
    the result one row per series, one column per evaluation time."""
    lo = np.searchsorted(ts, t - window, side="left")
    hi = np.searchsorted(ts, t, side="right")
    n = hi - lo
    k = vs.shape[0]
    out = np.full((k, len(t)), np.nan)
    has = n > 0
    if op == "count":
        out[:, has] = n[has]
    elif op == "avg":
        cs = np.concatenate((np.zeros((k, 1)), np.cumsum(vs, axis=1)), axis=1)
        out[:, has] = (cs[:, hi[has]] - cs[:, lo[has]]) / n[has]
    elif op == "last":
        out[:, has] = vs[:, hi[has] - 1]
    elif op in ("max", "min"):
        if has.any():
            ufunc = np.maximum if op == "max" else np.minimum
            padded = np.concatenate((vs, np.full((k, 1), np.nan)), axis=1)
            idx = np.empty(2 * int(has.sum()), dtype=np.intp)
            idx[0::2] = lo[has]
            idx[1::2] = hi[has]
            out[:, has] = ufunc.reduceat(padded, idx, axis=1)[:, 0::2]
    elif op in ("rate", "increase"):
        out = _extrapolated(ts, vs, t, window, lo, hi, op == "rate")
    else:
        raise ValueError(f"unknown operation {op!r}")
    return out


def _extrapolated(ts: FloatArray, vs: FloatArray, t: FloatArray, window: float, lo: FloatArray, hi: FloatArray,
                  is_rate: bool) -> FloatArray:
    """Prometheus' extrapolatedRate (counter case), vectorized over evaluation times and series (rows of vs)."""
    k = vs.shape[0]
    out = np.full((k, len(t)), np.nan)
    ok = (hi - lo) >= 2
    if not ok.any():
        return out
    lo, hi, t = lo[ok], hi[ok], t[ok]
    # Reset corrections: when a counter drops, the value before the drop is added back.
    prev = vs[:, :-1]
    drops = np.where(vs[:, 1:] < prev, prev, 0.0)
    # cdrops[:, i+1] = sum of drops up to pair (i-1, i)
    cdrops = np.concatenate((np.zeros((k, 2)), np.cumsum(drops, axis=1)), axis=1)
    first, last = vs[:, lo], vs[:, hi - 1]
    result = last - first + (cdrops[:, hi] - cdrops[:, lo + 1])
    first_t, last_t = ts[lo], ts[hi - 1]
    sampled = last_t - first_t
    avg_gap = sampled / (hi - lo - 1)
    to_start = first_t - (t - window)
    to_end = t - last_t
    with np.errstate(divide="ignore", invalid="ignore"):
        to_zero = np.where((result > 0) & (first >= 0), sampled * (first / result), np.inf)
    to_start = np.minimum(to_start, to_zero)
    threshold = avg_gap * 1.1
    interval = sampled + np.where(to_start < threshold, to_start, avg_gap / 2)
    interval = interval + np.where(to_end < threshold, to_end, avg_gap / 2)
    with np.errstate(divide="ignore", invalid="ignore"):
        value = result * (interval / sampled)
    if is_rate:
        value = value / window
    out[:, ok] = value
    return out
