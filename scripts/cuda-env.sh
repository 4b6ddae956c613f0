#!/usr/bin/env bash
# Makes .venv-cuda/ (git-ignored) with NVRTC and the CUDA headers from PyPI, pinned to CUDA 13.0
# (the GPU machines' driver 580 accepts CUBINs from NVRTC 13.0), and prints the exports that
# let Tessera find them:  eval "$(scripts/cuda-env.sh)"
# No GPU or driver is needed: CI uses this to compile every kernel source (the NVRTC gate).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-cuda"
PACKAGES=("nvidia-cuda-nvrtc==13.0.88" "nvidia-cuda-runtime==13.0.96")
CU13="$VENV/nvidia/cu13"
if [[ ! -f "$CU13/lib/libnvrtc.so.13" || ! -f "$CU13/include/cuda_bf16.h" ]]; then
    rm -rf "$VENV"
    python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$VENV" "${PACKAGES[@]}" >&2
fi
echo "export LD_LIBRARY_PATH=\"$CU13/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\""
echo "export TESSERA_CUDA_INCLUDE=\"$CU13/include\""
