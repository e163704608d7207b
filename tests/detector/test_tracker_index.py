"""The tracker's per-node and per-incident indexes of open findings give what a pass over every open finding gives."""

from __future__ import annotations

from collections import Counter

import numpy as np

from gpufleet.detector.core import kinds
from gpufleet.detector.core.candidate import Candidate
from gpufleet.detector.incidents.tracker import Finding, Key, Tracker


class _Scanning(Tracker):
    """The tracker with its lookups done as passes over every open finding (the definition)."""

    def _related_incident(self, f: Finding) -> str:
        if not kinds.spec(f.kind).on_nodes or not f.node or f.group:
            return ""
        for of in self.active.values():
            if not of.group and of.node == f.node and kinds.spec(of.kind).on_nodes and (
                    of.gpu == f.gpu or of.gpu is None or f.gpu is None):
                return of.incident
        return ""

    def _close(self, k: Key, end: float) -> None:
        meta = dict(self.incident_meta)
        super()._close(k, end)
        f = self.closed[-1]
        if any(a.incident == f.incident for a in self.active.values()):
            self.incident_meta[f.incident] = meta[f.incident]
        else:
            self.incident_meta.pop(f.incident, None)


def _state(tr: Tracker) -> tuple[object, ...]:
    return ([f.to_json() for f in tr.all_findings()], [(k, f.incident, f.absorbed_by) for k, f in tr.active.items()],
            sorted(tr.incident_meta.items()))


def test_indexed_lookups_equal_passes_over_every_open_finding() -> None:
    rng = np.random.default_rng(3)
    ours = Tracker(open_after=1, close_after=1, merge_seconds=0, reopen_seconds=600)
    ref = _Scanning(open_after=1, close_after=1, merge_seconds=0, reopen_seconds=600)
    opened_at_once = 0
    for step in range(300):
        t = 60.0 * step
        cands = []
        for _ in range(int(rng.integers(0, 12))):
            node = f"node-{rng.integers(0, 6)}"
            kind = str(rng.choice(["straggler", "throttling", "network"]))
            gpu = None if rng.random() < 0.2 else str(rng.integers(0, 4))
            nic = f"mlx5_{gpu}/1" if kind == "network" and gpu is not None else ""
            cands.append((kind, Candidate(node, gpu, f"job-{rng.integers(0, 3)}", "dc1",
                                          str(rng.choice(["clock", "thermal", "network"])),
                                          float(rng.uniform(5, 10)), nic=nic)))
        before = len(ours.active)
        seen = rng.random() < 0.8
        def observed(k: Key, s: bool = seen) -> bool:
            return s

        for tr in (ours, ref):
            tr.update(t, cands, observed)
        opened_at_once = max(opened_at_once, len(ours.active) - before)
        assert _state(ours) == _state(ref), step
        by_node: dict[str, list[Key]] = {}
        for k, f in ours.active.items():
            if f.node:
                by_node.setdefault(f.node, []).append(k)
        assert {n: list(ks) for n, ks in ours._open_on_node.items()} == by_node, step
        assert ours._open_in_incident == dict(Counter(f.incident for f in ours.active.values())), step
    assert opened_at_once >= 4 and len(ours.closed) > 50  # findings opened, absorbed and closed in numbers
    assert any(f.absorbed_by for f in ours.closed) and any(f.recurrences for f in ours.all_findings())
