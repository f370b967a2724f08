# Sourced by the GPU machine's scripts (tests/gpu/*.sh): unpacks the bundle tests/gpu/bundle.sh
# made into ROOT (once) and points the loader at its libraries and at the machine's NVRTC,
# cuBLAS, cuDNN and shared CUDA runtime, from the CUDA toolkit or the Python wheels beside
# PyTorch (nvidia-cudnn-cu13 and friends).
#
#   . tests/gpu/env.sh BUNDLE ROOT      # then: $root/bin/kiln, $root/bin/kilnd, ...
bundle=${1:?usage: . env.sh BUNDLE ROOT}
root=${2:?usage: . env.sh BUNDLE ROOT}
mkdir -p "$root"
if [ ! -x "$root/bin/kiln" ]; then
  tar -C "$root" -xJf "$bundle" || return 1
fi
sites=$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null)
# One directory per library, the toolkit's first (find lists them in this order).
libdirs=$(for name in 'libnvrtc.so.1[23]' 'libcublas.so.1[23]' 'libcudnn.so.9' \
                      'libcudart.so.1[23]'; do
            find -H /usr/local/cuda*/lib64 /usr/local/cuda*/lib /usr/local/cuda*/targets $sites /opt /usr/lib \
              /usr/local/lib -name "$name" -printf '%h\n' 2>/dev/null | head -1
          done | awk '!seen[$0]++' | tr '\n' ':')
export LD_LIBRARY_PATH="$root/lib:${libdirs}${LD_LIBRARY_PATH:-}"
export KILN_CACHE_DIR="$root/cache"
bin=$root/bin
