#!/usr/bin/env bash
# Front ends are adapters: server/ includes only the scheduler's public headers (scheduler/*.h,
# not scheduler/llm/ or the engine and models below it), plus engine/base/ (Status, metrics)
# and its own, config/ and proto/ headers. The exceptions are kilnd's wiring: server.cc, which
# loads models (models/llm/loader.h, models/encoder/embedding_tensor_model.h), and main.cc,
# which puts the kernel cache in the storage directory (engine/compiler/kernel_cache.h). Test
# files are exempt. Usage: layering_check.sh SOURCE_DIR
set -euo pipefail
src=$1
status=0
while IFS= read -r f; do
  rel=${f#"$src"/}
  while IFS= read -r inc; do
    case "$inc" in
      engine/base/*) ;;
      scheduler/finetune/job_service.h) ;;  # fine-tuning's public API (its records with it)
      scheduler/*/*) echo "$rel: includes $inc (past the scheduler's public headers)"; status=1 ;;
      scheduler/*) ;;
      models/llm/loader.h | models/encoder/embedding_tensor_model.h)
        [ "$rel" = server/server.cc ] || { echo "$rel: includes $inc"; status=1; } ;;
      engine/compiler/kernel_cache.h)
        [ "$rel" = server/main.cc ] || { echo "$rel: includes $inc"; status=1; } ;;
      engine/* | models/* | backends/*)
        echo "$rel: includes $inc (server/ reaches only the scheduler's public headers)"; status=1 ;;
      *) ;;  # server/, config/, proto/ and third-party headers
    esac
  done < <(sed -n 's/^#include "\([^"]*\)".*/\1/p' "$f")
done < <(find "$src/server" -name '*.h' -o -name '*.cc' | grep -v -e '_test\.cc$' -e '/test_llm\.' | sort)
echo "layering: server/ $([ $status = 0 ] && echo "includes only the scheduler's public headers" || echo FAILED)"
exit $status
