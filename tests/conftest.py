from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry


@pytest.fixture
def registry() -> CollectorRegistry:
    """A fresh Prometheus registry per test."""
    return CollectorRegistry()
