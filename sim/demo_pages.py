"""The demo's findings page: the in-process detector's ``/findings`` (gpufleet.detector.outputs.pages) served on
127.0.0.1 by the agents' HTTP server, with every evaluation's evidence traced, so the demo's injected straggler
can be opened in a browser with its plots while the demo runs."""

from __future__ import annotations

from typing import Any


class DemoPages:
    """``/findings`` of ``det`` on 127.0.0.1 (a free port unless ``port``); :meth:`close` stops it."""

    def __init__(self, det: Any, port: int = 0) -> None:
        from gpufleet.detector.outputs.exporter import Exposer, Health, registry_for
        from gpufleet.detector.outputs.pages import FindingsPages, LiveEvidence
        from gpufleet.serving.server import MetricsServer

        self.det = det
        self.evidence = LiveEvidence()
        health = Health()
        self.server = MetricsServer(f"127.0.0.1:{port}", Exposer(registry_for(det, health), health,
                                                                   FindingsPages(det, self.evidence)),
                                    title="gpufleet demo detector")
        self.server.serve_in_thread()
        self.url = f"http://127.0.0.1:{self.server.port}/findings"

    def observe(self, evaluation: Any) -> None:
        self.evidence.observe(self.det, evaluation)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
