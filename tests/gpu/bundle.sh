#!/usr/bin/env bash
# Packs what tests/gpu/device_check.sh runs on a GPU machine into one archive: the GPU test
# binaries, the `kiln` CLI, kilnd, the backend plugins (lib/kiln/backends) and every shared
# library they load from this machine (not glibc, not the GPU driver; NVRTC, cuBLAS and cuDNN
# (hundreds of MB) come from the GPU machine's CUDA toolkit). The archive travels with the
# working tree to a lent GPU machine (see docs/gpu.md).
#
#   tests/gpu/bundle.sh BUILD_DIR OUT_DIR      -> OUT_DIR/kiln-gpu-bundle.tar.xz
#
# BUNDLE_BINS="bin/kiln backends/gpu/gpu_harness_test" packs only those (build-relative paths):
# a smaller archive leaves room in the call for a model (tests/gpu/decode_check.sh).
set -euo pipefail
build=${1:?usage: bundle.sh BUILD_DIR OUT_DIR}
out=${2:?usage: bundle.sh BUILD_DIR OUT_DIR}
bins=(backends/gpu/gpu_harness_test backends/gpu/gpu_sdpa_test backends/device_interface_test
  tests/bench/gpu_sdpa_bench bin/kiln server/kilnd)
if [ -n "${BUNDLE_BINS:-}" ]; then read -r -a bins <<< "$BUNDLE_BINS"; fi
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib" "$out"
# The cuda backend is a plugin: lib/kiln/backends beside bin/ is where kilnd and kiln look.
mkdir -p "$stage/lib/kiln/backends"
plugins=()
for p in "$build"/lib/kiln/backends/libkiln_backend_*.so; do
  [ -e "$p" ] || continue
  cp "$p" "$stage/lib/kiln/backends/"
  strip "$stage/lib/kiln/backends/$(basename "$p")"
  plugins+=("lib/kiln/backends/$(basename "$p")")
done
for b in "${bins[@]}" "${plugins[@]}"; do
  case "$b" in
    lib/*) ;;
    *) cp "$build/$b" "$stage/bin/"
       strip "$stage/bin/$(basename "$b")" ;;  # a call to the GPU machine carries 64 MiB at most
  esac
  ldd "$build/$b" | awk '/=> \//{print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*|ld-linux*|libcuda.so*) ;;
      *) cp -Ln "$lib" "$stage/lib/" ;;
    esac
  done
done
tar -C "$stage" -cf - bin lib | xz -T0 -6 > "$out/kiln-gpu-bundle.tar.xz"
ls -la "$out/kiln-gpu-bundle.tar.xz"
