#!/usr/bin/env bash
# The README's first command: set up gpufleet in .venv and run the demo, a
# simulated GPU fleet (no GPU needed) served by real agent processes on local ports.
# Arguments go to `gpufleet-sim demo` (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv || {
    rm -rf .venv
    echo "demo.sh: cannot create .venv with python3 -m venv (Debian/Ubuntu: apt-get install python3-venv)" >&2
    exit 1
  }
fi
echo "==> installing gpufleet[all] into .venv"
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[all]'
exec .venv/bin/gpufleet-sim demo "$@"
