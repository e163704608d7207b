"""The feature layer: series -> per-GPU / per-NIC frames (entity naming, combining, missing values)."""

from __future__ import annotations

import gc
import math

import numpy as np

from gpufleet.detector.config import parse
from gpufleet.detector.engine import Detector
from gpufleet.detector.frame.features import NodeNaming, collect
from gpufleet.detector.sources.profiles import Query
from gpufleet.detector.sources.source import Pairs, Result, SeriesTable, SourceError

Q_SAMPLES = Query("samples", "m_util", "count")
Q_UTIL = Query("util", "m_util", "avg")
Q_CLOCK = Query("sm_clock", "m_clock", "avg")
Q_LINK = Query("nvlink_down", "m_link_up", "min", agg="min")
Q_NVBW = Query("nvlink_bw", "m_link_bw", "avg", agg="sum")
Q_MASK = Query("@mask", "m_reasons", "last")
Q_MASK2 = Query("@mask", "m_reasons_new", "last")
Q_JOB = Query("@job", "m_job", "count")
Q_TX = Query("nic_tx", "m_tx", "rate", "nic")
Q_WAIT = Query("nic_xmit_wait", "m_wait", "rate", "nic")
Q_BROKEN = Query("temp", "m_temp", "avg")


def lab(node: str, gpu: str | None = None, **extra: str) -> dict[str, str]:
    out = {"instance": node, "site": "dc1"}
    if gpu is not None:
        out["gpu"] = gpu
    return out | extra


class Fixed:
    def __init__(self, answers: dict[Query, Pairs], failing: tuple[Query, ...] = ()) -> None:
        self.answers = answers
        self.table = SeriesTable()
        self.failing = failing
        self.query_errors = 0

    def query(self, query: Query, t: float, window: float) -> Result:
        if query in self.failing:
            raise SourceError(f"{query.metric}: boom")
        return Result.from_pairs(self.answers.get(query, []), self.table)


def test_collect_names_entities_and_combines_series() -> None:
    answers: dict[Query, Pairs] = {
        # a:9400 and a:9445 are one node; b has no port; c is only known by Hostname (no instance label).
        Q_SAMPLES: [(lab("a:9400", "0"), 20.0), (lab("a:9445", "1"), 20.0), (lab("b", "0"), 10.0),
                    ({"Hostname": "c", "gpu": "0", "site": "dc2"}, 20.0), (lab("a:9400"), 20.0)],
        Q_UTIL: [(lab("a:9400", "0"), 0.9), (lab("b", "0"), 0.5), (lab("z:1", "3"), 0.7)],
        Q_CLOCK: [(lab("a:9400", "1"), 1.9e9)],
        Q_LINK: [(lab("a:9400", "0", link="0"), 1.0), (lab("a:9400", "0", link="1"), 0.0),
                 (lab("a:9400", "1", link="0"), 1.0)],
        Q_NVBW: [(lab("a:9400", "0", link="0"), 3.0), (lab("a:9400", "0", link="1"), 4.0)],
        Q_MASK: [(lab("a:9400", "0"), float(0x20)), (lab("a:9400", "1"), 0.0)],
        Q_MASK2: [(lab("a:9400", "1"), float(0x4))],
        Q_JOB: [(lab("a:9400", "0", hpc_job="j1"), 20.0), (lab("a:9445", "1", hpc_job="j1"), 12.0),
                (lab("a:9445", "1", hpc_job="j2"), 8.0)],
        Q_TX: [(lab("a:9400", device="mlx5_1", port="1"), 5.0), (lab("a:9400", device="mlx5_0"), 7.0),
               (lab("b", device="mlx5_0", port="2", site="dc9"), 1.0)],
        Q_WAIT: [(lab("a:9400", device="mlx5_0", port="1"), 2.0)],
    }
    qs = [*answers, Q_BROKEN]
    snap = collect(Fixed(answers, failing=(Q_BROKEN,)), qs, 100.0, 60.0, profile="dcgm")
    g = snap.gpu
    assert list(zip(g.nodes, g.gpus, strict=True)) == [("a", "0"), ("a", "1"), ("b", "0"), ("c", "0")]
    assert g.sites == ["dc1", "dc1", "dc1", "dc2"]
    np.testing.assert_array_equal(g.get("util"), [0.9, np.nan, 0.5, np.nan])  # z:3 has no samples: not a GPU
    np.testing.assert_array_equal(g.get("nvlink_down"), [0.0, 1.0, np.nan, np.nan])  # min over links
    np.testing.assert_array_equal(g.get("nvlink_bw"), [7.0, np.nan, np.nan, np.nan])  # sum over links
    np.testing.assert_array_equal(g.get("thr_thermal"), [1.0, 0.0, np.nan, np.nan])
    np.testing.assert_array_equal(g.get("thr_power"), [0.0, 1.0, np.nan, np.nan])  # bits of either reasons metric
    assert math.isnan(g.get("temp")[0])  # failed query: NaN, never 0
    assert g.jobs == ["j1", "j1", None, None]
    assert list(g.churn) == [False, True, False, False]  # two jobs within the window
    assert list(g.valid) == [True, True, False, True]  # b has half the samples
    assert snap.errors == ["m_temp: boom"]

    n = snap.nic
    assert list(zip(n.nodes, n.devices, n.ports, strict=True)) == [("a", "mlx5_0", "1"), ("a", "mlx5_1", "1"),
                                                                   ("b", "mlx5_0", "2")]
    np.testing.assert_array_equal(n.get("nic_tx"), [7.0, 5.0, 1.0])
    np.testing.assert_array_equal(n.get("nic_xmit_wait"), [2.0, np.nan, np.nan])
    assert n.sites == ["dc1", "dc1", "dc9"]
    assert n.gpus[:2] == [("0",), ("1",)]  # rail order: i-th NIC of a node serves its i-th GPU


