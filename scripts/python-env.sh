#!/usr/bin/env bash
# Makes .venv-test/ (git-ignored) with the Python packages the end-to-end tests use: the
# official `openai` client from PyPI. Does nothing when it is already there. Prints the
# venv's python on stdout.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-test"
if ! "$VENV/bin/python" -c "import openai" >/dev/null 2>&1; then
    python3 -m venv "$VENV" >&2
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "openai>=1.40" >&2
fi
echo "$VENV/bin/python"
