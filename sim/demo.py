"""``gpufleet-sim demo`` and ``gpufleet-sim serve``: a simulated fleet served by real agents.

``serve`` starts a :class:`~gpufleet.sim.live.LiveFleet` headless and prints its
targets (and the Prometheus ``file_sd`` file) until Ctrl-C, SIGTERM or ``--duration``.

``demo`` does the same and shows the fleet live in the terminal. Everything in the
per-GPU tables is scraped over HTTP from the real agent processes (:mod:`.demo_scrape`):
SM clock, utilization, SM and tensor activity, power, temperature and active throttle
(clock-event) reasons. The detector runs in-process on those scrapes
(:mod:`.demo_detector`, when ``gpufleet.detector`` is installed) and its findings appear as it
raises them; the GPUs it calls stragglers are the ones the view highlights. The job line tells
the step-time story from the simulated training job (:mod:`.demo_story`). The fault the
simulator injected is shown only in its own "injected fault" line, as ground truth to compare
with. Without a terminal (``--no-ui`` or stdout not a TTY, e.g. CI) it prints plain log lines
(:mod:`.demo_view`). This module is the command line and the loop that ties them together.

``gpufleet-sim`` (``gpufleet.sim.cli``) calls :func:`register` to add both subcommands; each sets
``func`` (``args.func(args) -> int``) on its parser.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
import tomllib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import FrameType
from typing import Any, TextIO

from gpufleet.serving.argtypes import positive_float, positive_int
from gpufleet.sim.demo_detector import DetectorBridge, lagging_gpus, load_detector
from gpufleet.sim.demo_scrape import NodeView, scrape_all
from gpufleet.sim.demo_story import JobStory, injected_faults
from gpufleet.sim.demo_view import elapsed, log_lines, rich_view
from gpufleet.sim.live import DEFAULT_TICK, LiveFleet, LiveFleetError
from gpufleet.sim.scenario import ScenarioError

#: The demo runs accelerated so the demo scenario's fault (60 simulated seconds in) shows within 20 s.
DEMO_SPEED = 3.0
#: The fewest GPUs a demo fleet may have: the detector compares a GPU with its job's peers only in
#: groups of at least 4 GPUs (its default straggler ``min_peers``).
DEMO_MIN_GPUS = 4


# ---------------------------------------------------------------------- commands


def _common(p: argparse.ArgumentParser, speed: float) -> None:
    p.add_argument("--scenario", default="demo", help="built-in scenario name or TOML file (default: demo)")
    p.add_argument("--nodes", type=positive_int, default=None, help="number of nodes (default: the scenario's)")
    p.add_argument("--gpus-per-node", type=positive_int, default=None,
                   help="GPUs per node (default: the scenario's)")
    p.add_argument("--seed", type=int, default=1, help="random seed (default: 1)")
    p.add_argument("--speed", type=positive_float, default=speed,
                   help=f"simulated seconds per wall-clock second (default: {speed:g}; 1 = real time; counters "
                        "then grow speed times faster per wall-clock second)")
    p.add_argument("--tick", type=positive_float, default=DEFAULT_TICK,
                   help=f"wall-clock seconds between simulator steps (default: {DEFAULT_TICK:g})")
    p.add_argument("--duration", type=positive_float, default=None,
                   help="exit after this many wall-clock seconds (default: run until Ctrl-C)")
    p.add_argument("--base-port", type=int, default=None,
                   help="serve node i on 127.0.0.1:BASE+i (default: free ports)")
    p.add_argument("--processes", action="store_true",
                   help="run the jobs under Slurm: one compute process per GPU of a running job, its "
                        "/proc/PID/cgroup naming the job (numeric Slurm job ids, attributed from the cgroups; "
                        "no job mapping files)")
    p.add_argument("--run-dir", default=None,
                   help="keep snapshots, sysfs trees, targets and agent logs here (default: a temporary directory)")


def register(subparsers: Any) -> None:
    """Add ``demo`` and ``serve`` to ``gpufleet-sim``'s subcommands."""
    demo = subparsers.add_parser(
        "demo", help="simulate a small fleet, serve it with real agents and show it live in the terminal",
        description="Simulate a small GPU fleet with an injected straggler, serve every node with a real "
                    "gpufleet-agent on 127.0.0.1, and show what the agents report live in the terminal.",
    )
    _common(demo, DEMO_SPEED)
    demo.add_argument("--no-ui", action="store_true",
                      help="print plain log lines instead of the live view (automatic when stdout is not a TTY)")
    demo.add_argument("--interval", type=positive_float, default=None,
                      help="seconds between scrapes/refreshes (default: 1 with the live view, 5 with --no-ui)")
    demo.set_defaults(func=run_demo)
    serve = subparsers.add_parser(
        "serve", help="simulate a fleet and serve it with real agents (no UI); prints the targets",
        description="Simulate a fleet and serve each node with a real gpufleet-agent on 127.0.0.1; print the "
                    "targets and the Prometheus file_sd file, then run until Ctrl-C, SIGTERM or --duration.",
    )
    _common(serve, 1.0)
    serve.set_defaults(func=run_serve)


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """Turn SIGTERM into SystemExit so ``with LiveFleet`` cleans up (only in the main thread)."""
    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def fit_scenario(
    name: str, nodes: int | None, gpus_per_node: int | None, min_gpus: int = DEMO_MIN_GPUS,
) -> tuple[Any, list[str]]:
    """The scenario to serve, and a note per fault that had to move.

    A built-in scenario resized with ``--nodes``/``--gpus-per-node`` keeps its faults: one placed
    on a node or GPU the smaller fleet lacks moves to the last node or GPU (the demo's straggler,
    node-002 GPU 5, is on node-001 with ``--nodes 2``); the default size is unchanged. A scenario
    file is loaded as given. Raises ``ScenarioError`` (one line) for an impossible size or a
    fleet of fewer than ``min_gpus`` GPUs.
    """
    from gpufleet.sim.scenario import builtin_names, builtin_text, load_scenario, parse_scenario

    if name not in builtin_names() or (nodes is None and gpus_per_node is None):
        scenario = load_scenario(name, nodes=nodes, gpus_per_node=gpus_per_node)
        return _check_size(scenario, min_gpus), []
    data = tomllib.loads(builtin_text(name))
    sites = data.get("sites", [])
    if nodes is not None:
        if len(sites) != 1:
            raise ScenarioError(f"built-in scenario {name!r}: --nodes needs a single-site scenario")
        sites[0]["nodes"] = nodes
    if gpus_per_node is not None:
        for site in sites:
            site["gpus_per_node"] = gpus_per_node
    source = f"built-in scenario {name!r}"
    bare = {k: v for k, v in data.items() if k not in ("faults", "reboots")}
    size = _check_size(parse_scenario(bare, source), min_gpus)
    names, gpn = size.node_names, size.sites[0].gpus_per_node
    notes = []
    for f in [*data.get("faults", []), *data.get("reboots", [])]:
        node, gpu = f.get("node"), f.get("gpu")
        if isinstance(node, str) and node not in names:
            f["node"] = names[-1]
        if isinstance(gpu, int) and gpu >= gpn:
            f["gpu"] = gpn - 1
        if (f.get("node"), f.get("gpu")) != (node, gpu):
            notes.append(f"{f.get('kind', 'reboot')} moved from {_where(node, gpu)} to "
                         f"{_where(f.get('node'), f.get('gpu'))}: this fleet has {len(names)} node(s) x {gpn} GPUs")
    return parse_scenario(data, source), notes


