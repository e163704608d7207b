"""Shards that split the query load: each shard reads only its jobs' nodes (job map, node selectors), the
fleet-wide parts once, and together they find exactly what one detector finds."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from test_detector_core import T0, Fault, Synth, fast_cfg, synth

from gpufleet.detector.config import DetectorConfig
from gpufleet.detector.engine import Detector
from gpufleet.detector.incidents.tracker import Finding
from gpufleet.detector.sharding import job_map as shard_map
from gpufleet.detector.sharding import shard, shard_source
from gpufleet.detector.sources.profiles import Query, queries
from gpufleet.detector.sources.prometheus import PrometheusSource
from gpufleet.detector.sources.recording import RecordingSource
from gpufleet.detector.sources.source import Result, SeriesTable, SourceError

TIMES = [T0 + 607.5 + 60.0 * i for i in range(8)]
FAULTS = [Fault("clock", 1, 2, 540.0), Fault("thermal", 2, 5, 540.0), Fault("link", 6, 1, 540.0)]


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth(tmp_path_factory.mktemp("shards") / "rec.om",
                 Synth(nodes=8, seconds=1200.0, faults=FAULTS, idle_nodes=(7,), jobs=4, seed=3))


@pytest.fixture(scope="module")
def source(recording: Path) -> RecordingSource:
    return RecordingSource.load([recording])


STEP = 15.0  # the recording's scrape interval
_SELECTOR = re.compile(r'(\w+)(?:\{(.*)\})?')
_MATCHER = re.compile(r'(\w+)(=~|=)"([^"]*)"')


class Counting:
    """A recording source as a backend would serve it: it counts the samples its queries touch (a range query:
    every sample in the window) and its metadata lookups (the series and label values APIs read no sample)."""

    def __init__(self, inner: RecordingSource) -> None:
        self.inner = inner
        self.query_errors = 0
        self.samples = 0.0
        self.name_lookups = 0
        self.metadata = 0

    def query(self, q: Query, t: float, window: float) -> Result:
        res = self.inner.query(q, t, window)
        self.samples += len(res) * (window // STEP + 1)
        return res

    def metric_names(self, start: float, end: float) -> set[str]:
        """As the label values API answers: the names in the recording (a superset of those in the window)."""
        self.name_lookups += 1
        return self.inner.metric_names()

    def series(self, selector: str, start: float, end: float) -> Result:
        """As the series API answers (label sets from the index, no sample read): the selector's series, value 1."""
        m = _SELECTOR.fullmatch(selector)
        assert m is not None, selector
        matchers = tuple((k, op, v) for k, op, v in _MATCHER.findall(m.group(2) or ""))
        res = self.inner.query(Query("@series", m.group(1), "count", matchers=matchers), end, end - start)
        self.metadata += 1
        return Result(res.table, res.ids, res.values * 0 + 1)

    def label_values(self, label: str, match: list[str], start: float, end: float) -> set[str]:
        """As the label values API answers: over the series of the ``match`` selectors, all series when none."""
        self.metadata += 1
        if not match:
            return {v for ss in self.inner.series.values() for s in ss if (v := s.labels.get(label)) is not None}
        out: set[str] = set()
        for sel in match:
            m = _SELECTOR.fullmatch(sel)
            assert m is not None, sel
            matchers = _MATCHER.findall(m.group(2) or "")
            for s in self.inner.series.get(m.group(1), []):
                if all(re.fullmatch(v, s.labels.get(k, "")) if op == "=~" else s.labels.get(k, "") == v
                       for k, op, v in matchers) and (got := s.labels.get(label)) is not None:
                    out.add(got)
        return out


def _key(f: Finding) -> tuple[object, ...]:
    return (f.kind, f.cause, f.node, f.gpu, f.job, f.site, f.nic, f.start, f.end)


def run(cfg: DetectorConfig, src: object) -> set[tuple[object, ...]]:
    det = Detector(cfg, src)  # type: ignore[arg-type]
    for t in TIMES:
        det.evaluate(t)
    return {_key(f) for f in det.tracker.all_findings()}


