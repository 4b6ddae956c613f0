#!/usr/bin/env bash
# Runs Tessera's CUDA tests on a GPU machine that has no Rust toolchain.
#
# Here (with cargo):   scripts/gpu-check.sh build     -> gpu-bin/ (strip'd test binaries + tessera)
# There (GPU machine): scripts/gpu-check.sh run [FILTER]
#
# `run` finds NVRTC, the CUDA headers and cuBLAS in the Python wheels of the machine's PyTorch
# (nvidia-cuda-nvrtc / nvidia-cuda-runtime 13.0, matching driver 580), or in .venv-cuda, and
# runs every CUDA test binary; tests print "skipped:" when they find no usable device.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="$ROOT/gpu-bin"
cd "$ROOT"
case "${1:-run}" in
build)
    rm -rf "$BIN" && mkdir -p "$BIN"
    # Each crate has one integration-test binary; its CUDA tests are the cuda_* modules.
    for crate in kernels engine; do
        exe=$(cargo test --release -p "tessera-$crate" --test it --no-run --message-format=json 2>/dev/null |
              python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable")][-1])')
        cp "$exe" "$BIN/$crate-tests" && strip "$BIN/$crate-tests"
    done
    cargo build --release -p tessera-server && cp target/release/tessera "$BIN/" && strip "$BIN/tessera"
    du -sh "$BIN"
    ;;
run)
    NV=$(python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__file__))' 2>/dev/null || true)
    for d in "$NV/cu13" "$ROOT/.venv-cuda/nvidia/cu13"; do
        if [[ -f "$d/include/cuda_bf16.h" ]]; then
            export TESSERA_CUDA_INCLUDE="$d/include" LD_LIBRARY_PATH="$d/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
            break
        fi
    done
    export TESSERA_REQUIRE_NVRTC=1 TESSERA_CUDA_CACHE="${TMPDIR:-/tmp}/tessera-cuda-cache"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    status=0
    # FILTER (default: every CUDA test) is a libtest name filter, e.g. cuda_linear::.
    for t in "$BIN"/kernels-tests "$BIN"/engine-tests; do
        echo "== $(basename "$t")"
        "$t" --test-threads=1 "${2:-cuda_}" || status=1
    done
    # Memory errors in the kernel tests (compute-sanitizer works on the Firecracker machines,
    # not under gVisor: see the device notes).
    if command -v compute-sanitizer >/dev/null; then
        echo "== memcheck kernels-tests"
        compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN"/kernels-tests --test-threads=1 "${2:-cuda_}" || status=1
    fi
    exit $status
    ;;
*) echo "usage: $0 build|run [FILTER]" >&2; exit 2 ;;
esac
