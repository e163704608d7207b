"""Network: InfiniBand/RoCE throughput, xmit_wait, ECN/CNP next to PFC pause and discards, errors, the GPU <-> NIC
mapping, Ethernet."""

from __future__ import annotations

from gpufleet.dashboards import panels as p
from gpufleet.dashboards.panels import DET_NODE, JOB, NODE, SITE, Q

N = f"{SITE},{NODE}"
PORT = "{{instance}} {{device}}/{{port}}"


def _rate(name: str, extra: str = "", by: str = "") -> str:
    sel = ",".join(x for x in (N, extra) if x)
    inner = f"rate({name}{{{sel}}}[$__rate_interval])"
    return f"sum by ({by}) ({inner})" if by else inner


dashboard = p.build(
    "network", "gpufleet / Network",
    "InfiniBand and RoCE ports: throughput, congestion (xmit_wait, ECN/CNP), errors and state, with the "
    "GPUs each NIC serves.",
    p.standard_vars(gpu=False),
    [
        ("Throughput", [
            (p.timeseries("gpufleet_ib_port_transmit_bytes_total", "IB/RoCE transmit",
                          Q(_rate("gpufleet_ib_port_transmit_bytes_total"), PORT), op="rate"), 12, 8),
            (p.timeseries("gpufleet_ib_port_receive_bytes_total", "IB/RoCE receive",
                          Q(_rate("gpufleet_ib_port_receive_bytes_total"), PORT), op="rate"), 12, 8),
            (p.timeseries("gpufleet_ib_port_rate_bytes_per_second", "Negotiated port rate",
                          Q(f"gpufleet_ib_port_rate_bytes_per_second{{{N}}}", PORT)), 12, 8),
            (p.timeseries("gpufleet_net_bytes_total", "Ethernet interfaces",
                          Q(_rate("gpufleet_net_bytes_total"), "{{instance}} {{interface}} {{direction}}"),
                          op="rate"), 12, 8),
        ]),
        ("Congestion", [
            (p.timeseries("gpufleet_ib_port_transmit_wait_total", "xmit_wait (ticks/s)",
                          Q(_rate("gpufleet_ib_port_transmit_wait_total"), PORT), op="rate"), 12, 8),
            (p.timeseries("gpufleet_ib_hw_counters_total", "RoCE ECN / CNP",
                          Q(_rate("gpufleet_ib_hw_counters_total", 'counter=~".*(ecn|cnp).*"'),
                            PORT + " {{counter}}"), op="rate"), 12, 8),
            # Next to ECN/CNP: PFC should fire rarely when congestion control marks first.
            (p.timeseries("gpufleet_nic_pause_duration_seconds_total", "RoCE PFC paused fraction",
                          Q(_rate("gpufleet_nic_pause_duration_seconds_total"),
                            "{{instance}} {{interface}} prio {{priority}} {{direction}}"), op="rate"), 12, 8),
            (p.timeseries("gpufleet_nic_pause_frames_total", "RoCE PFC / pause frames",
                          Q(_rate("gpufleet_nic_pause_frames_total"),
                            "{{instance}} {{interface}} prio {{priority}} {{direction}}"), op="rate"), 12, 8),
            (p.timeseries("gpufleet_nic_discards_total", "RoCE discards (buffer, congestion)",
                          Q(_rate("gpufleet_nic_discards_total"), "{{instance}} {{interface}} {{stat}}"),
                          op="rate"), 12, 8),
            (p.timeseries("gpufleet_nic_pause_storm_events_total", "NIC pause-storm events",
                          Q(_rate("gpufleet_nic_pause_storm_events_total"), "{{instance}} {{interface}} {{level}}"),
                          op="rate"), 12, 8),
        ]),
        ("Errors and state", [
            (p.timeseries("gpufleet_ib_port_errors_total", "Port errors",
                          Q(_rate("gpufleet_ib_port_errors_total"), PORT + " {{error}}"), op="rate"), 12, 8),
            (p.timeseries("gpufleet_ib_port_state_id", "Logical port state (4 = ACTIVE)",
                          Q(f"gpufleet_ib_port_state_id{{{N}}}", PORT)), 12, 8),
            (p.timeseries("gpufleet_ib_port_physical_state_id", "Physical port state (5 = LinkUp)",
                          Q(f"gpufleet_ib_port_physical_state_id{{{N}}}", PORT)), 12, 8),
            (p.timeseries("gpufleet_nic_phy_errors_total", "RoCE/Ethernet PHY errors (CRC, symbol, FEC-corrected bits)",
                          Q(_rate("gpufleet_nic_phy_errors_total"), "{{instance}} {{interface}} {{stat}}"),
                          op="rate"), 12, 8),
            (p.timeseries("gpufleet_net_errors_total", "Ethernet errors",
                          Q(_rate("gpufleet_net_errors_total"), "{{instance}} {{interface}} {{direction}}"),
                          op="rate"), 12, 8),
        ]),
        ("GPU / NIC mapping and findings", [
            (p.table("gpufleet_nic_gpu_info", "NIC nearest to each GPU", f"gpufleet_nic_gpu_info{{{N}}}"), 12, 8),
            (p.table("gpufleet_detector_finding", "Network findings",
                     f'gpufleet_detector_finding{{{SITE},{DET_NODE},{JOB},kind="network"}}',
                     links=[p.node_link()]), 12, 8),
        ]),
    ],
)