@pytest.mark.parametrize("local", [True, False])
@pytest.mark.parametrize("n", [2, 4])
def test_shards_together_find_exactly_what_one_detector_finds(source: RecordingSource, n: int, local: bool) -> None:
    one_src = Counting(source)
    served = 0.0
    one = run(fast_cfg(), one_src)
    assert {"straggler", "network"} <= {k[0] for k in one}, one
    parts: list[set[tuple[object, ...]]] = []
    for i in range(n):
        cfg = fast_cfg(detector__shard=f"{i}/{n}")
        counted = Counting(source)
        view = shard_source.ShardSource(counted, shard.Shard(i, n), cfg, local=local)
        parts.append(run(cfg, view))
        served += counted.samples
        if not local:  # the backend itself was asked for this shard's nodes only (a shard may own no job)
            assert view.plan is not None and bool(view.plan.selectors) == bool(view.plan.nodes)
            # metrics the backend does not hold (MIG, Kubernetes, RoCE here) are not asked for
            assert counted.name_lookups == len(TIMES)
            assert view.requests < len(TIMES) * (1 + len(queries("gpufleet")) * max(1, len(view.plan.selectors))) / 2
    union: set[tuple[object, ...]] = set().union(*parts)
    assert union == one
    assert sum(len(p) for p in parts) == len(one)  # each finding from one shard only
    if not local:
        # the samples all shards together touch: one detector's, plus a small job map per shard
        assert served < 1.2 * one_src.samples, (served, one_src.samples)


def test_each_shard_reads_only_its_nodes_and_shard_0_the_fleet_parts(source: RecordingSource) -> None:
    qs = queries("gpufleet")
    plans = []
    for i in range(4):
        view = shard_source.ShardSource(source, shard.Shard(i, 4), fast_cfg(detector__shard=f"{i}/4"), local=False)
        plans.append(view.make_plan(qs, TIMES[0], 120.0))
    every = {f"node-{k:03d}" for k in range(8)}
    assert set().union(*(p.nodes for p in plans)) == every
    # node-007 is idle (no job): its GPUs are compared across the fleet, by shard 0
    assert "node-007" in plans[0].nodes and all("node-007" not in p.nodes for p in plans[1:])
    for p in plans:
        assert p.readers == plans[0].readers  # every shard computes the same map
        for node in p.nodes:
            assert re.fullmatch(p.selectors[0], f"{node}:9445")
        for node in every - set(p.nodes):
            assert not any(re.fullmatch(rx, f"{node}:9445") for rx in p.selectors)


def test_node_regexes_are_batched_literal_alternations() -> None:
    values = [f"gpu-{i:05d}.dc1.example:9400" for i in range(2000)] + ["[fe80::1]:9100", "a+b:1"]
    rxs = shard_source.node_regexes(values, max_bytes=4000)
    assert len(rxs) > 1 and all(len(r) <= 4000 for r in rxs)
    compiled = [re.compile(r) for r in rxs]
    for v in values:
        assert sum(bool(c.fullmatch(v)) for c in compiled) == 1, v
    assert not any(c.fullmatch("gpu-00000Xdc1.example:9400") for c in compiled)  # dots are literal
    assert not any(c.fullmatch("gpu-00000.dc1.example") for c in compiled)  # exact values only
    assert not any(c.fullmatch("aab:1") for c in compiled)
    assert shard_source.node_regexes(["n1:9445", "n1:9445"]) == ["n1:9445"]
    assert shard_source.node_regexes([]) == []


def test_a_shards_nodes_go_out_in_few_batches() -> None:
    # each request costs the backend about 1.3 ms whatever it selects (Prometheus 2.42, 10,000 GPUs): a shard of
    # N = 2 or 4 at 10,000 GPUs (625 or 313 nodes, one instance each) sends each query once, not once per 256 nodes
    half = [f"node-{i:04d}:9445" for i in range(0, 1250, 2)]
    assert len(shard_source.node_regexes(half)) == 1
    assert len(shard_source.node_regexes(half, max_values=256)) == 3
    many = [f"node-{i:05d}.cluster.example:9100" for i in range(5000)]
    rxs = shard_source.node_regexes(many)
    assert all(len(r) <= shard_source.MAX_SELECTOR_BYTES and r.count("|") < shard_source.MAX_SELECTOR_VALUES
               for r in rxs)
    assert sorted(v for r in rxs for v in r.replace("\\", "").split("|")) == sorted(many)


