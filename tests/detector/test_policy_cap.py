"""detector.rules.policy's array pass decides what the rule says, GPU by GPU, on any fleet.

The reference below reads the rule as its module states it, one (job, model) group at a time; the module
computes it in a few array passes (it is run again over every GPU after each change of the fleet).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.detector.core import numeric
from gpufleet.detector.frame.frames import GpuFrame
from gpufleet.detector.rules import policy


def _reference(models: list[str], jobs: list[str | None], lim: np.ndarray, ref: np.ndarray | None) -> list[bool]:
    n = len(models)
    out = [False] * n
    known = [bool(np.isfinite(lim[i]) and lim[i] > 0) for i in range(n)]
    usual: dict[str, float] = {}
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i in range(n):
        if known[i]:
            usual[models[i]] = max(usual.get(models[i], 0.0), float(lim[i]))
            if jobs[i]:
                groups[(jobs[i] or "", models[i])].append(i)
    for (_, model), ix in groups.items():
        v = lim[ix]
        set_to = float(np.median(v))
        alike = [abs(x - set_to) <= policy.SAME * set_to for x in v]
        if len(ix) < 2 or 2 * sum(alike) <= len(ix):
            continue
        r = ref[ix] if ref is not None else np.full(len(ix), np.nan)
        default = max(usual[model], float(np.nanmax(r)) if np.isfinite(r).any() else 0.0)
        if set_to < (1.0 - policy.SAME) * default:
            for i, a in zip(ix, alike, strict=True):
                out[i] = out[i] or a
    return out


LIMITS = st.sampled_from([np.nan, 0.0, 600.0, 700.0, 795.0, 800.0, 804.0, 1000.0, 1000.0, 1000.0])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["eco", "std", "big", "", None]), st.sampled_from(["B200", "H200"]),
                          LIMITS, st.sampled_from([np.nan, 800.0, 1000.0, 1100.0])), min_size=1, max_size=60),
       st.booleans())
def test_array_pass_equals_the_rule_group_by_group(gpus: list[tuple[str | None, str, float, float]],
                                                   with_ref: bool) -> None:
    n = len(gpus)
    jobs, models = [j for j, _, _, _ in gpus], [m for _, m, _, _ in gpus]
    lim = np.array([x for _, _, x, _ in gpus])
    ref = np.array([r for _, _, _, r in gpus]) if with_ref else None
    g = GpuFrame([f"n{i // 8}" for i in range(n)], [str(i % 8) for i in range(n)], [""] * n, jobs, models, {},
                 np.ones(n, dtype=bool), np.zeros(n, dtype=bool))
    g.values["power_limit"] = lim
    assert policy.capped_by_policy(g, ref).tolist() == _reference(models, jobs, lim, ref)


def test_codes_number_values_in_order_of_first_appearance() -> None:
    code, distinct = numeric.codes(["b", None, "a", "b", None, ""])
    assert code.tolist() == [0, 1, 2, 0, 1, 3]
    assert distinct == ["b", None, "a", ""]
