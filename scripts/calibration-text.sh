#!/usr/bin/env bash
# Rebuilds the built-in calibration text of `tessera quantize`
# (engine/src/quantize/builtin_text.txt) from its source and checks that it is byte for byte
# the committed file: chapters 1-16 of Herman Melville's Moby-Dick (1851, public domain), from
# the Project Gutenberg text (EBook #2701) that the Debian package `r-cran-tokenizers` 0.3.0-1
# ships as its `mobydick` data set, line ends normalized to LF, from "CHAPTER 1. Loomings."
# to the line before "CHAPTER 17.". Neither the project corpus (Pride and Prejudice) nor the
# held-out texts (scripts/heldout-texts.sh) come from it.
#
#   scripts/calibration-text.sh [OUT]   (default: a scratch file, compared and removed)
#
# Needs apt-get (to download the package, no root) and python3 with venv; the R data reader
# (`rdata` from PyPI) goes into ~/.cache/tessera/heldout-venv, as for heldout-texts.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
OUT=${1:-$WORK/builtin_text.txt}

VENV=${HOME}/.cache/tessera/heldout-venv
[[ -x "$VENV/bin/pip" ]] || { rm -rf "$VENV"; python3 -m venv "$VENV"; }
[[ "$("$VENV/bin/python" -c "import rdata; print(rdata.__version__)" 2>/dev/null)" == 1.1.0 ]] || "$VENV/bin/pip" install -q "rdata==1.1.0"
(cd "$WORK" && apt-get -o APT::Sandbox::User=root download r-cran-tokenizers=0.3.0-1 >/dev/null)
dpkg-deb -x "$WORK"/r-cran-tokenizers_0.3.0-1_amd64.deb "$WORK/pkg"
"$VENV/bin/python" -W ignore "$ROOT/scripts/r-data-text.py" "$WORK/pkg/usr/lib/R/site-library/tokenizers/data/Rdata" "$WORK" mobydick
python3 - "$WORK/mobydick.txt" "$OUT" <<'PY'
import sys
book = open(sys.argv[1], encoding="utf-8").read()
start = book.index("CHAPTER 1. Loomings.")
end = book.index("\nCHAPTER 17. ", start)
open(sys.argv[2], "w", encoding="utf-8").write(book[start:end].rstrip() + "\n")
PY
if cmp -s "$OUT" "$ROOT/engine/src/quantize/builtin_text.txt"; then
  echo "$OUT: the committed built-in calibration text"
else
  echo "$OUT differs from engine/src/quantize/builtin_text.txt" >&2
  exit 1
fi
