"""Policy is context, not a fault: a power limit the site set alike on a whole job.

A site caps a partition's jobs (an "eco" partition's prolog sets 800 W on every GPU of the job where the
model's default is 1000 W), or an admin lowers one GPU's limit by mistake. The first is the job's operating
point: its GPUs are each other's peers, capped alike, and the ones that touch the cap (the leakier parts) are no
throttled stragglers. The second is a fault with a direct cause. Only the configuration the exporters show
decides (each GPU's enforced power limit), never a job's name or a wattage:

- a GPU is **capped by policy** when its enforced limit is the one most of its job's GPUs of its model are set
  to (within 1 %), and that is below what the model is configured for elsewhere (the highest limit of the
  model's GPUs in this frame, or the job's GPUs' own highest in their recent history);
- a GPU set below its job's others keeps its fault (``power_limit`` is a deviation against its peers, and the
  throttle rules read its reasons as usual).

Without a power limit in the profile nothing is policy here; a job whose every GPU caps alike still has no
reference to be held below (:mod:`gpufleet.detector.rules.throttling`).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from gpufleet.detector.core import memo
from gpufleet.detector.frame.frames import GpuFrame

BoolArray = np.ndarray
FloatArray = np.ndarray

#: Limits within this fraction of each other are the same setting.
SAME = 0.01


def capped_by_policy(g: GpuFrame, limit_ref: FloatArray | None = None) -> BoolArray:
    """Per GPU: its enforced power limit is a cap set alike on its whole job, below its model's usual limit (kept
    while the limits, references, models and jobs are the same as last time: at 500k GPUs its passes over every
    GPU cost a quarter of a second)."""
    lim = g.get("power_limit")
    ref = np.asarray(limit_ref, dtype=float) if limit_ref is not None else None
    key = (lim.tobytes(), ref.tobytes() if ref is not None else None, g.models, g.jobs)
    out: BoolArray = memo.last("policy.capped", key, lambda: _frozen(_capped(g, limit_ref)),
                               keep=lambda k: (k[0], k[1], list(k[2]), list(k[3]))).copy()
    return out


def _frozen(a: BoolArray) -> BoolArray:
    a.flags.writeable = False
    return a


def _capped(g: GpuFrame, limit_ref: FloatArray | None) -> BoolArray:
    n = len(g)
    out = np.zeros(n, dtype=bool)
    lim = g.get("power_limit")
    known = np.isfinite(lim) & (lim > 0)
    if not known.any():
        return out
    usual: dict[str, float] = {}
    for i in np.flatnonzero(known).tolist():
        m = g.models[i]
        usual[m] = max(usual.get(m, 0.0), float(lim[i]))
    by_job: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i in np.flatnonzero(known).tolist():
        if g.jobs[i]:
            by_job[(g.jobs[i] or "", g.models[i])].append(i)
    ref = np.asarray(limit_ref, dtype=float) if limit_ref is not None else np.full(n, np.nan)
    for (_, model), ix in by_job.items():
        if len(ix) < 2:
            continue  # one GPU: nothing says its limit is the job's
        members = np.asarray(ix)
        v = lim[members]
        set_to = float(np.median(v))
        alike = np.abs(v - set_to) <= SAME * set_to
        if 2 * int(alike.sum()) <= len(ix):
            continue  # no setting most of the job shares
        default = max(usual[model], float(np.nanmax(ref[members])) if np.isfinite(ref[members]).any() else 0.0)
        if set_to < (1.0 - SAME) * default:
            out[members[alike]] = True  # a GPU set below the rest of its job is not: that is a fault
    return out
