#!/usr/bin/env bash
# Makes .venv-test/ (git-ignored) with the Python packages the end-to-end tests use, all from
# PyPI: the official `openai` client (with `pydantic`) and `jsonschema` for the structured-output
# checks, vLLM's router (`vllm-router`) and SGLang's model gateway (`smg`), both Rust binaries in
# prebuilt wheels (the router tests put them in front of tessera replicas), and `yamllint` plus
# `kubernetes-validate` (which ships the Kubernetes schemas) for deploy/'s offline checks. Does
# nothing when they are there. Prints the path of the python to run on stdout.
#
# Without the venv module (Debian's python3 without python3-venv), the packages go into
# .venv-test/site-packages and .venv-test/bin/python is a wrapper that puts them on the path.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-test"
PACKAGES=("openai>=1.40" "jsonschema>=4" "vllm-router==0.1.17" "smg==1.13.0" "yamllint>=1.35" "kubernetes-validate>=1.31")
IMPORTS="import openai, jsonschema, pydantic, vllm_router.launch_router, smg.launch_router, yamllint, kubernetes_validate"
PIP_FLAGS=(--quiet --disable-pip-version-check)
# Tests call this concurrently: one at a time, so none removes a venv another is checking.
exec 9>"$ROOT/.venv-test.lock"
flock 9
if ! "$VENV/bin/python" -c "$IMPORTS" >/dev/null 2>&1; then
    rm -rf "$VENV"
    if python3 -m venv "$VENV" >/dev/null 2>&1 && "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
        "$VENV/bin/python" -m pip install "${PIP_FLAGS[@]}" "${PACKAGES[@]}" >&2
    else
        echo "python3 -m venv is unavailable; installing into $VENV/site-packages" >&2
        rm -rf "$VENV"
        mkdir -p "$VENV/bin"
        python3 -m pip install "${PIP_FLAGS[@]}" --target "$VENV/site-packages" "${PACKAGES[@]}" >&2
        cat > "$VENV/bin/python" <<WRAPPER
#!/bin/sh
PYTHONPATH="$VENV/site-packages\${PYTHONPATH:+:\$PYTHONPATH}" exec python3 "\$@"
WRAPPER
        chmod +x "$VENV/bin/python"
    fi
    "$VENV/bin/python" -c "$IMPORTS" >&2
fi
echo "$VENV/bin/python"
