#!/usr/bin/env bash
# Builds llama.cpp's llama-bench, llama-quantize and llama-server OUTSIDE the repository, for the
# side-by-side benchmarks of issue 28 (e.g. scripts/bench-vs-llamacpp.sh). Not part of tests or CI.
# The source is the llama-cpp-python sdist from PyPI, which vendors llama.cpp (with its git
# metadata) under vendor/llama.cpp; nothing from it is built but those three CMake targets.
# Usage: BIN=$(scripts/build-llama-cpp.sh)   (logs go to stderr; the bin directory to stdout)
# Env: TESSERA_LLAMA_CPP_DIR (cache, default ~/.cache/tessera/llama.cpp),
#      LLAMA_CPP_PYTHON_VERSION (sdist pin), JOBS (default 2). Skips work once the binaries exist.
set -euo pipefail
exec 3>&1 1>&2
DIR="${TESSERA_LLAMA_CPP_DIR:-$HOME/.cache/tessera/llama.cpp}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
TARGETS=(llama-bench llama-quantize llama-server)
BIN="$DIR/build/bin"
built() { for t in "${TARGETS[@]}"; do [[ -x "$BIN/$t" ]] || return 1; done; }
if built; then cat "$DIR/VERSION"; echo "$BIN" >&3; exit 0; fi

if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null || ! command -v git >/dev/null; then
    SUDO=; [[ $(id -u) == 0 ]] || SUDO=sudo
    $SUDO apt-get update && $SUDO apt-get install -y cmake build-essential git
fi
mkdir -p "$DIR"
SDIST="$DIR/dl/llama_cpp_python-$VERSION.tar.gz"
if [[ ! -f "$SDIST" ]]; then
    # Download only: scikit-build-core (a wheel, in a throwaway venv) lets pip read the sdist's
    # metadata without build isolation, so pip never builds cmake or anything else from source.
    python3 -m venv "$DIR/venv"
    "$DIR/venv/bin/pip" install -q --only-binary :all: scikit-build-core
    "$DIR/venv/bin/pip" download -q --no-deps --no-binary :all: --no-build-isolation \
        "llama-cpp-python==$VERSION" -d "$DIR/dl"
    rm -rf "$DIR/venv"
fi
SRC="$DIR/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
[[ -f "$SRC/CMakeLists.txt" ]] || { mkdir -p "$DIR/src"; tar xzf "$SDIST" -C "$DIR/src"; }
{
    echo "llama-cpp-python sdist $VERSION"
    echo "llama.cpp $(git -C "$SRC" log -1 --format='%H %cd %s' --date=short)"
} > "$DIR/VERSION"

# GGML_NATIVE: -march=native (AVX-512/VNNI on Zen 4). UI and HTTPS off: no network at build time.
cmake -S "$SRC" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
nice -n 10 cmake --build "$DIR/build" --config Release -j "${JOBS:-2}" --target "${TARGETS[@]}"
built
cat "$DIR/VERSION"
echo "$BIN" >&3
