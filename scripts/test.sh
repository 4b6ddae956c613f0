#!/usr/bin/env bash
# Runs Tessera's whole test suite: fetches the default model when missing (model-level
# tests run the real model), then builds and runs every test optimized.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/fetch-default-model.sh
cargo test --release --workspace --locked "$@"
