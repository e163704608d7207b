"""The remote-write window's columns (detector/sources/stream_window.py): the same answers as the recording path
for the same samples, whatever order they arrive in, and a view that stays one picture while samples arrive."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gpufleet.detector.receiver.proto import decode, encode
from gpufleet.detector.sources import remote_write
from gpufleet.detector.sources.profiles import Op, Query
from gpufleet.detector.sources.recording import RecordingSource, Series
from gpufleet.detector.sources.remote_write import StreamStore
from gpufleet.detector.sources.window_ops import window_bounds, window_ops, window_rows

OPS: tuple[Op, ...] = ("count", "avg", "last", "max", "min", "rate", "increase")
UTIL = "gpufleet_gpu_utilization_ratio"


def padded(series: list[tuple[np.ndarray, np.ndarray]], extra: int) -> tuple[np.ndarray, np.ndarray]:
    cap = max([len(ts) for ts, _ in series] + [0]) + extra
    t, v = np.full((cap, len(series)), np.nan), np.full((cap, len(series)), np.nan)
    for r, (ts, vs) in enumerate(series):
        t[: len(ts), r], v[: len(vs), r] = ts, vs
    return t, v


def random_series(rng: np.random.Generator, m: int) -> tuple[np.ndarray, np.ndarray]:
    ts = np.sort(rng.choice(np.arange(0.0, 300.0, 2.5) + rng.random(), size=m, replace=False))
    vs = np.cumsum(rng.random(m) * 10)
    if m and rng.random() < 0.4:
        vs[rng.integers(0, m)] = 0.25  # a counter reset
    if m and rng.random() < 0.1:
        vs[rng.integers(0, m)] = np.nan
    return ts, vs


def test_window_rows_is_window_ops_bit_for_bit() -> None:
    """Each series (a column) at its own times, NaN past its last sample: every op equals the recording path's, to the bit."""
    rng = np.random.default_rng(7)
    for _ in range(300):
        series = [random_series(rng, int(rng.integers(0, 20))) for _ in range(int(rng.integers(1, 7)))]
        t_mat, v_mat = padded(series, int(rng.integers(0, 4)))
        at, window = float(rng.uniform(-10, 320)), float(rng.choice([2.5, 15.0, 60.0, 120.0]))
        for op in OPS:
            got = window_rows(op, t_mat, v_mat, at, window)
            want = [window_ops(op, ts, vs[np.newaxis, :], np.array([at]), window)[0, 0] for ts, vs in series]
            np.testing.assert_array_equal(got, want, err_msg=op)
            pos = np.flatnonzero(rng.random(len(series)) < 0.5)  # a matcher's columns, bounds known
            np.testing.assert_array_equal(window_rows(op, t_mat, v_mat, at, window, window_bounds(
                t_mat, at, window), pos), got[pos], err_msg=op)
    with pytest.raises(ValueError, match="unknown operation"):
        window_rows("median", t_mat, v_mat, 1.0, 1.0)


def request(samples: list[tuple[dict[str, str], list[tuple[int, float]]]]) -> object:
    return decode(encode(samples), 1 << 24)


def labels(k: int) -> dict[str, str]:
    return {"__name__": UTIL, "instance": f"node-{k // 8}:9400", "gpu": str(k % 8)}


