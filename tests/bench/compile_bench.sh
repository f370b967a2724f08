#!/usr/bin/env bash
# Compile-time and fusion figures for a whole model, through `kiln generate` (the same
# loader and compiler as kilnd):
#
#   tests/bench/compile_bench.sh [KILN_BINARY] [MODEL] [THREADS]
#   (defaults: build/bin/kiln, .kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf — 30 layers, 2)
#
# Prints, each as the median of 3 runs:
#   load (AOT)   kernels built into the binary (the default): no compiler runs
#   load (cold)  KILN_CPU_AOT=0 with an empty KILN_CACHE_DIR: every kernel is compiled
#   load (warm)  KILN_CPU_AOT=0, the cache filled by the cold run: kernels load from disk
#   decode tokens/s fused (default) vs KILN_FUSE=0 (every op its own kernel), 128 tokens,
#   median of 5 alternating runs each
# "load" is kiln generate's figure: open + build the step graph + compile + bind weights +
# allocate the KV cache, i.e. everything before the first token's prefill.
set -euo pipefail
KILN=${1:-build/bin/kiln}
MODEL=${2:-.kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf}
THREADS=${3:-2}
PROMPT="The capital of France is"
CACHE=$(mktemp -d)
trap 'rm -rf "$CACHE"' EXIT

# run ENV... -> the stats line on stderr
run() { env "$@" "$KILN" generate --model "$MODEL" --prompt "$PROMPT" --max-tokens "${TOKENS:-8}" \
          --threads "$THREADS" 2>&1 >/dev/null | grep '^\[kiln generate\]'; }
load_s() { sed -E 's/.*load ([0-9.]+) s.*/\1/'; }
decode_tps() { sed -E 's/.* tokens in [0-9.]+ s \(([0-9.]+) tok\/s\) \| finish.*/\1/'; }
median() { sort -g | sed -n 2p; }

aot=$(for i in 1 2 3; do run KILN_CACHE_DIR="$CACHE/aot" | load_s; done | median)
cold=$(for i in 1 2 3; do rm -rf "$CACHE/jit"; run KILN_CPU_AOT=0 KILN_CACHE_DIR="$CACHE/jit" | load_s; done | median)
warm=$(for i in 1 2 3; do run KILN_CPU_AOT=0 KILN_CACHE_DIR="$CACHE/jit" | load_s; done | median)
echo "model: $MODEL, $THREADS threads"
echo "load (AOT kernels, default):           ${aot} s"
echo "load (cold: compiler runs):            ${cold} s"
echo "load (warm: kernels from disk cache):  ${warm} s"
# Alternating runs, so that a machine whose speed drifts (shared hosts) biases neither.
f_runs=() u_runs=()
for i in 1 2 3 4 5; do
  f_runs+=("$(TOKENS=128 run KILN_CACHE_DIR="$CACHE/jit" KILN_CPU_AOT=0 | decode_tps)")
  u_runs+=("$(TOKENS=128 run KILN_CACHE_DIR="$CACHE/unfused" KILN_CPU_AOT=0 KILN_FUSE=0 | decode_tps)")
done
median5() { sort -g | sed -n 3p; }
fused=$(printf '%s\n' "${f_runs[@]}" | median5)
unfused=$(printf '%s\n' "${u_runs[@]}" | median5)
echo "decode, fused (default):               ${fused} tok/s"
echo "decode, unfused (KILN_FUSE=0):         ${unfused} tok/s"
