"""A settled detector process (``serve`` after its first evaluation, detector.engine.settle_heap) freezes what each
evaluation keeps, so the collector never walks the rebuilt tables after a fleet change. That leaks nothing only
because an evaluation leaves no cyclic garbage, on a fleet that changes and with findings opening and closing:
checked in a process of its own (the test runner, and objects of earlier tests freed meanwhile, leave cycles of
their own)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.detector import engine
from gpufleet.detector.config import parse
from gpufleet.detector.engine import Detector

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from bench_churn import ChangingFleet

HERE = Path(__file__).resolve().parent

#: Evaluations in a fresh process; after each, the detector's objects only the cycle collector would free.
SCRIPT = r"""
import gc, json, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from bench_churn import ChangingFleet
from test_detector_core import Fault, Synth, synth
from gpufleet.detector.config import parse
from gpufleet.detector.engine import Detector
from gpufleet.detector.sources.profiles import sample_names
from gpufleet.detector.sources.recording import RecordingSource

def ours(o):
    mod = getattr(o, "__module__", None) if callable(o) else type(o).__module__
    return str(mod or "").startswith("gpufleet.")

def garbage():
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    found = sorted({f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage if ours(o)})
    gc.garbage.clear()
    gc.set_debug(0)
    return found

out = {}
from pathlib import Path
path = synth(Path(sys.argv[3]) / "r.om", Synth(nodes=3, seconds=1500.0, faults=[Fault("clock", 1, 3, 300.0, end=900.0),
                                                                          Fault("pcie", 2, 6, 600.0)]))
cfg = parse({"detector": {"window_seconds": 120.0, "interval_seconds": 30.0},
             "findings": {"open_after": 2, "close_after": 2}})
det = Detector(cfg, RecordingSource.load([str(path)], sample_names("gpufleet")))
lo, hi = det.source.time_range()
det.evaluate(lo + 90.0)  # the first evaluation's one-off garbage (lazy imports)
garbage()
opened, t = set(), lo + 120.0
while t <= hi:
    det.evaluate(t)
    opened |= set(det.tracker.active)
    out[f"recording {t - lo:.0f}"] = garbage()
    t += 30.0
out["findings"] = [len(opened), len(det.tracker.closed)]
del det  # one detector per process, as in a service: the first one freed before the second evaluates
gc.collect()
fleet = ChangingFleet(400)
det = Detector(parse({"findings": {"open_after": 1}}), fleet.src)
det.evaluate(1_700_000_000.0)
garbage()
nodes = sorted({str(x) for x in fleet.inst[next(iter(fleet.inst))].tolist()})
for i, (name, change) in enumerate((("replaced", lambda: fleet.replace(nodes[3], "renamed:9445")),
                                    ("drained", lambda: fleet.drain(nodes[5])),
                                    ("job restarted", lambda: fleet.restart_job("job-1", "job-1-restart")),
                                    ("back", lambda: fleet.back(nodes[5])))):
    change()
    det.evaluate(1_700_000_060.0 + 60.0 * i)
    out[name] = garbage()
print(json.dumps(out))
"""


def test_evaluations_leave_no_cyclic_garbage(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(HERE.parent / "bench"), str(HERE), str(tmp_path)],
                         capture_output=True, text=True, timeout=300, check=True)
    out = json.loads(run.stdout.splitlines()[-1])
    opened, closed = out.pop("findings")
    assert opened >= 2 and closed >= 1  # the tracker, incidents and evidence paths ran
    assert {"replaced", "drained", "job restarted", "back"} <= set(out)
    assert {k: v for k, v in out.items() if v} == {}


@pytest.fixture
def fresh_heap(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process's collector mode as a test found it, restored after (no frozen objects left behind)."""
    monkeypatch.setattr(engine, "_HEAP", engine._Heap())
    yield
    gc.unfreeze()


def test_a_settled_process_freezes_what_each_evaluation_keeps(fresh_heap: None) -> None:
    fleet = ChangingFleet(400)
    det = Detector(parse({"findings": {"open_after": 1}}), fleet.src)
    det.evaluate(1_700_000_000.0)
    gc.unfreeze()
    det.evaluate(1_700_000_060.0)
    assert gc.get_freeze_count() == 0  # not settled: the collector as usual
    engine.settle_heap()
    frozen = gc.get_freeze_count()
    assert frozen > 0 and not engine.resettle_due()
    fleet.replace(sorted({str(x) for x in fleet.inst[next(iter(fleet.inst))].tolist()})[3], "renamed:9445")
    det.evaluate(1_700_000_120.0)
    assert gc.get_freeze_count() > frozen  # the rebuilt tables joined the permanent generation
    assert gc.get_count()[0] < 50  # and nothing young is left for a collection to walk
    # (a second either side: at + RESETTLE_SECONDS - at rounds below RESETTLE_SECONDS for about one clock value in six)
    assert not engine.resettle_due(engine._HEAP.at + engine.RESETTLE_SECONDS - 1.0)
    assert engine.resettle_due(engine._HEAP.at + engine.RESETTLE_SECONDS + 1.0)
