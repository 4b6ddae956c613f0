#!/usr/bin/env bash
# Runs Tessera's whole test suite: fetches the default model when missing (model-level
# tests run the real model) and the end-to-end tests' tools, then builds and runs every test optimized.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/fetch-default-model.sh
# The server's end-to-end tests also run the official openai Python client and the routers
# (from PyPI, into .venv-test/), promtool (Debian's prometheus package), and buildah and
# debootstrap (Debian's packages; the container image test); get them ready first, one apt-get
# at a time.
scripts/python-env.sh >/dev/null
scripts/ensure-promtool.sh >/dev/null
scripts/ensure-container-tools.sh >/dev/null
# NVRTC and the CUDA headers (pinned CUDA 13.0 wheels, no GPU needed): the compile gate builds
# every CUDA kernel source for sm_80/sm_90/sm_90a and must not skip here.
eval "$(scripts/cuda-env.sh)"
export TESSERA_REQUIRE_NVRTC=1
cargo test --release --workspace --locked "$@"
