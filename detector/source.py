"""The metrics-source contract both sources (Prometheus, recordings) implement."""

from __future__ import annotations

from typing import Protocol

from gpufleet.detector.profiles import Query

#: One (labels, value) per series; labels exclude ``__name__`` as PromQL range functions drop it.
Result = list[tuple[dict[str, str], float]]


class SourceError(RuntimeError):
    """A query to the metrics source failed (network, HTTP status, bad answer)."""


class Source(Protocol):
    query_errors: int

    def query(self, query: Query, t: float, window: float) -> Result:
        """Evaluate ``query`` at time ``t`` over ``window`` seconds; raise SourceError on failure."""
        ...
