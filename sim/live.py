"""A simulated fleet served live by real agent processes.

:class:`LiveFleet` runs a fleet :class:`~gpufleet.sim.simulator.Simulator` in real
time (or accelerated: ``speed`` simulated seconds per wall-clock second). Every tick it
writes, for each node, the device snapshot the agent's fake NVML serves
(``--nvml.fake=live:PATH``, rewritten atomically), the node's fake sysfs tree
(InfiniBand counters and PCI topology, ``--path.sysfs``) and its dcgm-exporter style
job-mapping directory. It starts one real ``gpufleet-agent`` process per node on a
127.0.0.1 port and writes a Prometheus ``file_sd`` targets file plus a ready-to-use
``prometheus.yml`` so a local Prometheus can scrape the simulated fleet.

Run directory layout (a temporary directory unless ``run_dir`` is given)::

    RUN/targets.json                 file_sd target groups (instance="<node>:9445", site)
    RUN/prometheus.yml               scrape config using targets.json (JSON is valid YAML)
    RUN/nodes/<node>/snapshot.json   the node's device snapshot (model.write_snapshot)
    RUN/nodes/<node>/sysfs/          the node's fake sysfs root
    RUN/nodes/<node>/job-mapping/    one file per GPU index holding its job id (none with ``processes``)
    RUN/nodes/<node>/proc/           with ``processes``: <pid>/cgroup per compute process, pressure/cpu
    RUN/nodes/<node>/cgroup/         with ``processes``: Slurm's job cgroups (system.slice/slurmstepd.scope)
    RUN/logs/<node>.log              the agent's stdout and stderr

A temporary run directory is removed on stop; the log of an agent that failed is copied out of
it first (:meth:`LiveFleet.kept_log`), so the path an error message names stays readable.

Lifecycle is bounded: :meth:`LiveFleet.stop` (also on ``with`` exit and at interpreter
exit) stops the ticker and every agent (SIGTERM, then SIGKILL after a grace period). On
Linux each agent also gets ``PR_SET_PDEATHSIG`` so it dies with the process that started
it even if that process is killed outright: no orphan agents. Start a fleet from a thread
that lives as long as the fleet (normally the main thread): the death signal follows the
starting thread.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from gpufleet.agent.config import DEFAULT_PORT
from gpufleet.agent.nvml.model import Snapshot, write_snapshot
from gpufleet.serving.files import write_atomic
from gpufleet.sim.live_agents import (
    AgentProcess,
    agent_command,
    free_ports,
    http_ok,
    port_free,
    set_parent_death_signal,
)
from gpufleet.sim.slurm import SlurmNodes, node_dirs

log = logging.getLogger(__name__)

#: Wall-clock seconds between simulator ticks by default.
DEFAULT_TICK = 1.0
#: Seconds an agent may take to answer its first scrape.
DEFAULT_STARTUP_TIMEOUT = 45.0
#: Largest simulated step (seconds) taken at once; accelerated ticks are split into substeps.
MAX_SUBSTEP = 1.0
#: How often an agent that failed to start is retried on another free port.
PORT_RETRIES = 1
#: Seconds between SIGTERM and SIGKILL when stopping an agent.
STOP_GRACE = 5.0


class SimulatorLike(Protocol):
    """What :class:`LiveFleet` needs from the fleet simulator."""

    @property
    def t(self) -> float: ...

    @property
    def nodes(self) -> Sequence[str]: ...

    def step(self, dt: float | None = None) -> Any: ...

    def node_site(self, i: int) -> str: ...

    def node_snapshot(self, i: int) -> Snapshot: ...

    def write_node_sysfs(self, i: int, root: str | os.PathLike[str]) -> None: ...


class LiveFleetError(RuntimeError):
    """The live fleet could not start (an agent failed, a port was taken, ...)."""


def make_simulator(scenario: Any = "demo", seed: int = 0, **overrides: Any) -> SimulatorLike:
    """Build the fleet simulator for ``scenario``: a built-in name, a TOML path or a loaded scenario.

    ``overrides`` (``nodes``, ``gpus_per_node``, ...) resize a scenario given by name or path.
    """
    from gpufleet.sim.scenario import load_scenario
    from gpufleet.sim.simulator import Simulator

    overrides = {k: v for k, v in overrides.items() if v is not None}
    if isinstance(scenario, str | os.PathLike):
        scenario = load_scenario(str(scenario), **overrides)
    elif overrides:
        raise ValueError("nodes/gpus_per_node overrides apply to a scenario given by name or path")
    return Simulator(scenario, seed=seed)


class LiveFleet:
    """A fleet simulator served by one real agent process per node.

    Use as a context manager::

        with LiveFleet("demo", seed=1, speed=10) as fleet:
            for node, url in fleet.targets:
                ...

    ``tick`` is the wall-clock interval between simulator steps; each step advances
    the simulation by ``tick * speed`` seconds. ``base_port`` puts node *i* on
    ``base_port + i``; by default free ports are chosen. ``agent_args`` are appended to
    every agent's command line. ``processes``: the jobs run under Slurm, one compute process per GPU
    with its ``/proc/PID/cgroup`` (:mod:`gpufleet.sim.slurm`; numeric Slurm job ids, attributed
    from the cgroups, no job mapping files).
    """

    def __init__(
        self,
        scenario: Any = "demo",
        seed: int = 0,
        *,
        nodes: int | None = None,
        gpus_per_node: int | None = None,
        speed: float = 1.0,
        tick: float = DEFAULT_TICK,
        run_dir: str | os.PathLike[str] | None = None,
        base_port: int | None = None,
        site: str | None = None,
        agent_args: Sequence[str] = (),
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        simulator: SimulatorLike | None = None,
        processes: bool = False,
    ) -> None:
        if speed <= 0:
            raise ValueError(f"speed must be > 0 simulated seconds per second, got {speed}")
        if tick <= 0:
            raise ValueError(f"tick must be > 0 seconds, got {tick}")
        if base_port is not None and not 1 <= base_port <= 65535:
            raise ValueError(f"base port must be in 1..65535, got {base_port}")
        self.scenario = scenario
        self.seed = seed
        self.speed = float(speed)
        self.tick = float(tick)
        self.base_port = base_port
        self.agent_args = list(agent_args)
        self.startup_timeout = startup_timeout
        self._sim_overrides = {"nodes": nodes, "gpus_per_node": gpus_per_node}
        self._simulator = simulator
        self.processes = processes
        #: the Slurm view of the jobs (processes, cgroups) when ``processes``; built on start
        self.slurm: SlurmNodes | None = None
        self._run_dir_arg = Path(run_dir) if run_dir is not None else None
        self._own_run_dir = run_dir is None
        self._site = site
        self.run_dir = Path()
        self.agents: list[AgentProcess] = []
        self._kept_logs: dict[str, Path] = {}
        #: Held while the simulator steps and writes; hold it to read the simulator consistently.
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._started = False
        self._stopped = False
        self.ticks = 0
        #: Simulated unix time the scenario starts at (fault onsets are relative to it).
        self.simulator_start = 0.0
        #: The last error of the ticker thread (the fleet stops advancing when set).
        self.error: BaseException | None = None
        #: Nodes whose published state is not refreshed (:meth:`freeze`: their agents serve the same readings).
        self.frozen: set[str] = set()

    # ------------------------------------------------------------------ properties
    @property
    def simulator(self) -> SimulatorLike:
        if self._simulator is None:
            raise LiveFleetError("the fleet is not started")
        return self._simulator

    @property
    def targets(self) -> list[tuple[str, str]]:
        """``(node, metrics URL)`` per node, in node order."""
        return [(a.node, a.url) for a in self.agents]

    @property
    def targets_file(self) -> Path:
        return self.run_dir / "targets.json"

    @property
    def prometheus_config(self) -> Path:
        return self.run_dir / "prometheus.yml"

    def node_site(self, i: int) -> str:
        """The site label of node ``i`` (the ``site`` argument, else the simulator's)."""
        return self._site or str(self.simulator.node_site(i))

    @property
    def sim_time(self) -> float:
        return float(self.simulator.t)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> LiveFleet:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> LiveFleet:
        if self._started:
            raise LiveFleetError("a LiveFleet can be started once")
        self._started = True
        atexit.register(self.stop)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        if self._simulator is None:
            self._simulator = make_simulator(self.scenario, self.seed, **self._sim_overrides)
        self.simulator_start = float(getattr(self._simulator, "start", self._simulator.t))
        if self._run_dir_arg is None:
            self.run_dir = Path(tempfile.mkdtemp(prefix="gpufleet-live-"))
        else:
            self.run_dir = self._run_dir_arg
            self.run_dir.mkdir(parents=True, exist_ok=True)
        nodes = list(self.simulator.nodes)
        if not nodes:
            raise LiveFleetError("the scenario has no nodes")
        ports = self._ports(len(nodes))
        if self.processes:
            from gpufleet.sim.simulator import Simulator

            if not isinstance(self._simulator, Simulator):
                raise LiveFleetError("processes=True needs the fleet simulator (gpufleet.sim.simulator)")
            self.slurm = SlurmNodes(self._simulator)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        for node, port in zip(nodes, ports, strict=True):
            base = self.run_dir / "nodes" / node
            a = AgentProcess(
                node=node, port=port, snapshot=base / "snapshot.json", sysfs=base / "sysfs",
                job_mapping=base / "job-mapping", log=self.run_dir / "logs" / f"{node}.log",
            )
            if self.slurm is not None:
                a.procfs, a.cgroupfs = node_dirs(base)
            a.sysfs.mkdir(parents=True, exist_ok=True)
            a.job_mapping.mkdir(parents=True, exist_ok=True)
            self.agents.append(a)
        self._write_all()  # agents find a complete node when they start
        for a in self.agents:
            self._spawn(a)
        self._wait_ready()
        self._write_targets()
        self._ticker = threading.Thread(target=self._run, name="gpufleet-live-ticker", daemon=True)
        self._ticker.start()

    def _ports(self, n: int) -> list[int]:
        if self.base_port is None:
            return free_ports(n)
        ports = list(range(self.base_port, self.base_port + n))
        if ports[-1] > 65535:
            raise LiveFleetError(f"--base-port {self.base_port} + {n} nodes runs past port 65535")
        taken = [p for p in ports if not port_free(p)]
        if taken:
            raise LiveFleetError(f"port(s) already in use on 127.0.0.1: {', '.join(map(str, taken))}")
        return ports

    def _spawn(self, a: AgentProcess) -> None:
        argv = [
            *agent_command(),
            f"--nvml.fake=live:{a.snapshot}",
            f"--path.sysfs={a.sysfs}",
            f"--collector.jobs.mapping-dir={a.job_mapping}",
            f"--web.listen-address={a.address}",
            *([f"--path.procfs={a.procfs}"] if a.procfs is not None else []),
            *([f"--path.cgroupfs={a.cgroupfs}"] if a.cgroupfs is not None else []),
            *self.agent_args,
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
        with open(a.log, "ab") as out:
            a.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                preexec_fn=set_parent_death_signal if sys.platform.startswith("linux") else None,
            )
        log.debug("started agent for %s on %s (pid %s)", a.node, a.address, a.proc.pid)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        pending = list(self.agents)
        retries = {a.node: PORT_RETRIES if self.base_port is None else 0 for a in self.agents}
        while pending:
            for a in list(pending):
                if not a.running():
                    if retries[a.node] > 0:  # a free port taken by someone else meanwhile: try another one
                        retries[a.node] -= 1
                        a.port = free_ports(1)[0]
                        log.warning("the agent for %s exited before serving; retrying on port %d", a.node, a.port)
                        self._spawn(a)
                        continue
                    code = a.proc.returncode if a.proc else None
                    raise LiveFleetError(
                        f"the agent for {a.node} on {a.address} exited (code {code}) before serving; "
                        f"its log ({self.kept_log(a)}):\n{a.log_tail()}"
                    )
                if http_ok(a.url):
                    pending.remove(a)
            if not pending:
                break
            if time.monotonic() > deadline:
                names = ", ".join(f"{a.node} ({a.address})" for a in pending)
                raise LiveFleetError(f"agents not serving after {self.startup_timeout:.0f}s: {names}")
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop the ticker and every agent; remove the run directory if it was a temporary one."""
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        self._stop.set()
        if self._ticker is not None and self._ticker is not threading.current_thread():
            self._ticker.join(timeout=max(5.0, 2 * self.tick))
        procs = [a.proc for a in self.agents if a.proc is not None and a.proc.poll() is None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
        deadline = time.monotonic() + STOP_GRACE
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                p.wait(timeout=STOP_GRACE)
        if self._own_run_dir and self.run_dir != Path():
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def check(self) -> None:
        """Raise :class:`LiveFleetError` if the simulator stopped or an agent exited."""
        if self.error is not None:
            raise LiveFleetError(f"the simulator stopped: {self.error}")
        for a in self.agents:
            if not a.running():
                code = a.proc.returncode if a.proc else None
                raise LiveFleetError(f"the agent for {a.node} on {a.address} exited (code {code}); its log "
                                     f"({self.kept_log(a)}):\n{a.log_tail()}")

    def kept_log(self, a: AgentProcess) -> Path:
        """Where a failed agent's log stays after the fleet stops (to name in error messages).

        A ``run_dir`` given by the caller is kept as it is. The temporary run directory is removed
        on stop, so the log is first copied to a directory of its own that nothing removes
        (``$TMPDIR/gpufleet-agent-log-*/<node>.log``), once per agent.
        """
        if not self._own_run_dir:
            return a.log
        kept = self._kept_logs.get(a.node)
        if kept is None:
            kept = Path(tempfile.mkdtemp(prefix="gpufleet-agent-log-")) / a.log.name
            try:
                shutil.copyfile(a.log, kept)
            except OSError as e:
                kept.write_text(f"(the agent's log {a.log} could not be read: {e.strerror or e})\n")
            self._kept_logs[a.node] = kept
        return kept

    # ------------------------------------------------------------------ faults at run time
    def inject(self, kind: str, node: str, gpu: int | None = None, severity: float = 0.5,
               duration: float | None = None) -> float:
        """Start a fault of ``kind`` (:data:`gpufleet.sim.faults.FAULTS`) on ``node`` (``gpu``: one GPU of it) now,
        in the running fleet, for ``duration`` simulated seconds (None: until the fleet stops); its onset, in
        simulated unix time. Needs the fleet simulator (:mod:`gpufleet.sim.simulator`)."""
        from gpufleet.sim.faults import FAULTS
        from gpufleet.sim.simulator import Simulator

        sim = self.simulator
        if not isinstance(sim, Simulator):
            raise LiveFleetError("inject needs the fleet simulator (gpufleet.sim.simulator)")
        if kind not in FAULTS:
            raise ValueError(f"unknown fault kind {kind!r}")
        with self.lock:
            onset = sim.elapsed
            fault = FAULTS[kind](onset=onset, end=None if duration is None else onset + duration,
                                 severity=severity, node=list(sim.nodes).index(node), gpu=gpu)
            sim.fault_schedule.add(fault)
            return sim.start + onset

    def freeze(self, node: str, frozen: bool = True) -> None:
        """Stop (or resume) publishing ``node``'s state: its agent keeps serving the readings it had, as a hung
        exporter or a stuck device snapshot does."""
        with self.lock:
            (self.frozen.add if frozen else self.frozen.discard)(node)

    # ------------------------------------------------------------------ ticking
    def _run(self) -> None:
        next_tick = time.monotonic() + self.tick
        while not self._stop.wait(max(0.0, next_tick - time.monotonic())):
            next_tick += self.tick
            if next_tick < time.monotonic():  # fell behind (slow machine): do not try to catch up in a burst
                next_tick = time.monotonic() + self.tick
            try:
                self.advance()
            except Exception as e:  # the fleet freezes rather than the program crashing
                log.exception("live fleet tick failed; the simulated fleet stops advancing")
                self.error = e
                return

    def advance(self, dt: float | None = None) -> None:
        """Advance the simulation by ``dt`` seconds (default ``tick * speed``) and publish the state.

        Large steps are split into substeps of at most :data:`MAX_SUBSTEP` simulated seconds so an
        accelerated fleet follows the same physics as a real-time one.
        """
        total = self.tick * self.speed if dt is None else dt
        n = max(1, math.ceil(total / MAX_SUBSTEP - 1e-9))
        with self.lock:
            for _ in range(n):
                self.simulator.step(dt=total / n)
            self._write_all()
            self.ticks += 1

    def _write_all(self) -> None:
        sim = self.simulator
        jobs = getattr(sim, "write_node_job_mapping", None)
        for i, a in enumerate(self.agents):
            if a.node in self.frozen:
                continue
            if self.slurm is not None and a.procfs is not None and a.cgroupfs is not None:
                self.slurm.publish(i, sim.node_snapshot(i), a.snapshot, a.procfs, a.cgroupfs)
            else:
                write_snapshot(a.snapshot, sim.node_snapshot(i))
            sim.write_node_sysfs(i, a.sysfs)
            if callable(jobs) and self.slurm is None:
                jobs(i, a.job_mapping)

    def _write_targets(self) -> None:
        groups = [
            {
                "targets": [a.address],
                "labels": {"instance": f"{a.node}:{DEFAULT_PORT}", "site": self.node_site(i)},
            }
            for i, a in enumerate(self.agents)
        ]
        write_atomic(self.targets_file, json.dumps(groups, indent=2) + "\n")
        config = {
            "global": {"scrape_interval": "5s", "scrape_timeout": "4s"},
            "scrape_configs": [
                {
                    "job_name": "gpufleet-agent",
                    "file_sd_configs": [{"files": [str(self.targets_file)], "refresh_interval": "30s"}],
                }
            ],
        }
        write_atomic(self.prometheus_config, json.dumps(config, indent=2) + "\n")
