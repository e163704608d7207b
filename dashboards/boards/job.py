"""Job and straggler view: each job's GPUs side by side (per-GPU heatmaps and peer bands),
the detector's straggler scores, feature deviations and findings, each node's and GPU's share of its job's work."""

from __future__ import annotations

from grafanalib import core as g

from gpufleet.dashboards import panels as p
from gpufleet.dashboards.panels import DET_NODE, JOB, NAMESPACE, NODE, SITE, Q

#: The selected jobs' GPUs; a GPU shared by several jobs appears once per job.
JOB_INFO = f"gpufleet_gpu_job_info{{{SITE},{JOB}}}"
DET = f"{SITE},{DET_NODE},{JOB}"
PER_GPU = "{{job_id}} {{instance}} gpu {{gpu}}"


def _of_job(name: str, extra: str = "") -> str:
    sel = ",".join(x for x in (SITE, NODE, extra) if x)
    return f"{JOB_INFO} * on (instance, gpu) group_left () {name}{{{sel}}}"


def _bands(name: str, extra: str = "") -> list[Q]:
    """Each GPU of the selected jobs against its job's median and 10th/90th percentiles."""
    series = _of_job(name, extra)
    return [Q(series, PER_GPU)] + [
        Q(f"quantile by (job_id) ({q}, {series})", f"{{{{job_id}}}} p{int(q * 100)}") for q in (0.1, 0.5, 0.9)
    ]


#: Per owner on the selected nodes: Slurm jobs among the selected job ids, every pod and systemd unit.
OWNER = f'{SITE},{NODE},owner_kind!="unknown"'
#: A MIG slice's series with its profile (from gpufleet_mig_device_info).
MIG_PROFILE = (f"* on (instance, gpu, gpu_instance) group_left (profile) "
               f"max by (instance, gpu, gpu_instance, profile) (gpufleet_mig_device_info{{{SITE},{NODE}}})")
PER_SLICE = "{{instance}} gpu {{gpu}} slice {{gpu_instance}} ({{profile}})"


def _shared() -> list[tuple[g.Panel, int, int]]:
    """Per-job and per-MIG-slice use of shared GPUs (time-slicing, MPS, MIG)."""
    jobs = f'{OWNER},owner_kind="slurm_job",owner=~"$job_id"'
    return [
        (p.timeseries("gpufleet_gpu_owner_sm_utilization_ratio", "SM utilization per job",
                      Q(f"sum by (owner) (gpufleet_gpu_owner_sm_utilization_ratio{{{jobs}}})", "job {{owner}}"),
                      note="Summed over the job's processes on every GPU it runs on (1 = one whole GPU). "
                           "NVML has no per-process utilization in MIG mode: see the slice panels."), 12, 9),
        (p.timeseries("gpufleet_gpu_owner_memory_used_bytes", "GPU memory per owner",
                      Q(f"sum by (owner_kind, owner) (gpufleet_gpu_owner_memory_used_bytes{{{OWNER}}})",
                        "{{owner_kind}} {{owner}}"), stack=True, fill=20), 12, 9),
        (p.timeseries("gpufleet_mig_sm_active_ratio", "SM activity per MIG slice",
                      Q(f"gpufleet_mig_sm_active_ratio{{{SITE},{NODE}}} {MIG_PROFILE}", PER_SLICE),
                      note="Compare a slice only with slices of the same profile."), 12, 9),
        (p.timeseries("gpufleet_mig_memory_used_bytes", "Memory used per MIG slice",
                      Q(f"gpufleet_mig_memory_used_bytes{{{SITE},{NODE}}} {MIG_PROFILE}", PER_SLICE)), 12, 9),
        (p.table("gpufleet_gpu_owner_processes", "Who runs on which GPU or slice",
                 f"gpufleet_gpu_owner_processes{{{SITE},{NODE}}}"), 24, 7),
    ]


#: Each GPU's SM activity in the selected jobs (every node of the job: a share needs the whole job).
JOB_WORK = f"{JOB_INFO} * on (instance, gpu) group_left () gpufleet_gpu_sm_active_ratio{{{SITE}}}"
NODE_WORK = f"sum by (job_id, instance) ({JOB_WORK})"
NODE_SHARE = f"{NODE_WORK} / on (job_id) group_left () sum by (job_id) ({NODE_WORK})"


