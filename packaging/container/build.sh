#!/usr/bin/env bash
# Builds the two gpufleet images from packaging/container/Dockerfile, tagged with the package version
# (pyproject.toml):  gpufleet-agent:VERSION and gpufleet-detector:VERSION (REGISTRY/gpufleet-...:VERSION
# with --registry), the names packaging/kubernetes/base/kustomization.yaml rewrites.
#
#   bash packaging/container/build.sh                      # base chosen by what is available
#   bash packaging/container/build.sh --base python        # the public python:3.11-slim-bookworm base
#   bash packaging/container/build.sh --base debian        # a base made here from Debian packages
#   bash packaging/container/build.sh --registry registry.example.com/gpufleet --push
#   bash packaging/container/build.sh --ca-file /etc/ssl/certs/ca-certificates.crt  # pip behind a TLS proxy
#
# --base python pulls python:3.11-slim-bookworm (any Docker or Podman host that reaches Docker Hub).
# --base debian makes the base with mmdebstrap from the host's Debian release (python3 for the images,
# python3 + python3-venv for the build stages) and imports it with `podman/docker import`: for hosts
# without a registry to pull from. Its tarballs are kept in packaging/container/.cache/ (ignored by git;
# GPUFLEET_IMAGE_CACHE moves it), so only the first build runs mmdebstrap. The default, auto, takes the
# python base if the engine has it or can pull it, otherwise the Debian one.
# --ca-file (default: $PIP_CERT when it names a file) is the CA bundle pip trusts inside the build, passed
# as the build secret pip-cert, never stored in an image.
# The engine is docker where its daemon answers, otherwise podman (--engine picks). Under podman on a
# cgroup v1/hybrid host with runc installed, the builds use runc (crun fails there), and every podman
# build runs with nofile=1024 and nproc=4096 (podman's defaults exceed some hosts' hard limits).
# --only agent|detector builds one image.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)

usage() {
  sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'
  exit "${1:-0}"
}

base=auto engine="" registry="" push=0 targets="agent detector" ca_file=${PIP_CERT:-}
while (($#)); do
  case $1 in
    --base) base=${2:?--base needs python, debian or auto}; shift 2 ;;
    --engine) engine=${2:?--engine needs docker or podman}; shift 2 ;;
    --registry) registry=${2:?--registry needs a registry/path prefix}; shift 2 ;;
    --push) push=1; shift ;;
    --ca-file) ca_file=${2:?--ca-file needs a file}; shift 2 ;;
    --only) targets=${2:?--only needs agent or detector}; shift 2 ;;
    -h | --help) usage 0 ;;
    *) echo "build.sh: unknown argument $1" >&2; usage 2 >&2 ;;
  esac
done
case $base in python | debian | auto) ;; *) echo "build.sh: --base must be python, debian or auto" >&2; exit 2 ;; esac
for t in $targets; do
  case $t in agent | detector) ;; *) echo "build.sh: --only must be agent or detector" >&2; exit 2 ;; esac
done

version=$(sed -n 's/^version *= *"\([^"]*\)".*/\1/p' "$repo/pyproject.toml" | head -1)
[ -n "$version" ] || { echo "build.sh: no version in pyproject.toml" >&2; exit 1; }

if [ -z "$engine" ]; then
  if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    engine=docker
  elif command -v podman >/dev/null 2>&1; then
    engine=podman
  else
    echo "build.sh: neither a running docker nor podman (Debian: apt-get install podman buildah runc)" >&2
    exit 1
  fi
fi
command -v "$engine" >/dev/null 2>&1 || { echo "build.sh: $engine is not installed" >&2; exit 1; }

engine_flags=()
if [ "$engine" = podman ]; then
  if [ "$(stat -fc %T /sys/fs/cgroup 2>/dev/null)" != cgroup2fs ] && command -v runc >/dev/null 2>&1; then
    engine_flags+=(--runtime runc)
  fi
  build_flags=(--ulimit nofile=1024:1024 --ulimit nproc=4096:4096 --network host --ignorefile "$here/Dockerfile.dockerignore")
else
  build_flags=(--network host)
fi

python_image=python:3.11-slim-bookworm
if [ "$base" = auto ]; then
  base=debian
  if "$engine" image inspect "$python_image" >/dev/null 2>&1 \
    || timeout 120 "$engine" pull -q "$python_image" >/dev/null 2>&1; then
    base=python
  fi
  echo "==> base: $base (auto)"
