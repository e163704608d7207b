"""One module per collector; each exposes a class implementing :class:`Collector`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from prometheus_client.core import Metric


class Collector(Protocol):
    """A gpufleet collector.

    ``describe()`` must not touch hardware (it is called at registration);
    ``collect()`` reads the source and yields metric families built from the
    catalog (:meth:`gpufleet.vocab.catalog.MetricSpec.family`). It may raise: the
    registry times every collector, reports ``gpufleet_scrape_collector_success``
    0 for one that raised, and still serves the others. A missing subsystem
    (no InfiniBand, no mapping directory) yields nothing and does not raise.
    """

    name: str

    def describe(self) -> Iterable[Metric]: ...

    def collect(self) -> Iterable[Metric]: ...
