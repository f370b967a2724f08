#!/usr/bin/env bash
# Before/after figures of two Kiln builds, measured in the same run, interleaved (the VM's speed
# drifts: quote the ratios). For a change that must not cost speed:
#
#   tests/bench/ab_compare.sh OLD_BUILD_DIR NEW_BUILD_DIR [MODEL] [sections]
#   (MODEL default .kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf; sections default
#    "decode load harness xpu serving"; each build dir is a `build/` of its own checkout)
#
# decode   `kiln generate`, 128 new tokens, 2 threads, greedy: tok/s, median of 5 alternating
#          runs per build (exact default numerics)
# load     SmolLM2 load time (open + build + compile + bind + KV): AOT kernels (the default),
#          cold (KILN_CPU_AOT=0, empty kernel cache) and warm (the cache filled): medians of 3
# harness  the op harness' perf mode on cpu (kiln_op_harness --mode=perf): per-case µs/run,
#          median of 3 alternating runs; the geometric mean of new/old over the cases
# xpu      the xpu op-harness tests (forward + gradient) cold (fresh kernel caches) and warm:
#          wall seconds, and the cases each build has (a build with more cases takes longer:
#          compare per case); and `kiln generate --backend xpu`, 32 tokens: tok/s
# serving  tests/bench/llm_loadgen.py at STREAMS (16) streams, REQUESTS (6) requests each
#          (~128-token prompts, 128 new tokens) against both kilnd, one server at a time
#          (ports 8100-8102 old, 8200-8202 new); fewer than ~6 requests per stream leave TTFT
#          p50 within ±15% noise on a 2-core VM
set -euo pipefail
OLD=$(cd "$1" && pwd)
NEW=$(cd "$2" && pwd)
MODEL=${3:-.kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf}
SECTIONS=${4:-decode load harness xpu serving}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
TMP=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
  rm -rf "$TMP"
}
trap cleanup EXIT

median() { sort -g | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.3f", b / a}'; }
# gen BUILD ENV... -- ARGS: the stats line of `kiln generate`.
gen() {
  local build=$1
  shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  env "${envs[@]}" "$build/bin/kiln" generate --model "$MODEL" --prompt "The capital of France is" \
    --threads 2 "$@" 2>&1 >/dev/null | grep '^\[kiln generate\]'
}
tps() { sed -E 's/.* tokens in [0-9.]+ s \(([0-9.]+) tok\/s\).*/\1/'; }
load_s() { sed -E 's/.*load ([0-9.]+) s.*/\1/'; }

echo "old: $OLD"
echo "new: $NEW"
echo "model: $MODEL; $(nproc) cores; $(date -u +%FT%TZ)"

for section in $SECTIONS; do
  case $section in
  decode)
    o=() n=()
    for i in 1 2 3 4 5; do
      o+=("$(gen "$OLD" KILN_CACHE_DIR="$TMP/c-old" -- --max-tokens 128 | tps)")
      n+=("$(gen "$NEW" KILN_CACHE_DIR="$TMP/c-new" -- --max-tokens 128 | tps)")
    done
    mo=$(printf '%s\n' "${o[@]}" | median) mn=$(printf '%s\n' "${n[@]}" | median)
    echo "decode (1 stream, 128 tokens): old ${mo} tok/s [${o[*]}], new ${mn} tok/s [${n[*]}]," \
      "new/old $(ratio "$mo" "$mn")"
    ;;
  load)
    for kind in aot cold warm; do
      o=() n=()
      for i in 1 2 3; do
        for side in old new; do
          b=$OLD; [ $side = new ] && b=$NEW
          case $kind in
          aot) v=$(gen "$b" KILN_CACHE_DIR="$TMP/l-$side-aot" -- --max-tokens 1 | load_s) ;;
          cold)
            rm -rf "$TMP/l-$side-jit"
            v=$(gen "$b" KILN_CPU_AOT=0 KILN_CACHE_DIR="$TMP/l-$side-jit" -- --max-tokens 1 | load_s) ;;
          warm) v=$(gen "$b" KILN_CPU_AOT=0 KILN_CACHE_DIR="$TMP/l-$side-jit" -- --max-tokens 1 | load_s) ;;
          esac
          if [ $side = old ]; then o+=("$v"); else n+=("$v"); fi
        done
      done
      mo=$(printf '%s\n' "${o[@]}" | median) mn=$(printf '%s\n' "${n[@]}" | median)
      echo "load ($kind): old ${mo} s, new ${mn} s, new/old $(ratio "$mo" "$mn")"
    done
    ;;
  harness)
    for i in 1 2 3; do
      "$OLD/backends/kiln_op_harness" --mode=perf --backend=cpu > "$TMP/h-old-$i.txt" 2>&1 || true
      "$NEW/backends/kiln_op_harness" --mode=perf --backend=cpu > "$TMP/h-new-$i.txt" 2>&1 || true
    done
    "$PY" - "$TMP" <<'EOF'