fi

if [ "$base" = python ]; then
  build_image=$python_image
  runtime_image=$python_image
else
  # shellcheck source=/dev/null
  suite=$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")
  suite=${suite:-bookworm}
  cache=${GPUFLEET_IMAGE_CACHE:-$here/.cache}
  build_image=localhost/gpufleet-base:$suite-build
  runtime_image=localhost/gpufleet-base:$suite
  if [ ! -s "$cache/$suite-build.tar" ] || [ ! -s "$cache/$suite.tar" ]; then
    command -v mmdebstrap >/dev/null 2>&1 \
      || { echo "build.sh: --base debian needs mmdebstrap (apt-get install mmdebstrap)" >&2; exit 1; }
    mkdir -p "$cache"
    rm -f "$cache/$suite-build.part.tar" "$cache/$suite.part.tar"
    echo "==> making the Debian $suite base with mmdebstrap into $cache (once)"
    # essential + python3 (+ libstdc++6, which grpcio's wheel links): no apt, no docs. mmdebstrap merges /usr with usrmerge, which brings perl:
    # both go once the tree is merged. The build stages' tarball is written before python3-venv (pip's
    # bundled wheels, ensurepip) is purged from the images' one.
    purge_perl='chroot "$1" dpkg-query -W -f "\${Package}\n" | grep -E "^(usrmerge|perl|libperl5[.0-9]*|perl-modules-.*|lib.*-perl)$" | xargs -r chroot "$1" dpkg --purge'
    purge_venv='chroot "$1" dpkg-query -W -f "\${Package}\n" | grep -E "^(python3[.0-9]*-venv|python3-(pip|setuptools)-whl|python3-distutils|python3-lib2to3)$" | xargs -r chroot "$1" dpkg --purge'
    mmdebstrap --quiet --format=tar --variant=essential --include=usr-is-merged,python3,python3-venv,libstdc++6 \
      --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
      --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
      --dpkgopt='path-exclude=/usr/share/lintian/*' \
      --dpkgopt='path-exclude=/usr/lib/x86_64-linux-gnu/gconv/*' \
      --dpkgopt='path-include=/usr/lib/x86_64-linux-gnu/gconv/gconv-modules*' \
      --customize-hook="$purge_perl" \
      --customize-hook="tar -C \"\$1\" --numeric-owner --exclude=./proc/* --exclude=./sys/* --exclude=./dev/* -cf \"$cache/$suite-build.part.tar\" ." \
      --customize-hook="$purge_venv" \
      --customize-hook='rm -rf "$1"/var/cache/debconf/*-old "$1"/var/lib/dpkg/*-old "$1"/var/log/*' \
      "$suite" "$cache/$suite.part.tar"
    mv "$cache/$suite-build.part.tar" "$cache/$suite-build.tar"
    mv "$cache/$suite.part.tar" "$cache/$suite.tar"
    "$engine" rmi -f "$build_image" "$runtime_image" >/dev/null 2>&1 || true
  fi
  for pair in "$build_image=$suite-build" "$runtime_image=$suite"; do
    image=${pair%%=*}
    if ! "$engine" image inspect "$image" >/dev/null 2>&1; then
      echo "==> importing $cache/${pair#*=}.tar as $image"
      "$engine" import --change 'CMD ["python3"]' "$cache/${pair#*=}.tar" "$image" >/dev/null
    fi
  done
fi

if [ -n "$ca_file" ]; then
  [ -r "$ca_file" ] || { echo "build.sh: cannot read the CA bundle $ca_file" >&2; exit 1; }
  build_flags+=(--secret "id=pip-cert,src=$ca_file")
fi

prefix=${registry:+${registry%/}/}
for target in $targets; do
  tag=${prefix}gpufleet-$target:$version
  echo "==> $engine build --target $target -t $tag (base $build_image, runtime $runtime_image)"
  "$engine" "${engine_flags[@]}" build "${build_flags[@]}" -f "$here/Dockerfile" --target "$target" \
    --build-arg "PYTHON_IMAGE=$build_image" --build-arg "RUNTIME_IMAGE=$runtime_image" -t "$tag" "$repo"
done
for target in $targets; do
  tag=${prefix}gpufleet-$target:$version
  size=$("$engine" image inspect --format '{{.Size}}' "$tag")
  echo "$tag $((size / 1000000)) MB"
  if ((push)); then
    "$engine" "${engine_flags[@]}" push "$tag"
  fi
done
