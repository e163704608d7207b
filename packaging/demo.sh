#!/usr/bin/env bash
# The README's first command: set up gpufleet in .venv and run the demo, a
# simulated GPU fleet (no GPU needed) served by real agent processes on local ports.
# Arguments go to `gpufleet-sim demo` (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[all]'
exec .venv/bin/gpufleet-sim demo "$@"
