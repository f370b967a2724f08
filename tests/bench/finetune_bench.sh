#!/usr/bin/env bash
# Fine-tuning throughput and memory of `kiln finetune` against PyTorch + PEFT
# (tests/bench/peft_train_peer.py), measured in the same run, interleaved (the VM's speed drifts:
# quote the ratios).
#
#   tests/bench/finetune_bench.sh BUILD_DIR PEER_PYTHON [F32_MODEL] [STEPS] [ROUNDS]
#
# BUILD_DIR     a Kiln build (its bin/kiln)
# PEER_PYTHON   a Python with torch, transformers, peft and gguf (e.g. .venv-ref/bin/python)
# F32_MODEL     optional: SmolLM2 with F32 weights (the same weights dequantized), made by
#               `PY tests/bench/gguf_to_f32.py .kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf F32.gguf`;
#               adds "LoRA on the f32 base" (Kiln; the peer computes in f32 either way)
# STEPS         timed steps per run (default 4; each run adds one untimed warm-up step)
# ROUNDS        alternating rounds (default 2)
# CONFIGS       (environment) which configurations, e.g. "kiln_q4 peer_q4" (default: all)
#
# Every configuration: SmolLM2-135M-Instruct, 2 threads, batch 4 x 256 tokens, LoRA r 8 /
# alpha 16 on all linear modules (or full fine-tuning, compared with the peer's), AdamW;
# Kiln also with --recompute (activation recomputation per block). Kiln trains on packed prompt/completion rows whose
# completions are most of each row; the peer on random ids, every position a target — both push
# batch x seq_len tokens through forward and backward per step, which is what tokens/s counts
# here (batch * seq_len / median step seconds). Peak RSS is the process's (ru_maxrss).
set -euo pipefail
BUILD=$(cd "$1" && pwd)
PEER=$2
F32=${3:-}
STEPS=${4:-4}
ROUNDS=${5:-2}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
Q4=$ROOT/.kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
B=4
L=256

python3 - "$TMP/train.jsonl" <<'EOF'
import json, sys
with open(sys.argv[1], "w") as f:
    for i in range(256):
        story = " ".join(f"Item {i}.{j} follows item {i}.{j - 1} in the long list." for j in range(40))
        f.write(json.dumps({"prompt": f"Continue the list {i}:", "completion": " " + story}) + "\n")
EOF

median() { sort -g | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }

# kiln MODEL [ARGS...] -> "tokens_per_s peak_rss_mib"
kiln_run() {
  local log=$TMP/kiln.log model=$1
  shift
  "$BUILD/bin/kiln" finetune --model "$model" --train "$TMP/train.jsonl" --out "$TMP/out" \
    --steps $((STEPS + 1)) --batch-size $B --seq-len $L --threads 2 --lr 1e-4 \
    --save-steps 1000000 --keep-checkpoints 1 "$@" > "$log.out" 2> "$log"
  local step_s
  step_s=$(grep -o '[0-9.]* s$' "$log" | tail -n +2 | awk '{print $1}' | median)
  local rss
  rss=$(grep -o 'peak RSS [0-9]* MiB' "$log.out" | awk '{print $3}')
  rm -rf "$TMP/out"
  awk -v s="$step_s" -v r="$rss" -v t=$((B * L)) 'BEGIN {printf "%.1f %s\n", t / s, r}'
}
# peer MODEL METHOD -> "tokens_per_s peak_rss_mib"
peer_run() {
  "$PEER" "$ROOT/tests/bench/peft_train_peer.py" --model "$1" --method "$2" --steps "$STEPS" \
    --batch-size $B --seq-len $L --threads 2 |
    awk '{for (i = 1; i <= NF; ++i) {split($i, kv, "="); v[kv[1]] = kv[2]} print v["tokens_per_s"], v["peak_rss_mib"]}'
}

# CONFIGS (environment): the configurations to run, in this order (default: all of them).
CONFIGS=${CONFIGS:-kiln_q4 peer_q4 kiln_q4_recompute ${F32:+kiln_f32} kiln_full peer_full}
declare -A TPS RSS
for round in $(seq "$ROUNDS"); do
  for cfg in $CONFIGS; do
    case $cfg in
      kiln_q4) out=$(kiln_run "$Q4") ;;
      kiln_q4_recompute) out=$(kiln_run "$Q4" --recompute) ;;
      peer_q4) out=$(peer_run "$Q4" lora) ;;
      kiln_f32) out=$(kiln_run "$F32") ;;
      kiln_full) out=$(kiln_run "$Q4" --method full) ;;
      peer_full) out=$(peer_run "$Q4" full) ;;
    esac
    echo "round $round $cfg: $out tok/s, MiB"
    TPS[$cfg]+="${out%% *} "
    RSS[$cfg]="${out##* }"
  done
done
m() { echo "$1" | tr ' ' '\n' | grep . | median; }
echo
echo "configuration          tokens/s   peak RSS MiB   vs PyTorch+PEFT (tokens/s, memory)"
for cfg in $CONFIGS; do
  t=$(m "${TPS[$cfg]}")
  ref=peer_q4
  [[ $cfg == *full ]] && ref=peer_full
  peer=$(m "${TPS[$ref]}")
  awk -v n="$cfg" -v t="$t" -v r="${RSS[$cfg]}" -v p="$peer" -v pr="${RSS[$ref]}" \
    'BEGIN {printf "%-22s %9.1f %14s   %.2fx, %.2fx\n", n, t, r, t / p, r / pr}'
done
