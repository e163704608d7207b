"""Peers that are alike, fleet-wide states and roles: the network detector and straggler peer keys."""

from __future__ import annotations

import numpy as np

from gpufleet.detector.frame.features import GpuFrame, NicFrame
from gpufleet.detector.rules.baseline import Baseline
from gpufleet.detector.rules.network import NetworkParams, find
from gpufleet.detector.rules.straggler import StragglerParams, peer_key

GB = 1e9 / 8


def _fleet(nodes: int = 8, rails: int = 4, rate: list[float] | None = None, tx: float = 20 * GB,
           wait_per_mb: float = 30.0, storage: bool = True) -> NicFrame:
    names, devs, layers, rates = [], [], [], []
    gpus: list[tuple[str, ...]] = []
    for n in range(nodes):
        for k in range(rails + (1 if storage else 0)):
            names.append(f"node-{n:03d}")
            devs.append(f"mlx5_{k}")
            host = k == rails
            gpus.append(() if host else (str(k),))
            layers.append("Ethernet" if host else "InfiniBand")
            rates.append(25 * GB if host else (rate[n] if rate else 50 * GB))
    m = len(names)
    values = {"nic_rate": np.array(rates), "nic_tx": np.full(m, tx), "nic_xmit_wait": np.full(m, tx / 1e6 * wait_per_mb),
              "nic_ecn": np.zeros(m), "nic_symbol_errors": np.zeros(m), "nic_link_downed": np.zeros(m),
              "nic_link_recovery": np.zeros(m)}
    return NicFrame(names, devs, ["1"] * m, ["s"] * m, values, gpus, layers)


def _gpus(nodes: int = 8, rails: int = 4) -> GpuFrame:
    n = nodes * rails
    return GpuFrame([f"node-{i // rails:03d}" for i in range(n)], [str(i % rails) for i in range(n)], ["s"] * n,
                    ["job"] * n, ["H100"] * n, {}, np.ones(n, bool), np.zeros(n, bool))


def _run(nic: NicFrame, p: NetworkParams | None = None, base: Baseline | None = None) -> list[str]:
    base = base or Baseline()
    cap = base.nic_capability(nic.nodes, nic.devices, nic.ports, nic.get("nic_rate"), 0.0)
    return sorted(f"{c.node}/{c.nic}:{','.join(c.evidence.flags)}"
                  for c in find(nic, _gpus(), p or NetworkParams(), cap))


def test_200g_adapters_are_not_reduced_next_to_400g_ones_but_a_link_that_trains_down_is() -> None:
    rates = [50 * GB] * 4 + [25 * GB] * 4  # H100 nodes on 400G, A100 nodes on 200G
    base = Baseline()
    assert _run(_fleet(rate=rates), base=base) == []
    nic = _fleet(rate=rates)
    nic.values["nic_rate"][0] = 25 * GB  # node-000 mlx5_0 trains down from 400G to 200G
    assert _run(nic, base=base) == ["node-000/mlx5_0/1:reduced_rate"]


def test_congestion_needs_busy_alike_peers_and_an_absolute_floor() -> None:
    nic = _fleet()
    nic.values["nic_xmit_wait"][:] *= np.linspace(1.0, 3.0, len(nic.devices))  # all clean, some noise
    assert _run(nic) == []
    idle = _fleet(tx=1e5)  # most of the fleet idles: their ports are no peers
    busy = [i for i, d in enumerate(idle.devices) if idle.nodes[i] == "node-000" and d != "mlx5_4"]
    idle.values["nic_tx"][busy] = 20 * GB
    idle.values["nic_xmit_wait"][busy] = 20 * GB / 1e6 * np.array([30.0, 40.0, 60.0, 200.0])
    assert _run(idle) == []  # 4 busy ports, 200 ticks/MB: below the floor
    hot = _fleet()
    hot.values["nic_xmit_wait"][0] *= 100  # 3000 ticks per MB
    assert _run(hot) == ["node-000/mlx5_0/1:xmit_wait"]


