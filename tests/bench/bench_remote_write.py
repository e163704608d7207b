"""What feeding the detector costs the metrics backend: query path against remote write, 1, 2 and 4 shards, beside
the backend's own cost of ingesting the scrapes, and remote write through the fan-out (vmagent) that sends shards
the stream once. One real Prometheus, every phase side by side in one run.

Run: ``.venv/bin/python tests/bench/bench_remote_write.py [--gpus 2000] [--other 200] [--interval 5]
[--phase 40] [--repeat 2] [--shards 1 2 4]``.

A synthetic fleet (8-GPU nodes, the gpufleet profile's families as the agent exports them, from the tests'
generator, plus ``--other`` series per node the detector does not read, as node_exporter's) is served as one live
scrape target; Prometheus (Debian's ``prometheus``, on a free 127.0.0.1 port) scrapes it every ``--interval``
seconds. Phases of ``--phase`` seconds, in rounds, so a change of the machine's load falls on all alike:

* ``scrape``: nothing but the scrapes (the backend's scrape-ingest cost);
* ``query xN``: N shard detectors (``--shard i/N``, :mod:`gpufleet.detector.sharding.shard_source`) each evaluating every
  interval through the query API;
* ``rw xN``: Prometheus remote-writing the keep-list ``remote-write-config`` prints to N receivers (reloaded
  config, SIGHUP), N detectors evaluating from their streams every interval;
* ``fanout xN``: Prometheus remote-writing the one entry ``remote-write-config --fanout`` prints to the vmagent
  it prints (Debian's ``vmagent``, on a free 127.0.0.1 port), which copies the stream to N receivers; N detectors
  evaluating from their streams every interval.

Per phase: Prometheus' CPU (user + system, ``/proc``) per second, its RSS at the end, and the bytes that went
to the detector (query answers' bodies; remote write request bodies as sent, snappy-compressed: for ``rw`` as the
receivers counted them, for ``fanout`` as Prometheus counted them, ``prometheus_remote_storage_*bytes_total``).
The detector's share is the phase's CPU less the median ``scrape`` phase's; the ratio is N shards' share over
one detector's on the same path, and for ``fanout`` over ``rw x1``'s (one detector fed directly). The fan-out's
own CPU, RSS and the bytes it sent on to the replicas are the detector side's cost, in columns of their own.
At the end one detector on each path evaluates the same instant: their findings are compared, and the fan-out's
shards' candidates together with one detector's.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import requests
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "detector"))

from support import free_port, need_binary, running, wait_http
from test_detector_core import Fault, Synth, synth

from gpufleet.detector.config import DetectorConfig, parse
from gpufleet.detector.engine import Detector
from gpufleet.detector.receiver import fanout
from gpufleet.detector.receiver import prometheus_config as remote_write_config
from gpufleet.detector.receiver.server import RemoteWriteReceiver
from gpufleet.detector.sharding import shard_source
from gpufleet.detector.sources.prometheus import PrometheusSource
from gpufleet.detector.sources.remote_write import StreamStore
from gpufleet.detector.sources.source import Source


def exposition(gpus: int, other: int, tmp: Path) -> bytes:
    """One scrape of the whole fleet (no timestamps: Prometheus stamps it), ``other`` unread series per node."""
    rec = synth(tmp / "frame.om", Synth(nodes=max(1, gpus // 8), seconds=0.0, jobs=max(1, gpus // 256),
                                        faults=[Fault("thermal", 1, 3, 0.0)], seed=3))
    lines = []
    for line in rec.read_text().splitlines():
        if line.startswith("#") or not line:
            continue
        series, value, _ = line.rsplit(" ", 2)
        lines.append(f"{series} {value}")
    for n in range(max(1, gpus // 8)):
        lines += [f'node_other_metric{{instance="node-{n:03d}:9100",i="{i}"}} {i}' for i in range(other)]
    return ("\n".join(lines) + "\n").encode()


class Target:
    def __init__(self, body: bytes) -> None:
        class H(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


class CountingSource(PrometheusSource):
    """The query path, counting the answers' bytes."""

    def __init__(self, url: str) -> None:
        super().__init__(url, timeout=300)
        self.bytes = 0
        self.session.hooks["response"].append(self._count)

    def _count(self, r: requests.Response, *a: Any, **kw: Any) -> None:
        self.bytes += len(r.content)


