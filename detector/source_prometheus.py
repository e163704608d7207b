"""Features from the Prometheus HTTP API (and Thanos Query, Mimir, VictoriaMetrics).

Each feature is one instant query of a windowed function at the evaluation
time, e.g. ``avg_over_time(gpufleet_gpu_power_watts[300s])``, so Prometheus
returns one number per series. The HTTP session is swappable (tests pass a
mock); every failed query raises :class:`SourceError` and is counted.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import requests

from gpufleet.detector.profiles import Query
from gpufleet.detector.source import Result, SeriesTable, SourceError


class PrometheusSource:
    def __init__(self, url: str, *, timeout: float = 10.0, session: requests.Session | None = None,
                 headers: dict[str, str] | None = None, auth: tuple[str, str] | None = None,
                 verify: bool | str = True, max_series: int = 4_000_000) -> None:
        self.url = url.rstrip("/") + "/api/v1/query"
        self.timeout = timeout
        self.session = session or requests.Session()
        if headers:
            self.session.headers.update(headers)
        if auth:
            self.session.auth = auth
        self.session.verify = verify
        self.query_errors = 0
        #: Label sets interned across evaluations (ids stay stable, so entity resolution is cached); a new
        #: table is started when this many series have been seen (series churn over a long run).
        self.table = SeriesTable()
        self.max_series = max_series

    def query(self, query: Query, t: float, window: float) -> Result:
        return self.instant(query.promql(window), t, query.scale)

    def instant(self, expr: str, t: float, scale: float = 1.0) -> Result:
        try:
            r = self.session.post(self.url, data={"query": expr, "time": f"{t:.3f}"}, timeout=self.timeout)
        except requests.RequestException as e:
            self.query_errors += 1
            raise SourceError(f"{expr}: {type(e).__name__}: {e}") from e
        try:
            body: Any = r.json()
        except ValueError:
            body = None
        if r.status_code != 200 or not isinstance(body, dict) or body.get("status") != "success":
            self.query_errors += 1
            detail = body.get("error") if isinstance(body, dict) else r.text[:200]
            raise SourceError(f"{expr}: HTTP {r.status_code}: {detail}")
        data = body.get("data") or {}
        if data.get("resultType") != "vector":
            self.query_errors += 1
            raise SourceError(f"{expr}: expected a vector, got {data.get('resultType')!r}")
        items = data.get("result", [])
        if not isinstance(items, list):
            self.query_errors += 1
            raise SourceError(f"{expr}: malformed result {items!r:.200}")
        if len(self.table) > self.max_series:  # series churn: start over rather than grow without bound
            self.table = SeriesTable()
        table = self.table
        ids: list[int] = []
        values: list[float] = []
        known = table.ids
        for item in items:
            try:
                value = float(item["value"][1])
                metric = item["metric"]
                # The label pairs as the server sent them (Prometheus sorts them): a known series is one dict
                # lookup; a new one is checked and interned in the table's order.
                raw = tuple(metric.items())
                i = known.get(raw)
                if i is None:
                    i = known[raw] = table.intern({str(k): str(v) for k, v in raw if k != "__name__"})
            except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
                self.query_errors += 1
                raise SourceError(f"{expr}: malformed result {item!r:.200}") from e
            if not math.isnan(value):
                ids.append(i)
                values.append(value)
        vals = np.array(values, dtype=np.float64)
        if scale != 1.0:
            vals *= scale
        return Result(table, np.array(ids, dtype=np.int64), vals)
