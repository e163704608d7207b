"""The remote write receiver: the wire format, the window it keeps, bad input, TLS and basic auth.

Requests are sent over HTTP to a receiver on a free 127.0.0.1 port (real Prometheus senders are in
test_remote_write_prometheus.py).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from pathlib import Path

import bcrypt
import cramjam
import pytest
import requests
import trustme
from prometheus_client.core import CollectorRegistry
from prometheus_client.exposition import generate_latest
from test_detector_core import T0, Fault, Synth, fast_cfg, synth

from gpufleet.detector.config import DetectorConfig, parse
from gpufleet.detector.engine import Detector
from gpufleet.detector.receiver import fanout
from gpufleet.detector.receiver import prometheus_config as remote_write_config
from gpufleet.detector.receiver.proto import WireError, WriteRequest, decode, encode, uncompressed_length
from gpufleet.detector.receiver.server import RemoteWriteReceiver
from gpufleet.detector.sharding import shard_source
from gpufleet.detector.sources.profiles import Query, queries
from gpufleet.detector.sources.recording import RecordingSource
from gpufleet.detector.sources.remote_write import StreamingSource, StreamStore
from gpufleet.detector.sources.source import Result
from gpufleet.serving.webconfig import load_web_config

HEADERS = {"Content-Type": "application/x-protobuf", "Content-Encoding": "snappy",
           "X-Prometheus-Remote-Write-Version": "0.1.0"}
UTIL = "gpufleet_gpu_utilization_ratio"
STALE = struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000002))[0]


def gpu(n: int, g: int) -> dict[str, str]:
    return {"__name__": UTIL, "instance": f"node-{n}:9400", "gpu": str(g)}


@pytest.fixture
def receiver() -> Iterator[RemoteWriteReceiver]:
    store = StreamStore({UTIL, "gpufleet_gpu_power_watts"}, retention=300.0)
    rx = RemoteWriteReceiver("127.0.0.1:0", store, max_body=1 << 16, max_decoded=1 << 18)
    rx.serve_in_thread()
    try:
        yield rx
    finally:
        rx.shutdown()


def post(rx: RemoteWriteReceiver, body: bytes, headers: dict[str, str] | None = None, **kw: object) -> requests.Response:
    return requests.post(rx.url, data=body, headers=headers if headers is not None else HEADERS, timeout=10, **kw)  # type: ignore[arg-type]


def counters(rx: RemoteWriteReceiver) -> str:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(rx.collector())
    return generate_latest(reg).decode()


def test_wire_round_trip_and_length_prefix() -> None:
    body = encode([(gpu(1, 0), [(1000, 0.5), (2000, 0.75)])])
    req = decode(body, 1 << 20)
    [ts] = req.timeseries
    assert {lb.name: lb.value for lb in ts.labels} == gpu(1, 0)
    assert [(s.timestamp, s.value) for s in ts.samples] == [(1000, 0.5), (2000, 0.75)]
    assert uncompressed_length(body) == len(bytes(cramjam.snappy.decompress_raw(body)))
    with pytest.raises(WireError, match="over the limit"):
        decode(body, 10)
    with pytest.raises(WireError, match="not snappy"):
        decode(b"\xff\xff\xff\xff\xff\xff", 1 << 20)
    with pytest.raises(WireError, match="WriteRequest"):
        decode(bytes(cramjam.snappy.compress_raw(b"\x0a\xff\xff\xff\x0f")), 1 << 20)


def test_store_answers_like_promql_and_keeps_its_window() -> None:
    store = StreamStore({UTIL}, retention=60.0)
    req = WriteRequest()
    req.ParseFromString(bytes(cramjam.snappy.decompress_raw(encode(
        [(gpu(1, 0), [(t * 1000, float(t)) for t in range(0, 100, 10)]),
         ({**gpu(1, 0), "__name__": "not_read"}, [(0, 1.0)])]))))
    got = store.ingest(req)
    assert (got.accepted, got.not_kept, got.out_of_order) == (10, 1, 0)
    q = Query("util", UTIL, "avg")
    # avg_over_time(m[30s]) at 90: samples at 60, 70, 80, 90
    [(labels, value)] = list(store.query(q, 90.0, 30.0))
    assert labels == {"instance": "node-1:9400", "gpu": "0"} and value == 75.0
    assert store.samples == 7  # the samples older than newest - retention (90 - 60) were dropped
    assert store.covers(90.0, 60.0) and not store.covers(90.0, 61.0)


def test_out_of_order_resent_and_stale_samples() -> None:
    store = StreamStore(None, retention=600.0)

    def ingest(samples: list[tuple[int, float]]) -> tuple[int, int, int]:
        req = WriteRequest()
        req.ParseFromString(bytes(cramjam.snappy.decompress_raw(encode([(gpu(1, 0), samples)]))))
        got = store.ingest(req)
        return got.accepted, got.out_of_order, got.stale

    assert ingest([(1000, 1.0), (2000, 2.0)]) == (2, 0, 0)
    assert ingest([(2000, 2.0), (3000, 3.0)]) == (1, 0, 0)  # a resend of 2000 is not an error
    assert ingest([(3000, 4.0), (4000, 4.0)]) == (1, 1, 0)  # another value at a time held: rejected
    assert ingest([(1500, 9.0)]) == (1, 0, 0)  # late, inside the window: put in its place
    assert ingest([(5000, STALE)]) == (0, 0, 1)
    [(_, count)] = list(store.query(Query("n", UTIL, "count"), 5.0, 10.0))
    assert count == 5.0  # 1, 1.5, 2, 3, 4 s: neither the rejected samples nor the staleness marker
    [(_, last)] = list(store.query(Query("v", UTIL, "last"), 1.7, 1.0))
    assert last == 9.0  # the late sample sits in time order
    assert ingest([(700_000, 7.0), (50_000, 5.0)]) == (1, 1, 0)  # 50 s is older than the window (700 - 600)


def test_receiver_accepts_and_counts(receiver: RemoteWriteReceiver) -> None:
    r = post(receiver, encode([(gpu(1, g), [(1000, 0.5)]) for g in range(4)]))
    assert r.status_code == 204, r.text
    assert receiver.store.series_count == 4
    text = counters(receiver)
    assert 'gpufleet_detector_remote_write_requests_total{result="ok"} 1.0' in text
    assert 'gpufleet_detector_remote_write_samples_total{result="accepted"} 4.0' in text
    assert "gpufleet_detector_remote_write_series 4.0" in text


@pytest.mark.parametrize(("headers", "body", "status", "result"), [
    ({**HEADERS, "Content-Type": "application/json"}, None, 415, "content_type"),
    ({**HEADERS, "Content-Encoding": "gzip"}, None, 415, "encoding"),
    ({"Content-Type": "application/x-protobuf"}, None, 415, "encoding"),
    (HEADERS, b"\x05not snappy at all", 400, "snappy"),
    (HEADERS, bytes(cramjam.snappy.compress_raw(b"\x0a\x05\x0a\x03\x0a\x01")), 400, "protobuf"),
    (HEADERS, b"\x00" * (1 << 17), 413, "too_large"),  # over max_body
    (HEADERS, b"\xff\xff\xff\x7f", 413, "too_large"),  # claims 256 MiB uncompressed: refused before decompressing
])
def test_bad_requests_get_4xx_and_a_counter(receiver: RemoteWriteReceiver, headers: dict[str, str],
                                            body: bytes | None, status: int, result: str) -> None:
    r = post(receiver, body if body is not None else encode([(gpu(1, 0), [(1000, 0.5)])]), headers)
    assert r.status_code == status, r.text
    assert "\n" not in r.text.strip()  # one line
    assert f'gpufleet_detector_remote_write_requests_total{{result="{result}"}} 1.0' in counters(receiver)
    assert receiver.store.series_count == 0
    # the receiver still serves
    assert post(receiver, encode([(gpu(1, 0), [(1000, 0.5)])])).status_code == 204


def test_out_of_order_is_400_and_keeps_the_rest(receiver: RemoteWriteReceiver) -> None:
    assert post(receiver, encode([(gpu(1, 0), [(600_000, 0.5)])])).status_code == 204
    # 1 s: before the window, of a series held and of a new one (a sender's clock behind); a new one in the window
    r = post(receiver, encode([(gpu(1, 0), [(1000, 0.1)]), (gpu(1, 1), [(1000, 0.2)]), (gpu(1, 2), [(590_000, 0.3)])]))
    assert r.status_code == 400 and "2 sample(s) out of order" in r.text and "1 kept" in r.text
    assert receiver.store.series_count == 2
    text = counters(receiver)
    assert 'gpufleet_detector_remote_write_samples_total{result="out_of_order"} 2.0' in text


def test_other_paths_methods_and_lengths(receiver: RemoteWriteReceiver) -> None:
    base = receiver.url.removesuffix("/api/v1/write")
    assert requests.post(base + "/api/v1/other", data=b"x", headers=HEADERS, timeout=10).status_code == 404
    assert requests.get(receiver.url, timeout=10).status_code == 405
    chunked = requests.post(receiver.url, data=iter([b"\x01", b"\x00"]), headers=HEADERS, timeout=10)
    assert chunked.status_code == 411
    text = counters(receiver)
    for result in ("not_found", "method", "length"):
        assert f'gpufleet_detector_remote_write_requests_total{{result="{result}"}} 1.0' in text


def test_tls_and_basic_auth(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_pem.write_to_path(str(tmp_path / "rw.key"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "rw.crt"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    pw_hash = bcrypt.hashpw(b"hunter2", bcrypt.gensalt(rounds=6)).decode()
    (tmp_path / "web.yml").write_text("tls_server_config:\n  cert_file: rw.crt\n  key_file: rw.key\n"
                                      f"basic_auth_users:\n  prometheus: '{pw_hash}'\n")
    store = StreamStore(None, retention=300.0)
    rx = RemoteWriteReceiver("127.0.0.1:0", store, load_web_config(tmp_path / "web.yml"))
    rx.serve_in_thread()
    try:
        assert rx.url.startswith("https://")
        body = encode([(gpu(1, 0), [(1000, 0.5)])])
        ca_file = str(tmp_path / "ca.crt")
        r = post(rx, body, verify=ca_file)
        assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Basic")
        assert post(rx, body, verify=ca_file, auth=("prometheus", "wrong")).status_code == 401
        assert store.series_count == 0
        with pytest.raises(requests.exceptions.SSLError):
            post(rx, body, verify=True, auth=("prometheus", "hunter2"))
        with pytest.raises(requests.RequestException):  # plain HTTP on the TLS port
            requests.post(rx.url.replace("https", "http"), data=body, headers=HEADERS, timeout=5).raise_for_status()
        assert post(rx, body, verify=ca_file, auth=("prometheus", "hunter2")).status_code == 204
        assert store.series_count == 1
    finally:
        rx.shutdown()


def test_streaming_source_warms_up_from_the_query_api() -> None:
    store = StreamStore(None, retention=300.0)

    class Fallback:
        query_errors = 0
        asked: list[float] = []

        def query(self, query: Query, t: float, window: float) -> Result:
            self.asked.append(t)
            return Result.from_pairs([({"gpu": "0"}, 1.0)])

    fb = Fallback()
    src = StreamingSource(store, fb)
    req = WriteRequest()
    req.ParseFromString(bytes(cramjam.snappy.decompress_raw(encode([(gpu(1, 0), [(100_000, 0.5), (200_000, 0.5)])]))))
    store.ingest(req)
    q = Query("util", UTIL, "avg")
    assert list(src.query(q, 200.0, 120.0)) == [({"gpu": "0"}, 1.0)]  # the stream began at 100 s: not a window yet
    assert fb.asked == [200.0]
    [(_, v)] = list(src.query(q, 200.0, 100.0))
    assert v == 0.5 and (src.from_stream, src.from_fallback) == (1, 1)


@pytest.mark.parametrize("profile", ["gpufleet", "dcgm"])
def test_config_keeps_exactly_the_profiles_families(profile: str) -> None:
    import re

    import yaml

    cfg = DetectorConfig(profile=profile)
    doc = yaml.safe_load(remote_write_config.render(cfg, "https://det-{shard}:9447/api/v1/write", 3))
    blocks = doc["remote_write"]
    assert [b["url"] for b in blocks] == [f"https://det-{i}:9447/api/v1/write" for i in range(3)]
    wanted = {q.metric for q in queries(profile)} | set(remote_write_config.sample_names(cfg))
    for b in blocks:
        [rule] = b["write_relabel_configs"]
        assert rule["action"] == "keep" and rule["source_labels"] == ["__name__"]
        rx = re.compile(rule["regex"])
        assert {n for n in wanted if rx.fullmatch(n)} == wanted
        assert not rx.fullmatch("gpufleet_gpu_utilization_ratioX") and not rx.fullmatch("up")
    one = yaml.safe_load(remote_write_config.render(cfg, "https://det-{shard}:9447/api/v1/write", 3, only=1))
    assert [b["url"] for b in one["remote_write"]] == ["https://det-1:9447/api/v1/write"]
    with pytest.raises(ValueError, match="shard"):
        remote_write_config.render(cfg, "https://det:9447/api/v1/write", 2)


def test_fanout_config_sends_once_and_prints_the_fanouts_command_line() -> None:
    import yaml

    cfg = DetectorConfig(profile="dcgm")
    url = "https://det-{shard}:9447/api/v1/write"
    text = remote_write_config.render(cfg, url, 3, fanout="http://vmagent:8429")
    [entry] = yaml.safe_load(text)["remote_write"]
    assert entry["url"] == "http://vmagent:8429/api/v1/write"
    direct = yaml.safe_load(remote_write_config.render(cfg, url, 3))["remote_write"]
    assert all(entry["write_relabel_configs"] == d["write_relabel_configs"] for d in direct)  # the same keep-list
    argv = remote_write_config.fanout_args(url, 3, "http://vmagent:8429")
    assert argv[0] == "vmagent" and "-httpListenAddr=:8429" in argv
    assert [a.split("=", 1)[1] for a in argv if a.startswith("-remoteWrite.url=")] == \
        [f"https://det-{i}:9447/api/v1/write" for i in range(3)]
    comments = "\n".join(line.removeprefix("#   ") for line in text.splitlines() if line.startswith("#   "))
    assert comments == fanout.command_line(argv)  # the command line in the block is the one --fanout-args prints
    assert fanout.listen_address("http://127.0.0.1:9001/api/v1/write") == "127.0.0.1:9001"
    assert fanout.listen_address("https://[::1]:9001") == "[::1]:9001"
    tls = fanout.vmagent_args("https://vmagent:8429", ["https://det-0:9447/api/v1/write"])
    assert {"-tls", f"-tlsCertFile={fanout.TLS_CERT}", f"-tlsKeyFile={fanout.TLS_KEY}"} <= set(tls)
    assert "-tls" not in argv
    assert fanout.write_url("http://127.0.0.1:9001/prometheus/api/v1/write", "/api/v1/write") == \
        "http://127.0.0.1:9001/prometheus/api/v1/write"
    with pytest.raises(ValueError, match="--shard"):
        remote_write_config.render(cfg, url, 3, only=1, fanout="http://vmagent:8429")
    with pytest.raises(ValueError, match="--fanout"):
        remote_write_config.render(cfg, url, 3, fanout="vmagent:8429")
    with pytest.raises(ValueError, match="shard"):
        remote_write_config.render(cfg, "https://det:9447/api/v1/write", 2, fanout="http://vmagent:8429")


def test_cli_prints_the_fanouts_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    from gpufleet.detector.service.cli import main

    url = "http://127.0.0.1:900{shard}/api/v1/write"
    assert main(["remote-write-config", "--shards", "2", "--url", url, "--fanout", "http://127.0.0.1:8429",
                 "--fanout-args", "--fanout-data", "/srv/fanout"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "vmagent", "-httpListenAddr=127.0.0.1:8429", "-remoteWrite.tmpDataPath=/srv/fanout",
        f"-remoteWrite.maxDiskUsagePerURL={fanout.MAX_DISK_PER_URL}",
        "-remoteWrite.url=http://127.0.0.1:9000/api/v1/write", "-remoteWrite.url=http://127.0.0.1:9001/api/v1/write"]
    assert main(["remote-write-config", "--shards", "2", "--url", url, "--fanout", "http://127.0.0.1:8429"]) == 0
    assert "remote_write:\n  - url: \"http://127.0.0.1:8429/api/v1/write\"" in capsys.readouterr().out
    assert main(["remote-write-config", "--fanout-args"]) == 2
    assert "--fanout URL" in capsys.readouterr().err


def test_a_resent_request_is_harmless(receiver: RemoteWriteReceiver) -> None:
    """A sender (or the fan-out) sends a request again when it timed out waiting for the answer: the receiver
    answers 204 and keeps the samples once."""
    body = encode([(gpu(1, g), [(1000, 0.5), (2000, 0.25 * g)]) for g in range(4)])
    q = Query("n", UTIL, "count")
    for _ in range(3):
        assert post(receiver, body).status_code == 204
        assert sorted(v for _, v in receiver.store.query(q, 2.0, 10.0)) == [2.0] * 4
    assert receiver.stats.samples["accepted"] == 8 and receiver.stats.samples["out_of_order"] == 0
    assert receiver.stats.requests["ok"] == 3


def test_config_follows_configured_sites() -> None:
    cfg = parse({"sites": [{"name": "dc1", "facility_power": {"metric": "my_facility_watts"},
                            "it_power": {"metric": "my_it_watts"}, "outdoor_temperature": {"metric": "my_temp"}}]})
    names = remote_write_config.sample_names(cfg)
    assert {"my_facility_watts", "my_it_watts", "my_temp"} <= set(names)
    assert "gpufleet_site_facility_power_watts" not in names


def test_memory_stays_bounded_without_queries() -> None:
    store = StreamStore({UTIL}, retention=60.0)
    for t in range(0, 1200, 10):  # 20 minutes of a GPU that goes away halfway, and one that stays
        series = [(gpu(1, 0), [(t * 1000, 1.0)])] + ([(gpu(1, 1), [(t * 1000, 1.0)])] if t < 600 else [])
        req = WriteRequest()
        req.ParseFromString(bytes(cramjam.snappy.decompress_raw(encode(series))))
        store.ingest(req)
    assert store.samples <= 2 * 7 + 1  # at most two retentions' worth of the one series left
    assert store.series_count == 1


def stream_of(recording: RecordingSource, retention: float) -> StreamStore:
    """A store fed the whole recording as remote write requests (one per series)."""
    store = StreamStore(None, retention)
    for name, series in recording.series.items():
        for s in series:
            body = encode([({**s.labels, "__name__": name},
                            [(round(t * 1000), v) for t, v in zip(s.ts.tolist(), s.values.tolist(), strict=True)])])
            store.ingest(decode(body, 1 << 28))
    return store


@pytest.mark.parametrize("n", [1, 2])
def test_shards_on_the_stream_find_what_one_detector_finds_from_the_recording(tmp_path: Path, n: int) -> None:
    rec = RecordingSource.load([synth(tmp_path / "rec.om", Synth(
        nodes=8, seconds=1200.0, faults=[Fault("clock", 1, 2, 540.0), Fault("link", 6, 1, 540.0)], jobs=4, seed=3))])
    store = stream_of(rec, retention=1e6)
    times = [T0 + 607.5 + 60.0 * i for i in range(8)]

    def run(cfg: DetectorConfig, src: object) -> list[dict[str, object]]:
        det = Detector(cfg, shard_source.view(src, cfg))  # type: ignore[arg-type]
        for t in times:
            det.evaluate(t)
        return [f.to_json() for f in det.tracker.all_findings()]

    def key(f: dict[str, object]) -> tuple[str, ...]:
        return tuple(str(f[k]) for k in ("kind", "cause", "node", "gpu", "job", "site", "start", "end"))

    one = run(fast_cfg(), rec)
    assert {"straggler", "network"} <= {f["kind"] for f in one}
    cfgs = [fast_cfg(**({"detector__shard": f"{i}/{n}"} if n > 1 else {})) for i in range(n)]
    parts = [run(cfg, store) for cfg in cfgs]
    # each shard on the stream finds byte for byte what it finds from the recording
    assert parts == [run(cfg, rec) for cfg in cfgs]
    # and the shards together what one detector finds, each finding from one shard (a score may differ a little:
    # peers across jobs are per shard, docs/scaling.md)
    assert sorted(key(f) for p in parts for f in p) == sorted(key(f) for f in one)


def test_one_evaluation_reads_one_view() -> None:
    store = StreamStore({UTIL}, retention=600.0)

    def ingest(ms: int, v: float) -> None:
        req = WriteRequest()
        req.ParseFromString(bytes(cramjam.snappy.decompress_raw(encode([(gpu(1, 0), [(ms, v)])]))))
        store.ingest(req)

    ingest(10_000, 1.0)
    q = Query("n", UTIL, "count")
    assert [v for _, v in store.query(q, 20.0, 60.0)] == [1.0]
    ingest(15_000, 1.0)  # arrives while the evaluation at 20 s runs: not seen halfway through it
    assert [v for _, v in store.query(q, 20.0, 60.0)] == [1.0]
    assert [v for _, v in store.query(q, 35.0, 60.0)] == [2.0]  # the next instant sees it


def test_a_series_of_only_staleness_markers_is_no_answer() -> None:
    store = StreamStore({UTIL}, retention=600.0)
    req = WriteRequest()
    req.ParseFromString(bytes(cramjam.snappy.decompress_raw(encode(
        [(gpu(1, 0), [(10_000, 1.0)]), (gpu(1, 1), [(10_000, STALE)])]))))
    store.ingest(req)
    assert [lb["gpu"] for lb, _ in store.query(Query("n", UTIL, "count"), 20.0, 60.0)] == ["0"]


def test_connections_past_the_cap_are_closed_and_the_receiver_recovers() -> None:
    import socket

    store = StreamStore(None, retention=300.0)
    rx = RemoteWriteReceiver("127.0.0.1:0", store, max_connections=2)
    rx.serve_in_thread()
    idle = [socket.create_connection(("127.0.0.1", rx.port)) for _ in range(2)]  # slow clients: send nothing
    try:
        time.sleep(0.3)
        with pytest.raises(requests.RequestException):
            post(rx, encode([(gpu(1, 0), [(1000, 0.5)])]))
        for s in idle:
            s.close()
        deadline = time.monotonic() + 10
        while True:  # the slots come back once the idle connections are gone
            try:
                assert post(rx, encode([(gpu(1, 0), [(1000, 0.5)])])).status_code == 204
                break
            except requests.RequestException:
                assert time.monotonic() < deadline
                time.sleep(0.1)
    finally:
        rx.shutdown()
