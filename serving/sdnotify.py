"""systemd's readiness and watchdog protocol (``sd_notify(3)``), without libsystemd.

A service of ``Type=notify`` tells systemd how it is doing by sending datagrams such as
``READY=1``, ``STOPPING=1``, ``STATUS=...`` or ``WATCHDOG=1`` to the unix socket named by
``$NOTIFY_SOCKET`` (a path, or an abstract socket when it starts with ``@``). Without that
variable (not started by systemd, or not ``Type=notify``) every call is a no-op returning False.

With ``WatchdogSec=`` set, systemd exports ``$WATCHDOG_USEC`` (and ``$WATCHDOG_PID``) and
kills and restarts the service when ``WATCHDOG=1`` does not arrive within that time.
:class:`Watchdog` sends it from a thread every half timeout, but only while a health check
passes: a daemon whose work loop is wedged stops pinging and systemd restarts it.

Self-contained (standard library only) so that every gpufleet daemon can use it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping

log = logging.getLogger("gpufleet.sdnotify")


def _address(env: Mapping[str, str]) -> str | None:
    addr = env.get("NOTIFY_SOCKET", "")
    if addr.startswith("@"):
        return "\0" + addr[1:]  # abstract namespace
    if addr.startswith("/"):
        return addr
    return None  # unset, or a kind of address this module does not speak (e.g. vsock:)


def notify(state: str, env: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (one or more ``KEY=value`` lines) to systemd; True when it was sent."""
    addr = _address(os.environ if env is None else env)
    if addr is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto(state.encode("utf-8", "replace"), addr)
    except OSError as e:
        log.debug("sd_notify %r to %s failed: %s", state, addr, e)
        return False
    return True


def ready(status_text: str | None = None) -> bool:
    """``READY=1``: start-up is complete (with an optional status line)."""
    return notify("READY=1" + (f"\nSTATUS={_one_line(status_text)}" if status_text else ""))


def stopping() -> bool:
    """``STOPPING=1``: the service is shutting down."""
    return notify("STOPPING=1")


def status(text: str) -> bool:
    """``STATUS=...``: a one-line state shown by ``systemctl status``."""
    return notify(f"STATUS={_one_line(text)}")


def watchdog_ping() -> bool:
    """``WATCHDOG=1``: the service is alive."""
    return notify("WATCHDOG=1")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """The watchdog timeout in seconds from ``$WATCHDOG_USEC``, or None when no watchdog is
    set for this process (unset or invalid, or ``$WATCHDOG_PID`` names another process)."""
    env = os.environ if env is None else env
    pid = env.get("WATCHDOG_PID")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 1e6 if usec > 0 else None


#: A health check: None when healthy, else a one-line reason (sent as STATUS=).
Check = Callable[[], str | None]


class Watchdog:
    """Sends ``WATCHDOG=1`` every ``timeout / 2`` seconds while ``check()`` returns None.

    When the check returns a reason the pings stop (systemd then kills the service after
    ``timeout``), the reason is logged and sent as ``STATUS=``. ``timeout`` defaults to
    :func:`watchdog_interval`; with no watchdog configured :meth:`start` does nothing.
    """

    def __init__(self, check: Check, timeout: float | None = None) -> None:
        self.check = check
        self.timeout = watchdog_interval() if timeout is None else timeout
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_reason: str | None = None
        #: Pings sent.
        self.pings = 0

    @property
    def enabled(self) -> bool:
        return self.timeout is not None and self.timeout > 0

    def start(self) -> Watchdog:
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpufleet-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def tick(self) -> bool:
        """Ping now if healthy; True when a ping was sent (for daemons that also ping from their loop)."""
        if not self.enabled:
            return False
        try:
            reason = self.check()
        except Exception as e:  # a broken check must not look healthy
            reason = f"health check failed: {type(e).__name__}: {e}"
        if reason is not None:
            if reason != self._last_reason:
                log.error("watchdog: not pinging systemd: %s", reason)
                status(f"unhealthy: {reason}")
            self._last_reason = reason
            return False
        if self._last_reason is not None:
            log.info("watchdog: healthy again")
            self._last_reason = None
        if watchdog_ping():
            self.pings += 1
            return True
        return False

    def _run(self) -> None:
        assert self.timeout is not None
        period = max(0.01, self.timeout / 2)
        self.tick()
        while not self._stop.wait(period):
            self.tick()
