"""The backend guard's rules on hand-made frames: which node is frozen, stale, or a fleet-wide gap (issue 34)."""

from __future__ import annotations

import numpy as np
import pytest

from gpufleet.detector.frame.backend_guard import BackendGuard, Degraded
from gpufleet.detector.frame.frames import FeatureFrame, GpuFrame, NicFrame, NodeNaming
from gpufleet.detector.sources.profiles import Query
from gpufleet.detector.sources.source import Result, SeriesTable

NODES = ["n0", "n1", "n2", "n3", "n4"]


class FakeProm:
    """``changes()`` of each node's power reading as given; partial answers as given."""

    def __init__(self) -> None:
        self.changes = dict.fromkeys(NODES, 5.0)
        self.partial: list[str] = []
        self.asked: list[str] = []

    def take_partial(self) -> list[str]:
        out, self.partial = self.partial, []
        return out

    def instant(self, expr: str, t: float, scale: float = 1.0) -> Result:
        self.asked.append(expr)
        table = SeriesTable()
        ids = [table.intern({"instance": f"{n}:9445", "gpu": "0"}) for n in self.changes]
        return Result(table, np.array(ids), np.array(list(self.changes.values())))


def frame(util: dict[str, float], valid: set[str] | None = None, errors: list[str] | None = None) -> FeatureFrame:
    nodes = list(util)
    ok = [n in (valid if valid is not None else set(nodes)) for n in nodes]
    g = GpuFrame(nodes, ["0"] * len(nodes), ["a"] * len(nodes), ["job"] * len(nodes), ["H100"] * len(nodes),
                 {"util": np.array([util[n] for n in nodes])}, np.array(ok), np.zeros(len(nodes), dtype=bool))
    nic = NicFrame([], [], [], [], {}, [])
    return FeatureFrame(0.0, g, nic, {}, {}, errors=errors or [])


def guard(prom: FakeProm) -> BackendGuard:
    return BackendGuard(prom, Query("power", "gpufleet_gpu_power_watts", "avg"), 60.0,  # type: ignore[arg-type]
                        NodeNaming())


def test_a_busy_node_whose_readings_stopped_is_frozen_an_idle_one_is_not() -> None:
    prom = FakeProm()
    g = guard(prom)
    busy = dict.fromkeys(NODES, 0.95)
    assert g(frame(busy), 0.0).held == {}
    assert prom.asked == ["changes(gpufleet_gpu_power_watts[60s])"]
    prom.changes["n2"] = 0.0
    assert g(frame(busy), 15.0).held == {"n2": "frozen_target"}
    assert g.last.reasons == {"frozen_target": "1 node(s) held: n2"}
    idle = {**busy, "n2": 0.0}  # an idle GPU's reading may sit still: not a frozen exporter
    assert g(frame(idle), 30.0).held == {}
    prom.changes = dict.fromkeys(NODES, 0.0)  # nobody moves (a fleet at rest): nobody is frozen
    assert g(frame(busy), 45.0).held == {}


def test_a_node_losing_its_samples_is_stale_many_at_once_is_a_gap() -> None:
    prom = FakeProm()
    g = guard(prom)
    busy = dict.fromkeys(NODES, 0.95)
    g(frame(busy), 0.0)
    assert g(frame(busy, valid=set(NODES) - {"n1"}), 15.0).held == {"n1": "stale_target"}
    with pytest.raises(Degraded) as e:
        g(frame(busy, valid={"n0", "n4"}), 30.0)
    assert set(e.value.reasons) == {"gap"}
    assert g(frame(busy), 45.0).held == {}
    # held for an hour at most: then its findings go stale as without a guard
    g(frame(busy, valid=set(NODES) - {"n1"}), 60.0)
    assert g(frame(busy, valid=set(NODES) - {"n1"}), 45.0 + 3601.0).held == {}


def test_failed_queries_and_partial_answers_hold_the_evaluation() -> None:
    prom = FakeProm()
    g = guard(prom)
    busy = dict.fromkeys(NODES, 0.95)
    with pytest.raises(Degraded) as e:
        g(frame(busy, errors=["max_over_time(x[2m]): HTTP 503: injected"]), 0.0)
    assert set(e.value.reasons) == {"query_error"} and "HTTP 503" in e.value.reasons["query_error"]
    prom.partial = ["q: warning: store unavailable"]
    with pytest.raises(Degraded) as e:
        g(frame(busy), 15.0)
    assert set(e.value.reasons) == {"partial_response"}
    assert g(frame(busy), 30.0).held == {}  # read once: the next evaluation is judged


def test_a_node_back_from_frozen_is_held_until_the_frozen_stretch_has_left_the_window() -> None:
    prom = FakeProm()
    g = BackendGuard(prom, Query("power", "gpufleet_gpu_power_watts", "avg"), 60.0,  # type: ignore[arg-type]
                     NodeNaming(), feature_window=120.0)
    busy = dict.fromkeys(NODES, 0.95)
    g(frame(busy), 0.0)
    prom.changes["n2"] = 0.0
    assert g(frame(busy), 15.0).held == {"n2": "frozen_target"}
    prom.changes["n2"] = 3.0  # it thaws: its counters jump, its window still holds the frozen readings
    assert g(frame(busy), 30.0).held == {"n2": "frozen_target"}
    assert g(frame(busy), 135.0).held == {"n2": "frozen_target"}
    assert g(frame(busy), 150.0).held == {}  # a window later: judged again
