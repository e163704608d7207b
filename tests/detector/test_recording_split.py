"""Reading one recording in two processes (detector.sources.recording_split) gives what one process reads: the same
series, the same error message for a bad file, the strict reader for a file whose parts are fine but whole is
not; plain and gzip files; a worker that dies leaves its part to this process."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import pytest
from test_detector_core import Synth, synth

from gpufleet.detector.sources import recording as sr
from gpufleet.detector.sources import recording_fast, recording_split
from gpufleet.detector.sources.profiles import sample_names


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth(tmp_path_factory.mktemp("rec") / "r.om", Synth(nodes=2, seconds=600.0))


@pytest.fixture(autouse=True)
def small_files_split(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recording_split, "SPLIT_BYTES", 0)  # the tests' small files read in two processes


def _series(src: sr.RecordingSource) -> dict[str, list[tuple[dict[str, str], list[float], list[float]]]]:
    return {name: [(s.labels, s.ts.tolist(), s.values.tolist()) for s in ss] for name, ss in src.series.items()}


def _parsed_here(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The ``final`` flag of each part this process parses (the worker's, forked, are not seen)."""
    parts: list[bool] = []
    real = recording_fast.parse_part

    def parse_part(text: str, w: set[str] | None, final: bool) -> recording_fast.Part | None:
        parts.append(final)
        return real(text, w, final)

    monkeypatch.setattr(recording_split, "parse_part", parse_part)
    return parts


