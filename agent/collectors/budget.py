"""A scrape's time budget, as the collectors running for it see it.

The registry (:mod:`gpufleet.agent.registry`) runs each collector for a scrape under a
:class:`Budget`: when the scrape must be answered (``deadline``, ``time.monotonic()``) and a list
the collector adds to when it answers without some of its data (a GPU whose NVML call did not
return in time). A collector that notes anything there is reported with
``gpufleet_scrape_collector_success 0``, while what it did read is served.

Collectors that wait on hardware (the GPU collector, the MIG/process reader) call
:func:`current` to learn how long they may wait; outside a scrape (tests, the recorder) it
gives a budget of :data:`DEFAULT_TIMEOUT` seconds from now.
"""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass, field

#: Seconds a scrape may take when nobody says otherwise (``--scrape.timeout``'s default).
DEFAULT_TIMEOUT = 10.0
#: What a scrape keeps of its time for answering: the deadline is the timeout minus this part of it
#: (at least MIN_MARGIN, at most MAX_MARGIN seconds).
MARGIN_RATIO = 0.05
MIN_MARGIN = 0.1
MAX_MARGIN = 0.5
#: The part of a scrape's time the GPU reads may use; the rest is kept for the collectors after them.
GPU_SHARE = 0.75


@dataclass
class Budget:
    """One collector's run for one scrape (see the module docstring)."""

    start: float
    deadline: float
    #: What the collector could not read in time ("gpu 3"); empty: complete.
    missing: list[str] = field(default_factory=list)
    #: ``time.perf_counter()`` when the collector started (0.0: not yet), and seconds it ran.
    started: float = 0.0
    took: float = 0.0

    def share(self, ratio: float) -> float:
        """The time (``time.monotonic()``) by which ``ratio`` of the budget has gone."""
        return self.start + (self.deadline - self.start) * ratio


def deadline_for(timeout: float, now: float | None = None) -> float:
    """The deadline of a scrape that must be answered within ``timeout`` seconds (a margin taken off)."""
    now = time.monotonic() if now is None else now
    margin = min(MAX_MARGIN, max(MIN_MARGIN, timeout * MARGIN_RATIO))
    return now + max(0.0, timeout - margin)


_CURRENT: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("gpufleet_budget", default=None)


def current() -> Budget:
    """The budget of the collector run on this thread, or a fresh one of DEFAULT_TIMEOUT seconds."""
    b = _CURRENT.get()
    if b is None:
        now = time.monotonic()
        b = Budget(now, deadline_for(DEFAULT_TIMEOUT, now))
    return b


def enter(budget: Budget) -> contextvars.Token[Budget | None]:
    """Make ``budget`` current on this thread (undo with :func:`leave`)."""
    return _CURRENT.set(budget)


def leave(token: contextvars.Token[Budget | None]) -> None:
    _CURRENT.reset(token)
