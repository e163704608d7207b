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

import numpy as np

from gpufleet.detector.core import memo
from gpufleet.detector.core.numeric import codes_of, read_only, truthy
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
    out: BoolArray = memo.last("policy.capped", key, lambda: read_only(_capped(g, limit_ref)),
                               keep=lambda k: (k[0], k[1], list(k[2]), list(k[3]))).copy()
    return out


def _capped(g: GpuFrame, limit_ref: FloatArray | None) -> BoolArray:
    """Arrays over every GPU: the model's usual limit (highest in the frame), each (job, model) group's median
    limit, which of its GPUs are set to it, and the group's reference (the usual limit or its own history's)."""
    n = len(g)
    out = np.zeros(n, dtype=bool)
    lim = np.asarray(g.get("power_limit"), dtype=float)
    known = np.isfinite(lim) & (lim > 0)
    if not known.any():
        return out
    model, models = codes_of("models", g.models)
    usual = np.zeros(len(models))
    np.maximum.at(usual, model[known], lim[known])
    job, jobs = codes_of("jobs", g.jobs)
    sel = np.flatnonzero(known & truthy(job, jobs))
    if not len(sel):
        return out
    group = job[sel] * len(models) + model[sel]
    order = np.lexsort((lim[sel], group))  # by group, each group's limits ascending
    members, grp, v = sel[order], group[order], lim[sel][order]
    starts = np.flatnonzero(np.r_[True, grp[1:] != grp[:-1]])
    count = np.diff(np.r_[starts, len(grp)])
    mid = starts + count // 2
    set_to = np.where(count % 2 == 1, v[mid], (v[mid - 1] + v[mid]) / 2.0)  # np.median's, per group
    each = np.repeat(np.arange(len(starts)), count)
    alike = np.abs(v - set_to[each]) <= SAME * set_to[each]
    shared = 2 * np.add.reduceat(alike.astype(np.int64), starts) > count  # a setting most of the job shares
    ref = np.asarray(limit_ref, dtype=float)[members] if limit_ref is not None else np.full(len(members), np.nan)
    # the group's own highest limit in its history (0 where none of its GPUs' is known)
    known_ref = np.add.reduceat(np.isfinite(ref).astype(np.int64), starts) > 0
    own = np.where(known_ref, np.fmax.reduceat(ref, starts), 0.0)
    default = np.fmax(usual[model[members[starts]]], own)
    capped = (count >= 2) & shared & (set_to < (1.0 - SAME) * default)  # one GPU: nothing says it is the job's
    out[members[capped[each] & alike]] = True  # a GPU set below the rest of its job is not: that is a fault
    return out