def test_a_file_read_in_two_processes_is_the_file_read_in_one(recording: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    wanted = sample_names("gpufleet")
    one = sr.RecordingSource.load([recording], wanted)
    parts = _parsed_here(monkeypatch)
    two = sr.RecordingSource.load([recording], wanted, parallel=True)
    assert parts == [False]  # this process parsed the first part; the worker (forked: not seen here) the rest
    assert _series(two) == _series(one)
    assert two.samples == one.samples > 0


def _same_error(bad: Path) -> str:
    """The message of reading ``bad`` in two processes, which must be that of reading it in one."""
    with pytest.raises(sr.RecordingError) as one:
        sr.RecordingSource.load([bad], None)
    with pytest.raises(sr.RecordingError) as two:
        sr.RecordingSource.load([bad], None, parallel=True)
    assert str(two.value) == str(one.value)
    return str(two.value)


def _two_families(first: str, second: str) -> str:
    return f"# TYPE a gauge\n{first}# TYPE b gauge\n{second}# EOF\n"


@pytest.mark.parametrize("text", [
    _two_families("a 1 10\na 2 oops\n", "b 1 10\n"),  # an error in the first part
    _two_families("a 1 10\n", "b 1 10\nb 2 oops\n"),  # ... in the worker's
    _two_families("a 1 10\n# EOF\n", "b 1 10\n"),  # data after '# EOF', which ends the first part
    "# TYPE a gauge\na 1 10\n# TYPE b gauge\nb 1 10\n",  # no '# EOF'
])
def test_a_bad_file_read_in_two_processes_gets_the_readers_message(text: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "bad.om"
    bad.write_text(text)
    assert "bad.om:" in _same_error(bad)
    with pytest.raises(sr.RecordingError, match="cannot read"):
        sr.RecordingSource.load([tmp_path / "absent.om"], None, parallel=True)


def test_a_series_on_both_sides_of_the_cut_goes_to_the_strict_reader(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Each part is well-formed on its own, the file is not (a family twice, its series not contiguous): the
    parts are not joined, and the strict reader decides, as it does for the file read in one process."""
    path = tmp_path / "split.om"
    path.write_text(_two_families("a 1 10\n", "b 1 10\n# TYPE a gauge\na 2 20\n"))
    text = path.read_text()
    cut = recording_fast.family_cut(text.encode(), 0)
    assert text[cut:].startswith("# TYPE b")
    first = recording_fast.parse_part(text[:cut], None, final=False)
    second = recording_fast.parse_part(text[cut:], None, final=True)
    assert first is not None and second is not None
    assert recording_fast.join([first, second]) is None
    try:
        want: object = _series(sr.RecordingSource.load([path], None))
    except sr.RecordingError as e:
        want = str(e)
    try:
        got: object = _series(sr.RecordingSource.load([path], None, parallel=True))
    except sr.RecordingError as e:
        got = str(e)
    assert got == want


def test_the_cut_is_where_a_family_starts_after_its_samples() -> None:
    data = b"# HELP a x\n# TYPE a gauge\na 1 10\na 2 20\n# HELP b y\n# TYPE b gauge\nb 1 10\n# EOF\n"
    first_b = data.index(b"# HELP b")
    for near in range(data.index(b"a 1")):
        assert recording_fast.family_cut(data, near) == first_b  # never inside a family's metadata
    assert recording_fast.family_cut(data, first_b + 1) == data.index(b"# EOF")
    assert recording_fast.family_cut(data, data.index(b"# EOF") + 1) == 0
    assert recording_fast.family_cut(b"# TYPE a gauge\n# EOF\n", 0) == 0


def test_a_worker_that_dies_leaves_its_part_to_this_process(recording: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recording_split, "_part_worker", lambda *args: os._exit(3))
    src = sr.RecordingSource.load([recording], None, parallel=True)
    assert _series(src) == _series(sr.RecordingSource.load([recording], None))


def test_a_packed_part_unpacks_to_the_same_part() -> None:
    """The worker sends its part as a few large arrays; unpacked it is the same part, in the same order, and
    series that shared a timestamp array still share one."""
    shared = np.array([10.0, 25.0, 40.0])
    raw: sr.RawSeries = {"a": {(("x", "1"),): ([shared], [np.array([1.0, 2.0, 3.0])]),
                               (("x", "2"),): ([np.array([11.0])], [np.array([7.0])])},
                         "b": {},
                         "c": {(("y", "z"),): ([shared], [np.array([-1.0, 0.5, np.inf])])}}
    meta = ["# TYPE a gauge\n", "# EOF\n"]
    got, got_meta = recording_split._unpack_part(recording_split._pack_part((raw, meta)))
    assert got_meta == meta
    assert list(got) == ["a", "b", "c"]
    assert {n: {k: (ts[0].tolist(), vs[0].tolist()) for k, (ts, vs) in d.items()} for n, d in got.items()} == \
        {n: {k: (ts[0].tolist(), vs[0].tolist()) for k, (ts, vs) in d.items()} for n, d in raw.items()}
    assert np.shares_memory(got["a"][(("x", "1"),)][0][0], got["c"][(("y", "z"),)][0][0])
    assert recording_split._unpack_part(recording_split._pack_part(({}, []))) == ({}, [])


def test_a_gzip_file_is_decompressed_and_parsed_in_two_processes(recording: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    packed = tmp_path / "r.om.gz"
    packed.write_bytes(gzip.compress(recording.read_bytes()))
    one = _series(sr.RecordingSource.load([recording], None))
    parts = _parsed_here(monkeypatch)
    assert _series(sr.RecordingSource.load([packed], None, parallel=True)) == one
    assert parts == [False]  # the start here, the rest (decompressed by the worker) there


@pytest.mark.parametrize("shape", ["two members", "trailing zeros", "one family"])
def test_a_gzip_file_that_cannot_be_streamed_reads_the_same(shape: str, recording: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Not one clean member: decompressed whole first (as gzip -d does), then parsed in two parts. One family:
    the worker's part is the '# EOF' line."""
    text = recording.read_bytes()
    if shape == "one family":
        text = b"# TYPE m gauge\n" + b"".join(b"m{i=\"%d\"} 1 %d\n" % (i, 10 + i) for i in range(2000)) + b"# EOF\n"
    path = tmp_path / "r.om.gz"
    third = len(text) // 3
    path.write_bytes({"two members": gzip.compress(text[:third]) + gzip.compress(text[third:]),
                      "trailing zeros": gzip.compress(text) + b"\x00\x00",
                      "one family": gzip.compress(text)}[shape])
    plain = tmp_path / "r.om"
    plain.write_bytes(text)
    want = _series(sr.RecordingSource.load([plain], None))
    parts = _parsed_here(monkeypatch)
    assert _series(sr.RecordingSource.load([path], None, parallel=True)) == want
    assert parts == [False]


@pytest.mark.parametrize("cut_at", [0.3, 0.9])
def test_a_damaged_gzip_file_gets_the_readers_message(cut_at: float, recording: Path, tmp_path: Path) -> None:
    data = gzip.compress(recording.read_bytes())
    bad = tmp_path / "bad.om.gz"
    bad.write_bytes(data[: int(len(data) * cut_at)])  # truncated before or after the cut
    assert "corrupt or truncated gzip" in _same_error(bad)
