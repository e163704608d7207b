#!/bin/bash
# gpufleet Slurm epilog example: take the job's id out of the agent's job mapping directory (see
# gpufleet-prolog.sh for the layout and installation). Lines of other jobs sharing a GPU stay; a
# file left without a job is removed. If this never runs (a node crash), the agent ignores and counts
# the stale file once the job's cgroup is gone. Never fails the job: problems go to stderr, exit 0.
set -u
DIR="${GPUFLEET_JOB_MAPPING_DIR:-/var/lib/dcgm-exporter/job-mapping}"
job="${SLURM_JOB_ID:-}"
gpus="${SLURM_JOB_GPUS:-}"
log() { echo "gpufleet-epilog: $*" >&2; }

[[ -n "$job" && -n "$gpus" && -d "$DIR" ]] || exit 0
if [[ ! "$job" =~ ^[0-9]+(_[0-9]+)?$ ]]; then log "unexpected SLURM_JOB_ID '$job'"; exit 0; fi

IFS=',' read -r -a list <<< "$gpus"
for gpu in "${list[@]}"; do
    [[ "$gpu" =~ ^(0|[1-9][0-9]{0,3})$ && -f "$DIR/$gpu" ]] || continue
    (
        flock -w 10 9 || { log "lock timeout on $DIR/$gpu"; exit 0; }
        tmp="$(mktemp "$DIR/.$gpu.XXXXXX")" || exit 0
        grep -vx -- "$job" "$DIR/$gpu" > "$tmp"
        if [[ -s "$tmp" ]]; then
            chmod 0644 "$tmp" && mv -f "$tmp" "$DIR/$gpu" || { rm -f "$tmp"; log "cannot write $DIR/$gpu"; }
        else
            rm -f "$tmp" "$DIR/$gpu"
        fi
    ) 9> "$DIR/.lock"
done
exit 0
