"""A frame's entities after a few came or went (edited from the last order) are in the order of a full sort."""

from __future__ import annotations

import random

import numpy as np

from gpufleet.detector.frame.entities import EntityFrame
from gpufleet.detector.frame.frames import NodeNaming
from gpufleet.detector.sources.source import Result, SeriesTable

NAMING = NodeNaming()


def _frame(table: SeriesTable, members: list[tuple[str, str]]) -> EntityFrame:
    ids = np.array([table.intern({"instance": f"{n}:9400", "gpu": g}) for n, g in members], dtype=np.int64)
    return EntityFrame(NAMING, ("gpu",), None, [Result(table, ids, np.ones(len(ids)))])


def test_frames_after_entities_come_and_go_are_sorted_as_from_scratch() -> None:
    rng = random.Random(7)
    pool = [(f"node-{rng.randrange(10_000)}", str(rng.randrange(10))) for _ in range(400)]
    table = SeriesTable()
    current = pool[:200]
    edited = 0
    for step in range(60):
        if step % 10 == 9:  # now and then many at once (a full sort)
            current = rng.sample(pool, rng.randrange(1, len(pool)))
        elif step % 3 == 2 and current:  # a whole node drained, another one (back or new) with its GPUs
            node = rng.choice(current)[0]
            back = f"node-{rng.randrange(10_000)}"
            current = [m for m in current if m[0] != node] + [(back, str(g)) for g in range(4)]
            rng.shuffle(current)
        else:  # usually a few: a node drained, replaced or added; the series in any order
            gone = set(rng.sample(current, min(len(current), rng.randrange(0, 4))))
            current = [m for m in current if m not in gone] + rng.sample(pool, rng.randrange(0, 4))
            rng.shuffle(current)
        frame = _frame(table, current)
        expect = sorted({(n, g) for n, g in current})
        assert frame.keys == expect
        # the columns (edited from the last frame's when its keys were): those of the keys
        assert frame.columns(2) == [[n for n, _ in expect], [g for _, g in expect]]
        edited += frame.space is not None and frame.space.edit is not None and frame.space.edit.now is frame.keys
        res = Result(table, np.array([table.intern({"instance": f"{n}:9400", "gpu": g}) for n, g in current],
                                     dtype=np.int64), np.zeros(len(current)))
        assert [frame.keys[p] for p in frame.positions(res).tolist()] == current
    assert edited >= 30  # (most frames were edits)


def test_a_changed_frame_is_a_new_list() -> None:
    table = SeriesTable()
    a = _frame(table, [("n1", "0"), ("n2", "0")])
    same = _frame(table, [("n2", "0"), ("n1", "0")])
    assert same.keys is a.keys  # unchanged: the caches keyed on the list stay valid
    b = _frame(table, [("n1", "0"), ("n3", "0")])
    assert b.keys is not a.keys and b.keys == [("n1", "0"), ("n3", "0")] and a.keys == [("n1", "0"), ("n2", "0")]