def _where(node: Any, gpu: Any) -> str:
    return f"{node}" if gpu is None else f"{node} GPU {gpu}"


def _check_size(scenario: Any, min_gpus: int) -> Any:
    gpus = len(scenario.node_names) * scenario.sites[0].gpus_per_node
    if gpus < min_gpus:
        raise ScenarioError(
            f"the demo needs at least {min_gpus} GPUs in all (--nodes x --gpus-per-node) so the detector has "
            f"peers to compare a GPU with; this fleet has {gpus}"
        )
    return scenario


def _fleet(args: argparse.Namespace, out: TextIO, min_gpus: int) -> LiveFleet:
    scenario, notes = fit_scenario(args.scenario, args.nodes, args.gpus_per_node, min_gpus)
    for note in notes:
        print(f"note: {note}", file=out)
    return LiveFleet(
        scenario, args.seed, speed=args.speed, tick=args.tick, run_dir=args.run_dir, base_port=args.base_port,
        processes=bool(getattr(args, "processes", False)),
    )


def _print_targets(fleet: LiveFleet, out: TextIO) -> None:
    print(f"serving {len(fleet.targets)} simulated nodes with real gpufleet-agent processes:", file=out)
    for node, url in fleet.targets:
        print(f"  {node}: curl {url}", file=out)
    print(f"Prometheus file_sd targets: {fleet.targets_file}", file=out)
    print(f"Prometheus config:          prometheus --config.file={fleet.prometheus_config}", file=out)
    if fleet.slurm is not None:
        ids = ", ".join(f"{job} = {slurm}" for job, slurm in fleet.slurm.slurm_ids.items())
        print(f"Slurm job ids (job_id label): {ids}", file=out)
    out.flush()


