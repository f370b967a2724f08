#!/usr/bin/env bash
# One call's worth of GPU checks for the decode path, run on a machine with an NVIDIA GPU from
# the repository root: with a bundle of `kiln` and gpu_harness_test (BUNDLE_BINS="bin/kiln
# backends/gpu/gpu_harness_test" tests/gpu/bundle.sh) and a GGUF with the real model's shapes
# that compresses to a few MB (tests/gpu/pattern_gguf.py, then xz), both fit in one call.
#
#   tests/gpu/decode_check.sh BUNDLE.tar.xz MODEL.gguf[.xz] OUT_DIR [SECONDS]
#
# In order, each only while SECONDS (default 420) last:
# 1. the op harness' cases of the ops in HARNESS_OPS (default: linear) on cuda against ref
#    (forward and gradient);
# 2. greedy text on cuda == cpu for the golden prompts (smollm2_check.py golden);
# 3. decode tokens/s of the Linear kernels and sampling variants, interleaved (variants);
# 4. the whole op harness (forward and gradient; SKIP_HARNESS_ALL=1 leaves it out);
# 5. Nsight Compute's time of every kernel of 8 decode steps, by kernel (ncu).
# The last line says how many checks passed.
set -uo pipefail
bundle=${1:?usage: decode_check.sh BUNDLE MODEL OUT_DIR [SECONDS]}
model=${2:?usage: decode_check.sh BUNDLE MODEL OUT_DIR [SECONDS]}
out=${3:?usage: decode_check.sh BUNDLE MODEL OUT_DIR [SECONDS]}
budget=${4:-420}
mkdir -p "$out"
. "$(dirname "$0")/env.sh" "$bundle" "${KILN_GPU_ROOT:-$(mktemp -d)}" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
if [[ $model == *.xz ]]; then
  xz -dc "$model" > "$root/model.gguf" || exit 1
  model=$root/model.gguf
fi
pass=0
fail=0
left() { echo $((budget - SECONDS)); }
check() {  # check NAME SECONDS COMMAND...: runs under a timeout, logs to OUT/NAME.log, counts
  local name=$1 limit=$2
  shift 2
  if [ "$(left)" -lt 20 ]; then
    echo "SKIP $name (out of time)"
    return
  fi
  [ "$limit" -gt "$(left)" ] && limit=$(left)
  local t0=$SECONDS
  if timeout "$limit" "$@" > "$out/$name.log" 2>&1; then
    pass=$((pass + 1))
    echo "PASS $name ($((SECONDS - t0)) s)"
  else
    fail=$((fail + 1))
    echo "FAIL $name ($((SECONDS - t0)) s): $(grep -m3 -E 'Failure|error|FAIL|Error' "$out/$name.log" | head -3)"
  fi
}
for op in ${HARNESS_OPS:-linear}; do
  check "harness_$op" 150 env KILN_GPU_HARNESS_OP="$op" "$bin/gpu_harness_test" --gtest_brief=0
  grep -E "cases passed|programs|SKIPPED" "$out/harness_$op.log" | head -6
done
smol=(env PYTHONUNBUFFERED=1 python3 tests/gpu/smollm2_check.py --bin "$bin" --model "$model"
  --out "$out" --rounds 3 --only)
check golden 120 "${smol[@]}" golden
grep -E "^golden|DIFF" "$out/golden.log" | head -4
check variants 120 "${smol[@]}" variants
grep -E "decode," "$out/variants.log"
if [ -z "${SKIP_HARNESS_ALL:-}" ]; then
  check harness_all 240 "$bin/gpu_harness_test" --gtest_brief=0
  grep -E "cases passed|programs|Failure" "$out/harness_all.log" | head -8
fi
check ncu 150 "${smol[@]}" ncu
head -30 "$out/ncu.log"
echo "decode checks: $pass passed, $fail failed ($SECONDS s)"
