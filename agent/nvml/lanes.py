"""Work that may never return, run so that it never holds more than one thread per key.

:class:`Lanes` is a small, bounded thread pool whose jobs carry a key (a GPU's index, ``""`` for
NVML's node-wide calls, a collector's name). A key has at most one job queued or running at a
time: :meth:`Lanes.submit` answers None while the key's previous job is still in hand, so a call
that hangs in the driver holds one worker and is not called again, however many scrapes come,
until it returns. The caller waits for a job until its own deadline (:meth:`Lanes.run`); a job
that misses it is *abandoned*: its result, whenever it comes, is dropped (never served later as
if it were fresh), and while it keeps running it is listed by :meth:`Lanes.stalled` with the
NVML function it is blocked in (read from the worker's Python stack, at no cost to calls that
return) and for how long.

Workers are started on demand, up to ``max_workers``, and stay for later jobs; an abandoned job
that has not started yet is taken out of the queue, so its key is free at once.

:meth:`Lanes.run_batch` runs many keys' work one after another on one worker (one thread handoff for
a whole scrape's GPUs or collectors, as cheap as running them inline): when one item overruns its
time, the caller leaves that worker to it (the item's key is stalled, exactly as above) and hands
the items after it to another worker.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from types import FrameType
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The key of NVML calls that concern no one GPU (init, device count, driver versions).
NODE = ""
#: Stack frames looked at to name the NVML function a stalled worker is blocked in.
_MAX_FRAMES = 64


class Job(Generic[T]):
    """One unit of work for a key; :meth:`wait` returns True once it has finished."""

    __slots__ = (
        "_lanes",
        "abandoned",
        "done",
        "error",
        "finished",
        "fn",
        "key",
        "result",
        "started",
        "thread_id",
        "what",
    )

    def __init__(self, lanes: Lanes, key: str, what: str, fn: Callable[[], T]) -> None:
        self.key = key
        self.what = what
        self.fn = fn
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None
        self.started: float | None = None
        self.finished: float | None = None
        self.abandoned = False
        self.thread_id: int | None = None
        self._lanes = lanes

    def wait(self, deadline: float) -> bool:
        """Wait until the job finished or ``deadline`` (``time.monotonic()``) passed; a job not
        finished by then is abandoned (see the module docstring) and False is returned."""
        if self.done.wait(max(0.0, deadline - time.monotonic())):
            return True
        self._lanes.abandon(self)
        return self.done.is_set() and not self.abandoned


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """One batch item: whether it answered in time, its result, and the exception it raised."""

    answered: bool
    result: T | None = None
    error: BaseException | None = None


_MISSED: Outcome[Any] = Outcome(False)


class _Batch:
    """A batch's shared state: the items, the next one to run (``pos``), where the worker must stop
    (``stop``: the caller moved the items from there on to another worker), the outcomes."""

    __slots__ = ("item", "out", "pos", "stop", "tasks")

    def __init__(self, tasks: Sequence[tuple[str, str, Callable[[], Any]]], start: int, out: list[Outcome[Any]]) -> None:
        self.tasks = tasks
        self.pos = start
        self.stop = len(tasks)
        self.out = out
        #: the item job running now (None between items)
        self.item: Job[Any] | None = None


@dataclass(frozen=True)
class Stall:
    """A job its caller gave up on that is still running: which key, in which call, since when."""

    key: str
    call: str
    seconds: float


class Lanes:
    """See the module docstring. ``name`` prefixes the worker threads' names."""

    def __init__(self, name: str, max_workers: int = 16, *, clock: Callable[[], float] = time.monotonic,
                 call_prefix: str = "nvml") -> None:
        self.name = name
        self.max_workers = max(1, max_workers)
        self._clock = clock
        self._prefix = call_prefix
        self._reset()
        self._closed = False
        _ALL.add(self)
        #: Jobs that returned after their caller had given up (their results were dropped).
        self.late = 0
        self._batches = itertools.count()

    def _reset(self) -> None:
        """No workers and no jobs (a new pool; also in a forked child, which has none of the parent's threads)."""
        lock = threading.Lock()
        self._cv = threading.Condition(lock)  # workers wait on it for jobs
        self._progress = threading.Condition(lock)  # run_batch callers wait on it for items
        self._queue: deque[Job[Any]] = deque()
        #: key -> its job queued or running
        self._busy: dict[str, Job[Any]] = {}
        self._workers = 0
        self._idle = 0

    # ------------------------------------------------------------------ use

    def submit(self, key: str, what: str, fn: Callable[[], T]) -> Job[T] | None:
        """Queue ``fn`` for ``key``; None when the key's previous job is still queued or running."""
        with self._cv:
            if key in self._busy:
                return None
            self._closed = False  # used again after close(): workers start on demand again
            job: Job[T] = Job(self, key, what, fn)
            self._busy[key] = job
            self._queue.append(job)
            if len(self._queue) > self._idle and self._workers < self.max_workers:
                self._workers += 1
                threading.Thread(target=self._work, name=f"{self.name}-{self._workers}", daemon=True).start()
            else:
                self._cv.notify()
        return job

    def run(self, key: str, what: str, fn: Callable[[], T], deadline: float) -> tuple[bool, T | None]:
        """``fn()`` on ``key``'s lane, waited for until ``deadline``: (True, its result), or (False, None)
        when the key is still busy from before or the job missed the deadline. Its exception is raised."""
        job = self.submit(key, what, fn)
        if job is None:
            return False, None
        if not job.wait(deadline):
            self._gave_up(key, what)
            return False, None
        if job.error is not None:
            raise job.error
        return True, job.result

    def run_batch(self, tasks: Sequence[tuple[str, str, Callable[[], Any]]],
                  untils: Sequence[float]) -> list[Outcome[Any]]:
        """Run ``tasks`` (key, what, fn) in order on one worker; item ``i`` must finish by ``untils[i]``
        (``time.monotonic()``, non-decreasing). An item whose key is still busy from before is skipped;
        one that overruns keeps its worker (its key stalled, its result dropped when it comes) and the
        items after it go on on another worker. Returns each item's :class:`Outcome`."""
        n = len(tasks)
        out: list[Outcome[Any]] = [_MISSED] * n
        start = 0
        while start < n:
            batch = _Batch(tasks, start, out)
            job = self.submit(f"\x00batch{next(self._batches)}", "batch", partial(self._run_items, batch))
            assert job is not None  # a fresh key
            start = n
            with self._cv:
                while batch.pos < batch.stop:
                    i = batch.pos
                    left = untils[i] - self._clock()
                    if left > 0:
                        self._progress.wait(left)
                        continue
                    # item i overran (or never started: no free worker): leave it, go on from i + 1
                    item = batch.item
                    if item is not None and item.key == tasks[i][0] and item.started is not None:
                        item.abandoned = True
                        batch.stop = i + 1
                        self._gave_up(item.key, item.what)
                    else:
                        batch.stop = i
                    start = i + 1
                    break
            if job.started is None:
                self.abandon(job)
        return out

    def _run_items(self, batch: _Batch) -> None:
        """The worker's side of :meth:`run_batch`."""
        tasks, me = batch.tasks, threading.get_ident()
        while True:
            with self._cv:
                i = batch.pos
                if i >= batch.stop:
                    return
                key, what, fn = tasks[i]
                if key in self._busy:  # still stalled from an earlier call: not called again
                    batch.pos = i + 1
                    self._progress.notify_all()
                    continue
                item: Job[Any] = Job(self, key, what, fn)
                item.started = self._clock()
                item.thread_id = me
                self._busy[key] = item
                batch.item = item
            try:
                result, error = fn(), None
            except BaseException as e:  # handed to the caller in the Outcome
                result, error = None, e
            with self._cv:
                item.finished = self._clock()
                self._release(item)
                batch.item = None
                if item.abandoned:
                    self.late += 1
                    log.warning("%s %s: %s returned after %.1f s; its result was dropped (already reported missing)",
                                self.name, key or "node", what, item.finished - (item.started or 0.0))
                    return
                batch.out[i] = Outcome(True, result, error)
                batch.pos = i + 1
                self._progress.notify_all()

    def _gave_up(self, key: str, what: str) -> None:
        """Log once per stall (its key stays busy, so later reads skip it silently until it returns)."""
        log.warning("%s %s: %s has not returned by the read's deadline: served without it until it returns",
                    self.name, key or "node", what)

    def abandon(self, job: Job[Any]) -> None:
        """The caller stops waiting for ``job``: if it has not started it never will (its key is free)."""
        with self._cv:
            if job.done.is_set():
                return
            job.abandoned = True
            if job.started is None:
                try:
                    self._queue.remove(job)
                except ValueError:
                    return
                self._release(job)
                job.done.set()

    def busy(self, key: str) -> bool:
        with self._cv:
            return key in self._busy

    def stalled(self) -> list[Stall]:
        """Abandoned jobs still running, by key: the NVML function each is in, and seconds since it started."""
        now = self._clock()
        with self._cv:
            jobs = [j for j in self._busy.values() if j.abandoned and j.started is not None]
        frames = sys._current_frames() if jobs else {}
        out = []
        for j in sorted(jobs, key=lambda j: j.key):
            frame = frames.get(j.thread_id) if j.thread_id is not None else None
            out.append(Stall(j.key, _innermost_call(frame, self._prefix) or j.what,
                             max(0.0, now - (j.started or now))))
        return out

    @property
    def threads(self) -> int:
        """Worker threads started (they stay for later jobs)."""
        with self._cv:
            return self._workers

    def close(self) -> None:
        """Idle workers exit; a worker stuck in a call exits once it returns. Jobs queued are dropped
        (their callers stop waiting at their deadlines); a later submit starts workers again."""
        with self._cv:
            self._closed = True
            for job in self._queue:
                job.abandoned = True
                self._release(job)
                job.done.set()
            self._queue.clear()
            self._cv.notify_all()

    # ------------------------------------------------------------------ workers

    def _release(self, job: Job[Any]) -> None:
        if self._busy.get(job.key) is job:
            del self._busy[job.key]

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._idle += 1
                    self._cv.wait()
                    self._idle -= 1
                if self._closed:
                    self._workers -= 1
                    return
                job = self._queue.popleft()
                job.started = self._clock()
                job.thread_id = threading.get_ident()
            try:
                job.result = job.fn()
            except BaseException as e:  # handed to the caller (run() re-raises it)
                job.error = e
            with self._cv:
                job.finished = self._clock()
                self._release(job)
                if job.abandoned:
                    self.late += 1
                    job.result = None
                    log.warning("%s %s: %s returned after %.1f s; its result was dropped (already reported missing)",
                                self.name, job.key or "node", job.what, job.finished - (job.started or 0.0))
                job.done.set()


