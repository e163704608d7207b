"""Scraping as Prometheus does it, applied to a capture: when each target was scraped and what it read then.

The physics advances in ticks of the scrape interval ``dt``; a recording under the ``prometheus`` scrape model
(:mod:`gpufleet.sim.scraping`) is what a Prometheus server would have stored of it:

* **Targets.** Every exporter on every node is a target of its own (``instance``: ``<node>:<port>``); so are
  the facility's BMS and kube-state-metrics. Prometheus spreads its targets over the interval: a target's
  scrapes start at a fixed offset inside the interval, a stable hash of the target (mixed with the server's
  seed, the scenario's), plus a few milliseconds of jitter on every scrape. Timestamps are the scrape's start,
  in milliseconds.
* **When things change.** The ticks' changes (a job entering a checkpoint, a crash, a fault) happen at one
  instant inside the following interval (drifting through it and back over :data:`PHASE_TURN` ticks), reached by each
  node a few hundred ms apart (the ranks' skew, ``rank_skew_ms``), never before their labelled time. A target scraped before that instant still reads the previous state, one scraped
  after it the new one, so a job-wide edge reaches the nodes' samples up to one interval apart. Gauges read
  the state holding at their read time; counters grow linearly between two changes, so rates stay smooth.
* **Exporter lag.** dcgm-exporter serves what it collected on its own interval (``exporter_collect_interval``,
  at a phase of its own): its values are those of its last collection, up to one collect interval old. The
  gpufleet agent, node_exporter and ipmi_exporter read at scrape time.
* **Failed scrapes and restarts.** A scrape fails with the scenario's ``miss_rate`` (per target), while its
  node is down, and while its exporter restarts (``[[exporter_restarts]]``); a restarted exporter's own
  counters start again from 0 (dcgm-exporter's violation counters and XID gauge, the agent's XID counters).

:class:`ScrapeModel` holds the model of one capture; :meth:`ScrapeModel.frames` gives the capture as one
profile's targets read it (lazily, array by array), :meth:`ScrapeModel.timing` what the writer needs per
target (timestamps, successful scrapes). Under the ``aligned`` model nothing here is used.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gpufleet.sim.recording.capture import CUMULATIVE_ARRAYS, Frames, entity_of
from gpufleet.sim.simulator import Simulator
from gpufleet.vocab.exporters import DCGM, IPMI_EXPORTER, NODE_EXPORTER, Exporter

#: The gpufleet agent as Prometheus scrapes it (one target per node).
AGENT = Exporter("gpufleet-agent", "gpufleet-agent", 9445)
#: Per profile: the exporter behind each restartable component (:data:`gpufleet.sim.scraping.COMPONENTS`)
#: and the component that serves each kind of array (gpu, nic, node).
EXPORTERS: dict[str, dict[str, Exporter]] = {"gpufleet": {"gpu": AGENT},
                                             "dcgm": {"gpu": DCGM, "node": NODE_EXPORTER, "ipmi": IPMI_EXPORTER}}
SERVES: dict[str, dict[str, str]] = {"gpufleet": {"gpu": "gpu", "nic": "gpu", "node": "gpu"},
                                     "dcgm": {"gpu": "gpu", "nic": "node", "node": "ipmi"}}
#: Ticks for the instant of a tick's changes to drift through the interval and back.
PHASE_TURN = 123.6
#: Exporters whose values lag the scrape by their own collect interval.
LAGGING = frozenset({DCGM.job})


def instance(exporter: Exporter, node: str) -> str:
    """The ``instance`` label of ``exporter`` on ``node``."""
    return f"{node}:{exporter.port}"


def _hash(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little")


@dataclass
class Target:
    """One target's scrapes: sample times (unix s, ms resolution) and whether each succeeded (ticks)."""

    times: np.ndarray
    ok: np.ndarray