def _work_share() -> list[tuple[g.Panel, int, int]]:
    """Each node's (and GPU's) share of its job's work over time (issue 19): in a synchronous job every rank's step
    takes as long, so its SM activity is its share of the work. A pipeline stage given more work stands above an
    even share since the job started (its nodes together), data skew for a while, hot experts move."""
    name = "gpufleet_gpu_sm_active_ratio"
    return [
        (p.timeseries(name, "Share of the job's work per node",
                      Q(NODE_SHARE, "{{job_id}} {{instance}}"), stack=True, fill=60,
                      note="Each node's SM activity summed over its GPUs, over the job's; the stack is the whole job "
                           "(100 %). Bands that stay wider than the others since the job started are a busier "
                           "stage; a band that widens for a while is data skew; a wide band that moves from node "
                           "to node is hot experts."), 12, 10),
        (p.timeseries(name, "Node's work against an even share (100 % = even)",
                      Q(f"({NODE_SHARE}) * on (job_id) group_left () count by (job_id) ({NODE_WORK})",
                        "{{job_id}} {{instance}}"),
                      note="A node at 120 % does a fifth more than an even share of the job's work. With its clocks at "
                           "their maximum and no throttling that is the workload (a GpufleetWorkloadImbalance "
                           "ticket), not the hardware."), 12, 10),
        (p.gpu_heatmap(name, "GPU's work against the job's mean (100 % = even)",
                       Q(f"({JOB_WORK}) / on (job_id) group_left () avg by (job_id) ({JOB_WORK})", PER_GPU),
                       note="One rank above its peers: a skewed rank or a hot expert; a whole node or stage: "
                            "see the node panels."), 24, 10),
    ]


def _views(name: str, title: str, extra: str = "") -> list[tuple[g.Panel, int, int]]:
    return [
        (p.gpu_heatmap(name, f"{title} per GPU", Q(_of_job(name, extra), PER_GPU)), 12, 10),
        (p.timeseries(name, f"{title} against peers", _bands(name, extra),
                      note="Series p10/p50/p90 are the job's peer band."), 12, 10),
    ]


dashboard = p.build(
    "job", "gpufleet / Jobs and stragglers",
    "Each job's GPUs side by side. In a synchronous job every GPU waits for the slowest: utilization stays "
    "high everywhere, healthy peers drop power and tensor activity, and the straggler looks busier.",
    [*p.standard_vars(gpu=False)[:2], p.namespace_var(), *p.standard_vars(gpu=False)[2:]],
    [
        ("Detector", [
            (p.timeseries("gpufleet_detector_straggler_score", "Straggler score",
                          f"gpufleet_detector_straggler_score{{{DET}}}", links=[p.node_link()]), 12, 9),
            (p.timeseries("gpufleet_detector_feature_deviation", "Feature deviation (robust z)",
                          f"gpufleet_detector_feature_deviation{{{DET}}}"), 12, 9),
            (p.table("gpufleet_detector_finding", "Straggler and throttling findings",
                     f'gpufleet_detector_finding{{{DET},{NAMESPACE},kind=~"straggler|throttling"}}',
                     links=[p.node_link()]), 24, 7),
            (p.table("gpufleet_gpu_pod_info", "Kubernetes pods holding GPUs",
                     f"gpufleet_gpu_pod_info{{{SITE},{NODE},{NAMESPACE}}}", links=[p.node_link()]), 24, 7),
        ]),
        ("Share of the job's work", _work_share()),
        ("SM clock", _views("gpufleet_gpu_clock_hertz", "SM clock", 'clock="sm"')),
        ("SM activity", _views("gpufleet_gpu_sm_active_ratio", "SM activity")),
        ("Tensor activity", _views("gpufleet_gpu_tensor_active_ratio", "Tensor activity")),
        ("Power", _views("gpufleet_gpu_power_watts", "Power")),
        ("Temperature", _views("gpufleet_gpu_temperature_celsius", "GPU temperature", 'sensor="gpu"')),
        ("Utilization", _views("gpufleet_gpu_utilization_ratio", "Utilization")),
        ("Shared GPUs: per job, per owner and per MIG slice", _shared()),
    ],
)
