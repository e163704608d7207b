"""The Prometheus source's answer handling without a server: columnar results, interning, malformed answers."""

from __future__ import annotations

import json
from typing import Any

import pytest
import requests

from gpufleet.detector.sources.profiles import Query
from gpufleet.detector.sources.prometheus import PrometheusSource
from gpufleet.detector.sources.source import SourceError

Q = Query("power", "gpufleet_gpu_power_watts", "avg", scale=2.0)


class Answer:
    def __init__(self, body: Any, status: int = 200) -> None:
        self.status_code = status
        self.text = json.dumps(body)
        self._body = body

    def json(self) -> Any:
        return self._body


class Session(requests.Session):
    def __init__(self, answers: list[Any]) -> None:
        super().__init__()
        self.answers = answers

    def post(self, url: str | bytes, data: Any = None, json: Any = None, **kwargs: Any) -> Any:
        return Answer(self.answers.pop(0))


def vector(*items: Any) -> dict[str, Any]:
    return {"status": "success", "data": {"resultType": "vector", "result": list(items)}}


def test_answers_are_columnar_and_series_keep_their_ids() -> None:
    a = {"metric": {"gpu": "0", "instance": "n:1"}, "value": [1.0, "5"]}
    b = {"metric": {"instance": "n:1", "gpu": "1"}, "value": [1.0, "NaN"]}  # NaN: no value, never a made-up 0
    c = {"metric": {"__name__": "x", "gpu": "2", "instance": "n:1"}, "value": [1.0, "7.5"]}
    src = PrometheusSource("http://127.0.0.1:1", session=Session([vector(a, b, c), vector(c, a)]))
    first = src.query(Q, 1.0, 60.0)
    assert first == [({"gpu": "0", "instance": "n:1"}, 10.0), ({"gpu": "2", "instance": "n:1"}, 15.0)]
    second = src.query(Q, 2.0, 60.0)
    assert second.ids.tolist() == first.ids.tolist()[::-1] and second.table is first.table
    assert src.query_errors == 0


@pytest.mark.parametrize("body", [
    {"status": "success", "data": {"resultType": "vector", "result": {"not": "a list"}}},
    vector({"metric": {"gpu": "0"}}),  # no value
    vector({"metric": ["gpu", "0"], "value": [1.0, "1"]}),  # labels not an object
    vector({"metric": {"gpu": ["0"]}, "value": [1.0, "1"]}),  # a label value that is not a string
    vector({"metric": {"gpu": "0"}, "value": [1.0, "abc"]}),
    {"status": "success", "data": {"resultType": "matrix", "result": []}},
    {"status": "error", "error": "bad_data"},
    ["not", "an", "object"],
])
def test_malformed_answers_are_counted_errors(body: Any) -> None:
    src = PrometheusSource("http://127.0.0.1:1", session=Session([body]))
    with pytest.raises(SourceError, match=r"^avg_over_time\(gpufleet_gpu_power_watts\[60s\]\): "):
        src.query(Q, 1.0, 60.0)
    assert src.query_errors == 1


class ByQuery(requests.Session):
    """Answers by the query text, from any thread."""

    def __init__(self, answers: dict[str, Any]) -> None:
        super().__init__()
        self.answers = answers

    def post(self, url: str | bytes, data: Any = None, json: Any = None, **kwargs: Any) -> Any:
        return Answer(self.answers[data["query"]])


def test_concurrent_queries_keep_their_order_and_their_errors() -> None:
    qs = [Query(f"f{i}", f"m{i}", "last") for i in range(12)]
    answers: dict[str, Any] = {q.promql(60.0): vector({"metric": {"gpu": str(i)}, "value": [1.0, str(i)]})
                               for i, q in enumerate(qs)}
    answers[qs[5].promql(60.0)] = {"status": "error", "error": "boom"}
    done: list[int] = []
    src = PrometheusSource("http://127.0.0.1:1", session=ByQuery(answers), parallel=4)
    got = src.query_all(qs, 1.0, 60.0, lambda: done.append(1))
    assert len(done) == 12 and src.query_errors == 1
    assert isinstance(got[5], SourceError) and "boom" in str(got[5])
    for i, r in enumerate(got):
        if i != 5:
            assert r == [({"gpu": str(i)}, float(i))]


def test_the_environment_is_read_once_as_requests_would_read_it(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Any) -> None:
    """The source's own session takes the proxy, CA bundle and netrc from the environment when it is made, then
    stops requests from reading them again on every query (trust_env); a CA file given still beats the bundle."""
    netrc = tmp_path / "netrc"
    netrc.write_text("machine prom.example login reader password s3cret\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    monkeypatch.setenv("NO_PROXY", "direct.example")
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", "/etc/ssl/site-bundle.pem")
    src = PrometheusSource("https://prom.example:9090")
    assert not src.session.trust_env
    assert src.session.proxies.get("https") == "http://proxy.example:3128"
    assert src.session.auth == ("reader", "s3cret")
    assert src.session.verify == "/etc/ssl/site-bundle.pem"
    bypass = PrometheusSource("https://direct.example:9090")
    assert "https" not in bypass.session.proxies and bypass.session.auth is None
    assert PrometheusSource("https://prom.example:9090", verify="/etc/gpufleet/ca.pem").session.verify == \
        "/etc/gpufleet/ca.pem"
    monkeypatch.delenv("REQUESTS_CA_BUNDLE")
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
    assert PrometheusSource("https://prom.example:9090").session.verify is True
