"""detector.core.numeric gives numpy's values to the last bit (signed zeros, ties, NaN, infinities)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.detector.core import numeric


def _cases(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for n in range(1, 60):
        for _ in range(6):
            v = rng.normal(size=n) * 10.0 ** rng.integers(-320, 300)
            kind = rng.integers(0, 6)
            if kind == 0:
                v = np.round(v) * rng.choice([-1.0, 1.0], size=n)  # ties, signed zeros
            elif kind == 1:
                v = rng.choice([0.0, -0.0, 5e-324, -5e-324, 1.0], size=n)  # zeros and the smallest subnormals
            elif kind == 2:
                v[rng.random(n) < 0.3] = np.inf * rng.choice([-1.0, 1.0])
            elif kind == 3:
                v[rng.integers(0, n)] = np.nan
            elif kind == 4:
                v = rng.choice([np.finfo(np.float64).max, -np.finfo(np.float64).max, 1.0], size=n)  # overflowing pairs
            out.append(v)
    return out


def _same(a: float, b: float) -> bool:
    return (np.isnan(a) and np.isnan(b)) or (a == b and np.signbit(a) == np.signbit(b))


@pytest.mark.parametrize("seed", range(3))
def test_median_is_numpys(seed: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy warns on overflowing pairs
        for v in _cases(seed):
            assert _same(numeric.median(v), float(np.median(v))), v


@pytest.mark.parametrize("seed", range(2))
def test_nan_to_zero_is_numpys(seed: int) -> None:
    for v in _cases(seed):
        got, expected = numeric.nan_to_zero(v), np.nan_to_num(v, nan=0.0)
        assert got.tobytes() == expected.tobytes() and got is not v
    ints = np.arange(5)
    assert numeric.nan_to_zero(ints).tolist() == ints.tolist()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), max_size=40))
def test_uniform_groups_are_the_groups_of_one_value(rows: list[tuple[int, int]]) -> None:
    a = np.array([r[0] for r in rows], dtype=np.int64)
    b = np.array([r[1] for r in rows], dtype=np.int64)
    values: dict[int, set[int]] = {}
    for g, v in rows:
        values.setdefault(g, set()).add(v)
    one, mixed = numeric.uniform_groups(a, b, 6)
    assert one.tolist() == [next(iter(values[g])) if len(values.get(g, ())) == 1 else -1 for g in range(6)]
    assert mixed.tolist() == [len(values[g]) > 1 for g, _ in rows]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["n0", "n1", "n2", "n10", "", None]), st.integers(1, 40)), max_size=12),
       st.booleans())
def test_codes_number_values_by_first_appearance(runs: list[tuple[str | None, int]], short: bool) -> None:
    values = [v for v, k in runs for _ in range(k)]  # in runs (a frame's lists), some values in several runs
    if short:
        values = values[: numeric.RUNS_FROM]
    index: dict[str | None, int] = {}
    want = [index.setdefault(v, len(index)) for v in values]
    code, distinct = numeric.codes(values)
    assert code.dtype == np.int64 and code.tolist() == want and distinct == list(index)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["n0", "n1", "n2", "n10"]), st.integers(1, 12)), max_size=12))
def test_codes_by_ints_are_the_codes_of_the_values(runs: list[tuple[str, int]]) -> None:
    values = [v for v, k in runs for _ in range(k)]  # in runs, some values in several runs
    number = {"n0": 7, "n1": 3, "n2": 0, "n10": 12}  # any integers, equal exactly where the values are
    ints = np.array([number[v] for v in values], dtype=np.int64)
    code, distinct = numeric.codes_by_ints(values, ints)
    want_code, want_distinct = numeric.codes(values, runs=False)
    assert code.dtype == np.int64 and code.tolist() == want_code.tolist() and distinct == want_distinct
