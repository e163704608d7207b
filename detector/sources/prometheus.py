"""Features from the Prometheus HTTP API (and Thanos Query, Mimir, VictoriaMetrics).

Each feature is one instant query of a windowed function at the evaluation
time, e.g. ``avg_over_time(gpufleet_gpu_power_watts[300s])``, so Prometheus
returns one number per series. The HTTP session is swappable (tests pass a
mock); every failed query raises :class:`SourceError` and is counted.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import requests

from gpufleet.detector.sources.profiles import Query
from gpufleet.detector.sources.source import Result, SeriesTable, SourceError


def api_data(session: requests.Session, url: str, form: Mapping[str, str] | list[tuple[str, str]], timeout: float,
             what: str, method: str = "POST", notes: list[str] | None = None) -> object:
    """The ``data`` of one Prometheus HTTP API answer; SourceError naming ``what`` when the request fails or the
    answer is not JSON with status success (the HTTP status and the backend's error in the message). A partial
    answer (Prometheus' and Thanos' ``warnings``, VictoriaMetrics' ``isPartial``) is appended to ``notes``, one
    line each, when given."""
    try:
        if method == "GET":
            r = session.get(url, params=form, timeout=timeout)
        else:
            r = session.post(url, data=form, timeout=timeout)
    except requests.RequestException as e:
        raise SourceError(f"{what}: {type(e).__name__}: {e}") from e
    try:
        body: Any = r.json()
    except ValueError:
        body = None
    if r.status_code != 200 or not isinstance(body, dict) or body.get("status") != "success":
        detail = body.get("error") if isinstance(body, dict) else r.text[:200]
        raise SourceError(f"{what}: HTTP {r.status_code}: {detail}")
    if notes is not None:
        notes.extend(partial_notes(body, what))
    data: object = body.get("data")
    return data


def partial_notes(body: Mapping[str, Any], what: str) -> list[str]:
    """One line per sign that an API answer is partial: each of its ``warnings`` (Prometheus, Thanos Query,
    Mimir), ``isPartial`` true (VictoriaMetrics cluster, also in ``data``)."""
    out: list[str] = []
    warnings = body.get("warnings")
    if isinstance(warnings, list):
        out += [f"{what:.120}: warning: {w!s:.200}" for w in warnings]
    data = body.get("data")
    if body.get("isPartial") is True or (isinstance(data, dict) and data.get("isPartial") is True):
        out.append(f"{what:.120}: the backend marked the answer partial (isPartial)")
    return out


def settled_session(url: str) -> requests.Session:
    """A session that reads the environment's proxy (``HTTPS_PROXY``, ``NO_PROXY``, ...), CA bundle
    (``REQUESTS_CA_BUNDLE``, ``CURL_CA_BUNDLE``) and ``~/.netrc`` for ``url`` once, as requests would on every
    request (its ``trust_env``: a netrc lookup and a proxy-bypass check per query, about a seventh of a small
    fleet's evaluation against a local Prometheus)."""
    session = requests.Session()
    session.proxies.update(requests.utils.get_environ_proxies(url))
    netrc = requests.utils.get_netrc_auth(url)
    if netrc:
        session.auth = netrc
    bundle = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
    if bundle:
        session.verify = bundle
    session.trust_env = False
    return session


class PrometheusSource:
    def __init__(self, url: str, *, timeout: float = 10.0, session: requests.Session | None = None,
                 headers: dict[str, str] | None = None, auth: tuple[str, str] | None = None,
                 verify: bool | str = True, max_series: int = 4_000_000, parallel: int = 1) -> None:
        """``parallel``: queries in flight at once in :meth:`query_all` (each evaluation's forty-odd queries)."""
        self.url = url.rstrip("/") + "/api/v1/query"
        self.timeout = timeout
        self.session = session or settled_session(url)
        if headers:
            self.session.headers.update(headers)
        if auth:
            self.session.auth = auth
        if verify is not True or session is not None:
            self.session.verify = verify  # a CA file given beats the environment's bundle
        self.query_errors = 0
        #: Label sets interned across evaluations (ids stay stable, so entity resolution is cached); a new
        #: table is started when this many series have been seen (series churn over a long run).
        self.table = SeriesTable()
        self.max_series = max_series
        self.parallel = max(1, parallel)
        self._lock = threading.Lock()
        #: Partial answers since :meth:`take_partial` last ran (see :func:`partial_notes`).
        self._partial: list[str] = []

    def query(self, query: Query, t: float, window: float) -> Result:
        return self.instant(query.promql(window), t, query.scale)

    def query_all(self, queries: Sequence[Query], t: float, window: float,
                  done: Callable[[], None] | None = None) -> list[Result | SourceError]:
        """Every query at ``t``, up to ``parallel`` in flight (HTTP and JSON decoding in worker threads; the
        answers are interned here, in order). A failed query's entry is its SourceError; ``done`` is called
        as each query finishes."""
        exprs = [q.promql(window) for q in queries]

        def fetch(expr: str) -> list[Any] | SourceError:
            try:
                return self._fetch(expr, t)
            except SourceError as e:
                return e
            finally:
                if done is not None:
                    done()

        if self.parallel > 1 and len(exprs) > 1:
            with ThreadPoolExecutor(self.parallel, thread_name_prefix="prometheus-query") as pool:
                items = list(pool.map(fetch, exprs))
        else:
            items = [fetch(e) for e in exprs]
        out: list[Result | SourceError] = []
        for expr, q, got in zip(exprs, queries, items, strict=True):
            if isinstance(got, SourceError):
                out.append(got)
                continue
            try:
                out.append(self._build(expr, got, q.scale))
            except SourceError as e:
                out.append(e)
        return out

    def metric_names(self, start: float, end: float) -> set[str] | None:
        """The metric names the backend holds series of between ``start`` and ``end``; see :meth:`label_values`."""
        return self.label_values("__name__", (), start, end)

    def label_values(self, label: str, match: Sequence[str], start: float, end: float) -> set[str] | None:
        """The values of ``label`` over the series of the ``match`` selectors (all series when empty) between
        ``start`` and ``end``: the label values API, an index lookup that reads no samples (a superset where the
        backend answers at block granularity). None when the backend does not answer: callers then do without."""
        params: list[tuple[str, str]] = [("start", f"{start:.3f}"), ("end", f"{end:.3f}")]
        params += [("match[]", m) for m in match]
        data = self._api("GET", f"label/{label}/values", params)
        return {str(v) for v in data} if isinstance(data, list) else None

    def series(self, selector: str, start: float, end: float) -> Result:
        """The series of ``selector`` with samples between ``start`` and ``end`` (the series API: label sets from
        the index, no samples decoded), each with the value 1; SourceError when the backend does not answer."""
        data = self._api("POST", "series", [("match[]", selector), ("start", f"{start:.3f}"), ("end", f"{end:.3f}")])
        if not isinstance(data, list):
            self._error()
            raise SourceError(f"series {selector}: the backend gave no series list")
        return self._build(selector, [{"metric": m, "value": [end, "1"]} for m in data], 1.0)

    def _api(self, method: str, path: str, params: list[tuple[str, str]]) -> object:
        """The ``data`` of one metadata API call; None on any failure (not counted as a query error)."""
        try:
            return api_data(self.session, f"{self.url.removesuffix('/query')}/{path}", params, self.timeout, path,
                            method)
        except SourceError:
            return None

    def instant(self, expr: str, t: float, scale: float = 1.0) -> Result:
        return self._build(expr, self._fetch(expr, t), scale)

    def _error(self) -> None:
        with self._lock:
            self.query_errors += 1

    def note_partial(self, notes: list[str]) -> None:
        if notes:
            with self._lock:
                self._partial.extend(notes)

    def take_partial(self) -> list[str]:
        """The partial answers noted since the last call (the backend guard reads them once per evaluation)."""
        with self._lock:
            out, self._partial = self._partial, []
        return out

    def _fetch(self, expr: str, t: float) -> list[Any]:
        """The result items of one instant query (thread-safe: touches no shared state but the error count)."""
        notes: list[str] = []
        try:
            data = api_data(self.session, self.url, {"query": expr, "time": f"{t:.3f}"}, self.timeout, expr,
                            notes=notes) or {}
        except SourceError:
            self._error()
            raise
        self.note_partial(notes)
        if not isinstance(data, dict) or data.get("resultType") != "vector":
            self._error()
            kind = data.get("resultType") if isinstance(data, dict) else None
            raise SourceError(f"{expr}: expected a vector, got {kind!r}")
        items = data.get("result", [])
        if not isinstance(items, list):
            self._error()
            raise SourceError(f"{expr}: malformed result {items!r:.200}")
        return items

    def _build(self, expr: str, items: list[Any], scale: float) -> Result:
        """The columnar Result of ``items`` (series interned into the source's table; not thread-safe)."""
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
                self._error()
                raise SourceError(f"{expr}: malformed result {item!r:.200}") from e
            if not math.isnan(value):
                ids.append(i)
                values.append(value)
        vals = np.array(values, dtype=np.float64)
        if scale != 1.0:
            vals *= scale
        return Result(table, np.array(ids, dtype=np.int64), vals)
