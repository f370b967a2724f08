#!/usr/bin/env bash
# Installs everything Kiln needs to build, run and test. Idempotent: a second run only
# checks. Debian 12 packages via apt; Python test tools in .venv/ via pip.
#
#   scripts/install-deps.sh            # build + run + test dependencies
#   KILN_SKIP_PY=1 scripts/install-deps.sh   # Debian packages only
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  build-essential cmake ninja-build pkg-config git ca-certificates curl
  protobuf-compiler libprotobuf-dev protobuf-compiler-grpc libgrpc++-dev libgrpc-dev libabsl-dev
  libboost-dev libboost-system-dev
  libyaml-cpp-dev nlohmann-json3-dev libspdlog-dev libfmt-dev libcli11-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libsqlite3-dev libpcre2-dev
  libdnnl-dev libclblast-dev opencl-headers ocl-icd-opencl-dev pocl-opencl-icd clinfo
  python3 python3-venv python3-dev
  libclang-rt-14-dev libicu-dev
  clang
  ccache
  prometheus
  hipcc
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-deps: apt-get install ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Python tools for tests and benchmarks (never runtime dependencies of kilnd).
if [ "${KILN_SKIP_PY:-0}" != 1 ]; then
  PY=${PYTHON:-python3}
  if [ ! -x .venv/bin/python ]; then
    echo "install-deps: creating .venv"
    "$PY" -m venv .venv
  fi
  stamp=.venv/.requirements.sha
  want=$(sha256sum tests/requirements.txt | cut -d' ' -f1)
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "install-deps: pip install -r tests/requirements.txt"
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -r tests/requirements.txt
    echo "$want" > "$stamp"
  fi
fi

# cudnn-frontend's C++ headers (header-only; cuDNN SDPA in backends/gpu/gpu_sdpa.cc), taken from
# the `include/` folder of NVIDIA's PyPI wheel into a cache outside the repository. CMake looks
# for them there (KILN_CUDNN_FRONTEND_INCLUDE); libcudnn itself is opened at run time.
CUDNN_FE_VERSION=1.32.0
deps_cache=${KILN_DEPS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kiln}
fe_dir="$deps_cache/cudnn-frontend-$CUDNN_FE_VERSION"
if [ "${KILN_SKIP_PY:-0}" != 1 ] && [ ! -f "$fe_dir/include/cudnn_frontend.h" ]; then
  echo "install-deps: cudnn-frontend $CUDNN_FE_VERSION headers into $fe_dir"
  tmp=$(mktemp -d)
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: \
    "nvidia-cudnn-frontend==$CUDNN_FE_VERSION" -d "$tmp"
  .venv/bin/python -m zipfile -e "$tmp"/nvidia_cudnn_frontend-*.whl "$tmp/wheel"
  mkdir -p "$deps_cache"  # a fresh machine has no cache folder yet
  rm -rf "$fe_dir.partial" && mv "$tmp/wheel/include" "$fe_dir.partial"
  mkdir -p "$fe_dir" && rm -rf "$fe_dir/include" && mv "$fe_dir.partial" "$fe_dir/include"
  rm -rf "$tmp"
fi
