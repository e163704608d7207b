"""The metric catalog is the single source of truth: its names must follow Prometheus conventions."""

from __future__ import annotations

import re

from gpufleet.vocab import catalog

UNIT_SUFFIX = {
    "celsius": "_celsius", "watts": "_watts", "joules": "_joules", "hertz": "_hertz", "bytes": "_bytes",
    "seconds": "_seconds", "ratio": "_ratio", "bytes_per_second": "_bytes_per_second", "timestamp": "_seconds",
}


def test_names_are_unique_and_prefixed() -> None:
    names = [s.name for s in catalog.SPECS]
    assert len(names) == len(set(names))
    for n in names:
        assert re.fullmatch(r"gpufleet_[a-z0-9_]+", n), n


def test_counters_end_in_total_and_gauges_do_not() -> None:
    for s in catalog.SPECS:
        assert s.name.endswith("_total") == (s.type == "counter"), s.name


def test_unit_suffix_matches_unit() -> None:
    for s in catalog.SPECS:
        if s.unit:
            base = s.name.removesuffix("_total")
            if s.unit in ("seconds", "timestamp") and base.endswith("_seconds"):
                continue
            assert base.endswith(UNIT_SUFFIX[s.unit]), s.name


def test_info_series_have_labels_and_no_unit() -> None:
    for s in catalog.SPECS:
        if s.name.endswith("_info"):
            assert s.type == "gauge" and not s.unit and s.labels, s.name


def test_markdown_table_lists_every_metric() -> None:
    table = catalog.markdown_table()
    for s in catalog.SPECS:
        assert f"`{s.name}`" in table


def test_family_builds_the_right_type() -> None:
    fam = catalog.spec("gpufleet_gpu_energy_joules_total").family()
    fam.add_metric(["0"], 12.5)
    assert fam.type == "counter"
    assert [s.name for s in fam.samples] == ["gpufleet_gpu_energy_joules_total"]
    g = catalog.spec("gpufleet_gpu_power_watts").family()
    assert g.type == "gauge"


def test_docs_metric_reference_matches_the_catalog() -> None:
    from support import REPO

    doc = (REPO / "docs" / "metrics.md").read_text(encoding="utf-8")
    assert catalog.readme_section() in doc, (
        "docs/metrics.md is stale: run python -m gpufleet.vocab.catalog --readme docs/metrics.md"
    )
    guide = (REPO / "docs" / "README.md").read_text(encoding="utf-8")
    assert "(metrics.md)" in guide and "(docs/README.md)" in (REPO / "README.md").read_text(encoding="utf-8")


def test_a_family_is_what_prometheus_client_makes_and_its_own() -> None:
    """MetricSpec.family copies a validated prototype: each copy equals what prometheus-client builds for the
    spec, and samples added to one never show up in another."""
    for spec in catalog.SPECS:
        used = spec.family()
        used.add_metric(["x"] * len(spec.labels), 1.0)
        fam, reference = spec.family(), spec._new_family(None)
        assert type(fam) is type(reference) and vars(fam) == vars(reference)
        assert fam.samples == [] and fam.samples is not used.samples and len(used.samples) == 1
        other = spec.family(["gpu"])
        assert other._labelnames == ("gpu",) and spec.family()._labelnames == tuple(spec.labels)
