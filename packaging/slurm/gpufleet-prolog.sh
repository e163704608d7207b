#!/bin/bash
# gpufleet Slurm prolog example: write the job's id into the agent's job mapping directory, one file
# per GPU index the job was given, before the job's first CUDA context exists.
#
# The agent attributes GPUs to jobs from the processes on them (their /proc/PID/cgroup), so this
# script is optional: it only covers the seconds between allocation and the first CUDA context,
# and jobs whose GPUs hold no process of theirs (an interactive allocation). A file whose job has
# no process and no cgroup any more (a node that crashed, an epilog that did not run) is ignored
# and counted by the agent (gpufleet_gpu_job_mapping_stale_files), never exported.
#
# Install (slurm.conf on the compute nodes; both run as root on the node):
#   Prolog=/etc/slurm/prolog.d/gpufleet-prolog.sh
#   Epilog=/etc/slurm/epilog.d/gpufleet-epilog.sh
# Slurm gives the prolog SLURM_JOB_ID and SLURM_JOB_GPUS (the job's GPU indices, "0,1,3"); with
# gres.conf AutoDetect=nvml those are NVML indices, the agent's gpu label. With MIG, SLURM_JOB_GPUS
# names the parent GPUs' indices: the per-slice owner is the agent's gpufleet_gpu_owner_processes.
#
# The directory is the agent's --collector.jobs.mapping-dir (default below). Several jobs may share
# a GPU (MIG, sharding): a file lists one job id per line; updates take a lock and replace the file
# atomically, so the agent never reads half a file. A prolog must not fail the job over monitoring:
# every problem is logged to stderr (slurmd's log) and the script exits 0.
set -u
DIR="${GPUFLEET_JOB_MAPPING_DIR:-/var/lib/dcgm-exporter/job-mapping}"
job="${SLURM_JOB_ID:-}"
gpus="${SLURM_JOB_GPUS:-}"
log() { echo "gpufleet-prolog: $*" >&2; }

[[ -n "$job" && -n "$gpus" ]] || exit 0  # not a GPU job: nothing to map
if [[ ! "$job" =~ ^[0-9]+(_[0-9]+)?$ ]]; then log "unexpected SLURM_JOB_ID '$job'"; exit 0; fi
mkdir -p -m 0755 "$DIR" || { log "cannot create $DIR"; exit 0; }

IFS=',' read -r -a list <<< "$gpus"
for gpu in "${list[@]}"; do
    if [[ ! "$gpu" =~ ^(0|[1-9][0-9]{0,3})$ ]]; then log "skipping GPU '$gpu' (not an index)"; continue; fi
    (
        flock -w 10 9 || { log "lock timeout on $DIR/$gpu"; exit 0; }
        tmp="$(mktemp "$DIR/.$gpu.XXXXXX")" || exit 0
        { [[ -f "$DIR/$gpu" ]] && grep -vx -- "$job" "$DIR/$gpu"; echo "$job"; } > "$tmp"
        chmod 0644 "$tmp" && mv -f "$tmp" "$DIR/$gpu" || { rm -f "$tmp"; log "cannot write $DIR/$gpu"; }
    ) 9> "$DIR/.lock"
done
exit 0
