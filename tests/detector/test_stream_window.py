"""The remote-write window's columns (detector/sources/stream_window.py): the same answers as the recording path
for the same samples, whatever order they arrive in, and a view that stays one picture while samples arrive."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gpufleet.detector.receiver.proto import decode, encode
from gpufleet.detector.sources import remote_write, stream_window
from gpufleet.detector.sources.profiles import Op, Query
from gpufleet.detector.sources.recording import RecordingSource, Series
from gpufleet.detector.sources.remote_write import StreamStore
from gpufleet.detector.sources.window_ops import count_below, window_bounds, window_ops, window_rows

OPS: tuple[Op, ...] = ("count", "avg", "last", "max", "min", "rate", "increase", "irate")
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


def test_irate_is_the_latest_interval_of_the_counter() -> None:
    """PromQL's irate: the window's last two samples, per second between them; a drop between them is a reset (the
    last value is the increase); fewer than two samples in the window: no rate."""
    ts = np.array([0.0, 15.0, 30.0, 45.0])
    vs = np.array([[0.0, 10.0, 40.0, 4.0]])
    got = window_ops("irate", ts, vs, np.array([30.0, 44.0, 45.0, 90.0, 100.0]), 60.0)[0]
    np.testing.assert_array_equal(got, [30.0 / 15.0, 30.0 / 15.0, 4.0 / 15.0, 4.0 / 15.0, np.nan])
    # the window's rate spreads the same latest interval over all of it
    assert window_ops("rate", ts[:3], vs[:, :3], np.array([30.0]), 60.0)[0, 0] < got[0]


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
        held[key] = (store._rows[UTIL].times(row), store._rows[UTIL].v[:n, row].copy())
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


def test_integer_bounds_are_the_float_bounds_to_the_bit() -> None:
    """Times held as integer milliseconds after a base give the same window bounds as the float seconds they
    stand for, for any instant and window (instants on a sample, a rounding away from one, far from both)."""
    rng = np.random.default_rng(5)
    for _ in range(400):
        base = int(rng.integers(0, 2_000_000_000_000))
        off = np.sort(rng.integers(-50_000, 400_000, size=(int(rng.integers(1, 30)), 3)), axis=0).astype(np.int32)
        off[int(rng.integers(0, len(off))):, int(rng.integers(0, 3))] = np.iinfo(np.int32).max  # past the last
        seconds = np.where(off == np.iinfo(np.int32).max, np.nan, (off.astype(np.int64) + base) / 1000.0)
        window = float(rng.choice([0.001, 15.0, 60.0, 119.999, rng.uniform(0, 300)]))
        on = float(seconds[int(rng.integers(0, len(off))), 0])
        for at in (on, on + window, np.nextafter(on, np.inf), np.nextafter(on, -np.inf), on + window * 1e-9,
                   base / 1000.0 + float(rng.uniform(-100, 500)), -math.inf, math.inf):
            if math.isnan(at):
                continue
            want = window_bounds(seconds, at, window)
            got = window_bounds(off, at, window, base)
            np.testing.assert_array_equal(got[0], want[0], err_msg=f"{base} {at!r} {window!r}")
            np.testing.assert_array_equal(got[1], want[1], err_msg=f"{base} {at!r} {window!r}")
        for x in (int(rng.integers(-60_000, 410_000)), int(off.min()), int(off.max()), np.iinfo(np.int32).max):
            np.testing.assert_array_equal(count_below(off, x), np.count_nonzero(off < x, axis=0))


def recorded(series: dict[int, list[tuple[int, float]]], q: Query, at: float, window: float) -> dict[str, float]:
    """The recording path's answer for ``series`` (integer ms timestamps), by GPU."""
    out = {}
    for s, samples in series.items():
        ts = np.array([t / 1000.0 for t, _ in samples])
        vs = np.array([[v for _, v in samples]])
        got = window_ops(q.op, ts, vs, np.array([at]), window)[0, 0]
        if not math.isnan(got):
            out[str(s)] = float(got)
    return out


