"""The strict line-by-line recording reader: every error reported with its file and line.

The OpenMetrics parser (prometheus-client) validates the metadata and the first sample line of every series;
the further lines of a series repeat its ``name{labels}`` text and are read with ``float``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from prometheus_client.openmetrics.parser import text_fd_to_metric_families

from gpufleet.detector.sources.recording_fast import NAME_START, RawSeries
from gpufleet.detector.sources.recording_io import RecordingError, binary_lines


def load_file(fd: Iterable[str], wanted: set[str] | None, raw: RawSeries, path: str) -> None:
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
                elif line[0] not in NAME_START:
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


def _first_bad_utf8_line(path: str | Path) -> int:
    """The number of the first line of ``path`` that is not UTF-8 (0 when it cannot be found)."""
    try:
        for n, raw in enumerate(binary_lines(path), start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return n
    except (OSError, RecordingError):
        pass
    return 0


def _clip(text: str, n: int = 120) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")
