"""Replay beside promtool on two recording shapes: cost per sample and cost per evaluation.

Run: ``.venv/bin/python tests/bench/bench_replay.py [--shape dcgm192 fleet512] [--repeat 3] [--gz]
[--file REC.om[.gz] [--profile dcgm]] [--before CHECKOUT]``.

- ``dcgm192``: many evaluations over few GPUs. The simulator (``gpufleet-sim generate``, seed 23, the dcgm profile,
  ``--series core``) writes 24 nodes x 8 GPUs, 2 h of 30 s scrapes with job churn and one fault; replay evaluates it
  at the default interval (15 s: 472 evaluations).
- ``dcgm192-inputs``: the same recording with only the metric families the dcgm profile reads (1.19 M samples,
  the size of the held-out recording of issue 23): promtool then ingests no more than replay reads.
- ``fleet512``: the large-fleet shape of ``bench_detector.py --replay-nodes 64``: 512 GPUs x 1 h of 15 s scrapes of
  the gpufleet profile (test_detector_core's synth), evaluated every 15 s.

Each round runs ``gpufleet-detector replay FILE`` (a fresh process: imports, read, every evaluation) and
``promtool tsdb create-blocks-from openmetrics FILE DIR`` on the same file, alternately; the medians of wall and CPU
seconds (user + system of the process and its children: replay's reader process, promtool's threads) are
reported with every run. Both run as installed, their bytecode compiled beforehand (``PYTHONPYCACHEPREFIX`` in the
temporary directory). ``--file`` times a recording of your own instead of the shapes (a compressed one is
decompressed to a temporary file for promtool, and timed as it is for replay). ``--before CHECKOUT`` also times
the replay of another checkout of this project (e.g. ``git worktree add /tmp/before HEAD~3``) in the same rounds,
so before and after are measured side by side, and says whether its findings (JSON) are byte-identical. Samples are the file's sample lines (what promtool ingests); replay keeps only the
profile's metrics, so its rate is over the same count. ``--gz`` also times the gzip-compressed file.
"""

from __future__ import annotations

import argparse
import gzip
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "detector"))

SCENARIO = """name = "bench-dcgm192"
description = "bench shape: 24 nodes x 8 GPUs, 2 h of 30 s scrapes, job churn, one power-capped node"
seed = 23
hours = 2
step = 30

[[sites]]
name = "site-a"
nodes = 24

[jobs]
auto = true
fill = 0.85
mean_hours = 1
max_nodes = 8

[[faults]]
kind = "power_cap"
node = "node-005"
onset = "40m"
severity = "moderate"
"""


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def make(shape: str, d: Path) -> tuple[Path, list[str]]:
    """The recording of ``shape`` and the replay's extra arguments."""
    if shape.startswith("dcgm192"):
        scen = d / "scenario.toml"
        scen.write_text(SCENARIO)
        subprocess.run([sys.executable, "-m", "gpufleet.sim.cli", "generate", "--scenario", str(scen), "--out",
                        str(d / "sim"), "--profile", "dcgm", "--series", "core", "--quiet"], check=True,
                       stdout=subprocess.DEVNULL)
        rec = d / "sim" / "metrics.dcgm.om"
        if shape == "dcgm192-inputs":
            rec = _inputs_only(rec, d / "inputs.om")
        return rec, ["--profile", "dcgm"]
    from test_detector_core import Fault, Synth, synth

    rec = synth(d / "r.om", Synth(nodes=64, seconds=3600.0, faults=[Fault("clock", 2, 5, 1800.0)]))
    cfg = d / "d.toml"
    cfg.write_text("[detector]\nwindow_seconds = 120.0\ninterval_seconds = 15.0\n")
    return rec, ["--config", str(cfg)]


def _inputs_only(rec: Path, out: Path) -> Path:
    """``rec`` with only the metric families the dcgm profile (and the site queries) read."""
    from gpufleet.detector.config import DetectorConfig
    from gpufleet.detector.service.replay import _site_metrics
    from gpufleet.detector.sources.profiles import sample_names

    cfg = DetectorConfig()
    cfg.profile = "dcgm"
    wanted = sample_names("dcgm") | _site_metrics(cfg)
    keep = False
    with open(rec) as src, open(out, "w") as dst:
        for line in src:
            if line.startswith("# EOF"):
                dst.write(line)
                break
            if line.startswith("#"):
                fam = line.split()[2]
                keep = any(w == fam or w.startswith(fam + "_") for w in wanted)
            if keep:
                dst.write(line)
    return out


def _checkout_path(checkout: Path, d: Path) -> str:
    """A directory that makes ``import gpufleet...`` load ``checkout``'s packages (for PYTHONPATH)."""
    pkg = d / "before-path" / "gpufleet"
    pkg.mkdir(parents=True, exist_ok=True)
    for sub in ("vocab", "serving", "agent", "sim", "detector", "dashboards", "alerts"):
        link = pkg / sub
        if not link.exists() and (checkout / sub).is_dir():  # older checkouts: sim, vocab, serving in agent/
            link.symlink_to(checkout.resolve() / sub)
    return str(pkg.parent)


