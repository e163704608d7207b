"""Replay's faster paths give the same findings: the file read in two processes (a forked worker parses its
second half), the fast block reader (shared timestamp columns), series evaluated as one matrix, sort-based
medians."""

from __future__ import annotations

import multiprocessing
import warnings
from pathlib import Path

import numpy as np
import pytest
from test_detector_core import Fault, Synth, synth

from gpufleet.detector.config import DetectorConfig, parse
from gpufleet.detector.incidents.tracker import Finding
from gpufleet.detector.rules import robust
from gpufleet.detector.service.replay import replay
from gpufleet.detector.sources import recording as sr
from gpufleet.detector.sources import recording_fast, recording_split, recording_strict
from gpufleet.detector.sources.profiles import queries, sample_names


def _cfg() -> DetectorConfig:
    return parse({"detector": {"window_seconds": 120.0, "interval_seconds": 30.0},
                  "findings": {"open_after": 2, "close_after": 2}})


def _plain(findings: list[Finding]) -> list[tuple[object, ...]]:
    return [(f.kind, f.node, f.gpu, f.job, f.cause, f.nic, f.start, f.end, f.score, f.summary, f.evidence)
            for f in findings]


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A clock straggler (scored near the threshold, so the IsolationForest is fitted) and a PCIe link fault.
    return synth(tmp_path_factory.mktemp("rec") / "r.om",
                 Synth(nodes=3, seconds=1200.0, faults=[Fault("clock", 1, 3, 300.0, end=900.0),
                                                        Fault("pcie", 2, 6, 600.0)]))


