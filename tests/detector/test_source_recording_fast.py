"""Recordings: the fast block reader gives exactly what the strict line-by-line reader gives, and defers to it."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_detector_core import Fault, Synth, synth

from gpufleet.detector.sources import recording as sr
from gpufleet.detector.sources import recording_fast, recording_strict
from gpufleet.detector.sources.profiles import sample_names


def strict(path: Path, wanted: set[str] | None) -> sr.RawSeries:
    raw: sr.RawSeries = {}
    with open(path, encoding="utf-8") as fd:
        recording_strict.load_file(fd, wanted, raw, str(path))
    return raw


def same(a: sr.RawSeries, b: sr.RawSeries) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        for key, (ts, vs) in a[name].items():
            np.testing.assert_array_equal(np.concatenate(ts), np.concatenate(b[name][key][0]))
            np.testing.assert_array_equal(np.concatenate(vs), np.concatenate(b[name][key][1]))


def test_fast_reader_matches_the_strict_reader(tmp_path: Path) -> None:
    rec = synth(tmp_path / "r.om", Synth(nodes=2, seconds=600.0, faults=[Fault("pcie", 1, 2, 300.0)]))
    for wanted in (sample_names("gpufleet"), None):
        fast = recording_fast.load_fast(rec.read_text(), wanted)
        assert fast is not None
        same(fast, strict(rec, wanted))


def test_fast_reader_handles_spaces_in_label_values_and_special_values(tmp_path: Path) -> None:
    text = ('# TYPE m gauge\nm{a="x y",b="1"} 1.5 10.0\nm{a="x y",b="1"} NaN 25\nm{a="x y",b="1"} +Inf 40.5\n'
            'm{a="z"} -2 10\nm{a="q\\"uote\\\\ \\n"} 1 10\n# TYPE c counter\nc_total 3 10\nc_total 4 25\n# EOF\n')
    path = tmp_path / "s.om"
    path.write_text(text)
    fast = recording_fast.load_fast(text, None)
    assert fast is not None
    same(fast, strict(path, None))
    src = sr.RecordingSource.load([path])
    [m_xy] = [s for s in src.series["m"] if s.labels == {"a": "x y", "b": "1"}]
    np.testing.assert_array_equal(m_xy.ts, [10.0, 25.0, 40.5])
    assert {"a": 'q"uote\\ \n'} in [s.labels for s in src.series["m"]]


@pytest.mark.parametrize(("text", "message"), [
    ("# TYPE m gauge\nm{a=\"1\"} 1 10\nm{a=\"2\"} 1 10\nm{a=\"1\"} 2 25\n# EOF\n", r"s\.om:4: samples of .* not contiguous"),
    ("# TYPE m gauge\nm{a=\"1\"} 1 10\nm{a=\"1\"} 2\n# EOF\n", r"s\.om:3: sample without a timestamp"),
    ("# TYPE m gauge\nm{a=\"1\"} 1 10\nm{a=\"1\"} 2 25\n", r"truncated"),
    ("# TYPE m gauge\nm{a=\"1\"} 1 10\nm{a=\"1\"} x 25\n# EOF\n", r"s\.om:3: not valid OpenMetrics: bad value"),
    ("# TYPE m gauge\nm{1a=\"1\"} 1 10\n# EOF\n", r"s\.om:\d+: not valid OpenMetrics"),
    ("# TYPE m gauge\nm{a=\"1\",a=\"2\"} 1 10\n# EOF\n", r"s\.om:\d+: not valid OpenMetrics"),
    ("# TYPE c counter\nc 1 10\n# EOF\n", r"s\.om:\d+: not valid OpenMetrics"),
    # a field too few on one line and one too many on the next: the columns would shift
    ("# TYPE m gauge\nm{a=\"1\"} 1 10\nm{a=\"1\"} 2\nm{a=\"1\"} 3 30 4\n# EOF\n", r"s\.om:3: sample without a timestamp"),
    ("# TYPE m gauge\nm{a=\"x y\"} 1 10\nm{a=\"x y\"} 2\nm{a=\"x y\"} 3 30 4\n# EOF\n",
     r"s\.om:3: sample without a timestamp"),
])
def test_unusual_files_get_the_strict_readers_message(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "s.om"
    path.write_text(text)
    assert recording_fast.load_fast(text, None) is None
    with pytest.raises(sr.RecordingError, match=message):
        sr.RecordingSource.load([path])


def test_a_file_the_fast_reader_declines_still_loads(tmp_path: Path) -> None:
    text = "# TYPE m gauge\nm 1 10\nother 2 10\nother 3 25\n# EOF\n"  # `other`: a family without metadata
    path = tmp_path / "s.om"
    path.write_text(text)
    assert recording_fast.load_fast(text, None) is None
    src = sr.RecordingSource.load([path])
    np.testing.assert_array_equal(src.series["other"][0].values, [2.0, 3.0])


_DOC = ('# TYPE m gauge\n# HELP m A gauge.\n'
        + "".join(f'm{{gpu="0",instance="n1:9445"}} {500 + i} {1_700_000_000 + 15 * i}\n' for i in range(5))
        + 'm{gpu="1",instance="n1:9445"} 480 1700000000\nm{gpu="1",instance="n1:9445"} 481 1700000015\n'
        + '# TYPE c counter\nc_total{gpu="0"} 1 1700000000\nc_total{gpu="0"} 2 1700000015\n# EOF\n')
# the same with a space in a label value (dcgm's modelName="NVIDIA H100 80GB HBM3"): the reader's other path
_DOC_SPACED = _DOC.replace('instance="n1:9445"', 'model="H 1",instance="n1:9445"')


@settings(derandomize=True, max_examples=300, deadline=2000, database=None)
# Cases that escaped the fast reader once: a sample line cut by a newline, and a stray line inside a series'
# block, both in a family that is not read; and the one below.
@example(edits=[(381, "replace", "\n")], wanted=frozenset({"m"}), spaced=False)
@example(edits=[(384, "replace", "\n")], wanted=frozenset({"m"}), spaced=False)
# A newline moved within a block (one line split after the series' text, two later ones joined): the same line
# and space counts and the tokens in order, but not valid (found when the suite ran this test beside others).
@example(edits=[(152, "replace", "\n"), (212, "replace", " ")], wanted=None, spaced=False)
@given(edits=st.lists(st.tuples(st.integers(0, len(_DOC_SPACED) - 1),
                                st.sampled_from(["replace", "insert", "delete"]),
                                st.sampled_from(list(' {}"=,#\n\\aZ0.-+e'))), min_size=1, max_size=3),
       wanted=st.sampled_from([None, frozenset({"m"}), frozenset({"m", "c_total"})]),
       spaced=st.booleans())
def test_whatever_the_fast_reader_accepts_the_strict_reader_reads_alike(
        edits: list[tuple[int, str, str]], wanted: frozenset[str] | None, spaced: bool) -> None:
    doc = list(_DOC_SPACED if spaced else _DOC)
    for i, op, c in edits:
        i = min(i, len(doc) - 1)
        if op == "replace":
            doc[i] = c
        elif op == "insert":
            doc.insert(i, c)
        elif len(doc) > 1:
            del doc[i]
    text = "".join(doc)
    fast = recording_fast.load_fast(text, set(wanted) if wanted is not None else None)
    if fast is None:
        return
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "f.om"
        path.write_text(text)
        same(fast, strict(path, set(wanted) if wanted is not None else None))  # the strict reader accepts it too


@pytest.mark.parametrize("spaced", [False, True])
def test_a_space_and_a_newline_swapped_anywhere_are_read_alike_or_declined(spaced: bool) -> None:
    """Every swap of one space with one newline in the series' lines (counts unchanged, lines reshaped): the fast
    reader declines, or the strict reader reads the same."""
    base = _DOC_SPACED if spaced else _DOC
    end = base.index("# TYPE c")
    spaces = [i for i in range(end) if base[i] == " " and not base.startswith("# ", base.rfind("\n", 0, i) + 1)]
    newlines = [i for i in range(end) if base[i] == "\n"]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "f.om"
        for i in spaces:
            for j in newlines:
                doc = list(base)
                doc[i], doc[j] = "\n", " "
                text = "".join(doc)
                fast = recording_fast.load_fast(text, None)
                if fast is None:
                    continue
                path.write_text(text)
                same(fast, strict(path, None))
    assert spaces and newlines
