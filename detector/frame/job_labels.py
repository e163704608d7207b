"""Each GPU's job over the window, from the job-info series' sample counts (and job churn)."""

from __future__ import annotations

import numpy as np

from gpufleet.detector.core.numeric import uniform_groups
from gpufleet.detector.sources.source import SeriesTable
from gpufleet.vocab import exporters

IntArray = np.ndarray
FloatArray = np.ndarray
BoolArray = np.ndarray

def pod_key(lb: dict[str, str]) -> tuple[str, str] | None:
    """(namespace, pod) of a job/pod-info series. ``exported_pod`` (a ServiceMonitor with honor_labels false)
    is the workload's pod; ``pod`` is then the exporter's own."""
    pod = lb.get(exporters.EXPORTED_POD_LABEL)
    if pod:
        return lb.get(exporters.EXPORTED_NAMESPACE_LABEL, ""), pod
    pod = lb.get(exporters.DCGM_POD_LABEL)
    return (lb.get("namespace", ""), pod) if pod else None


class Jobs:
    """Each GPU's training job over the window from the job-info sample counts (and job churn)."""

    def __init__(self, labels: tuple[str, ...]) -> None:
        self.labels = labels
        self.names: list[str] = [""]
        self._code = {"": 0}

    def codes(self, table: SeriesTable, ids: IntArray) -> IntArray:
        """Job code of the series ``ids`` of ``table`` (0: no job label)."""
        key = ("jobs", self.labels)
        local = table.derived.get(key)
        if not isinstance(local, JobCodes):
            local = table.derived[key] = JobCodes(self.labels)
        codes = local.get(table)[ids]  # (these series only: a table holds every query's series)
        trans = np.array([self._code.setdefault(j, len(self._code)) for j in local.names], dtype=np.int64)
        out: IntArray = trans[codes]
        return out


    def resolve(self, n: int, pos: list[IntArray], code: list[IntArray], count: list[FloatArray],
                samples: FloatArray, coverage: float, idle_is_churn: bool) -> tuple[list[str | None], BoolArray]:
        churn = np.zeros(n, dtype=bool)
        if not pos or n == 0:
            return [None] * n, churn
        self.names = [""] * len(self._code)
        for name, k in self._code.items():
            self.names[k] = name
        p, c, v = np.concatenate(pos), np.concatenate(code), np.concatenate(count)
        # Most GPUs have one job over the window, however many series say it: that job and the sum of their
        # counts are the GPU's (counted, not sorted); only the GPUs with several jobs (jobs that changed, pods
        # that restarted) need the per-(GPU, job) totals and a sort.
        ref, several_jobs = uniform_groups(p, c, n)
        one = ~several_jobs
        alone = np.flatnonzero(np.bincount(p[one], minlength=n))
        summed = np.bincount(p[one], weights=v[one], minlength=n)[alone]
        gpu, job, total = self._totals(p[several_jobs], c[several_jobs], v[several_jobs])
        gpu, job, total = (np.concatenate((alone, gpu)), np.concatenate((ref[alone], job)),
                           np.concatenate((summed, total)))
        named = job != 0
        n_named = np.bincount(gpu[named], minlength=n)
        # The job with the most samples per GPU: sort by GPU, then count descending (stable: the first job wins ties).
        several = named & (n_named[gpu] > 1)
        order = np.lexsort((-total[several], gpu[several]))
        g_sorted = gpu[several][order]
        head = np.ones(len(g_sorted), dtype=bool)
        head[1:] = g_sorted[1:] != g_sorted[:-1]
        first = np.flatnonzero(several)[order][head]
        pick = np.concatenate((np.flatnonzero(named & ~several), first))  # each named GPU's row of its job
        best = np.zeros(n, dtype=np.int64)
        best_count = np.zeros(n)
        best[gpu[pick]] = job[pick]
        best_count[gpu[pick]] = total[pick]
        has = n_named > 0
        with np.errstate(invalid="ignore"):
            churn |= (n_named > 1) | (has & (best_count < coverage * samples))
        if idle_is_churn:  # dcgm: the GPU was idle (no job label) for part of the window
            idle = np.zeros(n, dtype=bool)
            idle[gpu[~named]] = True
            churn |= (n_named == 1) & idle
        names = np.array([None, *self.names[1:]], dtype=object)
        out: list[str | None] = names[np.where(has, best, 0)].tolist()
        return out, churn

    def _totals(self, p: IntArray, c: IntArray, v: FloatArray) -> tuple[IntArray, IntArray, FloatArray]:
        """Each distinct (GPU, job) of the rows ``p``, ``c`` and the sum of its counts ``v``."""
        width = len(self.names)
        pair, inv = np.unique(p * width + c, return_inverse=True)
        total: FloatArray = np.bincount(inv, weights=v, minlength=len(pair))
        return pair // width, pair % width, total


class JobCodes:
    """Per table: each series id's job, as a code into ``names`` (code 0: no job label), extended as it grows."""

    def __init__(self, labels: tuple[str, ...]) -> None:
        self.labels = labels
        self.names: list[str] = [""]
        self._index = {"": 0}
        self.array = np.zeros(0, dtype=np.int64)  # per series id of the table: its job's code

    def get(self, table: SeriesTable) -> IntArray:
        have = len(self.array)
        if have < len(table):
            added: list[int] = []
            for lb in table.labels[have:]:
                job = next((lb[j] for j in self.labels if lb.get(j)), "")
                exported = lb.get(exporters.EXPORTED_POD_LABEL)
                if exported and job == lb.get(exporters.DCGM_POD_LABEL):
                    job = exported  # honor_labels false: "pod" is the exporter's, exported_pod the workload's
                code = self._index.get(job)
                if code is None:
                    code = self._index[job] = len(self.names)
                    self.names.append(job)
                added.append(code)
            # only the series added since converted (the table grows by a node's series after a fleet change)
            self.array = np.concatenate((self.array, np.array(added, dtype=np.int64)))
        return self.array
