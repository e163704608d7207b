"""The GPUs each NIC serves (one pass where the map covers the NICs) equal a plain reading of the rule: the map's
GPUs (sorted, once each), else rail order on a node whose NICs and GPUs are as many, else none."""

from __future__ import annotations

import random
import re
from collections import defaultdict

import numpy as np

from gpufleet.detector.frame.frames import GpuFrame, NicFrame
from gpufleet.detector.frame.nic_map import _natural, _nic_gpus
from gpufleet.detector.rules.network import NetworkParams


def _plain(nkeys: list[tuple[str, str, str]], nicmap: dict[tuple[str, str], list[str]],
           gpu_nodes: list[str], gpu_ids: list[str]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for n, d, _ in nkeys:
        mapped = nicmap.get((n, d))
        if mapped:
            out.append(tuple(sorted(set(mapped), key=_natural)))
            continue
        devs = sorted({dd for nn, dd, _ in nkeys if nn == n}, key=_natural)
        gs = sorted((g for nn, g in zip(gpu_nodes, gpu_ids, strict=True) if nn == n), key=_natural)
        unmapped = any(not nicmap.get((n, dd)) for dd in devs)
        out.append((gs[devs.index(d)],) if unmapped and gs and len(devs) == len(gs) else ())
    return out


def test_nic_gpus_equal_the_plain_rule() -> None:
    rng = random.Random(3)
    for _ in range(200):
        nodes = [f"n{i}" for i in range(rng.randrange(1, 5))]
        nkeys = sorted({(n, f"mlx5_{rng.randrange(12)}", rng.choice(["1", "2"])) for n in nodes
                        for _ in range(rng.randrange(0, 5))})
        gpu_nodes, gpu_ids = [], []
        for n in nodes:
            for g in rng.sample(range(12), rng.randrange(0, 5)):
                gpu_nodes.append(n)
                gpu_ids.append(str(g))
        nicmap: dict[tuple[str, str], list[str]] = defaultdict(list)
        for n, d, _ in nkeys:
            if rng.random() < 0.5:
                nicmap[(n, d)] = [str(rng.randrange(12)) for _ in range(rng.randrange(0, 4))]
        frame = GpuFrame(gpu_nodes, gpu_ids, [""] * len(gpu_ids), [None] * len(gpu_ids), [""] * len(gpu_ids), {},
                         np.ones(len(gpu_ids), dtype=bool), np.zeros(len(gpu_ids), dtype=bool))
        assert _nic_gpus(nkeys, dict(nicmap), frame) == _plain(nkeys, dict(nicmap), gpu_nodes, gpu_ids)


def _nic_role(nic: NicFrame, i: int, p: NetworkParams, node_mapped: set[str]) -> str:
    """The role rule of network's docstring, one NIC at a time: "fabric" or "storage"."""
    if p.storage_devices and re.fullmatch(p.storage_devices, nic.devices[i]):
        return "storage"
    if nic.gpus[i]:
        return "fabric"
    layer = nic.link_layers[i] if nic.link_layers else ""
    if layer == "Ethernet" or nic.nodes[i] in node_mapped:
        return "storage"
    return "fabric"


def _nic_peer_key(nic: NicFrame, i: int, capability: np.ndarray) -> str:
    """Congestion peers, one NIC at a time: same link layer and capability to 2 significant digits."""
    layer = nic.link_layers[i] if nic.link_layers else ""
    cap = capability[i]
    return f"{layer}|{float(cap):.2g}" if np.isfinite(cap) else f"{layer}|?"


def test_fabric_ports_are_those_the_role_rule_calls_fabric() -> None:
    """network.find's fabric mask (a few list passes) is the per-NIC role rule's answer for every NIC."""
    from gpufleet.detector.rules.network import _fabric

    rng = random.Random(5)
    for case in range(300):
        n = rng.randint(0, 12)
        nodes = [rng.choice(["a", "b", "c"]) for _ in range(n)]
        devices = [rng.choice(["mlx5_0", "mlx5_1", "eth0", "bond0"]) for _ in range(n)]
        gpus: list[tuple[str, ...]] = [rng.choice([(), ("0",), ("0", "1")]) for _ in range(n)]
        layers = [rng.choice(["InfiniBand", "Ethernet", ""]) for _ in range(n)] if case % 2 else []
        nic = NicFrame(nodes, devices, ["1"] * n, [""] * n, {}, gpus, layers)
        p = NetworkParams(storage_devices=rng.choice(["", "eth.*|bond.*", "mlx5_1"]))
        mapped = {nd for nd, g in zip(nodes, gpus, strict=True) if g}
        expected = [_nic_role(nic, i, p, mapped) == "fabric" for i in range(n)]
        assert _fabric(nic, p).tolist() == expected, (nic, p)


def test_busy_ports_group_as_the_peer_key_says() -> None:
    """network.find's congestion peer groups (a sort) are the ports of one per-NIC peer key, ascending."""
    from gpufleet.detector.rules.network import _peer_groups

    rng = np.random.default_rng(3)
    for case in range(200):
        n = int(rng.integers(0, 30))
        cap = rng.choice([1.0e11, 1.01e11, 1.06e11, 2.5e10, np.nan, 4e11], size=n)
        layers = [str(x) for x in rng.choice(["InfiniBand", "Ethernet", ""], size=n)] if case % 2 else []
        nic = NicFrame(["a"] * n, ["mlx5_0"] * n, ["1"] * n, [""] * n, {}, [("0",)] * n, layers)
        busy = np.flatnonzero(rng.random(n) < 0.7)
        expected: dict[str, list[int]] = defaultdict(list)
        for i in busy.tolist():
            expected[_nic_peer_key(nic, i, cap)].append(i)
        got = _peer_groups(nic, busy, cap)
        assert sorted(g.tolist() for g in got) == sorted(expected.values()), (cap, layers, busy)
