"""The threads that build responses: a small pool for routes, one thread for bcrypt checks.

Only complete requests reach them. Basic-auth checks whose credentials are not cached go to the
one bcrypt thread; requests with cached (or no) credentials never wait behind it, so a password
spray costs at most one core and does not slow real scrapes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from gpufleet.serving.http import Request
from gpufleet.serving.responder import PROBE_PATHS, Responder

log = logging.getLogger("gpufleet.serving.server")

#: Threads building responses.
WORKERS = 4
#: A request whose credentials wait longer than this for the bcrypt thread is answered 503.
AUTH_QUEUE_TIMEOUT = 10.0

C = TypeVar("C")


class WorkerPool(Generic[C]):
    """Answers requests of connections ``C``; each response goes to ``complete(conn, data, keep)``."""

    def __init__(self, responder: Responder, complete: Callable[[C, bytes, bool], None],
                 workers: int = WORKERS) -> None:
        self.responder = responder
        self.web = responder.web
        self._complete = complete
        self.size = max(1, workers)
        self._jobs: queue.SimpleQueue[tuple[C, Request] | None] = queue.SimpleQueue()
        self._auth_jobs: queue.SimpleQueue[tuple[C, Request, float] | None] = queue.SimpleQueue()

    def start(self) -> None:
        threads = [threading.Thread(target=self._worker, name=f"gpufleet-http-worker-{i}", daemon=True)
                   for i in range(self.size)]
        threads.append(threading.Thread(target=self._auth_worker, name="gpufleet-http-auth", daemon=True))
        for t in threads:
            t.start()

    def stop(self) -> None:
        """Let every thread finish its job in hand and exit."""
        for _ in range(self.size):
            self._jobs.put(None)
        self._auth_jobs.put(None)

    def submit(self, conn: C, req: Request) -> None:
        if (self.web.auth_required and req.path not in PROBE_PATHS
                and not self.web.cached_authorization(req.headers.get("authorization"))):
            self._auth_jobs.put((conn, req, time.monotonic()))
        else:
            self._jobs.put((conn, req))

    def _worker(self) -> None:
        while (job := self._jobs.get()) is not None:
            conn, req = job
            try:
                data, keep = self.responder.route(req)
            except Exception:
                log.exception("serving %s %s failed", req.method, req.target)
                data, keep = self.responder.error(500, "internal error"), False
            self._complete(conn, data, keep)

    def _auth_worker(self) -> None:
        while (job := self._auth_jobs.get()) is not None:
            conn, req, queued = job
            if time.monotonic() - queued > AUTH_QUEUE_TIMEOUT:
                self._complete(conn, self.responder.error(503, "authentication is overloaded"), False)
            elif self.web.check_authorization(req.headers.get("authorization")):
                self._jobs.put((conn, req))
            else:
                self._complete(conn, self.responder.unauthorized(req), req.keep_alive)
