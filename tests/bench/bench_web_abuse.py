"""Abuse benchmark for the agent's web endpoint (not a test): slow connections, password spray, auth timing.

Run from the repository root::

    .venv/bin/python tests/bench/bench_web_abuse.py slow [--connections 2000] [--seconds 15]
    .venv/bin/python tests/bench/bench_web_abuse.py spray [--clients 8] [--seconds 15] [--cost 10]
    .venv/bin/python tests/bench/bench_web_abuse.py timing [--cost 10] [--requests 20]

Every run starts the real agent, ``gpufleet-agent --nvml.fake=sim`` (8 simulated GPUs), on a free
127.0.0.1 port and reads its thread count, RSS and CPU time from ``/proc/PID``.

* **slow**: opens ``--connections`` connections that trickle a request head one byte per second,
  while a legitimate client scrapes ``/metrics`` once a second. Reports the agent's peak threads and
  RSS, the scrapes' latency (and failures), and how many slow connections the agent cut off.
* **spray**: ``--clients`` threads send wrong basic-auth passwords as fast as they can (bcrypt cost
  ``--cost``) while a legitimate client, authenticated once (so cached), scrapes in a loop. Reports the
  agent's CPU seconds per wall second during the spray and the legitimate scrapes' latency against an
  unloaded baseline.
* **timing**: median response time of an unknown user and of a known user with a wrong password.
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import bcrypt
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from support import BIN, cpu_seconds, free_port, proc_status, running, wait_http

AGENT = str(BIN / "gpufleet-agent")


@contextlib.contextmanager
def agent(*args: str, web_config: str | None = None) -> Iterator[tuple[str, int]]:
    """A running agent: yields (base URL, pid)."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        extra = []
        if web_config is not None:
            (Path(tmp) / "web.yml").write_text(web_config)
            extra.append(f"--web.config.file={Path(tmp) / 'web.yml'}")
        argv = [AGENT, "--nvml.fake=sim", f"--web.listen-address=127.0.0.1:{port}", *extra, *args]
        with running(argv, log=Path(tmp) / "agent.log") as proc:
            base = f"http://127.0.0.1:{port}"
            wait_http(base + "/health", timeout=60, ok=(200, 401))
            yield base, proc.pid


def raise_fd_limit(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, n))
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def slow(connections: int, seconds: float) -> None:
    raise_fd_limit(connections + 256)
    with agent() as (base, pid):
        port = int(base.rsplit(":", 1)[1])
        requests.get(base + "/metrics", timeout=10)
        idle = proc_status(pid)
        socks: list[socket.socket] = []
        refused = 0
        for _ in range(connections):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.setblocking(False)
                s.send(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
                socks.append(s)
            except OSError:
                refused += 1
        peak = dict(idle)
        lat: list[float] = []
        failures = 0
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            for s in socks:
                with contextlib.suppress(OSError):
                    s.send(b"a")
            t0 = time.perf_counter()
            try:
                ok = requests.get(base + "/metrics", timeout=10).status_code == 200
            except requests.RequestException:
                ok = False
            lat.append(time.perf_counter() - t0)
            failures += not ok
            st = proc_status(pid)
            peak = {k: max(peak[k], st[k]) for k in peak}
            time.sleep(max(0.0, 1.0 - (time.perf_counter() - t0)))
        cut = 0
        for s in socks:
            try:
                s.recv(1)  # data (an error response) or b"" (closed): the agent cut it off
                cut += 1
            except BlockingIOError:
                pass
            except OSError:
                cut += 1
            s.close()
    print(f"slow connections: {connections} opened ({refused} refused) for {seconds:g} s")
    print(f"  agent idle: {idle['Threads']} threads, {idle['VmRSS'] / 1024:.1f} MB RSS")
    print(f"  agent peak: {peak['Threads']} threads, {peak['VmRSS'] / 1024:.1f} MB RSS")
    print(f"  legitimate scrapes: {len(lat)}, failed {failures}, median {statistics.median(lat) * 1e3:.1f} ms, "
          f"max {max(lat) * 1e3:.1f} ms")
    print(f"  slow connections answered/closed by the agent: {cut}")


def _users(cost: int) -> str:
    pw = bcrypt.hashpw(b"hunter2", bcrypt.gensalt(rounds=cost)).decode()
    return f"basic_auth_users:\n  prometheus: '{pw}'\n"


def spray(clients: int, seconds: float, cost: int) -> None:
    with agent(web_config=_users(cost)) as (base, pid), requests.Session() as legit:
        legit.auth = ("prometheus", "hunter2")
        assert legit.get(base + "/metrics", timeout=30).status_code == 200

        def scrape_for(t: float) -> list[float]:
            out = []
            end = time.monotonic() + t
            while time.monotonic() < end:
                t0 = time.perf_counter()
                legit.get(base + "/metrics", timeout=30)
                out.append(time.perf_counter() - t0)
                time.sleep(0.05)
            return out

        baseline = scrape_for(3.0)
        stop = threading.Event()
        sent = [0] * clients

        def attacker(i: int) -> None:
            with requests.Session() as s:
                s.auth = ("prometheus", f"guess{i}")
                while not stop.is_set():
                    with contextlib.suppress(requests.RequestException):
                        s.get(base + "/metrics", timeout=30)
                    sent[i] += 1

        threads = [threading.Thread(target=attacker, args=(i,), daemon=True) for i in range(clients)]
        c0, w0 = cpu_seconds(pid), time.monotonic()
        for t in threads:
            t.start()
        loaded = scrape_for(seconds)
        cpu, wall = cpu_seconds(pid) - c0, time.monotonic() - w0
        stop.set()
        for t in threads:
            t.join(60)
    med = statistics.median
    print(f"password spray: {clients} clients, bcrypt cost {cost}, {wall:.1f} s, {sum(sent)} wrong guesses")
    print(f"  agent CPU: {cpu:.1f} s in {wall:.1f} s = {cpu / wall:.2f} cores")
    print(f"  legitimate scrape median: unloaded {med(baseline) * 1e3:.1f} ms, under spray {med(loaded) * 1e3:.1f} ms "
          f"(x{med(loaded) / med(baseline):.1f}), max {max(loaded) * 1e3:.1f} ms, {len(loaded)} scrapes")


def timing(cost: int, n: int) -> None:
    with agent(web_config=_users(cost)) as (base, _):
        def med(user: str) -> float:
            out = []
            for _ in range(n):
                t0 = time.perf_counter()
                requests.get(base + "/health", auth=(user, "wrong"), timeout=30)
                out.append(time.perf_counter() - t0)
            return statistics.median(out)

        unknown, known = med("nobody"), med("prometheus")
    print(f"auth timing, bcrypt cost {cost}: unknown user {unknown * 1e3:.1f} ms, known user + wrong password "
          f"{known * 1e3:.1f} ms (ratio {known / unknown:.2f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("slow")
    s.add_argument("--connections", type=int, default=2000)
    s.add_argument("--seconds", type=float, default=15.0)
    s = sub.add_parser("spray")
    s.add_argument("--clients", type=int, default=8)
    s.add_argument("--seconds", type=float, default=15.0)
    s.add_argument("--cost", type=int, default=10)
    s = sub.add_parser("timing")
    s.add_argument("--cost", type=int, default=10)
    s.add_argument("--requests", type=int, default=20)
    a = p.parse_args()
    if a.cmd == "slow":
        slow(a.connections, a.seconds)
    elif a.cmd == "spray":
        spray(a.clients, a.seconds, a.cost)
    else:
        timing(a.cost, a.requests)


if __name__ == "__main__":
    main()