def test_unsharded_detector_reads_the_source_itself(source: RecordingSource) -> None:
    assert shard_source.view(source, fast_cfg()) is source
    assert shard_source.view(source, fast_cfg(detector__shard="0/1")) is source
    assert isinstance(shard_source.view(source, fast_cfg(detector__shard="1/2")), shard_source.ShardSource)


def test_jobless_gpus_and_sites_belong_to_shard_0() -> None:
    assert shard.gpu_key(None, "node-3") == shard.FLEET_KEY
    assert all(shard.Shard(0, n).owns(shard.FLEET_KEY) for n in (1, 2, 4, 8))
    assert not shard.Shard(1, 2).owns(shard.FLEET_KEY)
    assert shard.owns_finding(shard.Shard(0, 4), "pue_drift", None, "dc1")
    assert not shard.owns_finding(shard.Shard(2, 4), "pue_drift", None, "dc1")
    owners = {"node-1": 2}
    assert shard.owns_finding(shard.Shard(2, 4), "network", "node-1", None, owners)
    assert not shard.owns_finding(shard.Shard(0, 4), "network", "node-1", None, owners)
    assert shard.owns_finding(shard.Shard(0, 4), "network", "storage-1", None, owners)  # no GPU: shard 0


def test_shards_on_a_simulated_dcgm_fleet_read_every_exporter(tmp_path: Path) -> None:
    """dcgm-exporter (:9400), node_exporter (:9100) and ipmi_exporter (:9290) name one node three ways: the job map
    finds each exporter's instance, so every shard reads its nodes' GPU, NIC and node series from all three."""
    from gpufleet.sim.cli import main as sim_main

    assert sim_main(["generate", "--scenario", "ib_link_degraded", "--out", str(tmp_path), "--profile", "dcgm",
                     "--hours", "0.75", "--quiet"]) == 0
    src = RecordingSource.load([tmp_path / "metrics.dcgm.om"])
    lo, hi = src.time_range()
    times = [lo + 300.0 + 60.0 * i for i in range(int((hi - lo - 300.0) // 60.0))]

    def found(cfg: DetectorConfig, s: object) -> set[tuple[object, ...]]:
        det = Detector(cfg, s)  # type: ignore[arg-type]
        for t in times:
            det.evaluate(t)
        return {_key(f) for f in det.tracker.all_findings()}

    one = found(fast_cfg(detector__profile="dcgm"), src)
    assert "network" in {k[0] for k in one}, one
    parts = []
    reading = 0
    for i in range(8):  # job-a's and job-b's nodes on shards 1 and 7 (the others read nothing)
        cfg = fast_cfg(detector__profile="dcgm", detector__shard=f"{i}/8")
        view = shard_source.ShardSource(Counting(src), shard.Shard(i, 8), cfg, local=False)
        parts.append(found(cfg, view))
        assert view.plan is not None
        ports = {v.rsplit(":", 1)[1] for rx in view.plan.selectors for v in rx.split("|")}
        assert ports == ({"9400", "9100", "9290"} if view.plan.nodes else set()), ports
        reading += bool(view.plan.nodes)
    assert sum(len(p) for p in parts) == len(one) and set().union(*parts) == one
    assert reading >= 2  # the fleet was split


def test_report_of_a_shard_plots_from_the_recording(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gpufleet.detector.service.cli import main as cli_main

    rec = synth(tmp_path / "r.om", Synth(faults=[Fault("clock", 1, 3, 600.0)], seconds=1200.0))
    cfg = tmp_path / "d.toml"
    cfg.write_text("[detector]\nwindow_seconds = 120\n[findings]\nopen_after = 2\n")
    mine = shard.owner("job:job-a", 2)
    out = tmp_path / "report.html"
    assert cli_main(["report", str(rec), "--config", str(cfg), "--step", "60", "--html", str(out),
                     "--shard", f"{mine}/2"]) == 0
    assert "node-001" in capsys.readouterr().out
    assert out.read_text().count("<svg") == 4  # the finding's evidence, read through the shard's view
    assert cli_main(["report", str(rec), "--config", str(cfg), "--step", "60", "--shard", f"{1 - mine}/2"]) == 0
    assert "findings (0)" in capsys.readouterr().out


class NoMetadata(Counting):
    """A backend that refuses the series API and answers no label values (metadata endpoints blocked)."""

    def series(self, selector: str, start: float, end: float) -> Result:
        raise SourceError(f"series {selector}: HTTP 403: forbidden")

    def label_values(self, label: str, match: list[str], start: float, end: float) -> None:  # type: ignore[override]
        return None

    def metric_names(self, start: float, end: float) -> None:  # type: ignore[override]
        return None


def test_shards_without_the_metadata_endpoints_query_instead(source: RecordingSource) -> None:
    one = run(fast_cfg(), source)
    parts = []
    for i in range(2):
        cfg = fast_cfg(detector__shard=f"{i}/2")
        parts.append(run(cfg, shard_source.ShardSource(NoMetadata(source), shard.Shard(i, 2), cfg, local=False)))
    assert sum(len(p) for p in parts) == len(one) and parts[0] | parts[1] == one


def test_fleet_parts_are_read_by_every_shard_unrestricted() -> None:
    from gpufleet.detector.sources.profiles import DCGM_FABRIC, FABRIC

    # NVL72 fabric series: a rack's NVLink domain spans trays of any job (its findings go by node hash)
    assert all(shard_source.scope(q) == "fleet" for q in FABRIC + DCGM_FABRIC)
    assert {shard_source.scope(q) for q in queries("gpufleet") if q.metric.startswith("kube_")} == {"fleet"}
    assert shard.owns_finding(shard.Shard(shard.bucket("node:rack A1", 4), 4), "nvlink_domain", "rack A1", None, {})
    assert sum(shard.owns_finding(shard.Shard(i, 4), "tray_health", "node-3", None, {}) for i in range(4)) == 1


class Fleet:
    """A backend whose GPUs' jobs change between evaluations: each GPU's sample series, its job series where it has a
    job, and NIC series per node; the series and label values APIs answer from the current state."""

    def __init__(self, jobs: dict[tuple[int, int], str | None]) -> None:
        self.jobs = jobs
        self.query_errors = 0
        self.table = SeriesTable()

    def _series(self) -> dict[str, list[dict[str, str]]]:
        out: dict[str, list[dict[str, str]]] = {"gpufleet_gpu_utilization_ratio": [], "gpufleet_gpu_job_info": [],
                                                "gpufleet_ib_port_rate_bytes_per_second": []}
        for (n, g), job in sorted(self.jobs.items()):
            lb = {"instance": f"node-{n}:9445", "gpu": str(g)}
            out["gpufleet_gpu_utilization_ratio"].append(lb)
            out["gpufleet_ib_port_rate_bytes_per_second"].append({"instance": f"node-{n}:9445", "device": f"mlx5_{g}"})
            if job:
                out["gpufleet_gpu_job_info"].append({**lb, "job_id": job})
        return out

    def _match(self, sel: str) -> list[dict[str, str]]:
        m = _SELECTOR.fullmatch(sel)
        assert m is not None, sel
        matchers = _MATCHER.findall(m.group(2) or "")
        return [s for s in self._series().get(m.group(1), [])
                if all(re.fullmatch(v, s.get(k, "")) if op == "=~" else s.get(k, "") == v for k, op, v in matchers)]

    def metric_names(self, start: float, end: float) -> set[str]:
        return {k for k, v in self._series().items() if v}

    def label_values(self, label: str, match: list[str], start: float, end: float) -> set[str]:
        series = [s for ss in self._series().values() for s in ss] if not match else [
            s for sel in match for s in self._match(sel)]
        return {v for s in series if (v := s.get(label)) is not None}

    def series(self, selector: str, start: float, end: float) -> Result:
        got = self._match(selector)
        return Result(self.table, np.array([self.table.intern(s) for s in got], dtype=np.int64), np.ones(len(got)))

    def query(self, q: Query, t: float, window: float) -> Result:
        return self.series(shard_map.selector(q), t - window, t)


def _needed(jobs: dict[tuple[int, int], str | None], i: int, n: int) -> set[str]:
    """The nodes shard i/n must read: those with a GPU whose job it owns (or, shard 0, a GPU without a job)."""
    return {f"node-{nd}" for (nd, _), job in jobs.items() if shard.owner(shard.gpu_key(job, ""), n) == i}


def test_a_kept_job_map_follows_jobs_that_start_end_and_move_at_the_next_evaluation() -> None:
    n = 4
    jobs: dict[tuple[int, int], str | None] = {(nd, g): f"job-{nd % 6}" if nd < 12 else None
                                               for nd in range(16) for g in range(4)}
    fleet = Fleet(jobs)
    qs = queries("gpufleet")
    views = [shard_source.ShardSource(fleet, shard.Shard(i, n), fast_cfg(detector__shard=f"{i}/{n}"), local=False)
             for i in range(n)]
    owner = {f"job-{k}": shard.owner(f"job:job-{k}", n) for k in range(20)}
    moved = next(j for j, o in owner.items() if o != 0 and j in set(jobs.values()))
    new = next(j for j, o in owner.items() if o != 0 and j not in set(jobs.values()))

    def check(step: str) -> None:
        for i, v in enumerate(views):
            plan = v.current_plan(qs, T0, 120.0, fleet.metric_names(0, 0))
            need = _needed(jobs, i, n)
            assert need <= set(plan.nodes), (step, i, sorted(need - set(plan.nodes)))
            for node in need:  # every series of the node is selected (the exporter's instance)
                assert any(re.fullmatch(rx, f"{node}:9445") for rx in plan.selectors), (step, i, node)

    check("start")
    full = [v.cache.full_maps for v in views]
    check("unchanged")
    assert [v.cache.full_maps for v in views] == full  # nothing changed: no full map was read again
    # a job moves to idle nodes (its id stays): its shard reads the new nodes, shard 0 the nodes it left
    for (nd, g), job in list(jobs.items()):
        if job == moved:
            jobs[(nd, g)] = None
            jobs[(nd + 12 if nd + 12 < 16 else nd, g)] = moved
    check("moved")
    # a job grows onto GPUs of a node that runs another job (no new node, no new job id)
    spare = next(k for k, j in jobs.items() if j is not None and j != moved and owner[j] != owner[moved])
    jobs[spare] = moved
    check("grown")
    # a new job starts on jobless GPUs; then a job ends (its GPUs jobless: shard 0 reads them)
    for k in [k for k, j in jobs.items() if j is None][:4]:
        jobs[k] = new
    check("new")
    ended = next(j for j in set(jobs.values()) if j and j not in (moved, new))
    for k, j in list(jobs.items()):
        if j == ended:
            jobs[k] = None
    check("ended")
    for v in views:  # and at the latest every refresh_every evaluations, the full map again
        v.cache.age = v.cache.refresh_every
    before = [v.cache.full_maps for v in views]
    check("refresh")
    assert [v.cache.full_maps for v in views] == [b + 1 for b in before]


def test_folded_queries_answer_each_query_exactly_what_it_alone_answers(source: RecordingSource) -> None:
    from gpufleet.detector.sharding import fold as shard_fold

    qs = [q for q in queries("gpufleet") if shard_source.scope(q) == "nodes"]
    sent, into = shard_fold.fold(qs)
    assert len(sent) < len(qs) - 10  # clock reasons, clocks, sensors, NIC errors: one query each
    thr = [q for q in qs if q.metric == "gpufleet_gpu_clock_event_active" and q.op == "avg"]
    assert len({into[qs.index(q)] for q in thr}) == 1 and len(thr) == 5
    assert sent[into[qs.index(thr[0])]].matchers == (
        ("reason", "=~", "(?:sw_thermal_slowdown|hw_thermal_slowdown)|sw_power_cap|hw_power_brake_slowdown|hw_slowdown"
             "|applications_clocks_setting"),)
    t = TIMES[-1]
    for q, k in zip(qs, into, strict=True):
        alone = source.query(q, t, 120.0)
        got = shard_fold.split(q, sent[k], source.query(sent[k], t, 120.0))
        pairs = sorted(zip(got.ids.tolist(), got.values.tolist(), strict=True))
        assert pairs == sorted(zip(alone.ids.tolist(), alone.values.tolist(), strict=True)), q
    # a value with regex specials is matched literally; a missing label is the empty string
    odd = [Query("a", "m", "avg", matchers=(("k", "=", "x.y"),)), Query("b", "m", "avg", matchers=(("k", "=", ""),))]
    sent, into = shard_fold.fold(odd)
    assert len(sent) == 1 and sent[0].matchers == (("k", "=~", "x\\.y|"),)


def _probe_values() -> list[str]:
    """Node label values of every shape a shard's batch holds: exporter ports, dots, IPv6 brackets."""
    out = [f"node-{i:04d}:9400" for i in range(500)] + [f"10.0.{i // 250}.{i % 250}:9100" for i in range(400)]
    return out + [f"[fe80::{i:x}]:9100" for i in range(100)] + [f"gpu-{i:05d}.dc1.example:9445" for i in range(300)]


@pytest.mark.slow
def test_long_node_batches_select_exactly_their_nodes_on_prometheus_and_victoriametrics(tmp_path: Path) -> None:
    # batches of up to MAX_SELECTOR_VALUES (past Prometheus' 256-literal set lookup and VictoriaMetrics' short
    # alternations, which both backends then match otherwise): each batch selects exactly its own values
    from support import backfilled_prometheus, imported_victoria_metrics

    values = _probe_values()
    lines = [f'shard_probe{{instance="{v}"}} 1 {T0 + k}' for k in (0.0, 15.0) for v in values]
    tmp = tmp_path
    (tmp / "p.om").write_text("\n".join(lines) + "\n# EOF\n")
    text = "\n".join(f'shard_probe{{instance="{v}"}} 1 {round((T0 + k) * 1000)}' for k in (0.0, 15.0) for v in values)
    wanted = values[::2]  # every other value: its neighbours (a digit, a dot apart) must not match
    rxs = shard_source.node_regexes(wanted)
    assert len(rxs) > 1 and max(r.count("|") + 1 for r in rxs) > 256

    def check(url: str) -> None:
        # through the product's own rendering (Query.promql) and client, as a shard sends its node batches
        src = PrometheusSource(url)
        got: list[str] = []
        for rx in rxs:
            res = src.query(Query("probe", "shard_probe", "last", "node", (("instance", "=~", rx),)), T0 + 15.0, 60.0)
            got += [res.table.labels[i]["instance"] for i in res.ids.tolist()]
        assert sorted(got) == sorted(wanted), url
        assert src.query_errors == 0

    with backfilled_prometheus(tmp / "p.om", tmp) as url:
        check(url)
    (tmp / "vm").mkdir()
    with imported_victoria_metrics(text.encode() + b"\n", tmp / "vm") as url:
        check(url)


def test_matcher_values_are_escaped_as_promql_strings() -> None:
    # a node batch's regular expression escapes dots with a backslash; PromQL reads the string with Go's escapes,
    # so the backslash itself is escaped (unescaped, Prometheus rejects "\." as an unknown escape sequence)
    rx = shard_source.node_regexes(["10.0.0.1:9100", 'a"b'])[0]
    q = Query("x", "m", "last", "node", (("instance", "=~", rx),))
    assert q.promql(60.0) == 'last_over_time(m{instance=~"10\\\\.0\\\\.0\\\\.1:9100|a\\"b"}[60s])'
    assert shard_map.selector(q) == 'm{instance=~"10\\\\.0\\\\.0\\\\.1:9100|a\\"b"}'