def streamed(store: StreamStore, q: Query, at: float, window: float) -> dict[str, float]:
    return {lb["gpu"]: v for lb, v in store.query(q, at, window)}


def test_a_stream_past_the_32_bit_range_moves_its_base_and_a_far_clock_widens_the_times(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A detector that runs for weeks: once a sample would not fit 32 bits after the base (24.8 days) the base
    moves to the oldest time held and the answers stay the recording's. A sender whose clock is years off
    (its samples far from the rest) widens the metric's times to 64 bits rather than losing either, narrowed
    again once the window holds only times that fit."""
    t0, step = 1_700_000_000_000, 10_000
    refits: list[str] = []  # the times' type after each move of the base
    refit = stream_window.MetricRows._refit

    def recorded_refit(self: stream_window.MetricRows, off: np.ndarray) -> None:
        refit(self, off)
        refits.append(str(self.t.dtype))

    monkeypatch.setattr(stream_window.MetricRows, "_refit", recorded_refit)
    store = StreamStore({UTIL}, 60.0)
    sent: dict[int, list[tuple[int, float]]] = {0: [], 1: []}
    jump = (1 << 31) - 500_000  # the second stretch starts 500 s before the first base's 32-bit range ends
    times = [t0 + k * step for k in range(100)] + [t0 + jump + k * step for k in range(100)]
    for i, t in enumerate(times):
        for s in sent:
            sent[s].append((t + 137 * s, float(i * (s + 1))))
        store.ingest(request([(labels(s), [sent[s][-1]]) for s in sent]))
        at = (t + 5_000) / 1000.0
        for op in OPS:
            q = Query(op, UTIL, op)
            got, want = streamed(store, q, at, 45.0), recorded(sent, q, at, 45.0)
            assert got.keys() == want.keys() and all(got[k] == want[k] for k in want), (op, i)
    rows = store._rows[UTIL]
    assert rows.t.dtype == np.int32 and rows.base > t0  # moved, not widened
    behind = t0 - 3 * 365 * 86_400_000  # a new sender whose clock is three years behind: older than the window
    ingested = store.ingest(request([(labels(3), [(behind, 1.0)])]))
    assert ingested.out_of_order == 1 and ingested.accepted == 0
    last = times[-1] + step
    far = last + 3 * 365 * 86_400_000  # and one three years ahead, in the same request as the others' samples
    sent[2] = [(far, 1.0), (far + step, 2.0)]
    store.ingest(request([(labels(s), [(last, 7.0)]) for s in (0, 1)] + [(labels(2), sent[2])]))
    for s in (0, 1):
        sent[s].append((last, 7.0))
    # both were flushed together (64-bit times for that flush), then the window moved to the far clock's now:
    # what it holds fits 32 bits again
    assert store._rows[UTIL].t.dtype == np.int32
    at = (far + step) / 1000.0
    for op in OPS:  # the window is the far clock's now (what the stream says is the newest); answered as recorded
        q = Query(op, UTIL, op)
        assert streamed(store, q, at, 45.0) == recorded(sent, q, at, 45.0) != {}
    for k in range(2, 40):  # the far clock's samples go on; the others' have left the window
        sent[2].append((far + k * step, float(k)))
        store.ingest(request([(labels(2), [sent[2][-1]])]))
        at = (far + k * step) / 1000.0
        assert streamed(store, Query("last", UTIL, "last"), at, 45.0) == {"2": float(k)}
    assert store._rows[UTIL].t.dtype == np.int32  # narrowed again once what is held fits 32 bits
    assert refits == ["int32", "int64", "int32"]  # moved, widened for the one flush, narrowed
    for op in OPS:
        q = Query(op, UTIL, op)
        assert streamed(store, q, at, 45.0) == recorded({2: sent[2]}, q, at, 45.0) != {}
