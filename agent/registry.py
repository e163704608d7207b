"""The agent's prometheus-client collector: runs every gpufleet collector on a scrape.

:class:`AgentCollector` wraps the enabled collectors (:class:`~gpufleet.agent.collectors.Collector`)
and, per scrape, times each one and adds the node_exporter-style self metrics
``gpufleet_scrape_collector_duration_seconds{collector}`` and
``gpufleet_scrape_collector_success{collector}`` (a collector that raises reports 0, is
logged, and the others are still served) plus ``gpufleet_build_info``.

Scrapes that arrive together share one hardware read (single flight): a scrape that
starts while another is reading waits for that read and serves its result. With
``cache_seconds`` > 0 a finished read is also reused by scrapes arriving within that
many seconds. Scrapes of one read also share its encodings: each negotiated format
(:mod:`gpufleet.agent.exposition`) is encoded once per read, and gzip-compressed once per read,
so a burst of scrapes costs little more than one. ``describe()`` never touches hardware.

A read has a deadline (the scrape's timeout, from Prometheus' ``X-Prometheus-Scrape-Timeout-Seconds``
header or ``timeout``, less a margin: :mod:`gpufleet.agent.collectors.budget`). Each collector runs on
a worker of its own key (:class:`~gpufleet.agent.nvml.lanes.Lanes`); one that has not finished by the
deadline is left running, served without (success 0, its families absent, never an older copy) and
not started again until it returns, while the read answers with everything else.
"""

from __future__ import annotations

import gzip
import logging
import platform
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from importlib import metadata

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

from gpufleet.agent import __version__
from gpufleet.agent.collectors import Collector
from gpufleet.agent.collectors import budget as budgets
from gpufleet.agent.exposition import TEXT, Format, encode_text
from gpufleet.agent.nvml.lanes import Lanes, Outcome, staggered
from gpufleet.vocab import catalog

__all__ = ["AgentCollector", "encode_text", "new_registry"]

log = logging.getLogger("gpufleet.agent.registry")

_DURATION = catalog.spec("gpufleet_scrape_collector_duration_seconds")
_SUCCESS = catalog.spec("gpufleet_scrape_collector_success")
_BUILD = catalog.spec("gpufleet_build_info")
#: Worker threads running collectors: one normally busy, one more per collector stuck past a deadline.
COLLECTOR_WORKERS = 4
#: The part of a read's budget kept for the collectors after the one running, and at most how much
#: (seconds) for each of them.
RESERVE_SHARE = 0.3
RESERVE_MAX = 0.25


def _binding_version() -> str:
    try:
        return metadata.version("nvidia-ml-py")
    except metadata.PackageNotFoundError:
        return "unknown"


class _Flight:
    """One hardware read; scrapes that share it block on ``done`` and then share its encodings:
    each format is encoded at most once per read, and gzip-compressed at most once per read."""

    def __init__(self, owner: AgentCollector) -> None:
        self.done = threading.Event()
        self.metrics: list[Metric] = []
        self._owner = owner
        self._lock = threading.Lock()
        #: (content type, gzip) -> the lock that makes its encoding once-only, and the bytes once made
        self._locks: dict[tuple[str, bool], threading.Lock] = {}
        self._bytes: dict[tuple[str, bool], bytes] = {}

    def encoded(self, fmt: Format, gzipped: bool = False) -> bytes:
        key = (fmt.content_type, gzipped)
        body = self._bytes.get(key)
        if body is not None:
            return body
        with self._lock:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:  # a scrape asking for the same bytes while they are being made waits for them
            body = self._bytes.get(key)
            if body is None:
                if gzipped:
                    plain = self.encoded(fmt)
                    body = gzip.compress(plain, compresslevel=1)
                else:
                    body = fmt.encode(self.metrics)
                self._bytes[key] = body
                with self._lock:
                    if gzipped:
                        self._owner.compressions += 1
                    else:
                        self._owner.encodings += 1
            return body