import math, re, statistics, sys, glob
tmp = sys.argv[1]
def load(side):
    runs = []
    for f in sorted(glob.glob(f"{tmp}/h-{side}-*.txt")):
        d = {}
        for line in open(f):
            m = re.match(r"^PASS perf\s+\S+\s+(.*?)\s+([0-9.]+) us/run", line)
            if m:
                d[m.group(1)] = float(m.group(2))
            m = re.match(r"^perf\s+\S+\s+launch overhead: ([0-9.]+) ns/launch", line)
            if m:
                d["launch overhead (ns, not us)"] = float(m.group(1))
        runs.append(d)
    keys = set.intersection(*(set(r) for r in runs)) if runs else set()
    return {k: statistics.median(r[k] for r in runs) for k in keys}
old, new = load("old"), load("new")
common = sorted(set(old) & set(new))
if not common:
    print("harness: no common perf cases (see the kiln_op_harness output format)")
    sys.exit(0)
logs = [math.log(new[k] / old[k]) for k in common if old[k] > 0 and new[k] > 0]
print(f"op harness perf (cpu): {len(common)} cases, geometric mean new/old "
      f"{math.exp(sum(logs) / len(logs)):.3f}")
for k in common:
    print(f"  {k:60.60s} old {old[k]:9.1f} us  new {new[k]:9.1f} us  {new[k] / old[k]:.2f}")
EOF
    ;;
  xpu)
    for kind in cold warm; do
      for side in old new; do
        b=$OLD; [ $side = new ] && b=$NEW
        if [ $kind = cold ]; then rm -rf "$TMP/x-$side"; fi
        mkdir -p "$TMP/x-$side/pocl"
        t0=$(date +%s.%N)
        KILN_CACHE_DIR="$TMP/x-$side" POCL_CACHE_DIR="$TMP/x-$side/pocl" \
          "$b/backends/xpu/xpu_harness_test" > "$TMP/x-$side-$kind.txt" 2>&1 || echo "  ($side: xpu_harness_test failed, see output)"
        t1=$(date +%s.%N)
        cases=$(grep -oE '[0-9]+/[0-9]+ cases passed' "$TMP/x-$side-$kind.txt" | cut -d/ -f2 | awk '{s += $1} END {print s}')
        echo "xpu harness ($kind): $side $(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.1f", b - a}') s, ${cases:-?} cases"
      done
    done
    o=() n=()
    for i in 1 2 3; do
      o+=("$(gen "$OLD" KILN_CACHE_DIR="$TMP/x-old" POCL_CACHE_DIR="$TMP/x-old/pocl" -- --backend xpu --max-tokens 32 | tps)")
      n+=("$(gen "$NEW" KILN_CACHE_DIR="$TMP/x-new" POCL_CACHE_DIR="$TMP/x-new/pocl" -- --backend xpu --max-tokens 32 | tps)")
    done
    mo=$(printf '%s\n' "${o[@]}" | median) mn=$(printf '%s\n' "${n[@]}" | median)
    echo "decode on xpu (32 tokens): old ${mo} tok/s [${o[*]}], new ${mn} tok/s [${n[*]}]," \
      "new/old $(ratio "$mo" "$mn")"
    ;;
  serving)
    start() {  # build http grpc metrics
      "$1/server/kilnd" --log-level warn --set "server.http.address=127.0.0.1:$2" \
        --set "server.grpc.address=127.0.0.1:$3" --set "server.metrics.address=127.0.0.1:$4" \
        --set 'models[3].threads=2' --set 'models[3].scheduler.kv_cache_bytes=1073741824' \
        --set "server.storage_dir=$TMP/s-$2" > "$TMP/kilnd-$2.log" 2>&1 &
      PIDS+=($!)
      for _ in $(seq 600); do
        curl -sf "127.0.0.1:$2/v2/health/ready" >/dev/null && return 0
        sleep 0.1
      done
      echo "kilnd ($1) did not become ready"; cat "$TMP/kilnd-$2.log"; exit 1
    }
    start "$OLD" 8100 8101 8102
    start "$NEW" 8200 8201 8202
    "$PY" "$ROOT/tests/bench/llm_loadgen.py" --server old=http://127.0.0.1:8100 --model old=smollm2 \
      --server new=http://127.0.0.1:8200 --model new=smollm2 --concurrency "${STREAMS:-16}" \
      --prompt-tokens 128 --max-tokens 128 --requests-per-worker "${REQUESTS:-6}"
    ;;
  *) echo "unknown section: $section"; exit 2 ;;
  esac
done
