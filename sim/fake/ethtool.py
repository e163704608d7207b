"""The simulated host's NIC driver statistics, as the kernel's ``ETHTOOL_GSTATS`` would return them.

An mlx5 port's ``ethtool -S`` set, names in the driver's order (device software counters, vport, the
physical port with PFC on priority 3, then per channel): :func:`mlx5_stat_names`. The values follow
the simulated port's counters (:class:`SimEthtool`): bytes and packets from its traffic, a PFC pause
now and then at load. Serves :class:`gpufleet.agent.collectors.ethtool.EthtoolCollector` through the
same ``read(interface) -> (names, values)`` shape as its live reader (an unknown interface: no statistics).
"""

from __future__ import annotations

from collections.abc import Callable

_DEVICE = ("rx_packets", "rx_bytes", "tx_packets", "tx_bytes", "tx_tso_packets", "tx_tso_bytes", "rx_lro_packets",
           "rx_ecn_mark", "rx_csum_unnecessary", "rx_csum_none", "rx_csum_complete", "tx_csum_partial",
           "tx_queue_stopped", "tx_queue_dropped", "tx_queue_wake", "tx_cqe_err", "rx_wqe_err", "rx_buff_alloc_err",
           "rx_cache_reuse", "rx_cache_full", "rx_cache_empty", "rx_cache_busy", "rx_congst_umr", "ch_events",
           "ch_poll", "ch_arm", "ch_eq_rearm", "rx_out_of_buffer", "rx_if_down_packets", "rx_steer_missed_packets")
_VPORT = tuple(f"{d}_vport_{k}_{u}" for k in ("unicast", "multicast", "broadcast", "rdma_unicast", "rdma_multicast")
               for d in ("rx", "tx") for u in ("packets", "bytes"))
_PHY = ("tx_packets_phy", "rx_packets_phy", "rx_crc_errors_phy", "tx_bytes_phy", "rx_bytes_phy", "tx_multicast_phy",
        "tx_broadcast_phy", "rx_multicast_phy", "rx_broadcast_phy", "rx_in_range_len_errors_phy",
        "rx_out_of_range_len_phy", "rx_oversize_pkts_phy", "rx_symbol_err_phy", "tx_mac_control_phy",
        "rx_mac_control_phy", "rx_unsupported_op_phy", "rx_pause_ctrl_phy", "tx_pause_ctrl_phy", "rx_discards_phy",
        "tx_discards_phy", "tx_errors_phy", "rx_undersize_pkts_phy", "rx_fragments_phy", "rx_jabbers_phy",
        "link_down_events_phy", "rx_pcs_symbol_err_phy", "rx_corrected_bits_phy", "rx_err_lane_0_phy",
        "rx_err_lane_1_phy", "rx_err_lane_2_phy", "rx_err_lane_3_phy", "rx_buffer_passed_thres_phy",
        "rx_pci_signal_integrity", "tx_pci_signal_integrity", "outbound_pci_stalled_rd", "outbound_pci_stalled_wr")
_PRIO = ("rx_prio{p}_bytes", "rx_prio{p}_packets", "rx_prio{p}_discards", "tx_prio{p}_bytes", "tx_prio{p}_packets")
_PFC = ("rx_prio{p}_pause", "rx_prio{p}_pause_duration", "tx_prio{p}_pause", "tx_prio{p}_pause_duration",
        "rx_prio{p}_pause_transition")
_TAIL = ("tx_pause_storm_warning_events", "tx_pause_storm_error_events", "module_unplug", "module_bus_stuck",
         "module_high_temp", "module_bad_shorted", "rx_prio{p}_buf_discard", "rx_prio{p}_cong_discard",
         "rx_prio{p}_marked")
_CHANNEL = ("ch{c}_events", "ch{c}_poll", "ch{c}_arm", "ch{c}_aff_change", "ch{c}_eq_rearm", "rx{c}_packets",
            "rx{c}_bytes", "rx{c}_csum_complete", "rx{c}_csum_none", "rx{c}_xdp_drop", "rx{c}_lro_packets",
            "rx{c}_ecn_mark", "rx{c}_wqe_err", "rx{c}_buff_alloc_err", "rx{c}_cache_reuse", "rx{c}_cache_full",
            "rx{c}_cache_empty", "rx{c}_cache_busy", "rx{c}_congst_umr", "rx{c}_recover", "tx{c}_packets",
            "tx{c}_bytes", "tx{c}_tso_packets", "tx{c}_tso_bytes", "tx{c}_csum_partial", "tx{c}_stopped",
            "tx{c}_dropped", "tx{c}_xmit_more", "tx{c}_recover", "tx{c}_cqes", "tx{c}_wake", "tx{c}_cqe_err")
#: The lossless (PFC) priority RoCE traffic runs on, as most deployments configure it.
ROCE_PRIORITY = 3


def mlx5_stat_names(channels: int = 16, pfc_priority: int = ROCE_PRIORITY) -> list[str]:
    """The statistic names of an mlx5 Ethernet port with PFC on ``pfc_priority`` and ``channels`` channels."""
    names = [*_DEVICE, *_VPORT, *_PHY]
    for prio in (0, pfc_priority):
        names += [n.format(p=prio) for n in _PRIO]
    names += [n.format(p=pfc_priority) for n in _PFC]
    names += [n.format(p=pfc_priority) for n in _TAIL]
    for c in range(channels):
        names += [n.format(c=c) for n in _CHANNEL]
    return list(dict.fromkeys(names))


class SimEthtool:
    """``read(interface)`` for the simulated host's NIC netdevs; ``counters(nic)`` gives the port's
    (tx bytes, rx bytes, tx packets, rx packets, elapsed seconds) now."""

    def __init__(self, interfaces: dict[str, int], counters: Callable[[int], tuple[int, int, int, int, float]],
                 channels: int = 16) -> None:
        self.interfaces = interfaces
        self._counters = counters
        self.names = mlx5_stat_names(channels)
        self._index = {n: i for i, n in enumerate(self.names)}
        self._channels = channels
        self._values: dict[str, list[int]] = {}

    def read(self, interface: str) -> tuple[list[str], list[int]]:
        nic = self.interfaces.get(interface)
        if nic is None:
            return [], []
        tx, rx, txp, rxp, elapsed = self._counters(nic)
        values = self._values.get(interface)
        if values is None or len(values) != len(self.names):
            values = self._values[interface] = [0] * len(self.names)
        ix = self._index
        for name, v in (("tx_bytes", tx), ("rx_bytes", rx), ("tx_packets", txp), ("rx_packets", rxp),
                        ("tx_bytes_phy", tx), ("rx_bytes_phy", rx), ("tx_packets_phy", txp), ("rx_packets_phy", rxp),
                        ("tx_prio3_bytes", tx), ("rx_prio3_bytes", rx), ("tx_prio3_packets", txp),
                        ("rx_prio3_packets", rxp)):
            values[ix[name]] = v
        # a healthy lossless fabric: brief pauses now and then at load (about 0.02 % of the time)
        pause_us = int(elapsed * 200) if tx else 0
        values[ix["rx_prio3_pause_duration"]] = pause_us
        values[ix["rx_prio3_pause"]] = pause_us // 50
        per = self._channels
        for c in range(per):
            values[ix[f"rx{c}_bytes"]] = rx // per
            values[ix[f"tx{c}_bytes"]] = tx // per
        return self.names, values

    def close(self) -> None:
        pass