#: Every pool, so that a forked child starts its own workers (fork copies only the forking thread).
_ALL: weakref.WeakSet[Lanes] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for lanes in list(_ALL):
        lanes._reset()


os.register_at_fork(after_in_child=_after_fork_in_child)


def staggered(start: float, end: float, n: int, share: float = 0.3, cap: float = 0.25) -> list[float]:
    """Deadlines for ``n`` items run one after another between ``start`` and ``end``: each keeps a slice
    (``share`` of the time over ``n``, at most ``cap`` seconds) for every item after it, so one that
    hangs still leaves the others time."""
    slice_ = min(cap, max(0.0, end - start) * share / max(1, n))
    return [end - (n - 1 - i) * slice_ for i in range(n)]


#: Code of the functions that only wait on other lanes' jobs (:func:`waits_on_lanes`).
_WAITING: set[Any] = set()

F = TypeVar("F", bound=Callable[..., Any])


def waits_on_lanes(fn: F) -> F:
    """Mark ``fn`` as one that only waits for other keys' jobs (NVML's start waiting for each GPU's open): a
    job stalled in it is named by what it was submitted as, not by where it waits (the keys it waits for are
    listed as stalled themselves once it gives up on them)."""
    _WAITING.add(fn.__code__)
    return fn


def _innermost_call(frame: FrameType | None, prefix: str) -> str:
    """The NVML function ``frame``'s stack is in: the pynvml wrapper (named after the C entry point,
    nvmlDeviceGetPowerUsage), else the entry point a Python stand-in of the library is running (the
    fake NVML), else the innermost gpufleet NVML function (a direct ctypes call: read_fields); "" if none."""
    entry = ours = ""
    depth = 0
    while frame is not None and depth < _MAX_FRAMES:
        if frame.f_code in _WAITING:
            return ""
        name = frame.f_code.co_name
        module = str(frame.f_globals.get("__name__", ""))
        if module == "pynvml" and name.startswith(prefix):
            return name
        if not entry and name == "__call__":
            called = getattr(frame.f_locals.get("self"), "__name__", "")
            if isinstance(called, str) and called.startswith(prefix):
                entry = called
        if not ours and (name.startswith(prefix) or module.startswith("gpufleet.agent.nvml.")) \
                and module != __name__:
            ours = name
        frame = frame.f_back
        depth += 1
    return entry or ours
