#!/usr/bin/env bash
# Clang's thread-safety analysis over scheduler/ and server/: every ABSL_GUARDED_BY field must
# be accessed with its mutex held. g++ ignores the annotations, so this is where they are
# enforced. Usage: thread_safety_check.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
CLANG=${CLANG:-$(command -v clang++ || true)}
if [ -z "$CLANG" ]; then
  echo "clang++ not found (Debian package clang, installed by scripts/install-deps.sh)" >&2
  exit 1
fi
status=0 n=0
# Files whose own source or header carries annotations: the analysis only has work there,
# and compiling every gRPC-heavy file with a second compiler would cost minutes.
for f in "$src"/scheduler/*.cc "$src"/scheduler/llm/*.cc "$src"/server/*.cc "$src"/server/http/*.cc \
    "$src"/server/finetune/*.cc; do
  case "$f" in *_test.cc) continue ;; esac
  grep -qE 'ABSL_(GUARDED_BY|EXCLUSIVE_LOCKS_REQUIRED|SHARED_LOCKS_REQUIRED)' \
    "$f" "${f%.cc}.h" 2>/dev/null || continue
  n=$((n + 1))
  if ! "$CLANG" -std=c++20 -fsyntax-only -Wthread-safety -Werror=thread-safety \
      -Wno-unknown-warning-option -I"$src" -I"$build" "$f"; then
    status=1
  fi
done
echo "thread-safety analysis: $n files, $([ $status = 0 ] && echo clean || echo FAILED)"
exit $status