def test_storage_ports_are_judged_on_errors_not_on_checkpoint_bursts() -> None:
    nic = _fleet()
    storage = [i for i, d in enumerate(nic.devices) if d == "mlx5_4"]
    nic.values["nic_xmit_wait"][storage[:4]] *= 200  # a checkpoint of one job's four nodes
    assert _run(nic) == []
    nic.values["nic_link_downed"][storage[5]] = 1
    assert _run(nic) == ["node-005/mlx5_4/1:link_downed"]
    nameless = _fleet()  # no topology nor link layer: named as storage in the configuration
    nameless.gpus = [() for _ in nameless.devices]
    nameless.link_layers = []
    nameless.values["nic_xmit_wait"][[i for i, d in enumerate(nameless.devices) if d == "mlx5_4"][:4]] *= 200
    assert _run(nameless, NetworkParams(storage_devices="mlx5_4")) == []


def test_a_node_whose_ports_are_all_congested_is_one_candidate() -> None:
    nic = _fleet()
    on = [i for i, n in enumerate(nic.nodes) if n == "node-002" and nic.devices[i] != "mlx5_4"]
    nic.values["nic_xmit_wait"][on] *= 100
    assert _run(nic) == ["node-002/:xmit_wait"]


def test_peer_key_is_job_model_and_configured_limit() -> None:
    g = _gpus(nodes=1, rails=3)
    g.models[2] = "A100"
    g.jobs[1] = None
    p = StragglerParams()
    limit = np.array([700.0, 700.0, 400.0])
    assert peer_key(g, 0, p, limit) == "job:job|model:H100|limit:700"
    assert peer_key(g, 1, p, limit) is None  # no job, no synchronous peers
    assert peer_key(g, 2, p, limit) == "job:job|model:A100|limit:400"
    base = Baseline()
    base.gpu_power_limit(g.nodes, g.gpus, limit, 0.0)
    capped = base.gpu_power_limit(g.nodes, g.gpus, np.array([420.0, 700.0, np.nan]), 60.0)
    assert capped.tolist() == [700.0, 700.0, 400.0]  # a capped GPU keeps its configured limit, so its peers


def test_a_flapping_link_stays_suspect_between_its_flaps() -> None:
    base = Baseline()
    nic = _fleet()
    downs = np.zeros(len(nic.devices))
    flagged = []
    for t in range(0, 3600, 60):
        downs[3] = 1.0 if t in (0, 60, 900, 960) else 0.0  # two link-down episodes, 15 minutes apart
        nic.values["nic_link_downed"] = downs.copy()
        flaps = base.nic_flaps(nic.nodes, nic.devices, nic.ports, downs, float(t), 3600.0)
        cap = base.nic_capability(nic.nodes, nic.devices, nic.ports, nic.get("nic_rate"), float(t))
        flagged.append(any(c.nic == "mlx5_3/1" for c in find(nic, _gpus(), NetworkParams(), cap, flaps)))
    assert flagged[:2] == [True, True] and flagged[2] is False  # one episode is a blip, not flapping
    assert all(flagged[15:])  # from the second episode on, for the hour


def test_several_gpus_of_a_node_throttled_for_one_reason_are_one_node_candidate() -> None:
    from gpufleet.detector.rules.throttling import ThrottleParams
    from gpufleet.detector.rules.throttling import find as throttled

    g = _gpus(nodes=2, rails=4)
    n = len(g)
    g.values = {"thr_thermal": np.zeros(n), "util": np.ones(n), "sm_clock": np.full(n, 1.9e9)}
    g.values["thr_thermal"][[1, 3]] = 0.6  # two of node-000's four GPUs
    g.values["thr_thermal"][5] = 0.6  # one GPU of node-001
    got = sorted((c.node, c.gpu) for c in throttled(g, ThrottleParams()))
    assert got == [("node-000", None), ("node-001", "1")]