class ScrapeModel:
    """The scrape model of one capture ``fr`` of ``sim`` (see the module docstring)."""

    def __init__(self, sim: Simulator, fr: Frames) -> None:
        sc = sim.scenario
        self.sim = sim
        self.fr = fr
        self.spec = sc.scrape
        self.dt = float(sc.step)
        self.n = len(fr.times)
        self.t0 = float(fr.times[0])
        self.start = sim.start
        self.seed = sim.seed
        self.miss_rate = sc.miss_rate
        self.nodes = sim.nodes
        rng = np.random.default_rng([self.seed, 0x5C4A])
        # where inside its interval a tick's changes land: drifting to and fro through the interval (there and
        # back every PHASE_TURN ticks), so edges minutes apart split the targets differently while every state
        # holds about one interval (a random phase per tick would have a target read some ticks twice and skip
        # others; a sawtooth would squeeze a tick's counters into an instant once a turn)
        phase = 1.0 - np.abs(2.0 * ((rng.random() + np.arange(self.n) / PHASE_TURN) % 1.0) - 1.0)
        skew = rng.normal(0.0, self.spec.rank_skew_ms / 1000.0, (self.n, len(self.nodes)))
        inside = np.clip(phase[:, None] * self.dt + skew, 1e-3, self.dt - 1e-3)
        # change[k, node]: when tick k's state begins on the node, inside [t_k, t_k+1) so that nothing is seen
        # before its time (a fault's labelled onset); row n: one interval after the last
        self.change = np.empty((self.n + 1, len(self.nodes)))
        self.change[:-1] = fr.times[:, None] + inside
        self.change[-1] = self.change[-2] + self.dt
        self.site_change = np.empty(self.n + 1)
        self.site_change[:-1] = fr.times + phase * self.dt
        self.site_change[-1] = self.site_change[-2] + self.dt
        self._targets: dict[str, Target] = {}
        self._readers: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
        node_index = {name: i for i, name in enumerate(self.nodes)}
        #: (node, component) -> [(start, end)] of the scenario's exporter restarts, unix s
        self.restarts: dict[tuple[int, str], list[tuple[float, float]]] = {}
        for r in sc.exporter_restarts:
            at = self.start + float(r["at"])
            self.restarts.setdefault((node_index[r["node"]], r.get("component", "gpu")), []).append(
                (at, at + float(r["seconds"])))

    def begins(self, t: float, node: int | None) -> float | None:
        """When a change scheduled for ``t`` (a fault's labelled onset) begins on ``node`` in the recording: the
        instant inside its interval where the first tick at or after ``t`` lands there (the site-wide instant for
        ``None``). None past the capture's end."""
        k = int(np.searchsorted(self.fr.times, t - 1e-6))
        if k >= self.n:
            return None
        return float(self.site_change[k] if node is None else self.change[k, node])

    # ---------------------------------------------------------------- targets
    def target(self, inst: str, node: int | None = None, component: str | None = None) -> Target:
        """The scrapes of target ``inst`` (on ``node``, serving ``component``: its restarts and reboots)."""
        got = self._targets.get(inst)
        if got is not None:
            return got
        h = _hash(self.seed, inst)
        offset = (h >> 11) / float(1 << 53) * self.dt
        rng = np.random.default_rng([self.seed, h & 0xFFFFFFFF])
        sd = self.spec.jitter_ms / 1000.0
        jitter = np.clip(rng.normal(0.0, sd, self.n), -4 * sd, 4 * sd) if sd > 0 else np.zeros(self.n)
        times = np.round((self.fr.times - self.dt + offset + jitter) * 1000.0) / 1000.0
        ok = rng.random(self.n) >= self.miss_rate
        if node is not None:
            up = self.fr.arrays["node_up"][:, node]
            ok &= up[self._index(times[:, None], self.change[:, [node]])[:, 0]]
            for a, b in self.restarts.get((node, component or ""), []):
                ok &= ~((times >= a) & (times < b))
        got = self._targets[inst] = Target(times, ok)
        return got

    def node_target(self, profile: str, component: str, node: int) -> Target:
        return self.target(instance(EXPORTERS[profile][component], self.nodes[node]), node, component)

    def read_times(self, profile: str, component: str) -> np.ndarray:
        """When each node's ``component`` target read what it served at each scrape, ticks x nodes: the scrape
        itself, or the exporter's last collection before it when it collects on its own interval."""
        exp = EXPORTERS[profile][component]
        s = np.stack([self.node_target(profile, component, i).times for i in range(len(self.nodes))], axis=1)
        if exp.job not in LAGGING:
            return s
        every = self.spec.exporter_collect_interval or self.dt
        phase = self.start + np.array([(_hash(self.seed, "collect", name) >> 11) / float(1 << 53) * every
                                       for name in self.nodes])
        return phase[None, :] + every * np.floor((s - phase[None, :]) / every)

    def _index(self, x: np.ndarray, change: np.ndarray) -> np.ndarray:
        """The tick whose state holds at times ``x`` (ticks x columns) given each column's change times."""
        k = np.clip(np.floor((x - self.t0) / self.dt).astype(np.int64), 0, self.n - 1)
        m = k - (x < np.take_along_axis(change, k, axis=0))
        return np.clip(m, 0, self.n - 1)

    # ---------------------------------------------------------------- frames
    def _reader(self, profile: str, kind: str) -> tuple[np.ndarray, np.ndarray]:
        """(tick index, fraction of the way to the next tick's state) that each of ``profile``'s targets serving
        arrays of ``kind`` read at each scrape, ticks x nodes (x sites for ``site``)."""
        key = (profile, kind)
        if key not in self._readers:
            if kind == "site":
                sites = [s.name for s in self.sim.fleet.sites]
                x = np.stack([self.target(f"bms-{s}").times for s in sites], axis=1)
                change = np.repeat(self.site_change[:, None], len(sites), axis=1)
            else:
                x = self.read_times(profile, SERVES[profile][kind])
                change = self.change
            m = self._index(x, change)
            lo = np.take_along_axis(change, m, axis=0)
            hi = np.take_along_axis(change, m + 1, axis=0)
            self._readers[key] = (m, np.clip((x - lo) / (hi - lo), 0.0, 1.0))
        return self._readers[key]

    def gauge(self, profile: str, kind: str, values: np.ndarray, node_of_col: np.ndarray) -> np.ndarray:
        """``values`` (ticks x columns on nodes ``node_of_col``) as the targets serving ``kind`` read them."""
        m = self._reader(profile, kind)[0][:, node_of_col]
        out: np.ndarray = values[m, np.arange(values.shape[1])[None, :]]
        return out

    def frames(self, profile: str) -> Frames:
        """The capture as ``profile``'s targets read it (arrays resampled on first use)."""
        f = self.sim.fleet
        owner = {"gpu": f.gpu_node, "nic": f.nic_node, "node": np.arange(len(self.nodes)),
                 "site": np.arange(len(f.sites))}
        flat: dict[tuple[str, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

        def indices(kind: str, inner: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            """Flat indices (into a ticks x (columns * inner) array) of what each scrape reads, of the tick
            before it, and the fraction of the way between them."""
            if (kind, inner) not in flat:
                m_all, frac_all = self._reader(profile, kind)
                m = np.repeat(m_all[:, owner[kind]], inner, axis=1)
                width = m.shape[1]
                col = np.arange(width, dtype=np.int64)[None, :]
                flat[(kind, inner)] = (m * width + col, np.maximum(m - 1, 0) * width + col,
                                       np.repeat(frac_all[:, owner[kind]], inner, axis=1))
            return flat[(kind, inner)]

        def resample(key: str, a: np.ndarray) -> np.ndarray:
            inner = int(np.prod(a.shape[2:], dtype=np.int64))
            now_i, before_i, frac = indices(entity_of(key), inner)
            source = a.reshape(-1)
            now: np.ndarray = source.take(now_i).reshape(a.shape)
            if key not in CUMULATIVE_ARRAYS:
                return now
            before: np.ndarray = source.take(before_i).reshape(a.shape)
            out: np.ndarray = before + frac.reshape(a.shape) * (now - before)
            return np.floor(out) if np.issubdtype(a.dtype, np.integer) else out

        return Frames(times=self.fr.times, arrays=_Resampled(self.fr.arrays, resample), xid=self.fr.xid,
                      job_ids=self.fr.job_ids)

    def timing(self, profile: str) -> Timing:
        """Per target, what the writer needs: the node targets of ``profile`` first, any other on first use."""
        t = Timing(self)
        for comp in EXPORTERS[profile]:
            for i in range(len(self.nodes)):
                t.add(instance(EXPORTERS[profile][comp], self.nodes[i]), self.node_target(profile, comp, i))
        return t

    # ---------------------------------------------------------------- restarts
    def restart_ticks(self, profile: str, node: int, component: str = "gpu") -> list[int]:
        """The first tick after each restart of the node's ``component`` exporter (its counters begin again)."""
        times = self.node_target(profile, component, node).times
        return [int(np.searchsorted(times, b)) for _, b in self.restarts.get((node, component), [])
                if np.searchsorted(times, b) < self.n]


class _Resampled(dict[str, np.ndarray]):
    """A capture's arrays as a profile reads them, each resampled the first time it is asked for."""

    def __init__(self, source: dict[str, np.ndarray], resample: Callable[[str, np.ndarray], np.ndarray]) -> None:
        super().__init__()
        self.source = source
        self.resample = resample

    def __missing__(self, key: str) -> np.ndarray:
        value = self.resample(key, self.source[key])
        self[key] = value
        return value

    def __contains__(self, key: object) -> bool:
        return key in self.source


class Timing:
    """The writer's view of the targets: a row per target of sample timestamps (text) and successful scrapes."""

    WIDTH = 14  # unix seconds with milliseconds: 10 digits, a point, 3 digits

    def __init__(self, model: ScrapeModel) -> None:
        self.model = model
        self.rows: dict[bytes, int] = {}
        self._ts: list[np.ndarray] = []
        self._ok: list[np.ndarray] = []
        self._tables: tuple[np.ndarray, np.ndarray] | None = None

    def add(self, inst: str, target: Target) -> int:
        key = inst.encode()
        if key not in self.rows:
            self.rows[key] = len(self._ts)
            ms = np.round(target.times * 1000.0).astype(np.int64)
            self._ts.append(_ms_text(ms))
            self._ok.append(target.ok)
            self._tables = None
        return self.rows[key]

    def rows_of(self, prefixes: list[bytes]) -> np.ndarray:
        """The target row of each series (from its ``instance`` label; targets not seen yet are added)."""
        out = np.empty(len(prefixes), np.int64)
        for i, p in enumerate(prefixes):
            a = p.find(b'instance="')
            inst = p[a + 10:p.find(b'"', a + 10)] if a >= 0 else b""
            row = self.rows.get(inst)
            out[i] = row if row is not None else self.add(inst.decode(), self.model.target(inst.decode()))
        return out

    def tables(self) -> tuple[np.ndarray, np.ndarray]:
        """(timestamps text, targets x ticks x WIDTH; successful scrapes, targets x ticks)."""
        if self._tables is None:
            self._tables = (np.stack(self._ts), np.stack(self._ok))
        return self._tables


def _ms_text(ms: np.ndarray) -> np.ndarray:
    """``1751328015.123`` as bytes per tick (ticks x 14) from integer milliseconds."""
    digits = np.frombuffer(b"0123456789", np.uint8)
    pow10 = 10 ** np.arange(12, -1, -1, dtype=np.int64)
    d = digits[(ms[:, None] // pow10) % 10]
    out = np.empty((len(ms), Timing.WIDTH), np.uint8)
    out[:, :10] = d[:, :10]
    out[:, 10] = ord(".")
    out[:, 11:] = d[:, 10:]
    return out
