"""Each GPU's job over the window (``job_labels.Jobs.resolve``): the fast path for GPUs with one job (one series or
several alike) gives what the per-(GPU, job) totals and a sort give for every GPU."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.detector.frame.job_labels import Jobs


def oracle(names: list[str], n: int, p: np.ndarray, c: np.ndarray, v: np.ndarray, samples: np.ndarray,
           coverage: float, idle_is_churn: bool) -> tuple[list[str | None], np.ndarray]:
    """Every GPU through the totals of its distinct (GPU, job) pairs; the most samples wins, the lower job code on
    a tie; churn where a GPU had several named jobs, too few samples of its job or (dcgm) idle spells."""
    churn = np.zeros(n, dtype=bool)
    totals: dict[tuple[int, int], float] = {}
    for g, j, x in zip(p.tolist(), c.tolist(), v.tolist(), strict=True):
        totals[(g, j)] = totals.get((g, j), 0.0) + x
    out: list[str | None] = [None] * n
    for g in range(n):
        mine = sorted((j, x) for (gg, j), x in totals.items() if gg == g)
        named = [(j, x) for j, x in mine if j != 0]
        if named:
            best_j, best_x = named[0]
            for j, x in named[1:]:
                if x > best_x:
                    best_j, best_x = j, x
            out[g] = names[best_j]
            churn[g] = len(named) > 1 or bool(best_x < coverage * samples[g])
            if idle_is_churn and len(named) == 1 and len(mine) > 1:
                churn[g] = True
    return out, churn


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 12), st.lists(st.tuples(st.integers(0, 11), st.integers(0, 3), st.sampled_from(
    [0.0, 1.0, 2.0, 5.0, 10.0, 20.0])), max_size=40), st.booleans(), st.integers(1, 3))
def test_resolve_matches_the_totals_of_every_pair(n: int, rows: list[tuple[int, int, float]], idle: bool,
                                                  parts: int) -> None:
    rows = [(g % n, j, x) for g, j, x in rows]
    jobs = Jobs(("job_id",))
    for name in ("job-a", "job-b", "job-c"):
        jobs._code.setdefault(name, len(jobs._code))
    names = ["", "job-a", "job-b", "job-c"]
    p = np.array([r[0] for r in rows], dtype=np.int64)
    c = np.array([r[1] for r in rows], dtype=np.int64)
    v = np.array([r[2] for r in rows], dtype=float)
    samples = np.full(n, 20.0)
    cut = np.array_split(np.arange(len(rows)), parts)  # (the rows arrive as several queries' arrays)
    got, churn = jobs.resolve(n, [p[k] for k in cut], [c[k] for k in cut], [v[k] for k in cut], samples, 0.8, idle)
    want, want_churn = oracle(names, n, p, c, v, samples, 0.8, idle)
    assert got == want
    assert churn.tolist() == want_churn.tolist()