def test_findings_are_the_same_with_every_shortcut_off(recording: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast paths (worker process, block reader, series evaluated as one matrix, sort-based medians) change
    no finding: a replay with all of them gives exactly what one with none of them gives."""
    _, inline = replay([str(recording)], _cfg(), parallel=False)
    monkeypatch.setattr(recording_split, "SPLIT_BYTES", 0)  # the test's small file read in two processes
    _, beside = replay([str(recording)], _cfg(), parallel=True)
    monkeypatch.setattr(recording_split, "parse_part", lambda text, wanted, final: None)  # every file through the strict reader
    monkeypatch.setattr(sr, "_CHUNK", 1)  # one series at a time
    monkeypatch.setattr(robust, "median", lambda v: float(np.median(v)))  # numpy's own median
    _, plain = replay([str(recording)], _cfg(), parallel=False)
    got = _plain(beside)
    assert {(k, n, g) for k, n, g, *_ in got} >= {("straggler", "node-001", "3"), ("straggler", "node-002", "6")}
    assert _plain(inline) == got
    assert _plain(plain) == got


@pytest.mark.parametrize("seed", range(4))
def test_medians_equal_numpys(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for n in range(1, 70):
        v = rng.normal(size=n) * 10.0 ** rng.integers(-3, 12)
        if seed % 2:
            v = np.round(v)  # ties
        if seed == 3:
            v[rng.integers(0, n)] = np.inf
        assert robust.median(v) == float(np.median(v))
        v[rng.random(n) < 0.3] = np.nan
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # numpy warns on an all-NaN slice
            expected = float(np.nanmedian(v))
        assert robust.nanmedian(v) == expected or (np.isnan(expected) and np.isnan(robust.nanmedian(v)))


@pytest.mark.parametrize("seed", range(3))
def test_grouped_robust_z_is_each_groups_robust_z(seed: int) -> None:
    """Grouped robust z (one group at a time where few, else all groups at once, or prepared once as
    PeerGroups) is each group's robust_z to the last bit and the sign of a zero (NaN, inf, ties, signed zeros, groups without a finite value, no group)."""
    rng = np.random.default_rng(seed)
    for case in range(1500):
        n = int(rng.integers(0, 40))
        x = rng.normal(size=n) * 10.0 ** rng.integers(-3, 6)
        if case % 3 == 0:
            x = np.round(x) * rng.choice([-1.0, 1.0], size=n)  # ties and signed zeros
        x[rng.random(n) < 0.2] = np.nan
        x[rng.random(n) < 0.05] = np.inf * rng.choice([-1, 1])
        groups = rng.integers(-1, int(rng.choice([3, 12])), size=n)
        floors = float(rng.choice([0.0, 0.02, 5.0])), float(rng.choice([0.0, 0.05, 0.25]))
        expected = np.full(n, np.nan)
        for gid in set(groups.tolist()) - {-1}:
            idx = np.flatnonzero(groups == gid)
            expected[idx] = robust.robust_z(x[idx], *floors)
        for got in (robust.grouped_robust_z(x, groups, *floors),  # few groups: one at a time
                    robust._all_groups_z(x, groups, *floors, np.full(n, np.nan)),  # all at once
                    robust.PeerGroups(groups).robust_z(x, *floors),  # rows of a padded matrix
                    robust.PeerGroups(groups).robust_zs([(-x, 1.0, 0.0), (x, *floors)])[1]):  # several features
            assert np.array_equal(got, expected, equal_nan=True), (x, groups, floors)
            assert (np.signbit(got) == np.signbit(expected)).all(), (x, groups, floors)


def test_peer_groups_of_very_unequal_sizes_are_each_groups_robust_z() -> None:
    """One large group beside many small ones (padding would cost more than the members): the same numbers."""
    rng = np.random.default_rng(7)
    groups = np.concatenate((np.zeros(600, dtype=np.int64), np.repeat(np.arange(1, 41), 3), [-1] * 5))
    x = np.round(rng.normal(size=len(groups)) * 100.0)
    x[rng.random(len(x)) < 0.1] = np.nan
    peers = robust.PeerGroups(groups)
    assert not peers.dense
    got = peers.robust_z(x, 0.5, 0.01)
    expected = np.full(len(x), np.nan)
    for gid in range(41):
        idx = np.flatnonzero(groups == gid)
        expected[idx] = robust.robust_z(x[idx], 0.5, 0.01)
    assert np.array_equal(got, expected, equal_nan=True)
    assert (np.signbit(got) == np.signbit(expected)).all()


def test_peer_groups_stack_features_in_batches_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """Features stacked a few at a time (a large fleet's) give what all at once gives."""
    rng = np.random.default_rng(11)
    groups = rng.integers(-1, 6, size=50)
    feats = [(np.round(rng.normal(size=50) * 10.0), float(a), 0.01) for a in range(5)]
    whole = robust.PeerGroups(groups).robust_zs(feats)
    monkeypatch.setattr(robust, "BATCH", 102)  # two features per stack
    parts = robust.PeerGroups(groups).robust_zs(feats)
    assert len(parts) == 5
    for a, b in zip(whole, parts, strict=True):
        assert a.tobytes() == b.tobytes()


def _series(src: sr.RecordingSource) -> dict[str, list[tuple[dict[str, str], list[float], list[float]]]]:
    return {name: [(s.labels, s.ts.tolist(), s.values.tolist()) for s in ss] for name, ss in src.series.items()}


def test_series_with_their_own_timestamps_keep_them(tmp_path: Path) -> None:
    """The fast reader converts a timestamp column once for series that share it, and never mixes columns."""
    path = tmp_path / "t.om"
    path.write_text("# TYPE m gauge\n" + "".join(f'm{{a="{a}"}} {v} {t}\n' for a, ts in
                                                 (("1", ("10", "25")), ("2", ("10", "25")), ("3", ("10", "26")),
                                                  ("4", ("10.0", "25")))
                                                 for v, t in zip((1, 2), ts, strict=True)) + "# EOF\n")
    src = sr.RecordingSource.load([path], None)
    got = {s.labels["a"]: s.ts.tolist() for s in src.series["m"]}
    assert got == {"1": [10.0, 25.0], "2": [10.0, 25.0], "3": [10.0, 26.0], "4": [10.0, 25.0]}
    assert all(np.array_equal(s.values, [1.0, 2.0]) for s in src.series["m"])


def test_series_evaluated_together_equal_series_evaluated_alone(recording: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """precompute evaluates series sharing timestamps as one matrix (in chunks): exactly as one by one."""
    cfg = _cfg()
    times = [sr.RecordingSource.load([recording], None).time_range()[0] - 150.0 + 7.5 * i for i in range(200)]  # from before the first sample to after the last

    def matrices() -> dict[tuple[object, float], np.ndarray]:
        src = sr.RecordingSource.load([recording], sample_names("gpufleet"))
        for q in queries(cfg.profile):
            src.precompute(q, times, cfg.window_seconds)
        return {k: v[2] for k, v in src._cache.items()}

    together = matrices()
    monkeypatch.setattr(sr, "_CHUNK", 1)  # one series per chunk
    alone = matrices()
    assert together.keys() == alone.keys()
    assert sum(m.size for m in together.values()) > 10_000
    for key, mat in together.items():
        np.testing.assert_array_equal(mat, alone[key], err_msg=str(key))
    assert any(np.isfinite(m).any() and np.isnan(m).any() for m in together.values())  # windows with no samples


def test_blocks_much_shorter_or_longer_than_the_last_are_found(tmp_path: Path) -> None:
    """The fast reader looks for a series' end near the last series' length first; any length is found."""
    lengths = [5, 1, 300, 2, 40, 40, 39, 41, 1000, 3]
    text = "# TYPE m gauge\n" + "".join(f'm{{s="{i}"}} {i + j / 7} {10 + 15 * j}\n' for i, k in enumerate(lengths)
                                        for j in range(k)) + "# EOF\n"
    fast = recording_fast.load_fast(text, None)
    assert fast is not None
    got = {dict(key)["s"]: len(ts[0]) for key, (ts, _) in fast["m"].items()}
    assert got == {str(i): k for i, k in enumerate(lengths)}
    path = tmp_path / "m.om"
    path.write_text(text)
    raw: sr.RawSeries = {}
    with open(path, encoding="utf-8") as fd:
        recording_strict.load_file(fd, None, raw, str(path))
    for key, (ts, vs) in fast["m"].items():
        np.testing.assert_array_equal(ts[0], np.concatenate(raw["m"][key][0]))
        np.testing.assert_array_equal(vs[0], np.concatenate(raw["m"][key][1]))


def _replay_in_pool(path: str) -> list[tuple[object, ...]]:
    return _plain(replay([path], _cfg(), parallel=True)[1])


def test_a_daemonic_process_reads_the_file_itself(recording: Path) -> None:
    """A multiprocessing pool's workers are daemons, which may not start a process: replay still works there."""
    with multiprocessing.get_context("fork").Pool(1) as pool:
        got = pool.map(_replay_in_pool, [str(recording)])[0]
    assert got == _plain(replay([str(recording)], _cfg(), parallel=False)[1])
    assert got


def test_peer_groups_follow_the_frames_jobs_when_they_change_in_place() -> None:
    """The peer groups' job/model codes are reused while the frame's jobs, namespaces and models are the same;
    a list changed in place (a job ends, a pod moves namespace) gives new groups."""
    from gpufleet.detector.core import memo
    from gpufleet.detector.frame.features import GpuFrame
    from gpufleet.detector.rules.straggler import StragglerParams, _groups

    n = 12
    jobs: list[str | None] = [*(["a"] * 6), *(["b"] * 6)]
    frame = GpuFrame([f"n{i // 4}" for i in range(n)], [str(i % 4) for i in range(n)], ["s"] * n, jobs,
                     ["H100"] * n, {}, np.ones(n, dtype=bool), np.zeros(n, dtype=bool), [None] * n,
                     [None] * n, np.ones(n, dtype=bool))
    p = StragglerParams(min_peers=3)
    ok = np.ones(n, dtype=bool)
    store: memo.Store = {}
    with memo.scope(store):  # (as in an evaluation: the detector's memos kept)
        assert _groups(frame, ok, p).tolist() == [0] * 6 + [1] * 6
        assert _groups(frame, ok, p).tolist() == [0] * 6 + [1] * 6
        assert "straggler.job_model_codes" in store
        jobs[6:] = [None] * 6  # job b ended: its GPUs have no peers
        assert _groups(frame, ok, p).tolist() == [0] * 6 + [-1] * 6
        frame.namespaces[:3] = ["x"] * 3  # three of a's GPUs in another namespace: a job of its own
        assert _groups(frame, ok, p).tolist() == [0] * 3 + [1] * 3 + [-1] * 6
        frame.models[3] = "A100"  # GPU 3 of another model: no peers, and GPUs 4 and 5 too few
        assert _groups(frame, ok, p).tolist() == [0] * 3 + [-1] * 9