@pytest.mark.parametrize("pending", [None, 4])  # 4: the samples go into the matrices as they come before a view
@pytest.mark.parametrize("retention", [1e9, 45.0])
def test_the_store_answers_as_the_recording_whatever_the_arrival_order(retention: float, pending: int | None,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Series at their own offsets, some going away and new ones arriving, sent in batches out of turn (late
    samples, resends); evaluations between the batches. Every answer is the recording's for the samples the
    window holds: to the bit while nothing was trimmed, and within float rounding of a cumulative sum started
    at another sample once the window dropped the oldest."""
    rng = np.random.default_rng(11)
    k, step = 40, 5.0
    offsets = rng.uniform(0, step, size=k)
    spans = [(0.0 if s < 30 else 60.0, 400.0 if s % 7 else 150.0) for s in range(k)]  # some leave, some join
    truth = {s: [(round((o + step * i) * 1000) / 1000, float(np.round(rng.random() * 100 + (i % 13) * 7, 3)))
                 for i in range(100) if spans[s][0] <= o + step * i <= spans[s][1]]
             for s, o in enumerate(offsets)}
    batches: list[tuple[float, int, list[tuple[int, float]]]] = []  # (send time, series, samples)
    for s, samples in truth.items():
        for i in range(0, len(samples), 3):
            part = [(round(t * 1000), v) for t, v in samples[i:i + 3]]
            sent = samples[i + len(part) - 1][0] + float(rng.uniform(0, 25))  # a queue's own delay: out of turn
            batches.append((sent, s, part))
            if rng.random() < 0.15:
                batches.append((sent + 3.0, s, part))  # a resend
    batches.sort(key=lambda b: b[0])
    if pending is not None:
        monkeypatch.setattr(remote_write, "_PENDING", pending)
    store = StreamStore({UTIL}, retention)
    queries = [Query(op, UTIL, op) for op in OPS] + [Query("g0", UTIL, "avg", matchers=(("gpu", "=", "0"),))]
    next_eval, evaluated, late = 30.0 if pending is None else 80.0, 0, 0
    for sent, s, part in batches:
        while sent > next_eval:
            if pending is not None and not evaluated:  # samples already in the matrices before the first view
                assert 0 < store._rows[UTIL].pending() < store._rows[UTIL].samples
            check(store, truth, queries, next_eval, retention)
            next_eval += 17.0
            evaluated += 1
        got = store.ingest(request([(labels(s), part)]))
        assert got.out_of_order == 0
        late += got.late
    assert evaluated >= 17 and late > 50
    if retention < 1e6:
        assert store.series_count < k  # the series that left are gone from the window


def check(store: StreamStore, truth: dict[int, list[tuple[float, float]]], queries: list[Query], at: float,
          retention: float) -> None:
    view = store.snapshot(at)
    held = {}
    for key, row in store._rows[UTIL].index.items():  # what the window holds, row by row
        n = int(store._rows[UTIL].cnt[row])
        held[key] = (store._rows[UTIL].t[:n, row].copy(), store._rows[UTIL].v[:n, row].copy())
    for s, samples in truth.items():
        key = tuple(sorted((a, b) for a, b in labels(s).items() if a != "__name__"))
        arrived = [(t, v) for t, v in samples if t <= store.newest]
        if key not in held:
            continue
        t_held, v_held = held[key]
        # never a sample the series did not send (its value at that time), always in time order
        sent = dict(samples)
        assert [sent.get(t) for t in t_held.tolist()] == v_held.tolist()
        assert (np.diff(t_held) > 0).all()
        if retention > 1e6:
            assert len(t_held) <= len(arrived)
    series = {UTIL: [Series(dict(key), ts, vs) for key, (ts, vs) in held.items() if len(ts)]}
    rec = RecordingSource(series)
    for q in queries:
        for window in (15.0, 40.0):
            got = {tuple(sorted(lb.items())): v for lb, v in view.query(q, at, window)}
            want = {tuple(sorted(lb.items())): v for lb, v in rec.query(q, at, window)}
            assert got.keys() == want.keys(), (q, at)
            a, b = np.array([got[x] for x in want]), np.array(list(want.values()))
            if retention > 1e6 or q.op in ("count", "last", "max", "min"):
                np.testing.assert_array_equal(a, b, err_msg=f"{q} at {at}")
            else:
                np.testing.assert_allclose(a, b, rtol=1e-9, err_msg=f"{q} at {at}")


def test_a_view_is_one_picture_while_samples_arrive() -> None:
    """Samples that arrive after a view was made (new ones, late ones, a new series) do not change its answers;
    the next instant's view sees them."""
    store = StreamStore({UTIL}, 600.0)
    store.ingest(request([(labels(g), [(t * 1000, float(t + g)) for t in range(0, 100, 10)]) for g in range(4)]))
    view = store.snapshot(90.0)
    q = Query("avg", UTIL, "avg")
    before = {tuple(lb.items()): v for lb, v in view.query(q, 90.0, 60.0)}
    store.ingest(request([(labels(g), [(85_000, 1e6), (95_000, 1e6), (100_000, 1e6)]) for g in range(4)]
                         + [(labels(9), [(80_000, 5.0)])]))
    assert {tuple(lb.items()): v for lb, v in view.query(q, 90.0, 60.0)} == before  # cached: same answer
    fresh = {tuple(lb.items()): v for lb, v in view.query(Query("avg2", UTIL, "avg"), 90.0, 60.0)}
    assert fresh == before  # evaluated again on the same view: still the picture at 90
    after = dict((tuple(lb.items()), v) for lb, v in store.query(q, 100.0, 60.0))
    assert len(after) == 5 and max(after.values()) > 1e5


def test_maintenance_while_nothing_queries_leaves_the_last_view_as_it_was() -> None:
    """With no evaluation for more than a window the store trims as samples arrive (memory stays bounded) into
    new matrices, so a view an evaluation may still be reading answers as before."""
    store = StreamStore({UTIL}, 60.0)
    store.ingest(request([(labels(g), [(t * 1000, float(t)) for t in range(0, 60, 10)]) for g in range(40)]))
    view = store.snapshot(50.0)
    q = Query("n", UTIL, "count")
    want = sorted(v for _, v in view.query(q, 50.0, 50.0))
    for t in range(60, 400, 10):
        store.ingest(request([(labels(0), [(t * 1000, float(t))])]))  # every other series has gone
    assert store.samples <= 2 * 7 + 1 and store.series_count == 1
    assert store._rows[UTIL].t.shape[1] < 40  # the rows of the series that went were dropped
    assert sorted(v for _, v in view.query(Query("n2", UTIL, "count"), 50.0, 50.0)) == want
    [(_, last)] = list(store.query(Query("last", UTIL, "last"), 390.0, 30.0))
    assert last == 390.0 and not math.isnan(last)
