"""The detector's dcgm profile reads other exporters' series by the vocabulary's names."""

from __future__ import annotations

import pytest

from gpufleet.detector.sources import profiles
from gpufleet.vocab import exporters


def test_every_dcgm_query_names_a_vocabulary_sample() -> None:
    for q in profiles.DCGM:
        assert exporters.external(q.metric).sample == q.metric, q


def test_a_misspelt_or_family_name_is_refused() -> None:
    with pytest.raises(KeyError):
        profiles._x("sm_clock", "DCGM_FI_DEV_SM_CLOK", "avg")
    with pytest.raises(ValueError, match="node_infiniband_symbol_error_total"):
        profiles._x("nic_symbol_errors", "node_infiniband_symbol_error", "increase", "nic")


def test_dcgm_labels_come_from_the_vocabulary() -> None:
    assert profiles.JOB_LABELS["dcgm"] == (exporters.DCGM_JOB_LABEL, exporters.DCGM_POD_LABEL)
    assert profiles.MODEL_LABELS["dcgm"] == (exporters.DCGM_MODEL_LABEL,)
    assert {exporters.DCGM_MODEL_LABEL, exporters.DCGM_HOST_LABEL} <= set(exporters.DCGM.labels)
    assert exporters.DCGM_POD_LABEL in exporters.DCGM_POD_LABELS


def test_dcgm_host_label_is_the_node_in_either_spelling() -> None:
    """Without an instance label the node is dcgm-exporter's host label: "Hostname", or "hostname" as
    dcgm-exporter writes it since May 2026."""
    from gpufleet.detector.frame.features import NodeNaming

    naming = NodeNaming()
    assert naming.node({"Hostname": "gpu-node-1"}) == "gpu-node-1"
    assert naming.node({exporters.DCGM_HOST_LABEL_LOWER: "gpu-node-2"}) == "gpu-node-2"
    assert naming.node({"instance": "10.0.0.3:9400", "hostname": "gpu-node-3"}) == "10.0.0.3"
    assert naming.node({"gpu": "0"}) is None

