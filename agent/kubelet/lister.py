"""The kubelet's pod-resources ``List``, asked once per refresh interval, never on the scrape path.

:class:`PodResourcesLister` asks ``List`` on a background thread every ``refresh_interval``
seconds (gRPC deadline ``timeout``) and keeps the last answer; :meth:`~PodResourcesLister.holders`
returns it at once, so a scrape never waits on the kubelet, except the very first (which
starts the thread): it waits at most ``first_wait`` seconds for the first answer, so that
``once`` mode gets one. Failures are counted by gRPC status
and logged once per change of state; the last good answer is served for ``stale_after``
seconds after it was taken (a kubelet restart or a single slow answer leaves no gap), then
dropped. A missing socket (no kubelet on this host) is no data and no error.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from gpufleet.agent.kubelet.devices import Holder, holders
from gpufleet.agent.kubelet.podresources.v1 import api_pb2, api_pb2_grpc

log = logging.getLogger(__name__)

#: The kubelet's own answers fit in 4 MiB (gRPC's default) on all but huge nodes; dcgm-exporter allows 16.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
_OK, _ABSENT = "ok", "absent"


class PodResourcesLister:
    def __init__(self, socket_path: str, resources: Sequence[str], refresh_interval: float = 5.0,
                 timeout: float = 1.5, stale_after: float | None = None, first_wait: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.socket_path = os.path.abspath(socket_path)
        self.resources = tuple(resources)
        self.refresh_interval = refresh_interval
        self.timeout = timeout
        self.stale_after = 3 * max(refresh_interval, timeout) if stale_after is None else stale_after
        self.first_wait = timeout if first_wait is None else first_wait
        self._clock = clock
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._first_done = threading.Event()
        self._data: list[Holder] | None = None
        self._data_at = 0.0
        self._state = ""  # "ok", "absent" or an error name: logged when it changes
        self._seen = False  # the socket has existed at least once
        self._errors: dict[str, int] = {}
        self._closed = False

    # ------------------------------------------------------------------ scrape side
    def start(self) -> None:
        """Start the background thread (if not yet started); does not wait for an answer."""
        with self._lock:
            if not self._closed and self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="gpufleet-kubelet-list", daemon=True)
                self._thread.start()

    def holders(self) -> list[Holder] | None:
        """The last answer's holders, None for no data (no socket yet, or the last answer is stale)."""
        self.start()
        if not self._first_done.is_set():
            self._first_done.wait(self.first_wait)
        with self._lock:
            if self._data is None or self._clock() - self._data_at > self.stale_after:
                return None
            return self._data

    def errors(self) -> dict[str, int] | None:
        """Failed calls by error name; None while the socket has never been seen (no kubelet here)."""
        with self._lock:
            return dict(self._errors) if self._seen else None

    def close(self) -> None:
        """Stop the background thread (waits for a call in flight, at most its deadline)."""
        with self._lock:
            self._closed = True
            thread = self._thread
        self._stop.set()
        if thread is not None:
            thread.join(self.timeout + 1.0)

    # ------------------------------------------------------------------ background calls
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._refresh()
            self._stop.wait(self.refresh_interval)

    def _refresh(self) -> None:
        state, data = _OK, None
        try:
            data = self._list()
            if data is None:
                state = _ABSENT
        except grpc.RpcError as e:
            code = e.code() if callable(getattr(e, "code", None)) else None
            state = code.name.lower() if isinstance(code, grpc.StatusCode) else "other"
            detail = e.details() if callable(getattr(e, "details", None)) else ""
            self._log(state, f"{state}: {detail or e}")
        except Exception as e:  # a broken answer must not kill attribution for good
            state = "other"
            self._log(state, f"{type(e).__name__}: {e}")
        with self._lock:
            if state == _OK:
                self._data, self._data_at = data, self._clock()
            elif state != _ABSENT:
                self._errors[state] = self._errors.get(state, 0) + 1
            if state != _ABSENT:
                self._seen = True
            self._log_change(state)
        self._first_done.set()

    def _list(self) -> list[Holder] | None:
        """One ``List`` call; None when there is no socket."""
        try:
            st = os.stat(self.socket_path)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise _LocalError(grpc.StatusCode.UNAVAILABLE, f"cannot stat {self.socket_path}: {e.strerror}") from e
        if not stat.S_ISSOCK(st.st_mode):
            raise _LocalError(grpc.StatusCode.UNAVAILABLE, f"{self.socket_path} is not a socket")
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.enable_http_proxy", 0)]
        with grpc.insecure_channel(f"unix://{self.socket_path}", options=options) as channel:
            stub = api_pb2_grpc.PodResourcesListerStub(channel)
            response = stub.List(api_pb2.ListPodResourcesRequest(), timeout=self.timeout)
        return holders(response, self.resources)

    def _log(self, state: str, message: str) -> None:
        if state != self._state:
            log.warning("kubelet pod-resources %s: %s (pod attribution paused; retrying every %gs)",
                        self.socket_path, message, self.refresh_interval)
        else:
            log.debug("kubelet pod-resources %s: %s", self.socket_path, message)

    def _log_change(self, state: str) -> None:
        if state == self._state:
            return
        if state == _OK:
            log.info("kubelet pod-resources %s: answering", self.socket_path)
        elif state == _ABSENT and self._state:
            log.info("kubelet pod-resources socket %s is gone", self.socket_path)
        self._state = state


class _LocalError(grpc.RpcError):
    """A failure found before calling (the path is not a socket), reported like the call's own."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details
