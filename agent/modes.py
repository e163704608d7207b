"""The agent's run modes: serve over HTTP(S), print once, write node_exporter's textfile, record a trace.

Each mode builds the :class:`~gpufleet.agent.app.Agent` from resolved settings, runs it, and reports
to systemd (``sd_notify`` readiness, status and watchdog pings) when it runs as a daemon.
"""

from __future__ import annotations

import gc
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from gpufleet.agent import __version__
from gpufleet.agent.config import AgentConfig
from gpufleet.agent.settings import PROG, Settings, UsageError
from gpufleet.serving import sdnotify
from gpufleet.serving.files import write_atomic

if TYPE_CHECKING:
    from gpufleet.agent.app import Agent

TEXTFILE_NAME = "gpufleet.prom"
#: Young-generation threshold for the daemon (Python's default is 700 container allocations).
GC_GEN0_THRESHOLD = 10_000

log = logging.getLogger("gpufleet.agent")


def run(settings: Settings) -> int:
    """Run the mode ``settings`` names (record excepted: see :func:`record`); returns the exit status."""
    if settings.mode == "once":
        return once(settings.config)
    if settings.mode == "textfile":
        return textfile(settings.config)
    return serve(settings.config)


def tune_gc() -> None:
    """For the long-running daemon, once started: freeze everything allocated so far (modules, the
    catalog, NVML state) into the permanent generation, so the cyclic garbage collector stops
    re-scanning it, and raise the young-generation threshold above what one scrape allocates at
    once. A scrape's garbage is acyclic and freed by reference counting; with the default threshold
    the collector would still run about twice per scrape on an 8-GPU host, finding nothing."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(GC_GEN0_THRESHOLD, gc.get_threshold()[0]), gen1, gen2)


def _build_agent(cfg: AgentConfig) -> Agent:
    from gpufleet.agent.app import Agent

    try:
        return Agent(cfg)
    except ValueError as e:  # e.g. a bad --nvml.fake spec
        raise UsageError(str(e)) from e


def _stop_event() -> threading.Event:
    stop = threading.Event()

    def handler(signum: int, frame: object) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def watchdog(alive: Callable[[], str | None], busy_for: Callable[[], float], what: str) -> sdnotify.Watchdog:
    """Start systemd's watchdog pings (when ``WatchdogSec=`` is set): they stop when ``alive()``
    gives a reason or when ``busy_for()`` (seconds the work in progress has run past its deadline)
    reaches the watchdog timeout, so systemd restarts an agent whose serving loop is wedged. An NVML
    call that never returns does not stop them: scrapes answer without it by their deadline, and a
    restarted agent would block in the same call. An idle agent that nobody scrapes keeps pinging."""
    wd = sdnotify.Watchdog(lambda: None)
    limit = wd.timeout

    def check() -> str | None:
        busy = busy_for()
        if limit is not None and busy >= limit:
            return f"{what} has been running for {busy:.0f} s (watchdog {limit:g} s)"
        return alive()

    wd.check = check
    return wd.start()


def _serving_problem(thread: threading.Thread, loop_stalled: float, limit: float) -> str | None:
    """Why the serving loop is not alive (the watchdog stops pinging), or None."""
    if not thread.is_alive():
        return "HTTP server thread stopped"
    if loop_stalled >= limit:
        return f"HTTP connection loop has not turned for {loop_stalled:.0f} s"
    return None


def serve(cfg: AgentConfig) -> int:
    from gpufleet.serving.server import MetricsServer
    from gpufleet.serving.webconfig import WebConfigError, load_web_config

    try:
        web = load_web_config(cfg.web_config_file)
    except WebConfigError as e:
        raise UsageError(f"web config: {e}") from e
    stop = _stop_event()
    agent = _build_agent(cfg)
    try:
        try:
            server = MetricsServer(cfg.listen_address, agent, web, cfg.telemetry_path)
        except WebConfigError as e:
            raise UsageError(f"web config: {e}") from e
        except OSError as e:
            print(f"{PROG}: cannot listen on {cfg.listen_address}: {e.strerror or e}", file=sys.stderr)
            return 1
        agent.start(stop=stop)
        tune_gc()
        thread = server.serve_in_thread()
        log.info("listening on %s://%s%s (version %s)", server.scheme, cfg.listen_address,
                 cfg.telemetry_path, __version__)
        where = f"listening on {server.scheme}://{cfg.listen_address}{cfg.telemetry_path}"
        sdnotify.ready(f"{where}; {agent.health()}")
        limit = sdnotify.watchdog_interval() or 60.0
        wd = watchdog(lambda: _serving_problem(thread, server.loop_stalled_for(), limit),
                      agent.collector.overdue_for, "a scrape past its deadline")
        shown = agent.health()
        try:
            while not stop.wait(1.0):
                if not thread.is_alive():
                    log.error("HTTP server stopped unexpectedly")
                    return 1
                if agent.health() != shown:
                    shown = agent.health()
                    sdnotify.status(f"{where}; {shown}")
        finally:
            sdnotify.stopping()
            wd.stop()
        server.shutdown()
        server.server_close()
    finally:
        agent.close()
    log.info("stopped")
    return 0


def once(cfg: AgentConfig) -> int:
    agent = _build_agent(cfg)
    try:
        agent.start(listen_xid=False)
        sys.stdout.buffer.write(agent.text())
        sys.stdout.flush()
    finally:
        agent.close()
    return 0


def write_textfile(directory: str, data: bytes) -> Path:
    """Write ``directory/gpufleet.prom`` atomically, synced to disk and readable by node_exporter (0644)."""
    return write_atomic(Path(directory) / TEXTFILE_NAME, data, mode=0o644, fsync=True)


def textfile(cfg: AgentConfig) -> int:
    assert cfg.textfile_directory is not None
    stop = _stop_event() if cfg.textfile_interval > 0 else threading.Event()
    agent = _build_agent(cfg)
    # When the write in progress (hardware read + file write) started: the watchdog stops if one wedges.
    busy: list[float | None] = [None]
    wd = sdnotify.Watchdog(lambda: None, timeout=0)  # disabled unless a daemon (--interval > 0)
    try:
        agent.start(listen_xid=cfg.textfile_interval > 0, stop=stop)
        if cfg.textfile_interval > 0:
            tune_gc()
            wd = watchdog(lambda: None, lambda: max(0.0, 0.0 if busy[0] is None else
                                                    time.monotonic() - busy[0] - cfg.scrape_timeout),
                          "writing the textfile (past the scrape timeout)")
        shown = ""
        while True:
            started = busy[0] = time.monotonic()
            try:
                path = write_textfile(cfg.textfile_directory, agent.text())
                log.debug("wrote %s", path)
                state = f"wrote {path}"
            except OSError as e:
                state = f"cannot write {cfg.textfile_directory}/{TEXTFILE_NAME}: {e.strerror or e}"
                print(f"{PROG}: {state}", file=sys.stderr)
                if cfg.textfile_interval <= 0:
                    return 1
            busy[0] = None
            if cfg.textfile_interval <= 0:
                return 0
            if not shown:
                sdnotify.ready(state)  # ready once the first write was attempted
            elif state.split()[0] != shown.split()[0]:
                sdnotify.status(state)
            shown = state
            wd.tick()
            if stop.wait(max(0.0, cfg.textfile_interval - (time.monotonic() - started))):
                return 0
    finally:
        if cfg.textfile_interval > 0:
            sdnotify.stopping()
        wd.stop()
        agent.close()


def record_args(cfg: AgentConfig, argv: list[str]) -> list[str]:
    """The recorder's arguments: the agent's sysfs path, log level and fake NVML, then ``argv``."""
    lead = [f"--path.sysfs={cfg.sysfs_path}", f"--log.level={cfg.log_level.lower()}"]
    if cfg.nvml_fake:
        lead.insert(0, f"--nvml.fake={cfg.nvml_fake}")
    return lead + argv


def record(cfg: AgentConfig, argv: list[str]) -> int:
    """``gpufleet-agent [FLAGS] record [RECORD OPTIONS]``: the recorder, with the agent's settings."""
    try:
        from gpufleet.agent.recorder import record_main
    except ImportError as e:
        print(f"{PROG}: record is not available: {e}", file=sys.stderr)
        return 1
    return int(record_main(record_args(cfg, argv)))