class AgentCollector:
    """A prometheus-client collector (``collect``/``describe``) over gpufleet collectors."""

    def __init__(
        self, collectors: Sequence[Collector], cache_seconds: float = 0.0,
        clock: Callable[[], float] = time.monotonic, before_read: Callable[[], None] | None = None,
        timeout: float = budgets.DEFAULT_TIMEOUT,
    ) -> None:
        """``before_read``: called at the start of every hardware read, before any collector runs
        (the fake NVML's ``refresh_host``: a simulated host's files move on by themselves).
        ``timeout``: seconds a read may take when the scrape does not say (``--scrape.timeout``)."""
        self.collectors = list(collectors)
        self.timeout = timeout
        self._lanes = Lanes("gpufleet-collect", COLLECTOR_WORKERS, call_prefix="collect")
        #: Collectors found still running from an earlier read (logged once per stall).
        self._stuck: set[str] = set()
        self._before_read = before_read
        self.cache_seconds = cache_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._flight: _Flight | None = None
        self._last: _Flight | None = None
        self._last_done = 0.0
        #: Hardware reads performed (scrapes that shared a read or hit the cache do not count).
        self.reads = 0
        #: Scrapes that joined a hardware read already in progress instead of starting one.
        self.joined = 0
        #: Expositions encoded, and gzip-compressed: at most once per read and format.
        self.encodings = 0
        self.compressions = 0
        #: ``time.monotonic()`` when the hardware read in progress started; None between reads.
        self.reading_since: float | None = None
        #: ``time.monotonic()`` by which the read in progress must answer; None between reads.
        self.reading_deadline: float | None = None
        self._build = self._build_info()

    @staticmethod
    def _build_info() -> Metric:
        fam = GaugeMetricFamily(_BUILD.name, _BUILD.help, labels=list(_BUILD.labels))
        fam.add_metric([__version__, platform.python_version(), _binding_version()], 1.0)
        return fam

    def reading_for(self) -> float:
        """Seconds the hardware read in progress has been running; 0 when none is (a wedged read,
        e.g. an NVML call that never returns, grows without bound: the watchdog checks this)."""
        since = self.reading_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def overdue_for(self) -> float:
        """Seconds the read in progress has run past its deadline; 0 when none is. A read answers by its
        deadline whatever the hardware does, so this grows only when the scrape path itself is wedged
        (the watchdog checks this; a hung NVML call does not count)."""
        deadline = self.reading_deadline
        return 0.0 if deadline is None else max(0.0, time.monotonic() - deadline)

    def describe(self) -> Iterator[Metric]:
        yield _BUILD.family()
        yield _DURATION.family()
        yield _SUCCESS.family()
        for c in self.collectors:
            try:
                yield from c.describe()
            except Exception:  # a broken describe() must not stop the agent from starting
                log.exception("collector %s: describe() failed", c.name)

    def collect(self) -> Iterator[Metric]:
        return iter(self.read())

    def read(self, timeout: float | None = None) -> list[Metric]:
        """The metric families of one hardware read, shared with concurrent scrapes."""
        return self._shared_read(timeout).metrics

    def read_text(self, timeout: float | None = None) -> bytes:
        """The Prometheus text exposition (format 0.0.4) of one shared hardware read."""
        return self._shared_read(timeout).encoded(TEXT)

    def read_encoded(self, fmt: Format, gzipped: bool = False, timeout: float | None = None) -> bytes:
        """One shared hardware read in format ``fmt`` (gzip-compressed, level 1, if ``gzipped``):
        concurrent scrapes of the same read get the very same bytes, encoded and compressed once.
        ``timeout``: seconds the scrape allows (None: ``self.timeout``); the read answers within it."""
        return self._shared_read(timeout).encoded(fmt, gzipped)

    def stuck(self) -> list[str]:
        """Collectors still running from a read that went on without them."""
        return sorted(s.key for s in self._lanes.stalled())

    def close(self) -> None:
        """Idle collector workers exit (one stuck in a collector exits once it returns)."""
        self._lanes.close()

    def _shared_read(self, timeout: float | None = None) -> _Flight:
        with self._lock:
            if (self._last is not None and self.cache_seconds > 0
                    and self._clock() - self._last_done < self.cache_seconds):
                return self._last
            flight = self._flight
            owner = flight is None
            if flight is None:
                flight = self._flight = _Flight(self)
            else:
                self.joined += 1
        if not owner:
            flight.done.wait()
            return flight
        self.reading_since = time.monotonic()
        deadline = self.reading_deadline = budgets.deadline_for(self.timeout if timeout is None else timeout)
        try:
            flight.metrics = self._read_all(deadline)
        finally:
            self.reading_since = self.reading_deadline = None
            with self._lock:
                self._flight = None
                self._last = flight
                self._last_done = self._clock()
            flight.done.set()
        return flight

    def _read_all(self, deadline: float) -> list[Metric]:
        self.reads += 1
        start = time.monotonic()
        if self._before_read is not None:
            try:
                self._before_read()
            except Exception:  # the hook serves a fake host: it must never cost a scrape
                log.exception("before_read hook failed")
        out: list[Metric] = [self._build]
        duration = _DURATION.family()
        success = _SUCCESS.family()
        # One worker runs the collectors in order; each keeps a slice of the budget for every one after
        # it, so one that hangs on its first scrape still leaves them time (later it is skipped at once).
        collectors = self.collectors
        untils = staggered(start, deadline, len(collectors), RESERVE_SHARE, RESERVE_MAX)
        budgets_ = [budgets.Budget(start, u) for u in untils]
        outcomes = self._lanes.run_batch(
            [(c.name, "collect", partial(_collect, c, b)) for c, b in zip(collectors, budgets_, strict=True)], untils)
        for c, b, o in zip(collectors, budgets_, outcomes, strict=True):
            fams, ok = self._outcome(c, b, o)
            duration.add_metric([c.name], b.took)
            success.add_metric([c.name], ok)
            out.extend(fams)
        out.append(duration)
        out.append(success)
        return _merge(out)


    def _outcome(self, c: Collector, budget: budgets.Budget, o: Outcome[list[Metric]]) -> tuple[list[Metric], float]:
        """One collector's families for this read and its success (1, or 0: failed, late or incomplete)."""
        if not o.answered:
            if budget.started and not budget.took:
                budget.took = time.perf_counter() - budget.started  # still running: how long so far
            if c.name not in self._stuck:
                self._stuck.add(c.name)
                log.error("collector %s did not finish within the scrape's deadline: served without it, and not "
                          "run again until it returns", c.name)
            return [], 0.0
        self._stuck.discard(c.name)
        e = o.error
        if e is not None:
            log.error("collector %s failed: %s: %s", c.name, type(e).__name__, e)
            log.debug("collector %s traceback", c.name, exc_info=e)
            return [], 0.0
        return o.result or [], 0.0 if budget.missing else 1.0


def _collect(c: Collector, budget: budgets.Budget) -> list[Metric]:
    token = budgets.enter(budget)
    budget.started = time.perf_counter()
    try:
        return list(c.collect())
    finally:
        budget.took = time.perf_counter() - budget.started
        budgets.leave(token)


def _merge(families: Iterable[Metric]) -> list[Metric]:
    """Merge families of the same name (two collectors may contribute to one family)."""
    by_name: dict[str, Metric] = {}
    for fam in families:
        prev = by_name.get(fam.name)
        if prev is None:
            by_name[fam.name] = fam
        elif prev.type == fam.type:
            if not prev.samples:
                by_name[fam.name] = fam
            elif fam.samples:
                merged = Metric(prev.name, prev.documentation, prev.type, prev.unit)
                merged.samples = [*prev.samples, *fam.samples]
                by_name[fam.name] = merged
        else:
            log.error("metric family %s produced with two types (%s, %s); dropping the second",
                      fam.name, prev.type, fam.type)
    return list(by_name.values())


def new_registry(collector: AgentCollector) -> CollectorRegistry:
    """A fresh registry holding only the agent's collector (no process/platform collectors)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    return reg
