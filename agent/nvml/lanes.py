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
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
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
        self._cv = threading.Condition(threading.Lock())
        self._queue: deque[Job[Any]] = deque()
        #: key -> its job queued or running
        self._busy: dict[str, Job[Any]] = {}
        self._workers = 0
        self._idle = 0
        self._closed = False
        #: Jobs that returned after their caller had given up (their results were dropped).
        self.late = 0

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
        if job is None or not job.wait(deadline):
            return False, None
        if job.error is not None:
            raise job.error
        return True, job.result

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


def _innermost_call(frame: FrameType | None, prefix: str) -> str:
    """The NVML function ``frame``'s stack is in: the pynvml wrapper (named after the C entry point,
    nvmlDeviceGetPowerUsage), else the entry point a Python stand-in of the library is running (the
    fake NVML), else the innermost gpufleet NVML function (a direct ctypes call: read_fields); "" if none."""
    entry = ours = ""
    depth = 0
    while frame is not None and depth < _MAX_FRAMES:
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
