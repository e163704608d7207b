#!/usr/bin/env bash
# The real-GPU check (tests/gpu/gpucheck.py): on a machine with NVIDIA GPUs and the driver,
#   OUT=dir bash tests/gpu/check.sh
# runs the agent's once and record against the driver, compares every GPU/NVML series and label with
# the fake NVML of the same model, measures per-scrape CPU (real beside fake), probes the NVML error
# paths that need no mode change or reset, and writes everything, report.md first, under $OUT.
# Without a GPU, GPUCHECK_REAL_SPEC=<fake spec> runs it as a self-test. Bounded to 280 s.
# The agent need not be installed from source on the GPU machine: install its wheel (pip wheel --no-deps -w dist .)
# into the device's own Python (python3 -m venv v && v/bin/pip install "$(ls dist/gpufleet-*.whl)[agent]") and run this script
# from a checkout with PYTHON=v/bin/python (the H200 run, tests/gpu/results/h200-gvisor-580, did so).
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the directory for the results, e.g. OUT=/tmp/gpucheck bash tests/gpu/check.sh}"
PY="${PYTHON:-.venv/bin/python}"
exec timeout 280 "$PY" tests/gpu/gpucheck.py "$OUT" "$@"
