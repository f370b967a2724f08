#!/usr/bin/env bash
# `make test-sanitize`: builds the scheduler, server and models tests and kilnd with
# sanitizers and runs them (docs/sanitizers.md).
#
#   tests/sanitize/run.sh [asan] [tsan]       (default: both)
#
#   asan  build-asan/, KILN_SANITIZE=address,undefined: the unit tests under scheduler/,
#         server/ and models/ (with models/{tensor,sampling,train}), then system tests
#         against the ASan kilnd (KILND=build-asan/server/kilnd).
#   tsan  build-tsan/, KILN_SANITIZE=thread: the unit tests under scheduler/ and server/.
#
# KILN_SANITIZE_SET=ci runs the subset CI runs (see docs/sanitizers.md for why and the times);
# the default, full, runs everything above. JOBS (default nproc) sets build and ctest jobs.
# A sanitizer finding fails its test: ASan, UBSan and TSan halt on the first report and LSan
# (kilnd and every test binary) fails the exit code. Suppressions, each one a third-party
# false positive with its reason, are in tests/sanitize/*.supp.
set -euo pipefail
SRC=$(cd "$(dirname "$0")/../.." && pwd)
cd "$SRC"
JOBS=${JOBS:-$(nproc)}
SET=${KILN_SANITIZE_SET:-full}
MODES=("$@")
[ ${#MODES[@]} -gt 0 ] || MODES=(asan tsan)
case "$SET" in full | ci) ;; *) echo "run.sh: KILN_SANITIZE_SET is full or ci, not $SET" >&2; exit 2 ;; esac

SUPP=$SRC/tests/sanitize
# halt_on_error: the first report ends the process with a failing exit code (ASan and TSan
# exit non-zero, UBSan aborts). detect_leaks: LSan at every process exit, kilnd's included.
export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:strict_init_order=1:check_initialization_order=1"
export LSAN_OPTIONS="suppressions=$SUPP/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$SUPP/ubsan.supp"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$SUPP/tsan.supp:print_suppressions=0"

# Test binaries by tree; ctest then runs what is registered under each folder.
SCHEDULER_TESTS=(kiln_scheduler_test kiln_llm_scheduler_test kiln_finetune_store_test
                 multi_lora_test kiln_finetune_test kiln_sequence_batcher_test kiln_decoupled_test)
SERVER_TESTS=(kiln_server_test kiln_llm_frontend_test kiln_finetune_frontend_test
              http_server_test)
MODELS_TESTS=(gguf_test safetensors_test hf_folder_test tokenizer_test tokenizer_fixture_test
              gguf_fixture_test jinja_test chat_template_fixture_test smollm2_golden_test
              llm_loader_test hf_golden_test peft_io_test kiln_tensor_models_test
              kiln_sampling_test train_dataset_test train_dataset_fixture_test checkpoint_test
              trainer_test finetune_test kiln_cli)
# System tests against the ASan kilnd. Not deploy_dockerfile: it compares kilnd's ldd with the
# runtime image, and libasan is (rightly) not in it.
SYSTEM_TESTS=(kserve_grpc kserve_http bad_input batching metrics cli_config shutdown wire_compat
              lora_serving deploy_observability openai generation_grpc kserve_llm llm_faults
              fine_tuning)

# TSan: the scheduler and server tests.
TSAN_TESTS=("${SCHEDULER_TESTS[@]}" "${SERVER_TESTS[@]}")
TSAN_FOLDERS=(scheduler server)
EXCLUDE='_xpu$'

# CI's subset (docs/sanitizers.md has the times and why): under both ASan+UBSan and TSan, the
# tests that need neither the LLM runtime nor gRPC (the batchers and the KV block manager over
# the fake LLM, the job store, the HTTP server), which keeps both trees small; no system tests
# (they need the whole ASan kilnd). Tests of the binaries a subset does not build show up as
# <binary>_NOT_BUILT and are skipped; the full set builds everything under its folders, so
# there they fail and flag a list here gone stale.
CI_TESTS=(kiln_scheduler_test kiln_llm_scheduler_test kiln_finetune_store_test http_server_test
          kiln_sequence_batcher_test kiln_decoupled_test)
if [ "$SET" = ci ]; then
  TSAN_TESTS=("${CI_TESTS[@]}")
  EXCLUDE='_xpu$|_NOT_BUILT$'
fi

build() {  # build() DIR SANITIZERS TARGET...
  local dir=$1 san=$2
  shift 2
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_WERROR=ON \
    -DKILN_SANITIZE="$san" -DKILN_BUILD_BENCH=OFF >/dev/null
  cmake --build "$dir" -j "$JOBS" --target "$@"
}

# ctest in each folder runs only the tests registered under it. Not models_fuzz (its own clang
# ASan build, run by `make test`) nor the *_xpu tests (PoCL's LLVM is not instrumented, and
# the OpenCL path is not what this run is for).
run_ctest() {  # run_ctest DIR FOLDER... [-- CTEST_ARGS...]
  local dir=$1 folders=() extra=()
  shift
  while [ $# -gt 0 ] && [ "$1" != -- ]; do folders+=("$1"); shift; done
  [ $# -gt 0 ] && shift && extra=("$@")
  local f rc=0
  for f in "${folders[@]}"; do
    echo "test-sanitize: $dir/$f"
    ctest --test-dir "$dir/$f" --output-on-failure --timeout 1800 -j "$JOBS" \
      -LE fuzz -E "$EXCLUDE" "${extra[@]}" || rc=1
  done
  return $rc
}

status=0
t0=$SECONDS
for mode in "${MODES[@]}"; do
  start=$SECONDS
  case "$mode" in
    asan)
      if [ "$SET" = full ]; then
        targets=("${SCHEDULER_TESTS[@]}" "${SERVER_TESTS[@]}" "${MODELS_TESTS[@]}" kilnd
                 kiln_v1_python_stubs)
        folders=(scheduler server models models/tensor models/sampling models/train)
      else
        targets=("${CI_TESTS[@]}")
        folders=(scheduler server)
      fi
      build build-asan address,undefined "${targets[@]}"
      echo "test-sanitize: asan build $((SECONDS - start)) s"
      run_ctest build-asan "${folders[@]}" || status=1
      if [ "$SET" = full ]; then
        regex="^system_($(IFS='|'; echo "${SYSTEM_TESTS[*]}"))\$"
        run_ctest build-asan tests/system -- -R "$regex" || status=1
      fi
      ;;
    tsan)
      build build-tsan thread "${TSAN_TESTS[@]}"
      echo "test-sanitize: tsan build $((SECONDS - start)) s"
      run_ctest build-tsan "${TSAN_FOLDERS[@]}" || status=1
      ;;
    *) echo "run.sh: unknown mode $mode (asan or tsan)" >&2; exit 2 ;;
  esac
  echo "test-sanitize: $mode took $((SECONDS - start)) s"
done
echo "test-sanitize: $SET set, ${MODES[*]}: $((SECONDS - t0)) s, $([ $status = 0 ] && echo passed || echo FAILED)"
exit $status