def _run_fleet(args: argparse.Namespace, body: Callable[[LiveFleet], None], min_gpus: int = 1) -> int:
    err = sys.stderr
    try:
        with _sigterm_exits(), _fleet(args, sys.stdout, min_gpus) as fleet:
            body(fleet)
    except KeyboardInterrupt:
        return 130
    except SystemExit as e:  # SIGTERM
        return int(e.code) if isinstance(e.code, int) else 1
    except (LiveFleetError, ValueError, FileNotFoundError) as e:
        print(f"gpufleet-sim: error: {e}", file=err)
        return 1
    return 0


def _deadline(args: argparse.Namespace) -> float:
    return time.monotonic() + args.duration if args.duration else float("inf")


def run_serve(args: argparse.Namespace) -> int:
    def body(fleet: LiveFleet) -> None:
        _print_targets(fleet, sys.stdout)
        end = _deadline(args)
        while time.monotonic() < end:
            fleet.check()
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))
    return _run_fleet(args, body)


def run_demo(args: argparse.Namespace) -> int:
    ui = not args.no_ui and sys.stdout.isatty()
    interval = args.interval or (1.0 if ui else 5.0)
    scrape_every = min(interval, 1.0)

    # Heavy imports before the fleet starts, so the first frame shows the fleet at the start of the scenario.
    with contextlib.suppress(ImportError):
        load_detector()
    if ui:
        import rich.live  # noqa: F401

    def body(fleet: LiveFleet) -> None:
        out = sys.stdout
        _print_targets(fleet, out)
        if not ui:
            print(f"[+Ns] = simulated seconds since the scenario started, at x{fleet.speed:g} ({fleet.speed:g} "
                  f"simulated seconds per wall-clock second); a block of lines every {interval:g} s", file=out)
        t0 = fleet.simulator_start
        sim_scrape = scrape_every * fleet.speed
        detector = DetectorBridge(fleet, window_s=max(30.0, 10 * sim_scrape), interval_s=sim_scrape)
        if detector.page_url:  # the detector's findings page: the straggler with its plots, while the demo runs
            print(f"findings page: {detector.page_url}", file=out, flush=True)
        jobs = JobStory()
        end = _deadline(args)
        findings: list[str] = []

        def render(views: list[NodeView]) -> Any:
            slow = lagging_gpus(detector.stragglers, views)
            story = jobs.lines(fleet, views, slow, detector.suspects)
            faults = injected_faults(fleet)
            if fleet.error is not None:
                story = [*story, f"simulator stopped: {fleet.error}"]
            note = detector.error or ("no findings (yet)" if detector.evaluations else "waiting for data")
            if ui:
                return rich_view(fleet, t0, views, slow, story, findings, note, faults)
            stamp = f"[{elapsed(fleet, t0)}]"
            lines = [*log_lines(views, slow), *(f"job: {s}" for s in story)]
            lines += [f"detector finding: {f}" for f in findings] or [f"detector: {note}"]
            lines += [f"injected fault (ground truth): {f}" for f in faults]
            return "\n".join(f"{stamp} {line}" for line in lines)

        with ThreadPoolExecutor(max_workers=max(1, len(fleet.targets))) as pool, contextlib.ExitStack() as stack:
            stack.callback(detector.close)
            live: Any = None
            if ui:
                from rich.live import Live

                live = stack.enter_context(Live(refresh_per_second=4, screen=False))
            next_render = time.monotonic()
            while True:
                started = time.monotonic()
                views = scrape_all(fleet.targets, pool)
                for v, a in zip(views, fleet.agents, strict=True):
                    if not a.running():
                        code = a.proc.returncode if a.proc else None
                        v.error = f"agent exited (code {code}); see {fleet.kept_log(a)}"
                t = fleet.sim_time
                detector.feed(views, t)
                findings[:] = detector.evaluate(t)
                last = started >= end
                if started >= next_render or last:
                    frame = render(views)
                    if live is not None:
                        live.update(frame)
                    else:
                        print(frame, file=out, flush=True)
                    next_render += interval
                if last:
                    break
                time.sleep(max(0.0, min(started + scrape_every, end) - time.monotonic()))
    return _run_fleet(args, body, DEMO_MIN_GPUS)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gpufleet.sim.demo [demo|serve] ...`` (same as ``gpufleet-sim demo|serve``)."""
    parser = argparse.ArgumentParser(prog="gpufleet-sim")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
