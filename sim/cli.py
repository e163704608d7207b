"""``gpufleet-sim``: generate labelled fleet recordings and list the built-in scenarios.

    gpufleet-sim scenarios
    gpufleet-sim generate --scenario clock_stuck_low --out rec/ [--profile gpufleet|dcgm|both]
                          [--seed N] [--hours H] [--step S] [--series full|core]
    gpufleet-sim demo ... / serve ...     (live fleet served by real agents, when available)
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
import time
from collections.abc import Sequence

from gpufleet.serving.argtypes import non_negative_int, positive_float
from gpufleet.sim.recording import PROFILES, SERIES, iter_profiles, record
from gpufleet.sim.scenario import (
    Scenario,
    ScenarioError,
    builtin_names,
    describe,
    load_scenario,
    parse_time,
)
from gpufleet.sim.scraping import MODELS
from gpufleet.sim.simulator import Simulator


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpufleet-sim",
        description="Simulated GPU fleets with injectable faults: labelled OpenMetrics recordings and live agents.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("scenarios", help="list the built-in scenarios")
    gen = sub.add_parser("generate", help="write a recording (OpenMetrics with timestamps) and its labels.json")
    gen.add_argument("--scenario", required=True, metavar="NAME|FILE",
                     help="a built-in scenario name (see `gpufleet-sim scenarios`) or a TOML/YAML file")
    gen.add_argument("--out", required=True, metavar="DIR", help="output directory (created if missing)")
    gen.add_argument("--profile", choices=(*PROFILES, "both"), default="gpufleet",
                     help="metric names: gpufleet's own, dcgm-exporter + node_exporter + ipmi_exporter, or both")
    gen.add_argument("--seed", type=non_negative_int, help="random seed (default: the scenario's)")
    gen.add_argument("--hours", type=positive_float, help="override the scenario's duration")
    gen.add_argument("--step", type=positive_float, help="override the seconds between samples")
    gen.add_argument("--series", choices=SERIES, default="full",
                     help="full: every modelled series; core: detector inputs and fault signatures only")
    gen.add_argument("--start", metavar="TIME|now",
                     help="first sample time: unix seconds, RFC 3339 / ISO 8601 (UTC if no zone) or 'now' to end the recording now "
                          "(default: the scenario's start, else 2026-07-01T00:00:00Z, so output is reproducible)")
    gen.add_argument("--scrape", choices=MODELS,
                     help="how Prometheus scrapes the fleet (default: the scenario's [scrape] model, else prometheus: "
                          "targets at their own offsets with jitter, failed scrapes, dcgm-exporter's lag; aligned: "
                          "every series at the tick)")
    gen.add_argument("--quiet", action="store_true", help="no progress output")
    try:
        demo = importlib.import_module("gpufleet.sim.demo")
    except ModuleNotFoundError as e:
        if e.name != "gpufleet.sim.demo":
            print(f"gpufleet-sim: demo/serve unavailable: {e}", file=sys.stderr)
        demo = None
    except Exception as e:  # the live demo is optional: a broken one must not break generate
        print(f"gpufleet-sim: demo/serve unavailable: {e}", file=sys.stderr)
        demo = None
    register = getattr(demo, "register", None)
    if callable(register):
        register(sub)
    return parser


def _start(value: str | None, scenario: Scenario) -> float:
    if value is None:
        return scenario.start_unix()
    if value == "now":
        begin = time.time() - scenario.duration
        return math.floor(begin / scenario.step) * scenario.step
    try:  # unix seconds, as every command's time flags take (and RFC 3339)
        seconds = float(value)
    except ValueError:
        return parse_time(value)
    if not math.isfinite(seconds):
        raise ScenarioError(f"expected unix seconds or an RFC 3339 time, got {value!r}")
    return seconds


def _scenarios() -> int:
    names = builtin_names()
    width = max(len(n) for n in names)
    for name in names:
        print(f"{name:<{width}}  {describe(name)}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    try:
        scenario = load_scenario(args.scenario, hours=args.hours, step=args.step, seed=args.seed)
    except ScenarioError as e:
        print(f"gpufleet-sim: {e}", file=sys.stderr)
        return 2
    if args.scrape is not None:
        scenario.scrape.model = args.scrape
    try:
        start = _start(args.start, scenario)
    except ScenarioError as e:
        print(f"gpufleet-sim: --start: {e}", file=sys.stderr)
        return 2
    sim = Simulator(scenario, start=start)
    started = time.monotonic()

    def progress(done: int, total: int) -> None:
        if not args.quiet:
            print(f"\rsimulating {scenario.name}: {done}/{total} ticks", end="", file=sys.stderr, flush=True)

    try:
        result = record(sim, args.out, tuple(iter_profiles(args.profile)), progress, args.series)
    except OSError as e:
        print(f"\ngpufleet-sim: cannot write {args.out}: {e.strerror or e}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(file=sys.stderr)
    elapsed = time.monotonic() - started
    for profile, path in result.files.items():
        print(f"{path}  ({result.samples[profile]:,} samples, {profile} profile)")
    print(f"{result.labels}  ({len(scenario.faults)} fault(s))")
    print(f"{result.gpus} GPUs x {result.ticks} ticks of {scenario.step:g} s in {elapsed:.1f} s; load with: "
          f"promtool tsdb create-blocks-from openmetrics {next(iter(result.files.values()))} DATA_DIR")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "scenarios":
        return _scenarios()
    if args.command == "generate":
        return _generate(args)
    handler = getattr(args, "func", None)
    if callable(handler):
        return int(handler(args) or 0)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
