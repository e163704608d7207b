"""The ``gpufleet`` profile of a recording: the agent's own metric names and labels.

Series carry the agent's target labels (``instance="<node>:9445"``, ``job="gpufleet-agent"``,
``site``); the site families (:func:`site_families`, written by both profiles) carry ``job="facility"``,
``instance="bms-<site>"``. Names, types and help texts come from :mod:`gpufleet.vocab.catalog`,
clock-event reasons from :mod:`gpufleet.vocab.nvml`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from gpufleet.sim.physics import ECC_KEYS, NIC_ERRORS, NIC_HW
from gpufleet.sim.recording.capture import THROTTLE_SECONDS_REASONS, Context
from gpufleet.sim.recording.mig_profile import write as write_mig
from gpufleet.sim.recording.nvl72_profile import write_gpufleet as write_racks
from gpufleet.sim.recording.openmetrics import OmWriter, prefix
from gpufleet.sim.recording.scrape import AGENT, instance
from gpufleet.vocab.catalog import spec
from gpufleet.vocab.nvml import CLOCK_EVENT_BITS

#: Reasons recorded as gpufleet_gpu_clock_event_active (the ones the simulator models).
ACTIVE_REASONS = ("gpu_idle", "sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
                  "hw_power_brake_slowdown")


def write(w: OmWriter, c: Context) -> None:
    """Every family of the gpufleet profile (``c.full``: all modelled series, else the core set)."""
    fr, f = c.fr, c.f
    full = c.full
    g_all = range(f.n_gpus)

    def target(node: int) -> dict[str, str]:
        return {"instance": instance(AGENT, c.nodes[node]), "job": AGENT.job, "site": c.site_of_node[node]}

    def gpu_prefixes(name: str, extra: dict[str, str] | None = None) -> list[bytes]:
        return [prefix(name, {"gpu": str(c.gpu_local[g]), **(extra or {}), **target(int(c.gpu_node[g]))})
                for g in g_all]

    def fam(name: str) -> str:
        s = spec(name)
        base = name.removesuffix("_total") if s.type == "counter" else name
        w.family(base, s.type, s.help)
        return name

    def gpu_metric(name: str, values: np.ndarray, decimals: int, extra: dict[str, str] | None = None,
                   mask: np.ndarray | None = None, header: bool = True) -> None:
        if header:
            fam(name)
        w.block(gpu_prefixes(name, extra), values, decimals, c.gpu_present if mask is None else mask)

    # ---- identity
    info = []
    for g in (g_all if full else ()):
        node, k = int(c.gpu_node[g]), int(c.gpu_local[g])
        m = f.nodes[node].model
        info.append(prefix("gpufleet_gpu_info", {
            "gpu": str(k), "uuid": c.sim.uuid(g), "name": m.name, "serial": f"{1650000000000 + g:013d}",
            "pci_bus_id": c.sim.pci_bus_id(node, k), "vbios_version": "96.00.99.00.01",
            "architecture": {10: "blackwell", 9: "hopper", 7: "ampere"}.get(m.architecture, "unknown"), **target(node)}))
    if info:
        fam("gpufleet_gpu_info")
        w.block(info, np.ones((w.n_ticks, f.n_gpus)), 0, c.gpu_present)
    gpu_metric("gpufleet_gpu_up", (~fr["lost"]).astype(float), 0, mask=c.node_present_gpu)
    pod_of = c.pod_of  # Kubernetes mode: the pods collector's info series instead of the Slurm mapping's
    jobs_fam = fam("gpufleet_gpu_job_info" if pod_of is None else "gpufleet_gpu_pod_info")
    pairs = np.unique(np.stack([fr["gpu_job"].ravel(), np.tile(np.arange(f.n_gpus), w.n_ticks)], 1), axis=0)
    pairs = pairs[pairs[:, 0] >= 0]
    for lo in range(0, len(pairs), 512):
        chunk = pairs[lo:lo + 512]
        pre = [prefix(jobs_fam, {"gpu": str(c.gpu_local[g]), "job_id": fr.job_ids[j], **target(int(c.gpu_node[g]))}
                      if pod_of is None else
                      {"gpu": str(c.gpu_local[g]), "uuid": c.sim.uuid(int(g)), "device": f"nvidia{c.gpu_local[g]}",
                       **(pod_of(fr.job_ids[j], int(c.gpu_node[g])) or {}), "resource": "nvidia.com/gpu",
                       **target(int(c.gpu_node[g]))})
               for j, g in chunk]
        mask = (fr["gpu_job"][:, chunk[:, 1]] == chunk[:, 0][None, :]) & c.gpu_present[:, chunk[:, 1]]
        w.block(pre, np.ones((w.n_ticks, 1)), 0, mask, cols=np.zeros(len(chunk), np.int64))
    write_mig(w, c, fam, target)  # the scenario's [[mig]] nodes: MIG devices, their activity and owners
    write_racks(w, c, fam, target)  # NVL72 racks: NVLink fabric, rack placement, margin, C2C (issue 21)
    # ---- utilization, clocks, power, thermal
    gpu_metric("gpufleet_gpu_utilization_ratio", fr["util"] / 100.0, 2)
    if full:
        gpu_metric("gpufleet_gpu_memory_utilization_ratio", np.floor(fr["dram"] * 80.0) / 100.0, 2)
    fam("gpufleet_gpu_clock_hertz")
    gpu_metric("gpufleet_gpu_clock_hertz", fr["clock_sm"] * 1e6, 0, {"clock": "sm"}, header=False)
    if full:
        gpu_metric("gpufleet_gpu_clock_hertz", fr["clock_mem"] * 1e6, 0, {"clock": "memory"}, header=False)
    gpu_metric("gpufleet_gpu_power_watts", fr["power"], 3)
    gpu_metric("gpufleet_gpu_power_limit_watts", fr["limit"], 3)
    gpu_metric("gpufleet_gpu_energy_joules_total", fr["energy"], 3)
    fam("gpufleet_gpu_temperature_celsius")
    gpu_metric("gpufleet_gpu_temperature_celsius", fr["temp"], 0, {"sensor": "gpu"}, header=False)
    if full:
        gpu_metric("gpufleet_gpu_temperature_celsius", fr["temp_mem"], 0, {"sensor": "memory"}, header=False)
        gpu_metric("gpufleet_gpu_memory_used_bytes", fr["mem_used"], 0)
    # ---- activity (GPM)
    gpu_metric("gpufleet_gpu_sm_active_ratio", fr["sm_active"], 4)
    gpu_metric("gpufleet_gpu_tensor_active_ratio", fr["tensor"], 4)
    gpu_metric("gpufleet_gpu_dram_active_ratio", fr["dram"], 4)
    fam("gpufleet_gpu_nvlink_throughput_bytes_per_second")
    for d in ("tx", "rx") if full else ("tx",):
        gpu_metric("gpufleet_gpu_nvlink_throughput_bytes_per_second", np.floor(fr["nvl_rate"]), 0,
                   {"direction": d}, header=False)
    # ---- throttling
    fam("gpufleet_gpu_clock_event_active")
    # application clocks set below the maximum (issue 31): recorded where the run has them, so recordings
    # without them stay as they were
    app = ("applications_clocks_setting",) if (fr["reasons"] & CLOCK_EVENT_BITS["applications_clocks_setting"]).any() else ()
    for reason in (*(ACTIVE_REASONS if full else ("hw_slowdown",)), *app):
        gpu_metric("gpufleet_gpu_clock_event_active", (fr["reasons"] & CLOCK_EVENT_BITS[reason]) > 0, 0, {"reason": reason},
                   header=False)
    fam("gpufleet_gpu_clock_event_seconds_total")
    for reason in THROTTLE_SECONDS_REASONS:
        gpu_metric("gpufleet_gpu_clock_event_seconds_total", fr.clock_event_seconds(reason), 3, {"reason": reason},
                   header=False)
    # ---- memory health
    fam("gpufleet_gpu_ecc_errors_total")
    for k, key in enumerate(ECC_KEYS):
        counter, _, error = key.partition("_")
        if not full and counter == "volatile":
            continue
        gpu_metric("gpufleet_gpu_ecc_errors_total", fr["ecc"][:, :, k], 0, {"error": error, "counter": counter},
                   header=False)
    fam("gpufleet_gpu_remapped_rows")
    for k, cause in enumerate(("correctable", "uncorrectable")):
        if not full and k == 0:
            continue
        gpu_metric("gpufleet_gpu_remapped_rows", fr["remapped"][:, :, k], 0, {"cause": cause}, header=False)
    gpu_metric("gpufleet_gpu_row_remap_pending", fr["remap_pending"], 0)
    # ---- PCIe, NVLink state
    gpu_metric("gpufleet_gpu_pcie_link_generation", fr["pcie_gen"], 0)
    gpu_metric("gpufleet_gpu_pcie_link_width", fr["pcie_width"], 0)
    ones = np.ones((w.n_ticks, f.n_gpus))
    gpu_metric("gpufleet_gpu_pcie_link_generation_max", ones * c.sim.physics.pcie_gen_max[None, :], 0)
    gpu_metric("gpufleet_gpu_pcie_link_width_max", ones * c.sim.physics.pcie_width_max[None, :], 0)
    gpu_metric("gpufleet_gpu_pcie_replay_total", fr["pcie_replay"], 0)
    # ---- PCIe AER (the GPU functions; the agent's pcie collector names them by PCI address)
    fam("gpufleet_pcie_aer_reports_total")
    w.block([prefix("gpufleet_pcie_aer_reports_total",
                    {"device": c.sim.pci_bus_id(int(c.gpu_node[g]), int(c.gpu_local[g]))[4:].lower(),
                     "kind": "correctable", **target(int(c.gpu_node[g]))}) for g in g_all],
            fr["aer_cor"], 0, c.gpu_present)
    # ... and their identity, as the pcie collector exports it (GpufleetPcieAerCorrectableRate joins on it)
    fam("gpufleet_pcie_device_info")
    w.block([prefix("gpufleet_pcie_device_info",
                    {"device": c.sim.pci_bus_id(int(c.gpu_node[g]), int(c.gpu_local[g]))[4:].lower(), "role": "gpu",
                     "gpu": str(c.gpu_local[g]), "nic": "", **target(int(c.gpu_node[g]))}) for g in g_all],
            ones, 0, c.gpu_present)
    if not full:
        _xid_families(w, c, target)
        _nics(w, c, fam, target)
        return
    fam("gpufleet_gpu_pcie_throughput_bytes_per_second")
    for d in ("tx", "rx"):
        gpu_metric("gpufleet_gpu_pcie_throughput_bytes_per_second", np.floor(fr["pcie_rate"]), 0, {"direction": d},
                   header=False)
    fam("gpufleet_gpu_nvlink_up")
    links = int(c.sim.physics.nvl_links.max())
    for link in range(links):
        has = c.sim.physics.nvl_links > link
        up = (link >= fr["nvl_down"]).astype(float)
        gpu_metric("gpufleet_gpu_nvlink_up", up, 0, {"link": str(link)}, mask=c.gpu_present & has[None, :],
                   header=False)
    # ---- XID
    _xid_families(w, c, target)
    _nics(w, c, fam, target)


def _nics(w: OmWriter, c: Context, fam: Callable[[str], str], target: Callable[[int], dict[str, str]]) -> None:
    fr, f, full = c.fr, c.f, c.full
    # ---- node totals
    node_t = [target(i) for i in range(len(c.nodes))]
    fam("gpufleet_node_gpu_power_watts")
    node_gpu_power = fr["power"].reshape(w.n_ticks, len(c.nodes), f.gpus_per_node).sum(axis=2)
    w.block([prefix("gpufleet_node_gpu_power_watts", t) for t in node_t], node_gpu_power, 3, fr["present"])
    fam("gpufleet_node_gpu_energy_joules_total")
    node_energy = fr["energy"].reshape(w.n_ticks, len(c.nodes), f.gpus_per_node).sum(axis=2)
    w.block([prefix("gpufleet_node_gpu_energy_joules_total", t) for t in node_t], node_energy, 3, fr["present"])
    # ---- host CPU pressure (PSI)
    fam("gpufleet_host_pressure_stalled_seconds_total")
    w.block([prefix("gpufleet_host_pressure_stalled_seconds_total", {"resource": "cpu", "kind": "some", **t})
             for t in node_t], fr["host_psi_cpu"], 6, fr["present"])
    # ---- NICs (InfiniBand/RoCE)
    nic_t = [{"device": f"mlx5_{int(f.nic_local[n])}", "port": "1", **target(int(f.nic_node[n]))}
             for n in range(f.n_nics)]

    def nic_metric(name: str, values: np.ndarray, decimals: int, extra: dict[str, str] | None = None,
                   header: bool = True) -> None:
        if header:
            fam(name)
        w.block([prefix(name, {**t, **(extra or {})}) for t in nic_t], values, decimals, c.nic_present)

    fam("gpufleet_nic_gpu_info")
    topo = []
    topo_mask = []
    for node in range(len(c.nodes)):
        for dev, gpu, addr, ancestor in c.sim.nic_gpu_map(node):
            topo.append(prefix("gpufleet_nic_gpu_info", {"device": dev, "gpu": str(gpu), "pci_bus_id": addr,
                                                          "common_ancestor": ancestor, **target(node)}))
            topo_mask.append(fr["present"][:, node])
    w.block(topo, np.ones((w.n_ticks, len(topo))), 0, np.stack(topo_mask, axis=1))
    info_t = []
    for n, t in enumerate(nic_t):
        layer = "Ethernet" if f.nic_is_host[n] else "InfiniBand"
        info_t.append(prefix("gpufleet_ib_port_info", {"device": t["device"], "port": "1", "link_layer": layer,
                                                        "hca_type": "MT4129", "board_id": "MT_0000000838",
                                                        "fw_ver": "28.41.1000", **target(int(f.nic_node[n]))}))
    if info_t:
        fam("gpufleet_ib_port_info")
        w.block(info_t, np.ones((w.n_ticks, f.n_nics)), 0, c.nic_present)
    nic_metric("gpufleet_ib_port_rate_bytes_per_second", fr["nic_rate"] * 1e9 / 8.0, 0)
    nic_metric("gpufleet_ib_port_state_id", fr["nic_state"], 0)
    if full:
        nic_metric("gpufleet_ib_port_physical_state_id", fr["nic_phys"], 0)
    nic_metric("gpufleet_ib_port_transmit_bytes_total", np.floor(fr["nic_bytes"][:, :, 0] / 4) * 4, 0)
    nic_metric("gpufleet_ib_port_receive_bytes_total", np.floor(fr["nic_bytes"][:, :, 1] / 4) * 4, 0)
    if full:
        nic_metric("gpufleet_ib_port_transmit_packets_total", np.floor(fr["nic_pkts"][:, :, 0]), 0)
        nic_metric("gpufleet_ib_port_receive_packets_total", np.floor(fr["nic_pkts"][:, :, 1]), 0)
    nic_metric("gpufleet_ib_port_transmit_wait_total", np.floor(fr["nic_wait"]), 0)
    fam("gpufleet_ib_port_errors_total")
    for k, err in enumerate(NIC_ERRORS if full else NIC_ERRORS[:2]):
        nic_metric("gpufleet_ib_port_errors_total", fr["nic_err"][:, :, k], 0, {"error": err}, header=False)
    # RoCE driver statistics (ethtool -S) of the GPU NICs' netdevs: PFC pause on priority 3, buffer discards
    roce = [n for n in range(f.n_nics) if not f.nic_is_host[n]]
    if roce:
        eth_t = [{"interface": f"ens{int(f.nic_local[n]) + 1}f0np0", **target(int(f.nic_node[n]))} for n in roce]
        fam("gpufleet_nic_pause_duration_seconds_total")
        w.block([prefix("gpufleet_nic_pause_duration_seconds_total", {**t, "priority": "3", "direction": "receive"})
                 for t in eth_t], fr["nic_pause"][:, roce], 6, c.nic_present[:, roce])
        fam("gpufleet_nic_discards_total")
        w.block([prefix("gpufleet_nic_discards_total", {**t, "stat": "rx_prio3_buf_discard"}) for t in eth_t],
                fr["nic_discards"][:, roce], 0, c.nic_present[:, roce])
        # each netdev's RDMA device and port (the agent reads it from sysfs): the detector's join to the NIC
        fam("gpufleet_nic_netdev_info")
        w.block([prefix("gpufleet_nic_netdev_info", {**t, "device": nic_t[n]["device"], "port": "1"})
                 for t, n in zip(eth_t, roce, strict=True)], np.ones((w.n_ticks, len(roce))), 0, c.nic_present[:, roce])
    fam("gpufleet_ib_hw_counters_total")
    for k, counter in enumerate(NIC_HW[:3] if full else NIC_HW[:1]):
        nic_metric("gpufleet_ib_hw_counters_total", np.floor(fr["nic_hw"][:, :, k]), 0, {"counter": counter},
                   header=False)
    site_families(w, c)


def _xid_families(w: OmWriter, c: Context, target: Callable[[int], dict[str, str]]) -> None:
    keys = sorted({key for _, d in c.fr.xid for key in d})
    counts = np.full((w.n_ticks, len(keys)), np.nan)
    last = np.full((w.n_ticks, len(keys)), np.nan)
    col = {key: i for i, key in enumerate(keys)}
    prev_counts: dict[tuple[int, int], int] = {}
    seen: dict[tuple[int, int], float] = {}
    for (k0, d), (k1, _) in itertools.pairwise([*c.fr.xid, (w.n_ticks, {})]):
        for key, v in d.items():
            if v != prev_counts.get(key):
                seen[key] = float(c.fr.times[k0])
            counts[k0:k1, col[key]] = v
            last[k0:k1, col[key]] = seen[key]
        prev_counts = d
    gpus = np.array([g for g, _ in keys], np.int64)
    if keys:  # an agent restart forgets what it counted: the series come back with the next XID, from 1
        counts = c.since_restart(c.as_scraped(counts, c.gpu_node[gpus]), c.gpu_node[gpus])
        last = c.as_scraped(last, c.gpu_node[gpus])
        last = np.where(counts > 0, last, np.nan)
        counts = np.where(counts > 0, counts, np.nan)
    present = np.isfinite(counts) & c.node_present_gpu[:, gpus] if keys else None
    for name, values, dec in (("gpufleet_gpu_xid_errors_total", counts, 0),
                              ("gpufleet_gpu_xid_last_seen_timestamp_seconds", last, 0)):
        s = spec(name)
        w.family(name.removesuffix("_total") if s.type == "counter" else name, s.type, s.help)
        pre = [prefix(name, {"gpu": str(c.gpu_local[g]), "xid": str(x), **target(int(c.gpu_node[g]))})
               for g, x in keys]
        w.block(pre, values, dec, present)


def site_families(w: OmWriter, c: Context) -> None:
    """The facility series of every site (both profiles write them under gpufleet's names)."""
    sites = [s.name for s in c.f.sites]
    t = [{"instance": f"bms-{s}", "job": "facility", "site": s} for s in sites]
    for name, key, dec in (("gpufleet_site_facility_power_watts", "facility", 1),
                           ("gpufleet_site_it_power_watts", "it_power", 1),
                           ("gpufleet_site_outdoor_temperature_celsius", "outdoor", 2)):
        w.family(name, spec(name).type, spec(name).help)
        w.block([prefix(name, x) for x in t], c.fr[key], dec)

