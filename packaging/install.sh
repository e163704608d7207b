#!/usr/bin/env bash
# Install (or uninstall) gpufleet on a host from its wheel: the one install path of docs/install.md.
#
#   packaging/install.sh agent WHEEL [--slurm]     a GPU host: the agent, its unit and config (+ Slurm prolog/epilog)
#   packaging/install.sh detector WHEEL            the central host: the detector, its unit and config
#   packaging/install.sh --uninstall agent|detector [--purge]
#
# What it lays down (under --root DIR, default /; the prefix is --prefix, default /opt/gpufleet):
#   PREFIX/                                  a virtualenv with gpufleet[agent] or gpufleet[detector] from WHEEL
#                                            (an upgrade replaces it whole; a rollback installs the older wheel)
#   /usr/local/bin/gpufleet-agent            a link into PREFIX/bin, where the unit's ExecStart expects it
#   /etc/systemd/system/gpufleet-agent.service
#   /etc/gpufleet/agent.toml                 only if absent: an edited config is never overwritten
#   /etc/default/gpufleet-agent              only if absent: GPUFLEET_CONFIG_FILE=/etc/gpufleet/agent.toml
#   /etc/slurm/{prolog,epilog}.d/gpufleet-*.sh   with --slurm (add Prolog=/Epilog= to slurm.conf yourself)
#   (detector: /usr/local/bin/gpufleet-detector, gpufleet-detector.service, /etc/gpufleet/detector.toml)
# It never starts anything: `systemctl daemon-reload && systemctl enable --now gpufleet-agent` is yours.
# --uninstall removes the prefix, the links, the unit and the Slurm scripts; the configs in /etc/gpufleet and
# /etc/default stay unless --purge. PYTHON picks the interpreter for the virtualenv (default python3).
# One line per step; a failure exits 1 naming it.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root=/ prefix=/opt/gpufleet slurm=0 uninstall=0 purge=0 role="" wheel=""
py=${PYTHON:-python3}

die() { echo "install.sh: error: $*" >&2; exit 1; }
say() { echo "install.sh: $*"; }
usage() { sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

while (($#)); do
  case $1 in
    --root) root=${2:?--root needs a directory}; shift ;;
    --root=*) root=${1#*=} ;;
    --prefix) prefix=${2:?--prefix needs a directory}; shift ;;
    --prefix=*) prefix=${1#*=} ;;
    --slurm) slurm=1 ;;
    --uninstall) uninstall=1 ;;
    --purge) purge=1 ;;
    -h | --help) usage ;;
    agent | detector) [ -z "$role" ] || usage; role=$1 ;;
    -*) echo "install.sh: unknown option $1" >&2; usage ;;
    *) [ -z "$wheel" ] || usage; wheel=$1 ;;
  esac
  shift
done
[ -n "$role" ] || usage
case $prefix in /*) ;; *) die "--prefix must be an absolute path, got $prefix" ;; esac
root=${root%/}
R() { printf '%s%s' "$root" "$1"; }  # a path of the installed system, under --root
cmd=gpufleet-$role
unit=/etc/systemd/system/$cmd.service

if ((uninstall)); then
  rm -f "$(R "/usr/local/bin/$cmd")" "$(R "$unit")"
  rm -f "$(R /etc/slurm/prolog.d/gpufleet-prolog.sh)" "$(R /etc/slurm/epilog.d/gpufleet-epilog.sh)"
  rm -rf "$(R "$prefix")"
  say "removed $prefix, /usr/local/bin/$cmd and $unit"
  if ((purge)); then
    rm -f "$(R "/etc/gpufleet/$role.toml")" "$(R "/etc/default/$cmd")"
    rmdir "$(R /etc/gpufleet)" 2>/dev/null || true
    say "purged /etc/gpufleet/$role.toml and /etc/default/$cmd"
  else
    say "kept /etc/gpufleet/$role.toml (--purge removes it)"
  fi
  exit 0
fi

[ -n "$wheel" ] || usage
[ -f "$wheel" ] || die "no wheel at $wheel (build it: python3 -m pip wheel --no-deps -w dist .)"
case $(basename "$wheel") in gpufleet-*.whl) ;; *) die "$wheel is not a gpufleet wheel" ;; esac
wheel=$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")
command -v "$py" >/dev/null || die "no $py (Debian: apt-get install python3 python3-venv)"

# The virtualenv: the old one is moved aside first and put back if the new one fails to install, so a
# failed upgrade leaves the old version in place.
dest=$(R "$prefix") old=$(R "$prefix.old")
rm -rf "$old"
[ ! -e "$dest" ] || mv "$dest" "$old"
restore() { rm -rf "$dest"; [ ! -e "$old" ] || mv "$old" "$dest"; die "$1"; }
mkdir -p "$(dirname "$dest")"
"$py" -m venv "$dest" || restore "$py -m venv failed (Debian: apt-get install python3-venv); the old install is back"
"$dest/bin/python" -m pip install -q --disable-pip-version-check "$wheel[$role]" \
  || restore "pip install '$wheel[$role]' failed (above); the old install is back"
rm -rf "$old"
version=$("$(R "$prefix")/bin/python" -c 'import importlib.metadata as m; print(m.version("gpufleet"))')
say "gpufleet $version [$role] in $prefix"

install -d -m 0755 "$(R /usr/local/bin)" "$(R /etc/systemd/system)" "$(R /etc/gpufleet)" "$(R /etc/default)"
ln -sfn "$prefix/bin/$cmd" "$(R "/usr/local/bin/$cmd")"
install -m 0644 "$here/systemd/$cmd.service" "$(R "$unit")"
say "/usr/local/bin/$cmd -> $prefix/bin/$cmd; $unit"
if [ ! -e "$(R "/etc/gpufleet/$role.toml")" ]; then
  install -m 0644 "$here/$role.toml" "$(R "/etc/gpufleet/$role.toml")"
  say "/etc/gpufleet/$role.toml (the shipped one: every value the default unless it says otherwise)"
else
  say "/etc/gpufleet/$role.toml kept as it is (the shipped one: $here/$role.toml)"
fi
if [ "$role" = agent ] && [ ! -e "$(R /etc/default/gpufleet-agent)" ]; then
  printf '# gpufleet-agent settings: GPUFLEET_* variables, one per flag (gpufleet-agent --help).\nGPUFLEET_CONFIG_FILE=/etc/gpufleet/agent.toml\n' \
    >"$(R /etc/default/gpufleet-agent)"
  chmod 0644 "$(R /etc/default/gpufleet-agent)"
fi
if ((slurm)); then
  install -D -m 0755 "$here/slurm/gpufleet-prolog.sh" "$(R /etc/slurm/prolog.d/gpufleet-prolog.sh)"
  install -D -m 0755 "$here/slurm/gpufleet-epilog.sh" "$(R /etc/slurm/epilog.d/gpufleet-epilog.sh)"
  say "/etc/slurm/prolog.d/gpufleet-prolog.sh, /etc/slurm/epilog.d/gpufleet-epilog.sh (add Prolog=/Epilog= to slurm.conf)"
fi
say "next: systemctl daemon-reload && systemctl enable --now $cmd"
