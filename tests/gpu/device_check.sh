#!/usr/bin/env bash
# The GPU checks, run on a machine with an NVIDIA GPU from the repository root, with the
# archive tests/gpu/bundle.sh made:
#
#   tests/gpu/device_check.sh BUNDLE.tar.xz OUT_DIR [bench | smollm2 GGUF [LLAMA_CPP_DIR]]
#
# (SMOL_ONLY=golden,one,... picks smollm2_check.py steps.) With `bench`, runs tests/bench/gpu_decode_bench.py (kiln against PyTorch on the same GPU)
# instead of the checks; with `smollm2`, tests/gpu/smollm2_check.py on the real SmolLM2 GGUF
# (against llama.cpp's CUDA build in LLAMA_CPP_DIR, if given).
#
# 1. the cuda backend's tests (op harness forward and gradient against `ref`, capture,
#    allocator) and the device interface tests with cuda included; the harness again with the
#    allocator on an expandable segment (KILN_CUDA_EXPANDABLE_SEGMENTS=1);
# 2. the tiny random Llama (tests/fixtures/models/llama_gqa_f32): greedy generation on cuda
#    equals ref's, text for text, and the cuda plugin compiled it fused;
# 3. two LoRA steps of `kiln finetune --backend cuda` give the losses the cpu run gives
#    (28.43, 30.77, as the kiln_finetune_tiny test pins);
# 4. (figures) tests/bench/gpu_sdpa_bench: cuDNN SDPA and Kiln's attention kernel;
# 5. kilnd serving a SmolLM2-shaped model (f16 and f32) with `backend: cuda` answers what
#    `kiln generate --backend ref` (exact arithmetic) continues (tests/gpu/serve_check.py).
# Logs go to OUT_DIR; the last line says how many checks passed.
set -uo pipefail
bundle=${1:?usage: device_check.sh BUNDLE OUT_DIR}
out=${2:?usage: device_check.sh BUNDLE OUT_DIR}
mkdir -p "$out"
# KILN_GPU_ROOT keeps the unpacked bundle (and its kernel cache) for later scripts.
. "$(dirname "$0")/env.sh" "$bundle" "${KILN_GPU_ROOT:-$(mktemp -d)}" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH" >> "$out/gpu.txt"
if [ "${3:-}" = bench ]; then
  python3 tests/bench/gpu_decode_bench.py --kiln "$bin/kiln" --rounds "${ROUNDS:-3}" 2>&1 |
    grep -v -E "Writing model shards|Loading weights" | tee "$out/bench.txt"
  exit "${PIPESTATUS[0]}"
fi
if [ "${3:-}" = smollm2 ]; then
  PYTHONUNBUFFERED=1 python3 tests/gpu/smollm2_check.py --bin "$bin" --model "${4:?GGUF}" \
    --out "$out" ${5:+--llama "$5"} ${SMOL_ONLY:+--only "$SMOL_ONLY"} 2>&1 | tee "$out/smollm2.txt"
  exit "${PIPESTATUS[0]}"
fi
pass=0
fail=0
check() {  # check NAME COMMAND...: runs, logs to OUT/NAME.log, counts
  local name=$1
  shift
  local t0=$SECONDS
  if "$@" > "$out/$name.log" 2>&1; then
    pass=$((pass + 1))
    echo "PASS $name ($((SECONDS - t0)) s)"
  else
    fail=$((fail + 1))
    echo "FAIL $name ($((SECONDS - t0)) s): $(grep -m3 -E 'Failure|error|FAIL|Error' "$out/$name.log" | head -3)"
  fi
}
check gpu_harness_test timeout 240 "$bin/gpu_harness_test" --gtest_brief=0
grep -E "cases passed|sm_|SKIPPED" "$out/gpu_harness_test.log" | head -20
check gpu_tests_ran bash -c "! grep -q SKIPPED '$out/gpu_harness_test.log'"
check device_interface_test timeout 120 "$bin/device_interface_test"
# The same cases with the allocator on one expandable segment (kernels now come from the cache).
check gpu_harness_expandable env KILN_CUDA_EXPANDABLE_SEGMENTS=1 timeout 240 \
  "$bin/gpu_harness_test" --gtest_brief=0
grep -E "cases passed|expandable|SKIPPED" "$out/gpu_harness_expandable.log" | head -8
# cuDNN SDPA against Kiln's attention; skips (saying why) where the machine has no libcudnn.
check gpu_sdpa_test timeout 240 "$bin/gpu_sdpa_test" --gtest_brief=0
grep -E "max error|SKIPPED|Skipped|cuDNN" "$out/gpu_sdpa_test.log" | head -20
# Attention speed: cuDNN SDPA and Kiln's kernel (figures, not a check).
timeout 300 "$bin/gpu_sdpa_bench" --iters 10 2>&1 | tee "$out/gpu_sdpa_bench.txt"
model=tests/fixtures/models/llama_gqa_f32
for be in ref cuda; do
  check "generate_$be" timeout 60 bash -c "'$bin/kiln' generate --model $model --max-tokens 24 \
    --prompt 'The quick brown fox' --backend $be --log-level info > '$out/text_$be.txt'"
done
check generate_equal cmp "$out/text_ref.txt" "$out/text_cuda.txt"
# The cuda plugin (lib/kiln/backends beside bin/) compiled the step program fused: its devices
# see the host compiler's fused groups (engine/compiler/host_services.h).
check cuda_plugin_fuses bash -c "grep -q 'fused [0-9]* nodes into' '$out/generate_cuda.log' &&
  ! grep -q 'fused program failed' '$out/generate_cuda.log'"
check finetune_cuda timeout 120 "$bin/kiln" finetune --backend cuda --model $model \
  --train tests/fixtures/train/tiny_prompt_completion.jsonl --out "$root/ft" --steps 2 \
  --batch-size 2 --seq-len 32
check finetune_losses grep -qzE "loss 28\.43.*loss 30\.77.*adapter in" "$out/finetune_cuda.log"
check serve_cuda timeout 420 python3 tests/gpu/serve_check.py --kilnd "$bin/kilnd" --kiln "$bin/kiln"
grep -E "^(OK|DIFF)|serve_check" "$out/serve_cuda.log"
echo "device checks: $pass passed, $fail failed"
