"""Findings with hysteresis: open after N consecutive evaluations, close after M clear ones.

An evaluation in which the finding's entity had no fresh data neither counts
towards opening nor towards closing (missing or stale data never opens a
finding); an open finding whose entity stays unobserved for ``stale_after``
evaluations closes at the last time it was seen.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from gpufleet.detector.straggler import Candidate

Key = tuple[str, str, str, str, str, str]  # kind, node, gpu, nic, site, job


@dataclass
class Finding:
    kind: str
    cause: str | None
    node: str | None
    gpu: str | None
    job: str | None
    site: str | None
    start: float
    end: float | None = None
    score: float = 0.0
    summary: str = ""
    nic: str = ""
    evidence: dict[str, float] = field(default_factory=dict)
    causes: Counter[str] = field(default_factory=Counter)
    last_seen: float = 0.0
    opened: float = 0.0  # evaluation time at which it opened (start + the hysteresis)
    namespace: str = ""  # Kubernetes: the pod the finding is about, and its namespace ("" when none)
    pod: str = ""
    gpu_instance: str = ""  # MIG: the slice (GPU instance of ``gpu``) and its profile ("" when not a slice)
    mig_profile: str = ""

    def to_json(self) -> dict[str, Any]:
        """The stable replay record (see :mod:`gpufleet.detector.cli`)."""
        return {"kind": self.kind, "cause": self.cause, "node": self.node, "gpu": self.gpu, "job": self.job,
                "site": self.site, "start": self.start, "end": self.end, "score": round(self.score, 3),
                "summary": self.summary, "namespace": self.namespace or None, "pod": self.pod or None,
                **({"gpu_instance": self.gpu_instance, "mig_profile": self.mig_profile} if self.gpu_instance else {})}


def key_of(kind: str, c: Candidate) -> Key:
    return (kind, c.node, (c.gpu or "") + (f"/{c.gpu_instance}" if c.gpu_instance else ""), c.nic, c.site if kind == "pue_drift" else "", c.job or "")


@dataclass
class _Pending:
    first: float
    count: int
    cand: Candidate
    causes: Counter[str]


class Tracker:
    def __init__(self, open_after: int = 3, close_after: int = 3, stale_after: int = 10,
                 summarize: Callable[[str, Candidate], str] | None = None) -> None:
        self.open_after = max(1, open_after)
        self.close_after = max(1, close_after)
        self.stale_after = max(1, stale_after)
        self.summarize = summarize or (lambda kind, c: f"{kind} ({c.cause}) score {c.score:.1f}")
        self.pending: dict[Key, _Pending] = {}
        self.active: dict[Key, Finding] = {}
        self.clear: dict[Key, int] = {}
        self.clear_since: dict[Key, float] = {}
        self.unseen: dict[Key, int] = {}
        self.closed: list[Finding] = []

    def update(self, t: float, candidates: Iterable[tuple[str, Candidate]],
               observed: Callable[[Key], bool]) -> None:
        seen: set[Key] = set()
        for kind, c in candidates:
            k = key_of(kind, c)
            if k in seen:
                continue
            seen.add(k)
            if k in self.active:
                f = self.active[k]
                f.score = max(f.score, c.score)
                f.causes[c.cause] += 1
                f.cause = f.causes.most_common(1)[0][0] or None
                f.last_seen = t
                f.evidence = c.evidence
                self.clear.pop(k, None)
                self.clear_since.pop(k, None)
                self.unseen.pop(k, None)
                continue
            p = self.pending.get(k)
            if p is None:
                p = self.pending[k] = _Pending(t, 0, c, Counter())
            p.count += 1
            p.causes[c.cause] += 1
            p.cand = c if c.score >= p.cand.score else p.cand
            if p.count >= self.open_after:
                del self.pending[k]
                cause = p.causes.most_common(1)[0][0]
                best = p.cand
                start = min(p.first, best.evidence.get("onset", p.first))
                self.active[k] = Finding(kind, cause or None, c.node or None, c.gpu, c.job, c.site or None, start,
                                         None, best.score, self.summarize(kind, best), c.nic, best.evidence,
                                         p.causes, t, t, best.namespace, best.pod, best.gpu_instance,
                                         best.mig_profile)
        for k in [k for k in self.pending if k not in seen]:
            if observed(k):
                del self.pending[k]  # a clear, observed evaluation resets the run
        for k in [k for k in self.active if k not in seen]:
            f = self.active[k]
            if observed(k):
                self.unseen.pop(k, None)
                n = self.clear[k] = self.clear.get(k, 0) + 1
                self.clear_since.setdefault(k, t)
                if n >= self.close_after:
                    self._close(k, self.clear_since[k])
            else:
                n = self.unseen[k] = self.unseen.get(k, 0) + 1
                if n >= self.stale_after:
                    self._close(k, f.last_seen)

    def _close(self, k: Key, end: float) -> None:
        f = self.active.pop(k)
        f.end = end
        self.clear.pop(k, None)
        self.clear_since.pop(k, None)
        self.unseen.pop(k, None)
        self.closed.append(f)

    def all_findings(self) -> list[Finding]:
        return sorted([*self.closed, *self.active.values()], key=lambda f: (f.start, f.kind, f.node or "", f.gpu or ""))