def test_peer_groups_are_the_partition_peer_key_defines() -> None:
    """The array-based peer grouping gives exactly the groups of peer_key (jobs, namespaces, models, MIG mode,
    power-limit buckets, inference pods, min_peers), on a random mixed frame."""
    from gpufleet.detector.rules.straggler import _groups, peer_key

    rng = np.random.default_rng(11)
    n = 400
    frame = GpuFrame([f"n{i // 8}" for i in range(n)], [str(i % 8) for i in range(n)], ["s"] * n,
                     [["a", "b", "c", None][k] for k in rng.integers(0, 4, n)],
                     [["H100", "A100", "H100 MIG 1g.10gb*7"][k] for k in rng.integers(0, 3, n)], {},
                     np.ones(n, dtype=bool), np.zeros(n, dtype=bool),
                     [None] * n, [["ns1", "ns2", None][k] for k in rng.integers(0, 3, n)], rng.random(n) > 0.1)
    limit = rng.choice([700.0, 695.0, 400.0, np.nan], size=n)
    eligible = rng.random(n) > 0.2
    for compare_jobless in (False, True):
        p = StragglerParams(min_peers=4, compare_jobless=compare_jobless)
        got = _groups(frame, eligible, p, limit)
        keys = [peer_key(frame, i, p, limit) if eligible[i] else None for i in range(n)]
        sizes = {k: keys.count(k) for k in set(keys) if k is not None}
        want = [k if k is not None and sizes[k] >= 4 else None for k in keys]
        assert [g < 0 for g in got] == [w is None for w in want]
        pairs = {(int(g), w) for g, w in zip(got, want, strict=True) if w is not None}
        assert len(pairs) == len({g for g, _ in pairs}) == len({w for _, w in pairs})  # one key per id and back


def test_running_max_is_the_max_of_each_entitys_history() -> None:
    """The array-backed running maximum equals a plain per-key maximum over the values seen (NaN: no value),
    through changing entity sets, and forgets keys not seen for forget_seconds."""
    from gpufleet.detector.rules.baseline import RunningMax

    rng = np.random.default_rng(5)
    rm = RunningMax(forget_seconds=7200.0)
    plain: dict[str, tuple[float, float]] = {}
    t = 0.0
    for step in range(60):
        t += 600.0
        keys = [f"k{i}" for i in range(rng.integers(3, 12))] if step % 7 else [f"k{i}" for i in range(3, 9)]
        vals = np.where(rng.random(len(keys)) < 0.2, np.nan, rng.integers(0, 50, len(keys)).astype(float))
        for k in [k for k, (_, seen) in plain.items() if t - seen > 7200.0 and step % 6 == 0]:
            del plain[k]
        got = rm.update(keys, vals, t)
        for k, v, g in zip(keys, vals, got, strict=True):
            if not np.isnan(v):
                plain[k] = (max(v, plain[k][0]) if k in plain else v, t)
            want = plain[k][0] if k in plain else np.nan
            assert (np.isnan(want) and np.isnan(g)) or g == want, (step, k)


def test_link_down_episodes_equal_a_plain_pass_over_every_nic() -> None:
    """Episodes visits only the NICs with a down now or an episode remembered; its counts and state equal a
    plain per-key pass over every NIC, through NICs coming and going, downs, quiet spells and the horizon.
    Columns are given to Baseline.nic_flaps as fresh lists each time (as collect() gives them)."""
    rng = np.random.default_rng(11)
    base = Baseline()
    on: set[tuple[str, str, str]] = set()
    starts: dict[tuple[str, str, str], list[float]] = {}
    universe = [(f"node-{i:02d}", f"mlx5_{i % 3}", "1") for i in range(20)]
    horizon = 1800.0
    for step in range(200):
        t = 60.0 * step
        keys = [k for k in universe if rng.random() < 0.9] if step % 5 == 0 else universe
        down = np.where(rng.random(len(keys)) < 0.04, rng.integers(1, 3, len(keys)), 0).astype(float)
        down[rng.random(len(keys)) < 0.02] = np.nan
        got = base.nic_flaps([k[0] for k in keys], [k[1] for k in keys], [k[2] for k in keys], down, t, horizon)
        want = np.zeros(len(keys))
        for i, k in enumerate(keys):  # the plain pass (the definition)
            active = bool(np.nan_to_num(down[i], nan=0.0) > 0)
            if active and k not in on:
                on.add(k)
                starts.setdefault(k, []).append(t)
            elif not active:
                on.discard(k)
            ts = starts.get(k)
            if ts:
                while ts and ts[0] < t - horizon:
                    ts.pop(0)
                want[i] = len(ts)
                if not ts:
                    del starts[k]
        assert got.tolist() == want.tolist(), step
        assert base.link_downs.on == on and base.link_downs.starts == starts, step
    assert max(len(v) for v in starts.values()) >= 2  # some NIC flapped (the test saw episodes)
