#!/usr/bin/env bash
# Sets up everything the test suite needs on a fresh Debian machine, then runs it:
# Debian's prometheus (promtool), prometheus-alertmanager (amtool) and victoria-metrics, slurmctld, slurmd and
# munge (the remediation service's Slurm tests), podman, buildah, runc and mmdebstrap (the container images),
# chromium (the pages' browser tests), a virtualenv
# with gpufleet[dev], the linters, and pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v amtool >/dev/null 2>&1 || need+=(prometheus-alertmanager)
command -v victoria-metrics >/dev/null 2>&1 || need+=(victoria-metrics)
command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
command -v curl >/dev/null 2>&1 || need+=(curl)
command -v openssl >/dev/null 2>&1 || need+=(openssl)
command -v ethtool >/dev/null 2>&1 || need+=(ethtool)
# tests/system/test_images.py: packaging/container/build.sh --base debian builds the images with podman
# (runc: crun fails on cgroup v1/hybrid hosts) on a base mmdebstrap makes from Debian packages.
command -v podman >/dev/null 2>&1 || need+=(podman)
command -v buildah >/dev/null 2>&1 || need+=(buildah)
command -v runc >/dev/null 2>&1 || need+=(runc)
command -v mmdebstrap >/dev/null 2>&1 || need+=(mmdebstrap)
# tests/system/test_findings_browser.py: the findings page and the report in Debian's headless Chromium
# (driven by Playwright with executable_path=/usr/bin/chromium; no browser is downloaded).
[ -x /usr/bin/chromium ] || need+=(chromium)
# tests/system/test_remediate_slurm.py: a real Slurm cluster on 127.0.0.1 (munged, slurmctld, slurmd).
command -v slurmctld >/dev/null 2>&1 || need+=(slurmctld)
command -v slurmd >/dev/null 2>&1 || need+=(slurmd)
command -v munged >/dev/null 2>&1 || need+=(munge)
# tests/system/test_podman_run.py: a one-binary image for packaging/container/podman-run.sh.
command -v busybox >/dev/null 2>&1 || need+=(busybox-static)
if ((${#need[@]})); then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  echo "==> installing ${need[*]} from Debian"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  python3 -m venv .venv || {
    rm -rf .venv
    echo "run.sh: cannot create .venv with python3 -m venv (Debian/Ubuntu: apt-get install python3-venv)" >&2
    exit 1
  }
fi
echo "==> installing gpufleet[dev] into .venv"
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]'

echo "==> ruff"
.venv/bin/ruff check .
echo "==> mypy"
.venv/bin/mypy
echo "==> import-linter (package contracts)"
.venv/bin/lint-imports --no-cache 2>&1 | grep -v "^Warning: skipping module with too many dots" | tail -12
# Two workers (pytest-xdist), each test file on one worker: most of the suite waits on real servers, so two
# halve its wall time on CI's two cores. GPUFLEET_TEST_WORKERS=1 runs it in one process.
# Files go to the workers in collection order, the heaviest first (tests/conftest.py: HEAVY).
workers=${GPUFLEET_TEST_WORKERS:-$(($(nproc) >= 2 ? 2 : 1))}
parallel=()
[ "$workers" -le 1 ] || parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
echo "==> pytest${parallel:+ (${workers} workers)}"
exec .venv/bin/python -m pytest "${parallel[@]}" "$@"
