"""The report plots every finding's evidence (detector.outputs.evidence, detector.outputs.report): on Kubernetes recordings
whose jobs come from pod owners (the detector's own job resolution gives the peers), on both profiles, plain and
compressed, and from a real Prometheus over a range (``report --prometheus URL --from --to``)."""

from __future__ import annotations

import gzip
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from gpufleet.detector.config import DetectorConfig
from gpufleet.detector.incidents.tracker import Finding
from gpufleet.detector.outputs.evidence import BEFORE, features_of, grid, quantiles, traces
from gpufleet.detector.service.cli import main as cli_main
from gpufleet.detector.service.replay import replay
from gpufleet.sim import kubernetes
from gpufleet.sim.recording import FILES

START = 1_767_225_600.0
#: A slow GPU in pod llama-worker-2 and a degraded rail NIC of llama-worker-4 (the PyTorchJob "llama": its pods
#: are named by the Kubeflow convention and owned by the PyTorchJob; its peers are its 6 nodes' 48 GPUs).
FAULTS = [dict(kubernetes.FAULT_CASES["slow_gpu"], onset="15m"), dict(kubernetes.FAULT_CASES["degraded_nic"],
                                                                         onset="15m")]


@pytest.fixture(scope="module")
def k8s(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("k8s")
    kubernetes.record(kubernetes.build("evidence", hours=0.75, seed=3, faults=FAULTS), d, ("gpufleet", "dcgm"),
                      start=START)
    return d


def _sections(page: str) -> list[str]:
    return page.split('<section class="finding"')[1:]


def _features(section: str) -> list[str]:
    return re.findall(r'<svg [^>]*class="plot" data-feature="([a-z_]+)"', section)


@pytest.mark.slow
@pytest.mark.parametrize("profile", ["gpufleet", "dcgm"])
def test_every_finding_of_a_kubernetes_fleet_plots_against_its_pod_owner_peers(
        k8s: Path, profile: str, tmp_path: Path) -> None:
    rec = k8s / FILES[profile]
    det, found = replay([str(rec)], DetectorConfig(profile=profile))
    kinds = {(f.kind, f.cause, f.node) for f in found}
    assert ("straggler", "clock", "node-002") in kinds and any(k[0] == "network" for k in kinds), kinds
    lo, hi = det.source.time_range()  # type: ignore[attr-defined]
    trs = traces(det, found, lo + det.cfg.window_seconds, hi)
    for tr in trs:
        f = tr.finding
        assert tr.panels and all(p.has_data() for p in tr.panels[:1]), f.to_json()
        assert {p.feature for p in tr.panels} <= set(features_of(f))
        if f.kind == "straggler" and f.gpu is not None:
            assert f.job == "llama" and tr.peers == 47, (tr.peers, f.to_json())  # the job's other GPUs
        if f.kind == "straggler" and f.cause == "clock":
            clock = next(p for p in tr.panels if p.feature == "sm_clock")
            before, after = clock.at(f.start - 600), clock.at(f.detected + 300)
            assert before[0] == pytest.approx(before[1], rel=0.05)  # like its peers before the fault
            assert after[0] < 0.8 * after[1]  # well below them once it is stuck low
        if f.kind == "network":
            feats = {p.feature for p in tr.panels}
            assert {"nic_tx", "nic_xmit_wait"} <= feats and "sm_clock" not in feats
            assert tr.peers >= 5  # the NICs of the job's other nodes
    # and the page: one section per finding, each with its plots, onset and detection marked
    out = tmp_path / "r.html"
    assert cli_main(["report", str(rec), "--profile", profile, "--html", str(out)]) == 0
    secs = _sections(out.read_text())
    assert len(secs) == len(found)
    for s in secs:
        assert _features(s) and "no data" not in s
        assert 'data-mark="onset"' in s and 'data-mark="detected"' in s


@pytest.mark.slow
def test_compressed_recordings_give_the_same_report(k8s: Path, tmp_path: Path) -> None:
    zstandard = pytest.importorskip("zstandard")
    rec = k8s / FILES["dcgm"]
    gz, zst = tmp_path / "r.om.gz", tmp_path / "r.om.zst"
    gz.write_bytes(gzip.compress(rec.read_bytes(), compresslevel=1))
    zst.write_bytes(zstandard.ZstdCompressor(level=1).compress(rec.read_bytes()))
    pages = []
    for path in (rec, gz, zst):
        out = tmp_path / f"{path.name}.html"
        assert cli_main(["report", str(path), "--profile", "dcgm", "--html", str(out)]) == 0
        pages.append([_features(s) for s in _sections(out.read_text())])
    assert pages[0] and pages[0] == pages[1] == pages[2]


@pytest.mark.slow
def test_report_from_a_real_prometheus_over_a_range(k8s: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from support import backfilled_prometheus

    rec = tmp_path / "backfill.om"
    shutil.copy(k8s / FILES["gpufleet"], rec)
    _, local = replay([str(rec)], DetectorConfig(profile="gpufleet"))
    out = tmp_path / "prom.html"
    with backfilled_prometheus(rec, tmp_path) as url:
        capsys.readouterr()
        assert cli_main(["report", "--prometheus", url, "--from", str(START), "--to", str(START + 2700),
                         "--profile", "gpufleet", "--html", str(out)]) == 0
    err = capsys.readouterr().err
    secs = _sections(out.read_text())
    n = len(secs)
    assert f"{n} finding(s), {n} with evidence plots" in err and n >= 2
    page = out.read_text()
    for f in local:  # the recording's findings, found again from Prometheus' range API
        if f.kind in ("straggler", "network"):
            assert f"{f.kind} ({f.cause})" in page and (f.node or "") in page, f.to_json()
    assert all(_features(s) for s in secs)


def test_report_needs_files_or_prometheus(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["report"]) == 2
    assert "give recording FILEs or --prometheus" in capsys.readouterr().err
    assert cli_main(["report", "--prometheus", "http://127.0.0.1:9"]) == 2
    assert "needs --from and --until" in capsys.readouterr().err
    assert cli_main(["report", "--prometheus", "ftp://x", "--from", "0", "--to", "1000"]) == 2
    assert "must start with http" in capsys.readouterr().err


def test_grid_is_shared_and_bounded() -> None:
    fs = [Finding("straggler", "clock", "n", "0", "j", None, start=10_000.0 + 50 * i, end=10_600.0 + 50 * i)
          for i in range(100)]
    times, step = grid(fs, 0.0, 1e9, 15.0)
    assert step == 15.0 and len(times) == len(set(times))
    assert times[0] - (10_000.0 - BEFORE) in (0.0, 5.0) and all(t % 15.0 == 0 for t in times)  # on the grid
    long = [Finding("straggler", "clock", "n", "0", "j", None, start=0.0, end=86400.0 * 30)]
    times, step = grid(long, 0.0, 1e9, 15.0)
    assert len(times) <= 1201 and step % 15.0 == 0


def test_quantiles_are_numpys_on_the_finite_values() -> None:
    rng = np.random.default_rng(1)
    m = rng.normal(size=(6, 33))
    m[1, ::3] = np.nan
    m[2] = np.nan
    got = quantiles(m, (0.5, 0.1, 0.9))
    for r in range(6):
        row = m[r][np.isfinite(m[r])]
        if row.size:
            assert got[r] == pytest.approx(np.percentile(row, [50, 10, 90]))
        else:
            assert np.isnan(got[r]).all()


@pytest.mark.slow
def test_an_nvlink_domain_finding_plots_its_racks_share_of_faulted_gpus(tmp_path: Path) -> None:
    import tomllib

    from gpufleet.sim.recording import record
    from gpufleet.sim.scenario import builtin_text, parse_scenario
    from gpufleet.sim.simulator import Simulator

    data = tomllib.loads(builtin_text("nvswitch_tray_failure"))
    data["hours"] = 0.75
    for f in data["faults"]:
        f["onset"] = "15m"
    record(Simulator(parse_scenario(data, "nvswitch_tray_failure"), start=START), tmp_path, ("gpufleet",))
    det, found = replay([str(tmp_path / FILES["gpufleet"])], DetectorConfig())
    rack = [f for f in found if f.kind == "nvlink_domain"]
    assert rack and (rack[0].node or "").startswith("rack "), [f.to_json() for f in found]
    lo, hi = det.source.time_range()  # type: ignore[attr-defined]
    tr = traces(det, rack, lo + det.cfg.window_seconds, hi)[0]
    share = next(p for p in tr.panels if p.feature == "fab_faulted")
    assert share.at(rack[0].start - 300)[0] == 0.0  # no GPU of the rack faulted before
    assert share.at(rack[0].detected + 300)[0] >= 0.3  # a switch tray's share of the domain after