def cpu(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def sent_bytes(url: str, remote_name: str) -> float:
    """The bytes (samples and metadata, as sent) Prometheus counts for its remote write queue ``remote_name``."""
    total = 0.0
    for line in requests.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(("prometheus_remote_storage_bytes_total{", "prometheus_remote_storage_metadata_bytes_total{")) \
                and f'remote_name="{remote_name}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def candidates(det: Detector, at: float) -> list[tuple[Any, ...]]:
    return sorted((k, c.node, c.gpu, c.cause) for k, c in det.evaluate(at).candidates)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=2000)
    ap.add_argument("--other", type=int, default=200, help="series per node the detector does not read")
    ap.add_argument("--interval", type=float, default=5.0)
    ap.add_argument("--phase", type=float, default=40.0)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    iv = args.interval
    cfg = parse({"detector": {"interval_seconds": iv, "window_seconds": 4 * iv}})
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        body = exposition(args.gpus, args.other, tmp)
        target = Target(body)
        port = free_port()
        base = {"global": {"scrape_interval": f"{iv:g}s", "scrape_timeout": f"{iv:g}s"},
                "scrape_configs": [{"job_name": "fleet", "honor_labels": True,
                                    "static_configs": [{"targets": [f"127.0.0.1:{target.port}"]}]}]}
        conf = tmp / "prometheus.yml"
        conf.write_text(yaml.safe_dump(base))
        argv = [need_binary("prometheus"), f"--config.file={conf}", f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}"]
        url = f"http://127.0.0.1:{port}"
        with running(argv, log=tmp / "prometheus.log") as proc:
            wait_http(f"{url}/-/ready", timeout=60)
            pid = proc.pid
            lines = body.count(b"\n")
            print(f"fleet: {args.gpus} GPUs, exposition {len(body) / 1e6:.1f} MB, "
                  f"{lines} series per scrape every {iv:g} s", flush=True)
            time.sleep(4 * iv + 2)  # a full window in the TSDB before the query path reads it
            rows: dict[str, list[dict[str, float]]] = {}

            def reload(rw: list[dict[str, Any]]) -> None:
                conf.write_text(yaml.safe_dump({**base, **({"remote_write": rw} if rw else {})}))
                os.kill(pid, signal.SIGHUP)
                time.sleep(iv)  # the reload and the WAL watcher's start are not measured

            def phase(name: str, sources: list[tuple[Source, Any, DetectorConfig]], counted: Callable[[], float],
                      fan: tuple[int, Callable[[], float]] | None = None) -> list[Detector]:
                dets = [Detector(cfg_sh, shard_source.view(src, cfg_sh)) for src, _, cfg_sh in sources]
                b0, c0, t0 = counted(), cpu(pid), time.monotonic()
                f0 = (cpu(fan[0]), fan[1]()) if fan else (0.0, 0.0)
                evals = 0
                while time.monotonic() - t0 < args.phase:
                    at = time.time() - iv  # an instant the sender has flushed
                    for det in dets:
                        det.evaluate(at)
                        evals += 1
                    time.sleep(max(0.0, iv - (time.monotonic() - t0) % iv))
                secs = time.monotonic() - t0
                row = {"cpu": (cpu(pid) - c0) / secs, "rss": rss_mb(pid), "bytes": (counted() - b0) / secs,
                       "evals": evals}
                if fan:
                    row |= {"fan_cpu": (cpu(fan[0]) - f0[0]) / secs, "fan_rss": rss_mb(fan[0]),
                            "fan_bytes": (fan[1]() - f0[1]) / secs}
                rows.setdefault(name, []).append(row)
                extra = (f"  fan-out CPU {row['fan_cpu'] * 100:5.1f} %  RSS {row['fan_rss']:5.0f} MB  "
                         f"to the replicas {row['fan_bytes'] / 1e3:7.1f} kB/s") if fan else ""
                print(f"  {name:9s} Prometheus CPU {row['cpu'] * 100:6.1f} %  RSS {row['rss']:7.0f} MB  "
                      f"to the detector {row['bytes'] / 1e3:9.1f} kB/s  ({evals} evaluations){extra}", flush=True)
                return dets

            def fanout_phase(n: int, r: int) -> None:
                stores = [StreamStore(remote_write_config.sample_names(cfg), 6 * iv) for _ in range(n)]
                rxs = [RemoteWriteReceiver("127.0.0.1:0", s) for s in stores]
                for rx in rxs:
                    rx.serve_in_thread()
                fan_url = f"http://127.0.0.1:{free_port()}"
                argv = fanout.vmagent_args(fan_url, [rx.url for rx in rxs], str(tmp / f"fanout-{r}-{n}"))
                argv[0] = need_binary(argv[0])
                try:
                    with running([*argv, "-loggerLevel=ERROR"], log=tmp / "vmagent.log") as fan:
                        wait_http(f"{fan_url}/health", timeout=60)
                        template = "http://replica-{shard}:9447" + remote_write_config.PATH  # not in the entry
                        [entry] = yaml.safe_load(remote_write_config.render(
                            cfg, template, n, fanout=fan_url, batch_send_deadline="1s"))["remote_write"]
                        reload([entry])
                        time.sleep(4 * iv)  # the streams fill a window
                        shard_stores: list[tuple[Source, Any, DetectorConfig]] = [
                            (s, parse_shard(i, n), with_shard(cfg, i, n)) for i, s in enumerate(stores)]
                        dets = phase(f"fanout x{n}", shard_stores, lambda: sent_bytes(url, entry["name"]),
                                     (fan.pid, lambda: float(sum(rx.stats.bytes for rx in rxs))))
                        if n == max(args.shards):
                            at = time.time() - 2 * iv
                            one = candidates(Detector(cfg, CountingSource(url)), at)
                            parts = [candidates(det, at) for det in dets]
                            same = sorted(c for p in parts for c in p) == one
                            print(f"  candidates at one instant, one detector (query path) vs {n} shards through "
                                  f"the fan-out: {'identical' if same else 'DIFFERENT'} ({len(one)} candidates)")
                        reload([])
                finally:
                    for rx in rxs:
                        rx.shutdown()

            for r in range(args.repeat):
                print(f"round {r + 1}", flush=True)
                reload([])
                phase("scrape", [], lambda: 0)
                for n in args.shards:
                    src = CountingSource(url)
                    shard_cfgs: list[tuple[Source, Any, DetectorConfig]] = [
                        (src, parse_shard(i, n), with_shard(cfg, i, n)) for i in range(n)]
                    phase(f"query x{n}", shard_cfgs, lambda s=src: s.bytes)  # type: ignore[misc]
                for n in args.shards:
                    stores = [StreamStore(remote_write_config.sample_names(cfg), 6 * iv) for _ in range(n)]
                    rxs = [RemoteWriteReceiver("127.0.0.1:0", s) for s in stores]
                    for rx in rxs:
                        rx.serve_in_thread()
                    try:
                        rw = []
                        for i, rx in enumerate(rxs):
                            block = yaml.safe_load(remote_write_config.render(cfg, rx.url, batch_send_deadline="1s"))
                            entry = block["remote_write"][0]
                            entry["name"] = f"det-{i}"
                            rw.append(entry)
                        reload(rw)
                        time.sleep(4 * iv)  # the streams fill a window
                        shard_stores: list[tuple[Source, Any, DetectorConfig]] = [
                            (s, parse_shard(i, n), with_shard(cfg, i, n)) for i, s in enumerate(stores)]
                        phase(f"rw x{n}", shard_stores, lambda rxs=rxs: sum(rx.stats.bytes for rx in rxs))  # type: ignore[misc]
                        if n == 1:
                            at = time.time() - 2 * iv
                            a = Detector(cfg, CountingSource(url)).evaluate(at)
                            b = Detector(cfg, stores[0]).evaluate(at)
                            same = [(k, c.node, c.gpu, c.cause) for k, c in a.candidates] == \
                                [(k, c.node, c.gpu, c.cause) for k, c in b.candidates]
                            print(f"  findings at one instant, query path vs stream: "
                                  f"{'identical' if same else 'DIFFERENT'} ({len(a.candidates)} candidates)")
                    finally:
                        reload([])
                        for rx in rxs:
                            rx.shutdown()
                    fanout_phase(n, r)  # beside rw xN: the two ways of feeding N shards, one after the other
        base_cpu = statistics.median(x["cpu"] for x in rows["scrape"])
        print(f"\nmedians of {args.repeat} round(s); scrape ingest alone: Prometheus CPU {base_cpu * 100:.1f} %, "
              f"RSS {statistics.median(x['rss'] for x in rows['scrape']):.0f} MB")
        print("| path | Prometheus CPU % | detector's share, CPU % | x one detector | RSS MB | to the detector kB/s "
              "| fan-out CPU % | fan-out RSS MB | fan-out to the replicas kB/s |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        ones: dict[str, float] = {}
        for kind in ("query", "rw", "fanout"):
            for n in args.shards:
                xs = rows[f"{kind} x{n}"]
                c = statistics.median(x["cpu"] for x in xs)
                share = c - base_cpu
                one = ones.setdefault("rw" if kind == "fanout" else kind, share)
                fan = (f"{statistics.median(x['fan_cpu'] for x in xs) * 100:.1f} | "
                       f"{statistics.median(x['fan_rss'] for x in xs):.0f} | "
                       f"{statistics.median(x['fan_bytes'] for x in xs) / 1e3:.1f}") if kind == "fanout" else "- | - | -"
                print(f"| {kind} x{n} | {c * 100:.1f} | {share * 100:.1f} | "
                      f"{share / one if one > 0 else float('nan'):.2f} | "
                      f"{statistics.median(x['rss'] for x in xs):.0f} | "
                      f"{statistics.median(x['bytes'] for x in xs) / 1e3:.1f} | {fan} |")
        if 1 in args.shards:  # round by round, each against its own round's scrape and rw x1 phases
            for kind in ("rw", "fanout"):
                for n in (m for m in args.shards if (kind, m) != ("rw", 1)):
                    ratios = [(f["cpu"] - b["cpu"]) / (o["cpu"] - b["cpu"]) for f, b, o in
                              zip(rows[f"{kind} x{n}"], rows["scrape"], rows["rw x1"], strict=True)]
                    print(f"{kind} x{n} over rw x1, detector's share of Prometheus CPU, by round: "
                          + ", ".join(f"{x:.2f}" for x in ratios))


def parse_shard(i: int, n: int) -> Any:
    from gpufleet.detector.sharding.shard import Shard

    return Shard(i, n) if n > 1 else None


def with_shard(cfg: DetectorConfig, i: int, n: int) -> DetectorConfig:
    from dataclasses import replace

    return replace(cfg, shard=parse_shard(i, n))


if __name__ == "__main__":
    main()