def test_collect_node_label_is_configurable() -> None:
    answers: dict[Query, Pairs] = {Q_SAMPLES: [({"host": "n1:9100", "instance": "x", "gpu": "0"}, 5.0)]}
    snap = collect(Fixed(answers), [Q_SAMPLES], 0.0, 60.0, naming=NodeNaming("host", strip_port=False))
    assert snap.gpu.nodes == ["n1:9100"]


def test_evaluation_leaves_the_garbage_collector_as_it_was() -> None:
    det = Detector(parse({}), Fixed({Q_SAMPLES: [(lab("a", "0"), 20.0)]}))
    assert gc.isenabled()
    det.evaluate(1000.0)
    assert gc.isenabled()
    gc.disable()
    try:
        det.evaluate(1060.0)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_meta_queries_are_kept_raw_on_the_frame() -> None:
    q_pod = Query("@pod", "kube_pod_info", "last", "meta")
    q_pod2 = Query("@pod", "kube_pod_info_other", "last", "meta")
    answers = {Q_SAMPLES: [(lab("a", "0"), 20.0)],
               q_pod: [({"pod": "p1", "node": "a"}, 1.0)], q_pod2: [({"pod": "p2", "node": "b"}, 1.0)]}
    snap = collect(Fixed(answers), [Q_SAMPLES, q_pod, q_pod2], 0.0, 60.0)
    assert list(snap.meta) == ["@pod"]
    assert list(snap.meta["@pod"]) == [({"node": "a", "pod": "p1"}, 1.0), ({"node": "b", "pod": "p2"}, 1.0)]
    assert snap.meta["@pod"].column("pod") == ["p1", "p2"]
    assert len(snap.gpu) == 1  # meta series never become GPUs


def test_results_intern_label_sets_and_frames_stay_right_as_the_table_grows() -> None:
    table = SeriesTable()
    r = Result.from_pairs([({"b": "2", "a": "1"}, 1.0), ({"a": "1", "b": "2"}, 2.0), ({"a": "3"}, 3.0)], table)
    assert r.ids.tolist() == [0, 0, 1] and len(table) == 2  # one id per label set, whatever the order
    assert r == [({"a": "1", "b": "2"}, 1.0), ({"a": "1", "b": "2"}, 2.0), ({"a": "3"}, 3.0)]
    src = Fixed({Q_SAMPLES: [(lab("a", "0"), 20.0), (lab("a", "1"), 20.0)], Q_UTIL: [(lab("a", "1"), 0.5)]})
    first = collect(src, [Q_SAMPLES, Q_UTIL], 0.0, 60.0)
    assert first.gpu.gpus == ["0", "1"]
    # a GPU appears (new series ids) and one disappears: positions follow, cached per series id
    src.answers = {Q_SAMPLES: [(lab("a", "2"), 20.0), (lab("a", "1"), 20.0)],
                   Q_UTIL: [(lab("a", "2"), 0.9), (lab("a", "1"), 0.4)]}
    second = collect(src, [Q_SAMPLES, Q_UTIL], 60.0, 60.0)
    assert second.gpu.gpus == ["1", "2"]
    np.testing.assert_array_equal(second.gpu.get("util"), [0.4, 0.9])
    # results from another table (a source that started a new one) land on the same entities
    other = SeriesTable()
    mixed = Fixed({})
    mixed.table = other
    mixed.answers = {Q_UTIL: [(lab("a", "2"), 0.7)]}

    class Two:
        query_errors = 0

        def query(self, query: Query, t: float, window: float) -> Result:
            return (src if query == Q_SAMPLES else mixed).query(query, t, window)

    third = collect(Two(), [Q_SAMPLES, Q_UTIL], 120.0, 60.0)
    np.testing.assert_array_equal(third.gpu.get("util"), [np.nan, 0.7])
    # the same GPUs, and a new series of one of them (the table grows while the frame stays): its position too
    src.answers = {Q_SAMPLES: [(lab("a", "2"), 20.0), (lab("a", "1"), 20.0)],
                   Q_UTIL: [({**lab("a", "2"), "pod": "new"}, 0.3), (lab("a", "1"), 0.6)]}
    fourth = collect(src, [Q_SAMPLES, Q_UTIL], 180.0, 60.0)
    assert fourth.gpu.gpus == ["1", "2"]
    np.testing.assert_array_equal(fourth.gpu.get("util"), [0.6, 0.3])
