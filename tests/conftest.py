from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

#: The files that take longest (seconds of both workers' time, measured with ``--durations``), heaviest first.
#: tests/run.sh hands files to its two workers in collection order (``--no-loadscope-reorder``): these go first, so
#: the run does not end with one worker idle while the other finishes an image build or a restart run. A stale
#: entry only costs balance, never a test.
HEAVY = (
    "tests/detector/test_backend_faults.py",
    "tests/system/test_images.py",
    "tests/system/test_doc_commands.py",
    "tests/system/test_restart.py",
    "tests/system/test_e2e.py",
    "tests/sim/test_quality_remediation.py",
    "tests/detector/test_remote_write_prometheus.py",
    "tests/detector/test_evidence_report.py",
    "tests/system/test_remediate_live.py",
    "tests/detector/test_warmstart.py",
    "tests/system/test_backend_faults_serve.py",
    "tests/sim/test_demo.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The heavy files first, in :data:`HEAVY`'s order; every other file after them as collected."""
    rank = {path: i for i, path in enumerate(HEAVY)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(HEAVY)))


@pytest.fixture
def registry() -> CollectorRegistry:
    """A fresh Prometheus registry per test."""
    return CollectorRegistry()
