"""The samples collectors build: reusable label sets and samples, so repeated series cost little.

A collector returns ordinary prometheus-client families; what this module adds is
only in the samples it puts in them. :class:`FrozenLabels` carries its rendered
``name{labels} `` prefix and :class:`StickySample` marks a sample reused unchanged
from the previous scrape, both of which the agent's encoders
(:mod:`gpufleet.agent.exposition`) use to skip rendering; any other
consumer sees plain samples. :class:`SeriesCache` builds them for a collector.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from math import copysign
from typing import Protocol

from prometheus_client.samples import Sample

from gpufleet.vocab import catalog


class SampleSink(Protocol):
    """What a collector fills: a family (or a bare list of samples) with its name."""

    name: str
    samples: list[Sample]


#: Rendered ``name{labels} `` prefixes by (sample name, label items): label sets repeat scrape after scrape.
PREFIXES: dict[tuple[str, tuple[tuple[str, str], ...]], str] = {}
_PREFIX_CACHE_MAX = 200_000


def _escape_value(v: str) -> str:
    if "\\" in v or "\n" in v or '"' in v:
        return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')
    return v


def label_prefix(name: str, labels: dict[str, str]) -> str:
    """``name{labels} `` as the text exposition renders it (labels sorted, values escaped), cached."""
    key = (name, tuple(labels.items()))
    p = PREFIXES.get(key)
    if p is None:
        if labels:
            inner = ",".join(f'{k}="{_escape_value(v)}"' for k, v in sorted(labels.items()))
            p = f"{name}{{{inner}}} "
        else:
            p = name + " "
        if len(PREFIXES) >= _PREFIX_CACHE_MAX:
            PREFIXES.clear()
        PREFIXES[key] = p
    return p


class StickySample(Sample):
    """A Sample a collector reuses, unchanged, across scrapes (e.g. cached slow-changing readings).

    The encoders keep the rendered line of each one on its FrozenLabels, so a reused sample costs an
    attribute lookup instead of a rendering. Never mutate one.
    """

    __slots__ = ()


class FrozenLabels(dict[str, str]):
    """A label set a collector builds once and reuses for one sample name, with its rendered
    ``name{labels} `` text prefix attached (the encoder then skips the prefix lookup). Never mutate one."""

    __slots__ = ("last", "line", "name", "prefix")

    def __init__(self, name: str, items: Iterable[tuple[str, str]]) -> None:
        super().__init__(items)
        self.name = name
        self.prefix = label_prefix(name, self)
        #: The collector's last sample with this label set (it reuses it while the value is unchanged).
        self.last: Sample | None = None
        #: (a StickySample with these labels, its rendered line): set by the encoders, which reuse the line
        #: while the very same sample comes back (a sample line is the same in the text and OpenMetrics formats).
        self.line: tuple[Sample, str] | None = None


class SeriesCache:
    """Builds a collector's samples so that repeated series cost little: each (family, label values)
    gets its FrozenLabels once, and the previous sample is reused while the value is unchanged (gauges
    that hold still, counters that did not move), so the encoder reuses its rendered line too."""

    def __init__(self, specs: Iterable[catalog.MetricSpec], max_series: int = 100_000) -> None:
        #: family name -> (sample name, label names)
        families = {fam.name: (spec.name, spec.labels) for spec in specs for fam in (spec.family(),)}
        sets: dict[tuple[str, ...], FrozenLabels] = {}
        get, new, sticky = sets.get, _new, StickySample

        def labels_of(name: str, labels: Sequence[str]) -> FrozenLabels:
            key = (name, *labels)
            lbl = get(key)
            if lbl is None:
                sname, names = families[name]
                if len(sets) >= max_series:
                    sets.clear()
                lbl = sets[key] = FrozenLabels(sname, zip(names, labels, strict=True))
            return lbl

        def emit(samples: list[Sample], lbl: FrozenLabels, value: float) -> None:
            last = lbl.last
            if last is not None:
                v = last[2]
                # Equal and of the same type prints the same, except 0.0 / -0.0 (equal, printed differently:
                # a float zero is reused only with the same sign; most error counters sit at 0.0).
                if v == value and type(v) is type(value) and (value or type(value) is int
                                                              or copysign(1.0, v) == copysign(1.0, value)):
                    samples.append(last)
                    return
            sample = lbl.last = new(sticky, (lbl.name, lbl, value, None, None, None))
            samples.append(sample)

        def put(fam: SampleSink, labels: Sequence[str], value: float) -> None:
            emit(fam.samples, labels_of(fam.name, labels), value)

        #: ``fam.add_metric(labels, value)`` (label values in the spec's order), via the cache.
        self.put: Callable[[SampleSink, Sequence[str], float], None] = put
        #: The label set of family ``name`` with these values (cached): a collector that keeps it for an
        #: entity seen scrape after scrape then adds its samples with ``emit`` (no lookup at all).
        self.labels_of: Callable[[str, Sequence[str]], FrozenLabels] = labels_of
        #: ``emit(fam.samples, labels_of(fam.name, labels), value)`` is ``put(fam, labels, value)``.
        self.emit: Callable[[list[Sample], FrozenLabels, float], None] = emit

_new = tuple.__new__
