"""Recordings: the fast block reader gives exactly what the strict line-by-line reader gives, and defers to it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_detector_core import Fault, Synth, synth

from gpufleet.detector import source_recording as sr
from gpufleet.detector.profiles import sample_names


def strict(path: Path, wanted: set[str] | None) -> sr.RawSeries:
    raw: sr.RawSeries = {}
    with open(path, encoding="utf-8") as fd:
        sr._load_file(fd, wanted, raw, str(path))
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
        fast = sr._load_fast(rec.read_text(), wanted)
        assert fast is not None
        same(fast, strict(rec, wanted))


def test_fast_reader_handles_spaces_in_label_values_and_special_values(tmp_path: Path) -> None:
    text = ('# TYPE m gauge\nm{a="x y",b="1"} 1.5 10.0\nm{a="x y",b="1"} NaN 25\nm{a="x y",b="1"} +Inf 40.5\n'
            'm{a="z"} -2 10\nm{a="q\\"uote\\\\ \\n"} 1 10\n# TYPE c counter\nc_total 3 10\nc_total 4 25\n# EOF\n')
    path = tmp_path / "s.om"
    path.write_text(text)
    fast = sr._load_fast(text, None)
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
])
def test_unusual_files_get_the_strict_readers_message(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "s.om"
    path.write_text(text)
    assert sr._load_fast(text, None) is None
    with pytest.raises(sr.RecordingError, match=message):
        sr.RecordingSource.load([path])


def test_a_file_the_fast_reader_declines_still_loads(tmp_path: Path) -> None:
    text = "# TYPE m gauge\nm 1 10\nother 2 10\nother 3 25\n# EOF\n"  # `other`: a family without metadata
    path = tmp_path / "s.om"
    path.write_text(text)
    assert sr._load_fast(text, None) is None
    src = sr.RecordingSource.load([path])
    np.testing.assert_array_equal(src.series["other"][0].values, [2.0, 3.0])
