#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (sub-build) and runs each for a bounded time.
#
#   tests/fuzz/run_fuzz.sh BUILD_DIR SECONDS [TARGET...]   (default: all targets)
#
# Seeds: tests/fuzz/seeds/<name>/ (small valid files; regenerate with
# scripts/fixtures/make_fuzz_seeds.py) plus the fixture files. New inputs go to
# BUILD_DIR/corpus/<name>/. A crash leaves its reproducer in BUILD_DIR and fails the run.
set -euo pipefail
SRC=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:?usage: run_fuzz.sh BUILD_DIR SECONDS [TARGET...]}
SECS=${2:?usage: run_fuzz.sh BUILD_DIR SECONDS [TARGET...]}
shift 2
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(gguf_fuzz safetensors_fuzz jinja_fuzz tokenizer_fuzz)

CXX=${KILN_FUZZ_CXX:-clang++}
if ! command -v "$CXX" >/dev/null; then
  echo "run_fuzz: $CXX not found; scripts/install-deps.sh installs clang and libclang-rt-14-dev" >&2
  exit 1
fi
mkdir -p "$BUILD"
if [ ! -f "$BUILD/build.ninja" ]; then
  # -O1 with line tables: quick to compile, still fast to fuzz, readable stack traces.
  cmake -S "$SRC/tests/fuzz" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=None \
    -DCMAKE_CXX_FLAGS="-O1 -gline-tables-only" \
    -DCMAKE_CXX_COMPILER="$CXX" -DKILN_SOURCE_DIR="$SRC" >/dev/null
fi
cmake --build "$BUILD" --target "${TARGETS[@]}" -j "${KILN_FUZZ_JOBS:-2}"

status=0
for t in "${TARGETS[@]}"; do
  name=${t%_fuzz}
  corpus="$BUILD/corpus/$name"
  mkdir -p "$corpus"
  seeds=("$SRC/tests/fuzz/seeds/$name")
  case "$name" in
    gguf) seeds+=("$SRC/tests/fixtures/gguf") ;;
    jinja) seeds+=("$SRC/tests/fixtures/chat/templates") ;;
    tokenizer) seeds=("$SRC/tests/fuzz/seeds/tokenizer") ;;
  esac
  echo "run_fuzz: $t for ${SECS}s"
  if ! (cd "$BUILD" && "./$t" -max_total_time="$SECS" -timeout=10 -rss_limit_mb=2048 \
          -max_len=65536 -print_final_stats=1 "$corpus" "${seeds[@]}" 2>"$BUILD/$t.log"); then
    echo "run_fuzz: $t FAILED; log: $BUILD/$t.log" >&2
    tail -40 "$BUILD/$t.log" >&2
    status=1
  else
    grep -E "stat::number_of_executed_units|stat::new_units_added" "$BUILD/$t.log" || true
  fi
done
exit $status
