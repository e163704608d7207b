"""The fast reader of well-formed recordings: a series' lines found as one block, its values converted at once.

Anything unusual (a series whose lines are not contiguous, exemplars, odd labels or spacing, a sample outside
its family, a missing ``# EOF``) makes :func:`load_fast` return None, and the strict line-by-line reader
(:mod:`gpufleet.detector.sources.recording_strict`) reads the file and reports what is wrong with its line number.
"""

from __future__ import annotations

import mmap
import re
from collections.abc import Sequence

import numpy as np
from prometheus_client.openmetrics.parser import text_fd_to_metric_families

FloatArray = np.ndarray

#: Per sample name and label set: chunks of timestamps and of values (lists or arrays), in file order.
RawSeries = dict[str, dict[tuple[tuple[str, str], ...], tuple[list[FloatArray], list[FloatArray]]]]


#: A file's bytes: in memory, or a memory map of it.
Buffer = bytes | bytearray | mmap.mmap


def load_fast(text: str, wanted: set[str] | None) -> RawSeries | None:
    """Parse one well-formed recording quickly; None when anything is unusual (the strict reader then reports it).

    The OpenMetrics parser validates the metadata (``# TYPE``/``# HELP``/``# UNIT``, ``# EOF``); each series'
    ``name{labels}`` is checked here against the OpenMetrics grammar (names, quoting, escapes, duplicate
    labels) and against its family's type (a counter's samples are ``<family>_total``). The lines of a series
    are contiguous and repeat that text, so a series is one block: its end is found by binary search, and its
    ``value timestamp`` pairs are converted by numpy at once.
    """
    part = parse_part(text, wanted, final=True)
    return join([part]) if part is not None else None


#: What :func:`parse_part` reads from one part of a file: its series and its metadata lines.
Part = tuple[RawSeries, list[str]]


def join(parts: Sequence[Part]) -> RawSeries | None:
    """One file's series from its consecutive parts (cut by :func:`family_cut`); None when it is not well-formed
    as a whole: a series in two parts (not contiguous), or metadata the OpenMetrics parser rejects."""
    raw: RawSeries = {}
    for series, _ in parts:
        for name, by_labels in series.items():
            into = raw.setdefault(name, {})
            if not into:
                into.update(by_labels)
                continue
            if not by_labels.keys().isdisjoint(into):
                return None
            into.update(by_labels)
    try:
        for _ in text_fd_to_metric_families(line for _, meta in parts for line in meta):  # type: ignore[no-untyped-call]
            pass
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    return raw


def family_cut(data: Buffer, near: int) -> int:
    """The offset of the first metadata line at or after ``near`` that follows a sample line: where a family
    starts, so the parts before and after it parse on their own (:func:`parse_part`); 0 when there is none (a
    line whose start is not in ``data`` is not looked at)."""
    p = near
    while True:
        p = data.find(b"\n#", p)
        if p < 0:
            return 0
        before = data.rfind(b"\n", 0, p)  # the newline before the line that ends at p
        if before >= 0 and data[before + 1:before + 2] not in (b"#", b"\n"):
            return p + 1
        p += 1


def parse_part(text: str, wanted: set[str] | None, final: bool) -> Part | None:
    """The series and metadata lines of one part of a recording (the whole file, or a piece cut where a family
    starts); None when anything is unusual. ``final``: the part ends the file (with ``# EOF``)."""
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
        if c not in NAME_START:
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
        if lo >= n and final:
            return None  # the file's last series with no '# EOF' after it
        q = text.rfind("\n", 0, lo) + 1
        last_block = q - p
        brace_at = prefix.find("{")
        name = prefix[:brace_at] if brace_at >= 0 else prefix
        if not line.startswith(lead) or len(line[len(lead):].split(" ")) != 2 or "" in line[len(lead):].split(" "):
            return None  # a sample line without its value and timestamp (wanted or not): the strict reader says so
        labels = _series_labels(prefix, name)
        if labels is None:
            return None  # unusual labels (read or not): the strict reader decides
        if wanted is not None and name not in wanted:
            # Not read, but the file must still be one the strict reader reads: the block holds only this series'
            # lines (the search above brackets its end; a stray line inside it is found here).
            skipped = text[p:q]
            if skipped.count("\n" + lead) != skipped.count("\n") - 1:
                return None
            p = q
            continue
        if prefix in seen:
            return None  # samples of one series not contiguous
        seen.add(prefix)
        if _SAMPLE_SUFFIX.get(ftype) is None or name != family + _SAMPLE_SUFFIX[ftype]:
            return None  # unusual labels, or a sample outside its family: the strict reader decides
        block = text[p:q]
        if block.find("#", len(line)) >= 0:
            return None  # exemplars
        # Each line is the series' text, a value and a timestamp, single-spaced. Where the series' text holds no
        # space, a line is three tokens, the first the text itself; otherwise every line is checked to start with
        # it and only what follows it is split.
        spaces = prefix.count(" ")
        if spaces == 0 and _SPACE.search(prefix) is None:
            lines = block.count("\n")
            # every line starts with the series' text (a newline moved within the block keeps its line and space
            # counts and its tokens in order, but is not valid: the strict reader names the line)
            if block.count(" ") != 2 * lines or block.count("\n" + lead) != lines - 1:
                return None
            parts = block.split()
            if len(parts) != 3 * lines or parts[0::3] != [prefix] * lines:
                return None
            # ... and one whitespace character per gap between them (so only the counted spaces and newlines: with
            # every line starting with the series' text, each line holds exactly its three tokens)
            if len(block) != sum(map(len, parts)) + 3 * lines:
                return None
            values, stamps = parts[1::3], parts[2::3]
        else:
            block_lines = block.split("\n")  # the last one empty (the block ends with a newline)
            lines = len(block_lines) - 1
            if not line.startswith(lead) or block.count("\n" + lead) != lines - 1:
                return None  # another line within the block: the series is not contiguous
            cut = len(lead)
            # one space within each line's value and timestamp (the block's spaces, counted in what is left of
            # it: the lines are joined by one space each)
            rest = [ln[cut:] for ln in block_lines]
            joined = " ".join(rest)
            parts = joined.split()
            if len(parts) != 2 * lines or joined.count(" ") != 2 * lines:
                return None
            # ... one in each line (a line with two and one with none keep the counts)
            if not all(r.count(" ") == 1 for r in rest[:-1]):
                return None
            values, stamps = parts[0::2], parts[1::2]
        try:
            vs = np.array(values, dtype=np.float64)
            # Series scraped together share their timestamps' text: convert each distinct column once.
            if stamps == last_stamps[0]:
                ts = last_stamps[1]
            else:
                ts = np.array(stamps, dtype=np.float64)
                # finite and in order (a line with a field too few and another with one too many would shift
                # the columns: the strict reader then says which line is wrong; it also sorts unordered series)
                if not np.isfinite(ts).all() or (len(ts) > 1 and not (ts[1:] >= ts[:-1]).all()):
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
    if eof != final:
        return None  # no '# EOF' at the end, or one before the file's next part
    return raw, meta


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
    if prefix[len(name)] != "{" or not prefix.endswith("}"):
        return None
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


_SPACE = re.compile(r"\s")
#: Characters that may start a metric name, so a sample line.
NAME_START = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_:")
