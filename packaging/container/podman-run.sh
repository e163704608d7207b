#!/usr/bin/env bash
# `podman run` with the flags this host needs, so the examples in docs/images.md run as written anywhere:
#
#   bash packaging/container/podman-run.sh --rm --read-only gpufleet-agent:0.1.0 once --nvml.fake=sim
#   bash packaging/container/podman-run.sh --explain     # only say which flags this host needs, and why
#
# What it detects (and the plain `podman run` error each avoids):
#   - cgroup v1 or hybrid (/sys/fs/cgroup is not cgroup2fs) with runc installed: `--runtime runc` (crun
#     fails there, "crun: ... cgroup" errors);
#   - a hard RLIMIT_NOFILE or RLIMIT_NPROC below podman's defaults for its user (rootful: 1048576 open files
#     and 4194304 processes; rootless: the user's own hard limits, never exceeded): `--ulimit nofile=1024:1024`
#     / `--ulimit nproc=4096:4096` ("error setting rlimit type 7": 7 is RLIMIT_NOFILE, 6 RLIMIT_NPROC; rc 126);
#   - rootless podman (not root): nothing more is needed; said so.
# Each flag it adds is named on stderr in one line. Every argument is passed on to `podman run`.
set -euo pipefail
explain=0
if [ "${1:-}" = --explain ]; then explain=1; shift; fi
command -v podman >/dev/null 2>&1 || { echo "podman-run.sh: podman is not installed (Debian: apt-get install podman)" >&2; exit 1; }

global=() run=() why=()
cgroup=$(stat -fc %T /sys/fs/cgroup 2>/dev/null || echo unknown)
if [ "$cgroup" != cgroup2fs ]; then
  if command -v runc >/dev/null 2>&1; then
    global+=(--runtime runc)
    why+=("--runtime runc: cgroup v1/hybrid host (/sys/fs/cgroup is $cgroup), where crun fails")
  else
    why+=("cgroup v1/hybrid host (/sys/fs/cgroup is $cgroup) and no runc: apt-get install runc if crun fails")
  fi
fi
if [ "$(id -u)" = 0 ]; then
  nofile_default=1048576 nproc_default=4194304 mode=rootful
else
  nofile_default=0 nproc_default=0 mode=rootless  # rootless podman starts from the user's own limits
fi
hard_nofile=$(ulimit -Hn) hard_nproc=$(ulimit -Hu)
if [ "$hard_nofile" != unlimited ] && ((hard_nofile < nofile_default)); then
  run+=(--ulimit nofile=1024:1024)
  why+=("--ulimit nofile=1024:1024: the hard open-files limit here is $hard_nofile, below $mode podman's $nofile_default (\"error setting rlimit type 7\")")
fi
if [ "$hard_nproc" != unlimited ] && ((hard_nproc < nproc_default)); then
  run+=(--ulimit nproc=4096:4096)
  why+=("--ulimit nproc=4096:4096: the hard processes limit here is $hard_nproc, below $mode podman's $nproc_default (\"error setting rlimit type 6\")")
fi
[ "$mode" = rootful ] || why+=("rootless podman: no other flag needed")

if ((explain)); then
  echo "podman ${global[*]:+${global[*]} }run ${run[*]:+${run[*]} }..."
  for w in "${why[@]}"; do echo "  $w"; done
  [ ${#why[@]} -gt 0 ] || echo "  nothing: this host runs the examples as written"
  exit 0
fi
((${#global[@]} + ${#run[@]} == 0)) || echo "podman-run.sh: adding ${global[*]:+${global[*]} }${run[*]} (--explain says why)" >&2
exec podman "${global[@]}" run "${run[@]}" "$@"
