#!/usr/bin/env bash
# A dropped kiln::Status must not compile (status_must_use.h). Arguments: the C++ compiler,
# the repository root, then include flags. Fails if the clean file does not compile or the
# file with a dropped Status does.
set -u
cxx=$1 root=$2
shift 2
src=$root/engine/base/status_must_use_test.cc
flags=(-std=c++20 -fsyntax-only -include "$root/engine/base/status_must_use.h"
       -Werror=unused-result -I"$root" "$@")
if ! out=$("$cxx" "${flags[@]}" "$src" 2>&1); then
  echo "FAIL: the clean file does not compile:"; echo "$out"; exit 1
fi
if out=$("$cxx" "${flags[@]}" -DKILN_DROP "$src" 2>&1); then
  echo "FAIL: a dropped Status compiled"; exit 1
fi
if ! grep -q 'ignoring returned value of type.*Status' <<<"$out"; then
  echo "FAIL: compiling the dropped Status failed for another reason:"; echo "$out"; exit 1
fi
echo "ok: a dropped Status is a compile error"
