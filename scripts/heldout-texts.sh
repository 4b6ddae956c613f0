#!/usr/bin/env bash
# Writes evaluation texts other than the corpus into DIR (default target/heldout) and prints
# their paths. The project was tuned on neither until 0c0caa5, which chose the key
# calibration's constants on them:
#   persuasion.txt  Jane Austen, Persuasion (1817): another novel from the Debian package
#                   `r-cran-janeaustenr` 1.0.0-1 that the corpus (Pride and Prejudice) comes
#                   from, extracted the same way (one line per element, joined with newlines);
#                   the same extraction of `prideprejudice` reproduces the corpus byte for byte.
#   licenses.txt    legal prose: Debian's /usr/share/common-licenses GPL-3, Apache-2.0,
#                   MPL-2.0, GFDL-1.3, CC0-1.0, Artistic and LGPL-2.1, concatenated.
# Use them with the quality scripts, e.g. CORPUS=target/heldout/persuasion.txt scripts/kv-ppl.sh.
#
#   scripts/heldout-texts.sh [DIR]
#
# Needs apt-get (to download the package, no root) and python3 with venv; the R data reader
# (`rdata` from PyPI) goes into ~/.cache/tessera/heldout-venv.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DIR=${1:-$ROOT/target/heldout}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

if [[ ! -s "$DIR/persuasion.txt" ]]; then
  VENV=${HOME}/.cache/tessera/heldout-venv
  [[ -x "$VENV/bin/pip" ]] || { rm -rf "$VENV"; python3 -m venv "$VENV"; }
  [[ "$("$VENV/bin/python" -c "import rdata; print(rdata.__version__)" 2>/dev/null)" == 1.1.0 ]] || "$VENV/bin/pip" install -q "rdata==1.1.0"
  (cd "$WORK" && apt-get -o APT::Sandbox::User=root download r-cran-janeaustenr=1.0.0-1 >/dev/null)
  dpkg-deb -x "$WORK"/r-cran-janeaustenr_1.0.0-1_all.deb "$WORK/pkg"
  "$VENV/bin/python" -W ignore "$ROOT/scripts/r-data-text.py" "$WORK/pkg/usr/lib/R/site-library/janeaustenr/data/Rdata" "$WORK" persuasion prideprejudice
  # The corpus is this extraction of Pride and Prejudice: check that the method reproduces it
  # before the book leaves the scratch directory.
  want=dfc684d4f857fa938268f9ab9c5567b64bd0691251eca959644adeabe6287a4d
  got=$(sha256sum "$WORK/prideprejudice.txt" | cut -d' ' -f1)
  [[ "$got" == "$want" ]] || { echo "extraction does not reproduce the corpus (sha256 $got)" >&2; exit 1; }
  mv "$WORK/persuasion.txt" "$DIR/persuasion.txt"
fi

L=/usr/share/common-licenses
cat "$L/GPL-3" "$L/Apache-2.0" "$L/MPL-2.0" "$L/GFDL-1.3" "$L/CC0-1.0" "$L/Artistic" "$L/LGPL-2.1" >"$DIR/licenses.txt"
# The files come with the host's base-files package: the docs' figures were measured on the
# text of base-files 12.4+deb12u11 (Debian 12). Another version may change them; say so.
measured=7f84c48d8b7c61e0bd8885d4798e35d02490e0d10a2a1d5bafd643ab1bcb2dbe
got=$(sha256sum "$DIR/licenses.txt" | cut -d' ' -f1)
[[ "$got" == "$measured" ]] || echo "note: licenses.txt (sha256 $got) is not the text the docs measured (base-files 12.4+deb12u11, sha256 $measured): compare its figures only with each other" >&2
echo "$DIR/persuasion.txt"
echo "$DIR/licenses.txt"
