"""A generic OpenMetrics text writer for recordings: families of series, each written as byte matrices.

:class:`OmWriter` streams a family's samples (series prefixes x tick values, with timestamps) without
building the text line by line, so a 1,000-GPU day never needs its text in memory; :func:`prefix`
formats a series' ``name{labels} `` with OpenMetrics escaping. Nothing here knows any metric name.
Timestamps are the ticks' (one row for every series) or, with a :class:`Timing`, each target's own
(:mod:`.scrape`): a series' target is its ``instance`` label, and its samples are kept only where the
target's scrape succeeded.
"""

from __future__ import annotations

from typing import IO, Protocol

import numpy as np

_DIGITS = np.frombuffer(b"0123456789", np.uint8)


_LUT4 = np.frombuffer("".join(f"{i:04d}" for i in range(10000)).encode(), np.uint8).reshape(10000, 4)


def _digits(values: np.ndarray, ndig: int) -> np.ndarray:
    """ASCII digits of non-negative int64 ``values``, zero-padded to ``ndig`` columns (last axis)."""
    chunks = -(-ndig // 4)
    pow4 = 10000 ** np.arange(chunks - 1, -1, -1, dtype=np.int64)
    out = _LUT4[(values[..., None] // pow4) % 10000].reshape(*values.shape, chunks * 4)
    return out[..., chunks * 4 - ndig:]


def _ts_matrix(times: np.ndarray) -> np.ndarray:
    integral = bool(np.all(np.abs(times - np.round(times)) < 1e-6))
    text = [f"{t:.0f}" if integral else f"{t:.3f}" for t in times]
    width = max(len(x) for x in text)
    return np.frombuffer("".join(x.rjust(width) for x in text).encode(), np.uint8).reshape(len(times), width)


class Timing(Protocol):
    """Per-target timestamps and successful scrapes (:class:`gpufleet.sim.recording.scrape.Timing`)."""

    def rows_of(self, prefixes: list[bytes]) -> np.ndarray:
        """The target row of each series prefix."""

    def tables(self) -> tuple[np.ndarray, np.ndarray]:
        """(timestamp text, targets x ticks x width; successful scrapes, targets x ticks)."""


class OmWriter:
    """Streams OpenMetrics families built from (series prefixes x tick values) blocks."""

    CHUNK_BYTES = 48 << 20

    def __init__(self, out: IO[bytes], times: np.ndarray, timing: Timing | None = None) -> None:
        self.out = out
        self.timing = timing
        self.ts = _ts_matrix(times)[None]  # targets x ticks x width (one row: the ticks)
        self._ragged = bool((self.ts == ord(" ")).any())  # timestamps of unequal widths (a timing's never are)
        self.n_ticks = len(times)
        self.samples = 0

    def _targets(self, prefixes: list[bytes], ok: np.ndarray) -> np.ndarray:
        """Each series' row of ``self.ts`` (0 without a timing); drops the failed scrapes from ``ok`` in place."""
        if self.timing is None:
            return np.zeros(len(prefixes), np.int64)
        rows = self.timing.rows_of(prefixes)
        self.ts, scraped = self.timing.tables()
        self._ragged = False
        ok &= scraped[rows].T
        return rows

    def family(self, name: str, typ: str, help_text: str) -> None:
        self.out.write(f"# TYPE {name} {typ}\n# HELP {name} {_escape_help(help_text)}\n".encode())

    def block(self, prefixes: list[bytes], values: np.ndarray, decimals: int, mask: np.ndarray | None = None,
              cols: np.ndarray | None = None) -> None:
        """Series ``prefixes[i]`` (``name{labels} ``) with values ``values[:, i]`` (or ``values[:, cols[i]]``
        when ``cols`` maps series to columns of a shared array) at every tick where ``mask[:, i]``."""
        if not prefixes:
            return
        values = np.asarray(values, dtype=np.float64)
        if cols is None:
            values = values.reshape(self.n_ticks, len(prefixes))
            src = np.arange(len(prefixes))
        else:
            values = values.reshape(self.n_ticks, -1)
            src = np.asarray(cols, dtype=np.int64)
        ok = np.isfinite(values) if cols is None else np.isfinite(values)[:, src]
        if mask is not None:
            ok &= np.asarray(mask, bool).reshape(self.n_ticks, len(prefixes))
        rows = self._targets(prefixes, ok)
        if self._fast(prefixes, values, src, decimals, ok, rows):
            return
        if cols is not None:
            values = values[:, src]
        scaled = np.rint(np.where(ok, np.abs(values), 0.0) * 10.0 ** decimals).astype(np.int64)
        neg = (values < 0) & ok & (scaled > 0)
        top = int(scaled.max()) if scaled.size else 0
        ndig = max(len(str(top)), decimals + 1)
        pmax = max(len(x) for x in prefixes)
        pre = np.zeros((len(prefixes), pmax), np.uint8)
        pre_keep = np.zeros((len(prefixes), pmax), bool)
        for i, x in enumerate(prefixes):
            pre[i, : len(x)] = np.frombuffer(x, np.uint8)
            pre_keep[i, : len(x)] = True
        wts = self.ts.shape[2]
        vcols = ndig + 1 + (1 if decimals else 0)  # sign + digits + point
        width = pmax + vcols + 1 + wts + 1
        per_series = self.n_ticks * width
        step = max(1, self.CHUNK_BYTES // max(per_series, 1))
        pow10 = 10 ** np.arange(ndig - 1, -1, -1, dtype=np.int64)
        for lo in range(0, len(prefixes), step):
            hi = min(len(prefixes), lo + step)
            sc = scaled[:, lo:hi].T  # series x ticks
            m = np.zeros((hi - lo, self.n_ticks, width), np.uint8)
            keep = np.zeros((hi - lo, self.n_ticks, width), bool)
            m[:, :, :pmax] = pre[lo:hi, None, :]
            keep[:, :, :pmax] = pre_keep[lo:hi, None, :]
            c = pmax
            m[:, :, c] = ord("-")
            keep[:, :, c] = neg[:, lo:hi].T
            c += 1
            digits = _DIGITS[(sc[:, :, None] // pow10) % 10]
            nd = np.maximum(np.floor(np.log10(np.maximum(sc, 1))).astype(np.int64) + 1, decimals + 1)
            dkeep = np.arange(ndig)[None, None, :] >= (ndig - nd)[:, :, None]
            int_d = ndig - decimals
            m[:, :, c:c + int_d] = digits[:, :, :int_d]
            keep[:, :, c:c + int_d] = dkeep[:, :, :int_d]
            c += int_d
            if decimals:
                m[:, :, c] = ord(".")
                keep[:, :, c] = True
                c += 1
                m[:, :, c:c + decimals] = digits[:, :, int_d:]
                keep[:, :, c:c + decimals] = True
                c += decimals
            m[:, :, c] = ord(" ")
            keep[:, :, c] = True
            c += 1
            m[:, :, c:c + wts] = self.ts[rows[lo:hi]]
            keep[:, :, c:c + wts] = self.ts[rows[lo:hi]] != ord(" ")
            c += wts
            m[:, :, c] = ord("\n")
            keep[:, :, c] = True
            row_ok = ok[:, lo:hi].T
            keep &= row_ok[:, :, None]
            self.samples += int(row_ok.sum())
            self.out.write(m[keep].tobytes())

    def _fast(self, prefixes: list[bytes], values: np.ndarray, src: np.ndarray, decimals: int,
              ok: np.ndarray, targets: np.ndarray) -> bool:
        """Fixed-width lines per prefix length: the value field keeps one width by printing more decimals
        for shorter integer parts (``72.5000`` next to ``612.500``), so rows are copied whole. Work is done per
        chunk of series over the ticks where they have samples. Returns False (nothing written) when the
        block needs the general path (negative values, over 18 digits)."""
        finite = np.isfinite(values)
        if bool((values[finite] < 0).any()) or self._ragged:
            return False
        scaled = np.rint(np.where(finite, np.abs(values), 0.0) * 10.0 ** decimals).astype(np.int64)
        ni = np.maximum(np.floor(np.log10(np.maximum(scaled, 1))).astype(np.int64) + 1 - decimals, 1)
        used = np.unique(src)
        big = int(ni[:, used].max()) if ni.size else 1
        mixed = decimals > 0 or int(ni[:, used].min()) != big
        width = big + 1 + max(decimals, 1) if mixed else big
        ndig = width - 1 if mixed else width
        if ndig > 18:
            return False
        lengths = np.array([len(x) for x in prefixes])
        wts = self.ts.shape[2]
        one_row = self.ts.shape[0] == 1
        present = ok.any(axis=0)
        first = np.where(present, ok.argmax(axis=0), self.n_ticks)
        for plen in np.unique(lengths):
            # series with samples, ordered by their first tick so a chunk spans a short tick window
            idx = np.flatnonzero((lengths == plen) & present)
            idx = idx[np.argsort(first[idx], kind="stable")]
            line = int(plen) + width + 1 + wts + 1
            pre_all = np.frombuffer(b"".join(prefixes[i] for i in idx), np.uint8).reshape(len(idx), int(plen))
            lo = 0
            while lo < len(idx):
                hi = lo + 1
                t0 = int(first[idx[lo]])
                t1 = self.n_ticks - int(ok[::-1, idx[lo]].argmax())
                while hi < len(idx):  # grow the chunk while the buffer stays small
                    n0 = min(t0, int(first[idx[hi]]))
                    n1 = max(t1, self.n_ticks - int(ok[::-1, idx[hi]].argmax()))
                    if (hi + 1 - lo) * (n1 - n0) * line > self.CHUNK_BYTES:
                        break
                    t0, t1, hi = n0, n1, hi + 1
                cols = idx[lo:hi]
                nt = t1 - t0
                buf = np.empty((len(cols), nt, line), np.uint8)
                buf[:, :, :plen] = pre_all[lo:hi, None, :]
                ni_c = ni[t0:t1][:, src[cols]].T
                shift = (width - 1 - ni_c - decimals) if mixed else np.zeros_like(ni_c)
                digits = _digits(scaled[t0:t1][:, src[cols]].T * 10 ** np.maximum(shift, 0), ndig)
                if mixed:
                    point = ni_c.astype(np.int8)[:, :, None]
                    j = np.arange(width, dtype=np.int8)[None, None, :]
                    val = buf[:, :, plen:plen + width]
                    val[:, :, :ndig] = digits
                    np.copyto(val[:, :, 1:], digits, where=j[:, :, 1:] > point)
                    np.copyto(val, np.uint8(ord(".")), where=j == point)
                else:
                    buf[:, :, plen:plen + width] = digits
                c = int(plen) + width
                buf[:, :, c] = ord(" ")
                buf[:, :, c + 1:c + 1 + wts] = self.ts[:1, t0:t1] if one_row else self.ts[targets[cols], t0:t1]
                buf[:, :, -1] = ord("\n")
                rows = ok[t0:t1, cols].T.reshape(-1)
                self.samples += int(rows.sum())
                self._write_rows(buf.reshape(-1, line), rows)
                lo = hi
        return True

    def _write_rows(self, rows: np.ndarray, keep: np.ndarray) -> None:
        """Write the kept rows of a C-contiguous byte matrix, copying only when rows are dropped."""
        if keep.all():
            self.out.write(rows.data.cast("B"))
            return
        edges = np.flatnonzero(np.diff(np.concatenate(([False], keep, [False])).astype(np.int8)))
        if len(edges) > 2048:
            self.out.write(rows[keep].tobytes())
            return
        for a, b in zip(edges[::2], edges[1::2], strict=True):
            self.out.write(rows[a:b].data.cast("B"))

    def eof(self) -> None:
        self.out.write(b"# EOF\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(pairs: dict[str, str]) -> str:
    return ",".join(f'{k}="{_escape_value(v)}"' for k, v in pairs.items())


def _escape_value(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prefix(name: str, labels: dict[str, str]) -> bytes:
    return f"{name}{{{_labels(labels)}}} ".encode()

