#!/usr/bin/env bash
# CI: every install path a user takes, from the built wheel, each alone in a fresh virtualenv.
#
# Builds the sdist and the wheel (`python -m build`: the wheel is built from the sdist, so a file
# the sdist forgets breaks the build), checks both carry what they must, then for each extra
# (agent, sim, detector, dashboards, all) creates a fresh venv, installs `gpufleet-*.whl[EXTRA]`
# (the wheel, never the source tree), imports every module that extra is for and runs its command
# from a directory outside the repository.
# Then the hosts' install path, packaging/install.sh, in temporary roots (docs/install.md). One line per step; the first failure exits 1 naming
# the extra. PYTHON picks the interpreter (default python3); pip's cache is shared by the venvs.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
py=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1
unset PYTHONPATH GPUFLEET_WEB_LISTEN_ADDRESS GPUFLEET_WEB_CONFIG_FILE GPUFLEET_NVML_FAKE || true

work=$(mktemp -d "${TMPDIR:-/tmp}/gpufleet-check-install.XXXXXX")
server_pid=""
cleanup() {
  if [ -n "$server_pid" ]; then
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

extra="build"
fail() {
  echo "check-install: FAIL [$extra]: $*" >&2
  exit 1
}
ok() { printf 'check-install: ok   [%-10s] %s (%ds)\n' "$extra" "$*" "$((SECONDS - t0))"; }

for cmd in openssl curl tar; do
  command -v "$cmd" >/dev/null 2>&1 || fail "needs $cmd (apt-get install $cmd)"
done

# A fresh venv in $work/venv-NAME with the wheel and EXTRA installed; prints nothing on success.
venv() {
  local name=$1 spec=$2
  "$py" -m venv "$work/venv-$name" || fail "cannot create a venv with $py"
  "$work/venv-$name/bin/python" -m pip install -q "$spec" >"$work/pip-$name.log" 2>&1 \
    || { tail -20 "$work/pip-$name.log" >&2; fail "pip install '$spec' failed"; }
}

# Import every module under the given packages (minus the excluded prefixes) from the venv; fails
# on the first missing import, and on a module that is not the installed one.
import_all() {
  local name=$1
  shift
  (cd "$work/outside" && "$work/venv-$name/bin/python" - "$@") <<'EOF' || fail "an import failed (above)"
import importlib, pkgutil, sys
roots = [a for a in sys.argv[1:] if not a.startswith("-")]
skip = tuple(a[1:] for a in sys.argv[1:] if a.startswith("-"))
count = 0
for root in roots:
    pkg = importlib.import_module(root)
    names = [root] + [m.name for m in pkgutil.walk_packages(pkg.__path__, root + ".")]
    for name in names:
        if name.startswith(skip):
            continue
        try:
            mod = importlib.import_module(name)
        except Exception as e:
            sys.exit(f"import {name}: {type(e).__name__}: {e}")
        if not str(getattr(mod, "__file__", "")).startswith(sys.prefix):
            sys.exit(f"import {name}: loaded from {mod.__file__}, not from the venv {sys.prefix}")
        count += 1
print(count)
EOF
}

t0=$SECONDS
mkdir -p "$work/outside" "$work/dist"

# ---------------------------------------------------------------- build: sdist, then the wheel from it
"$py" -m venv "$work/venv-build"
"$work/venv-build/bin/python" -m pip install -q build >"$work/pip-build.log" 2>&1 \
  || { tail -20 "$work/pip-build.log" >&2; fail "pip install build failed"; }
"$work/venv-build/bin/python" -m build --outdir "$work/dist" "$repo" >"$work/build.log" 2>&1 \
  || { tail -30 "$work/build.log" >&2; fail "python -m build failed"; }
if grep -q '^!!' "$work/build.log"; then
  grep -B2 -A6 'WARNING\|Warning' "$work/build.log" >&2 || true
  fail "python -m build printed warnings"
fi
wheel=$(ls "$work"/dist/gpufleet-*.whl)
sdist=$(ls "$work"/dist/gpufleet-*.tar.gz)
top=$(basename "$sdist" .tar.gz)
tar tzf "$sdist" >"$work/sdist.txt"
for f in pyproject.toml README.md MANIFEST.in sim/fake/data/h100-8gpu-idle.xml sim/scenarios/demo.toml \
  dashboards/json/gpufleet-overview.json alerts/__init__.py alerts/gpufleet.rules.yml alerts/alertmanager.yml \
  alerts/runbook.md alerts/tests/gpu.test.yml docs/README.md docs/metrics.md packaging/demo.sh packaging/container/build.sh packaging/web-config.yml packaging/agent.toml \
  packaging/systemd/gpufleet-agent.service tests/run.sh tests/conftest.py tests/support.py \
  tests/fixtures/traces/h100x8-sim.jsonl.gz .ci/run .ci/check-install.sh; do
  grep -qxF "$top/$f" "$work/sdist.txt" || fail "the sdist lacks $f"
done
"$py" -m zipfile -l "$wheel" | awk 'NR > 1 {print $1}' >"$work/wheel.txt"
for f in gpufleet/sim/fake/data/h100-8gpu-idle.xml gpufleet/sim/fake/data/NOTICE.md \
  gpufleet/sim/scenarios/demo.toml gpufleet/dashboards/boards/overview.py \
  gpufleet/dashboards/json/gpufleet-overview.json gpufleet/alerts/gpufleet.rules.yml \
  gpufleet/alerts/alertmanager.yml gpufleet/alerts/runbook.md gpufleet/alerts/tests/gpu.test.yml; do
  grep -qxF "$f" "$work/wheel.txt" || fail "the wheel lacks $f"
done
if grep -q '^tests/\|^gpufleet/tests/' "$work/wheel.txt"; then fail "the wheel carries the test suite"; fi
ok "$(basename "$sdist") ($(wc -l <"$work/sdist.txt") entries), $(basename "$wheel") ($(wc -l <"$work/wheel.txt") files)"

# ---------------------------------------------------------------- [agent]: a GPU host
extra=agent t0=$SECONDS
venv agent "$wheel[agent]"
n=$(import_all agent gpufleet.agent gpufleet.vocab gpufleet.serving gpufleet.sim.fake)
A=$work/venv-agent/bin
(cd "$work/outside" && "$A/gpufleet-agent" once --nvml.fake=sim) >"$work/once.prom" 2>"$work/once.err" \
  || { cat "$work/once.err" >&2; fail "gpufleet-agent once --nvml.fake=sim exited non-zero"; }
grep -q '^gpufleet_gpu_power_watts{' "$work/once.prom" || fail "no gpufleet_gpu_power_watts in the exposition"
samples=$("$A/python" -c '
import sys
from prometheus_client.parser import text_string_to_metric_families
print(sum(len(f.samples) for f in text_string_to_metric_families(sys.stdin.read())))' <"$work/once.prom") \
  || fail "the exposition does not parse"
# The web config: TLS with a self-signed certificate and a bcrypt basic-auth user, served for real.
openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1 \
  -keyout "$work/tls.key" -out "$work/tls.crt" >/dev/null 2>&1 || fail "openssl could not make a certificate"
hash=$("$A/python" -c 'import bcrypt; print(bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode())')
cat >"$work/web-config.yml" <<EOF
tls_server_config:
  cert_file: tls.crt
  key_file: tls.key
basic_auth_users:
  prometheus: '$hash'
EOF
port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
(cd "$work/outside" && exec "$A/gpufleet-agent" --nvml.fake=sim --web.listen-address="127.0.0.1:$port" \
  --web.config.file="$work/web-config.yml") >"$work/agent.log" 2>&1 &
server_pid=$!
url="https://127.0.0.1:$port/metrics"
for _ in $(seq 150); do
  code=$(curl -s -o /dev/null -w '%{http_code}' --cacert "$work/tls.crt" "$url" || true)
  [ "$code" = 000 ] || break
  kill -0 "$server_pid" 2>/dev/null || { cat "$work/agent.log" >&2; fail "the agent exited at start"; }
  sleep 0.2
done
[ "$code" = 401 ] || { cat "$work/agent.log" >&2; fail "$url without credentials answered $code, not 401"; }
curl -sf --cacert "$work/tls.crt" -u prometheus:s3cret -o "$work/https.prom" "$url" \
  && grep -q '^gpufleet_gpu_power_watts{' "$work/https.prom" \
  || { cat "$work/agent.log" >&2; fail "$url with TLS + basic auth did not serve gpufleet_gpu_power_watts"; }
# The probes as a kubelet sends them (no credentials, the certificate not checked) answer while /metrics needs them.
for probe in health ready; do
  code=$(curl -sk -o /dev/null -w '%{http_code}' "https://127.0.0.1:$port/$probe" || true)
  [ "$code" = 200 ] || { cat "$work/agent.log" >&2; fail "/$probe without credentials answered $code, not 200"; }
done
kill "$server_pid"
wait "$server_pid" || true
server_pid=""
# The commands of the other extras: one line naming the extra they need, exit status 2, no traceback.
for want in detector:gpufleet-detector sim:gpufleet-sim dashboards:gpufleet-dashboards; do
  rc=0
  (cd "$work/outside" && "$A/${want#*:}" --help) >"$work/other.out" 2>"$work/other.err" || rc=$?
  [ "$rc" = 2 ] && [ "$(wc -l <"$work/other.err")" = 1 ] && ! grep -q Traceback "$work/other.err" \
    && grep -q "^${want#*:}: this install lacks the \[${want%%:*}\] extra" "$work/other.err" \
    || { cat "$work/other.err" >&2; fail "${want#*:} on an [agent]-only install: rc $rc, not one line naming [${want%%:*}]"; }
done
"$A/gpufleet-agent" --version | grep -qx "gpufleet-agent $("$A/python" -c 'import importlib.metadata as m; print(m.version("gpufleet"))')" \
  || fail "gpufleet-agent --version does not say the package's version"
ok "$n modules import; once: $samples samples; https + basic auth: 401 without, metrics with credentials, probes without; the other commands name their extra"

# ---------------------------------------------------------------- [sim]: recordings and live agents
extra=sim t0=$SECONDS
venv sim "$wheel[sim]"
n=$(import_all sim gpufleet.agent gpufleet.sim gpufleet.vocab gpufleet.serving)
S=$work/venv-sim/bin
cat >"$work/small.toml" <<'EOF'
name = "ci-small"
description = "4 nodes x 8 GPUs, one job, GPU 5 of node-002 stuck at a low clock from 30 min"
hours = 1
step = 15
[[sites]]
name = "site-a"
nodes = 4
gpus_per_node = 8
[jobs]
[[jobs.fixed]]
id = "job-a"
nodes = "all"
[[faults]]
kind = "clock_stuck_low"
node = "node-002"
gpu = 5
onset = "30m"
severity = "moderate"
EOF
(cd "$work/outside" && "$S/gpufleet-sim" generate --scenario "$work/small.toml" --out "$work/rec" --series core \
  --quiet) >"$work/generate.log" 2>&1 || { cat "$work/generate.log" >&2; fail "gpufleet-sim generate failed"; }
[ -s "$work/rec/metrics.gpufleet.om" ] && [ -s "$work/rec/labels.json" ] || fail "generate wrote no recording"
(cd "$work/outside" && timeout 60 "$S/gpufleet-sim" serve --nodes 2 --duration 3) >"$work/serve.log" 2>&1 \
  || { cat "$work/serve.log" >&2; fail "gpufleet-sim serve --nodes 2 --duration 3 failed"; }
grep -q 'node-001: curl http://127.0.0.1:' "$work/serve.log" || fail "serve printed no targets"
ok "$n modules import; generate: $(du -h "$work/rec/metrics.gpufleet.om" | cut -f1) recording; serve: 2 live agents"

# ---------------------------------------------------------------- [detector]: the central host
extra=detector t0=$SECONDS
venv detector "$wheel[detector]"
n=$(import_all detector gpufleet.detector gpufleet.vocab gpufleet.serving)
(cd "$work/outside" && "$work/venv-detector/bin/gpufleet-detector" replay --format json --no-progress \
  "$work/rec/metrics.gpufleet.om") >"$work/findings.json" 2>"$work/replay.err" \
  || { cat "$work/replay.err" >&2; fail "gpufleet-detector replay failed"; }
grep -q '"kind": "straggler", "cause": "clock", "node": "node-002", "gpu": "5"' "$work/findings.json" \
  || { cat "$work/findings.json" "$work/replay.err" >&2; fail "replay did not find the straggler on node-002 GPU 5"; }
ok "$n modules import; replay: $(wc -l <"$work/findings.json") finding(s), straggler/clock on node-002 GPU 5"

# ---------------------------------------------------------------- packaging/install.sh: hosts, as docs/install.md
# The documented commands, with --root: a GPU host (agent, Slurm scripts) and the central host (detector) laid
# down in temporary roots, each unit verified there by systemd-analyze against the host's own system units; an
# upgrade in place keeps an edited config; uninstall keeps the config, --purge removes it.
extra=install t0=$SECONDS
for role in agent detector; do
  r=$work/root-$role
  flags=()
  [ "$role" = agent ] && flags=(--slurm)
  bash "$repo/packaging/install.sh" --root "$r" "$role" "$wheel" "${flags[@]}" >"$work/install-$role.log" 2>&1 \
    || { cat "$work/install-$role.log" >&2; fail "packaging/install.sh $role failed"; }
  [ "$(readlink "$r/usr/local/bin/gpufleet-$role")" = "/opt/gpufleet/bin/gpufleet-$role" ] \
    || fail "/usr/local/bin/gpufleet-$role does not link into /opt/gpufleet/bin"
  [ -f "$r/etc/gpufleet/$role.toml" ] && [ -f "$r/etc/systemd/system/gpufleet-$role.service" ] \
    || fail "install.sh $role did not lay down its config and unit"
  if command -v systemd-analyze >/dev/null 2>&1 && [ -d /usr/lib/systemd/system ]; then
    mkdir -p "$r/usr/lib/systemd"
    cp -a /usr/lib/systemd/system "$r/usr/lib/systemd/"
    systemd-analyze verify --root="$r" "gpufleet-$role.service" >"$work/verify-$role.log" 2>&1 \
      || { cat "$work/verify-$role.log" >&2; fail "systemd-analyze verify gpufleet-$role.service in the installed root"; }
    ! grep -q "gpufleet-$role.service.*\(Unknown\|ignoring\|rror\)" "$work/verify-$role.log" \
      || { cat "$work/verify-$role.log" >&2; fail "systemd-analyze verify complained about gpufleet-$role.service"; }
  fi
  "$r/opt/gpufleet/bin/gpufleet-$role" --version | grep -qx "gpufleet-$role [0-9].*" || fail "the installed gpufleet-$role --version"
done
[ -x "$work/root-agent/etc/slurm/prolog.d/gpufleet-prolog.sh" ] && [ -x "$work/root-agent/etc/slurm/epilog.d/gpufleet-epilog.sh" ] \
  || fail "install.sh agent --slurm did not install the prolog/epilog"
(cd "$work/outside" && "$work/root-agent/opt/gpufleet/bin/gpufleet-agent" once --nvml.fake=sim 2>"$work/once-installed.err") | grep -q '^gpufleet_gpu_power_watts{' \
  || fail "the installed agent's once --nvml.fake=sim served no gpufleet_gpu_power_watts"
"$work/root-agent/opt/gpufleet/bin/gpufleet-detector" --version 2>"$work/other.err" && fail "an agent host runs the detector" || true
grep -q "lacks the \[detector\] extra" "$work/other.err" || fail "the agent host's gpufleet-detector does not name its extra"
echo "# edited" >>"$work/root-agent/etc/gpufleet/agent.toml"
bash "$repo/packaging/install.sh" --root "$work/root-agent" agent "$wheel" >"$work/upgrade.log" 2>&1 \
  || { cat "$work/upgrade.log" >&2; fail "install.sh agent over an install (an upgrade) failed"; }
tail -1 "$work/root-agent/etc/gpufleet/agent.toml" | grep -qx "# edited" || fail "an upgrade overwrote the edited agent.toml"
# A failed upgrade (a wheel pip cannot install) leaves the old install in place and working.
: >"$work/gpufleet-9.9.9-py3-none-any.whl"
if bash "$repo/packaging/install.sh" --root "$work/root-agent" agent "$work/gpufleet-9.9.9-py3-none-any.whl" \
  >"$work/bad-upgrade.log" 2>&1; then fail "install.sh succeeded with a broken wheel"; fi
grep -q "the old install is back" "$work/bad-upgrade.log" || { cat "$work/bad-upgrade.log" >&2; fail "a failed upgrade did not say it restored the old install"; }
"$work/root-agent/opt/gpufleet/bin/gpufleet-agent" --version >/dev/null || fail "a failed upgrade broke the old install"
bash "$repo/packaging/install.sh" --root "$work/root-agent" --uninstall agent >/dev/null
[ ! -e "$work/root-agent/opt/gpufleet" ] && [ ! -L "$work/root-agent/usr/local/bin/gpufleet-agent" ] \
  && [ ! -e "$work/root-agent/etc/systemd/system/gpufleet-agent.service" ] && [ -f "$work/root-agent/etc/gpufleet/agent.toml" ] \
  || fail "--uninstall agent did not remove the install and keep the config"
bash "$repo/packaging/install.sh" --root "$work/root-agent" --uninstall --purge agent >/dev/null
[ ! -e "$work/root-agent/etc/gpufleet/agent.toml" ] || fail "--uninstall --purge kept agent.toml"
ok "agent (+ Slurm) and detector roots laid down, units verified, upgrade kept the config, a failed one the old install, uninstall and purge"

# ---------------------------------------------------------------- [dashboards]
extra=dashboards t0=$SECONDS
venv dashboards "$wheel[dashboards]"
n=$(import_all dashboards gpufleet.dashboards gpufleet.vocab)
D=$work/venv-dashboards/bin
(cd "$work/outside" && "$D/gpufleet-dashboards" --out "$work/dash") >"$work/dash.log" 2>&1 \
  || { cat "$work/dash.log" >&2; fail "gpufleet-dashboards failed"; }
(cd "$work/outside" && "$D/gpufleet-dashboards" --check) >>"$work/dash.log" 2>&1 \
  || { cat "$work/dash.log" >&2; fail "the wheel's dashboards/json differs from its sources"; }
ok "$n modules import; $(tail -1 "$work/dash.log"); $(ls "$work/dash" | wc -l) generated"

# ---------------------------------------------------------------- [all]: everything, the demo included
extra=all t0=$SECONDS
venv all "$wheel[all]"
n=$(import_all all gpufleet.vocab gpufleet.serving gpufleet.agent gpufleet.sim gpufleet.detector gpufleet.dashboards gpufleet.alerts)
"$work/venv-all/bin/python" -c '
from importlib.resources import files
for name in ("gpufleet.rules.yml", "alertmanager.yml", "runbook.md"):
    assert (files("gpufleet.alerts") / name).read_text().strip(), name' || fail "the alert rules are not readable"
(cd "$work/outside" && timeout 120 "$work/venv-all/bin/gpufleet-sim" demo --no-ui --duration 20 --speed 6 \
  </dev/null) >"$work/demo.log" 2>&1 || { tail -30 "$work/demo.log" >&2; fail "gpufleet-sim demo failed"; }
grep -q 'detector finding: straggler/clock .*GPU 5 on node-002' "$work/demo.log" \
  || { tail -30 "$work/demo.log" >&2; fail "the demo did not report straggler/clock on node-002 GPU 5"; }
ok "$n modules import; alert rules readable; demo: straggler/clock on node-002 GPU 5 reported"