def timed(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float, str]:
    w0, c0 = time.perf_counter(), _children_cpu()
    out = subprocess.run(argv, capture_output=True, text=True, check=True, env=env)
    return time.perf_counter() - w0, _children_cpu() - c0, out.stdout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", nargs="+", choices=("dcgm192", "dcgm192-inputs", "fleet512"),
                    default=["dcgm192", "dcgm192-inputs", "fleet512"])
    ap.add_argument("--file", type=Path, help="time this recording (plain or .gz) instead of the shapes")
    ap.add_argument("--profile", default="dcgm", help="the metric profile of --file (default dcgm)")
    ap.add_argument("--before", type=Path, help="a checkout of this project whose replay is timed beside this one")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--gz", action="store_true", help="also replay the gzip-compressed file")
    args = ap.parse_args()
    promtool = shutil.which("promtool")
    if promtool is None:
        raise SystemExit("promtool not installed (Debian package prometheus; tests/run.sh installs it)")
    for shape in ([str(args.file)] if args.file else args.shape):
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            if args.file:
                given, extra = args.file, ["--profile", args.profile]
                rec = given
                if _head(given) == b"\x1f\x8b":  # gzip
                    rec = d / "plain.om"  # promtool reads plain text only
                    with gzip.open(given, "rb") as src, open(rec, "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 24)
            else:
                given = None
                rec, extra = make(shape, d)
            samples = 0
            with open(rec, "rb") as f:
                for line in f:
                    if line[:1] != b"#":
                        samples += 1
            files = {"plain": rec}
            if given is not None and given != rec:
                files["as given"] = given
            if args.gz:
                gz = d / (rec.name + ".gz")
                gz.write_bytes(gzip.compress(rec.read_bytes(), compresslevel=6))
                files["gz"] = gz
            # As installed: the modules' bytecode compiled once (pip compiles it at install; without it, a machine
            # that sets PYTHONDONTWRITEBYTECODE would time compiling the project's modules on every run).
            env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
            env["PYTHONPYCACHEPREFIX"] = str(d / "pycache")
            before_env = None
            if args.before:
                before_env = {**env, "PYTHONPATH": _checkout_path(args.before, d)}
            for e in (env, before_env):
                if e is not None:
                    subprocess.run([sys.executable, "-c", _IMPORTS], check=True, env=e)
            kinds = [*files, *([f"before {k}" for k in files] if before_env else [])]
            runs: dict[str, list[tuple[float, float]]] = {k: [] for k in [*kinds, "promtool"]}
            outputs: dict[str, str] = {}
            for i in range(args.repeat):
                for kind in kinds:
                    path = files[kind.removeprefix("before ")]
                    wall, cpu, out = timed([sys.executable, "-m", "gpufleet.detector.service.cli", "replay", str(path), *extra,
                                            "--format", "json"], before_env if kind.startswith("before ") else env)
                    runs[kind].append((wall, cpu))
                    outputs[kind] = out
                wall, cpu, _ = timed([promtool, "tsdb", "create-blocks-from", "openmetrics", str(rec),
                                      str(d / f"blocks{i}")])
                shutil.rmtree(d / f"blocks{i}", ignore_errors=True)
                runs["promtool"].append((wall, cpu))
            evals = _evaluations(rec, extra)
            med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in runs.items()}
            pw, pc = med["promtool"]
            print(f"{shape}: {rec.stat().st_size / 1e6:.0f} MB, {samples:,} samples, {evals} evaluations "
                  f"({len(outputs['plain'].splitlines())} findings)")
            for kind in kinds:
                w, c = med[kind]
                same = "" if kind == "plain" else (", same findings as this plain file" if outputs[kind] == outputs["plain"]
                                                   else ", FINDINGS DIFFER from this plain file")
                print(f"  replay ({kind}): median wall {w:.2f} s, cpu {c:.2f} s = {samples / w:,.0f} samples/s; "
                      f"{w / evals * 1e3:.2f} ms wall and {c / evals * 1e3:.2f} ms cpu per evaluation, "
                      f"{w / samples * 1e6:.2f} us wall per sample; {pw / w:.2f}x promtool by wall, {pc / c:.2f}x by cpu"
                      f" (runs: {' '.join(f'{x:.2f}/{y:.2f}' for x, y in runs[kind])}){same}")
            print(f"  promtool create-blocks-from openmetrics: median wall {pw:.2f} s, cpu {pc:.2f} s = "
                  f"{samples / pw:,.0f} samples/s (runs: {' '.join(f'{x:.2f}/{y:.2f}' for x, y in runs['promtool'])})",
                  flush=True)


#: What a replay imports (its bytecode is compiled before the timed runs).
_IMPORTS = ("import gpufleet.detector.service.cli, gpufleet.detector.service.replay, gpufleet.detector.outputs.report; "
            "import sklearn.tree._criterion, sklearn.tree._splitter, sklearn.tree._tree, sklearn.utils.random")


def _head(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(2)


def _evaluations(rec: Path, extra: list[str]) -> int:
    """How many evaluations the replay runs (from the recording's time range, the window and the interval)."""
    from gpufleet.detector.service.cli import _config
    from gpufleet.detector.sources.profiles import sample_names
    from gpufleet.detector.sources.recording import RecordingSource

    cfg = _config(extra[1] if extra[0] == "--config" else None, extra[1] if extra[0] == "--profile" else None)
    lo, hi = RecordingSource.load([rec], sample_names(cfg.profile)).time_range()
    first = lo + cfg.window_seconds
    return int((hi - first) // cfg.interval_seconds) + 1 if hi >= first else 0


if __name__ == "__main__":
    main()
